"""Trainer tests that need no Ray: the loss math, batch and config checks, the megamoe experts seam,
checkpoint validation, NaN skipping, megamoe vs reference steps, atomic checkpoints.

    .venv/bin/python -m pytest -q tests/trainer/test_trainer.py

World size 1 here runs the unsharded model (fsdp=False: no process group in the pytest process);
FSDP2 across Ray actors is tests/trainer/test_trainer_fsdp.py.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from megamoe.testing import assert_close
from records import RecordError, TrainBatch
from trainer import checkpoint as ckpt
from trainer.batch import BatchError, train_rows
from trainer.config import ConfigError, TrainerConfig, TrainerSettings, TrainerWorkerConfig
from trainer.experts import MOE_CALLS, Fp32Router
from rl.advantages import group_advantages
from trainer.loss import (finish_stats, policy_loss, k3_kl, mismatch_correction, mismatch_metrics,
                          pad_lists, sequence_log_ratio, token_logprobs)
from trainer.model import CheckpointMismatchError, load_model
from trainer.testing import assert_same_weights, make_batch, weights_rel_err
from trainer.worker import TrainerWorker

# Tolerances (relative Frobenius error, megamoe.testing.rel_err), fp32 on CPU:
# - logits of the megamoe / reference experts against transformers' stock experts: only the
#   summation order differs; measured <= 4.8e-7 max |d logprob| on the tiny models (2-core x86,
#   2026-11-30). Bound: 1e-5, the contract's fp32 tolerance.
FP32_LOGITS_TOL = 1e-5
# - weights after 3 AdamW steps, megamoe vs reference: measured max 7.7e-7 (qwen3_moe) and 1.2e-6
#   (mixtral) per tensor. Adam normalises each element's update, so an element whose gradient is
#   at rounding-noise level can move by a different amount; 1e-5 bounds this with margin >= 8x.
FP32_STEP_TOL = 1e-5

ARCHS = ("qwen3_moe", "mixtral")
IMPLS = ("megamoe", "reference")
BASE_CFG = {"fsdp": False, "lr": 1e-3, "micro_batch_size": 4}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from rl.make_model import make_model

    root = tmp_path_factory.mktemp("trainer_models")
    return {arch: make_model(root / arch, arch=arch, seed=1) for arch in ARCHS}


# ---------------------------------------------------------------------------------------------
# loss math (pure functions)
# ---------------------------------------------------------------------------------------------
def test_group_advantages_hand_computed():
    adv = group_advantages([1.0, 0.0, 3.0, 3.0], group_size=2)
    # group (1, 0): mean 0.5, population std 0.5 -> (+1, -1); group (3, 3): std 0 -> 0
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    adv = group_advantages([1.0, 0.0], group_size=2, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages([1.0, 2.0], group_size=3)


def test_mismatch_metrics_hand_computed():
    trainer, mask = pad_lists([[math.log(0.5), math.log(0.2)], [math.log(0.4)]])
    sampler, _ = pad_lists([[math.log(0.25), math.log(0.2)], [math.log(0.8)]])
    r = torch.tensor([2.0, 1.0, 0.5])  # p_trainer / p_sampler for the three real tokens
    k3 = r - 1 - r.log()
    m = mismatch_metrics(trainer, sampler, mask)
    assert m["mismatch/k3_kl"] == pytest.approx(float(k3.mean()), rel=1e-6)
    assert m["mismatch/abs_logp_diff_mean"] == pytest.approx(float(r.log().abs().mean()), rel=1e-6)
    assert m["mismatch/abs_logp_diff_max"] == pytest.approx(math.log(2.0), rel=1e-6)
    assert m["mismatch/is_ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert m["mismatch/is_ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert m["mismatch/is_ratio_mean"] == pytest.approx(3.5 / 3, rel=1e-6)
    # k3 is 0 on padding and >= 0 everywhere
    per_tok = k3_kl(trainer, sampler, mask)
    assert float(per_tok[1, 1]) == 0.0 and bool((per_tok >= 0).all())
    # sequence ratio is the geometric mean: exp(mean log r)
    torch.testing.assert_close(sequence_log_ratio(trainer, sampler, mask).exp(),
                               torch.tensor([math.sqrt(2.0), 0.5]))


@pytest.mark.parametrize("mode, weights, keep", [
    pytest.param("none", [[1, 1, 1]], [[1, 1, 1]], id="none"),
    pytest.param("metrics_only", [[1, 1, 1]], [[1, 1, 1]], id="metrics_only"),
    pytest.param("tis", [[2, 0.25, 1.5]], [[1, 1, 1]], id="tis-cap2"),
    pytest.param("token_mask", [[1, 1, 1]], [[0, 0, 1]], id="token_mask"),
    pytest.param("seq_mask", [[1, 1, 1]], [[0, 0, 0]], id="seq_mask"),
], )
def test_mismatch_correction_modes(mode, weights, keep):
    # token ratios r = 3, 0.25, 1.5 (old vs sampler); geometric mean (3*0.25*1.5)^(1/3) = 1.04 would
    # keep the sequence, so use a second, out-of-bounds sequence to exercise seq_mask below.
    samp = torch.zeros(1, 3)
    old = torch.tensor([[math.log(3.0), math.log(0.25), math.log(1.5)]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    if mode == "seq_mask":
        old = torch.tensor([[math.log(3.0), math.log(3.0), math.log(1.5)]])  # geometric mean 2.38 > 2
    w, k = mismatch_correction(old, samp, mask, mode, cap=2.0, low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor(weights, dtype=torch.float32), rtol=1e-6, atol=1e-6)
    assert k.tolist() == [[bool(x) for x in row] for row in keep]
    if mode == "seq_mask":  # a sequence inside the bounds is kept whole
        old_in = torch.tensor([[math.log(3.0), math.log(0.25), math.log(1.5)]])
        _, k_in = mismatch_correction(old_in, samp, mask, mode, cap=2.0, low=0.5, high=2.0)
        assert bool(k_in.all())


def test_ppo_clipping_hand_computed():
    # one sequence, A = +1 and one with A = -1; ratios exp(logp - old) = 1.5 and 0.5
    old = torch.zeros(2, 1)
    logp = torch.tensor([[math.log(1.5)], [math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, old, adv, mask, is_correction="none", clip_low=0.2, clip_high=0.2)
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 (clipped, no gradient); A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    assert float(loss.detach()) == pytest.approx((-1.2 + 0.8) / 2, rel=1e-6)
    loss.backward()
    assert logp.grad.abs().max() == 0.0
    assert finish_stats({**{k: float(v) for k, v in stats.items()}})["loss/clip_frac"] == 1.0
    # inside the clip range the gradient is -A * r / N
    logp2 = torch.tensor([[math.log(1.1)], [math.log(0.9)]], requires_grad=True)
    loss2, _ = policy_loss(logp2, old, old, adv, mask, is_correction="none")
    loss2.backward()
    torch.testing.assert_close(logp2.grad, torch.tensor([[-1.1 / 2], [0.9 / 2]]))


def test_loss_ignores_nan_on_dropped_and_padded_tokens():
    logp, mask = pad_lists([[-1.0, -2.0], [-1.5]])
    samp = torch.tensor([[-1.0, float("nan")], [-1.5, float("nan")]])
    mask = torch.tensor([[True, False], [True, False]])  # the NaNs sit on padding
    loss, _ = policy_loss(logp, logp, samp, torch.tensor([1.0, -0.5]), mask, is_correction="tis")
    assert math.isfinite(float(loss))


def test_token_logprobs_uses_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g)
    tgt = torch.randint(0, 11, (2, 3), generator=g)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, tgt[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, tgt, 0.7), ref)
    assert not torch.allclose(token_logprobs(logits, tgt, 1.0), ref)


# ---------------------------------------------------------------------------------------------
# config and batch checks
# ---------------------------------------------------------------------------------------------
def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="'lrr'.*did you mean 'lr'"):
        TrainerWorkerConfig.from_dict({"lrr": 1e-3})
    with pytest.raises(ConfigError, match="is_correction: expected one of"):
        TrainerWorkerConfig.from_dict({"is_correction": "clip"})
    with pytest.raises(ConfigError, match="temperature: expected a float > 0, got 0.0"):
        TrainerWorkerConfig.from_dict({"temperature": 0.0})
    with pytest.raises(ConfigError, match="minibatches: expected an int, got 1.5"):
        TrainerWorkerConfig.from_dict({"minibatches": 1.5})
    with pytest.raises(ConfigError, match="total_steps: expected an int > warmup_steps"):
        TrainerWorkerConfig.from_dict({"lr_schedule": "cosine", "warmup_steps": 5, "total_steps": 5})
    # moe_impl and world_size are TrainerWorker's own arguments: they travel once, never in cfg
    for key, value in (("moe_impl", "megamoe"), ("world_size", 2)):
        with pytest.raises(ConfigError, match=f"{key}: expected it as TrainerWorker's {key} argument"):
            TrainerWorkerConfig.from_dict({key: value})
    # the run's placement keys are not a rank's settings
    with pytest.raises(ConfigError, match="unknown key 'checkpoint_every'"):
        TrainerWorkerConfig.from_dict({"checkpoint_every": 5})
    c = TrainerWorkerConfig.from_dict({"temperature": 0.8, "clip_eps_high": 0.28})
    assert c.temperature == 0.8 and c.clip_high == 0.28


def test_worker_config_is_the_run_sections_settings_plus_three_named_values():
    section = TrainerConfig(lr=3e-4, minibatches=2, activation_checkpointing=True, moe_impl="reference", world_size=4)
    c = TrainerWorkerConfig.of(section, temperature=0.7, dtype="bfloat16", seed=3)
    shared = [f.name for f in dataclasses.fields(TrainerSettings)]
    assert {n: getattr(c, n) for n in shared} == {n: getattr(section, n) for n in shared}
    assert (c.temperature, c.dtype, c.seed) == (0.7, "bfloat16", 3)
    assert not hasattr(c, "moe_impl") and not hasattr(c, "world_size")
    with pytest.raises(ConfigError, match="temperature: expected a float > 0"):
        TrainerWorkerConfig.of(section, temperature=-1.0, dtype="float32", seed=0)


def _check(batch, **kw):
    args = dict(vocab_size=512, max_seq_len=16, truncate=False)
    args.update(kw)
    return train_rows(batch, **args)


def _with(batch, i: int, **values):
    """`batch` (a TrainBatch) with sequence i's fields replaced, built (and so checked) again."""
    cols = {k: list(getattr(batch, k)) for k in ("prompt_ids", "completion_ids", "sampler_logprobs", "advantages",
                                                 "policy_versions")}
    for k, v in values.items():
        cols[k][i] = v
    return TrainBatch(**cols)


def test_batch_rejects_empty_completion():
    # refused where the record is built (records/samples.py): a trainer never sees it
    with pytest.raises(RecordError, match=r"completion_ids\[2\]: expected at least one token, got an empty completion"):
        _with(make_batch(4), 2, completion_ids=[], sampler_logprobs=[])


def test_batch_too_long_rejected_or_truncated():
    b = _with(make_batch(4), 1, prompt_ids=list(range(3, 13)),      # 10 prompt tokens
              completion_ids=list(range(3, 11)),                     # 8 completion tokens: 18 > 16
              sampler_logprobs=[-1.0 * i for i in range(8)])
    with pytest.raises(BatchError,
                       match=r"sequence 1: prompt \+ completion = 10 \+ 8 = 18 tokens, expected <= max_seq_len=16"):
        _check(b)
    seqs, n = _check(b, truncate=True)
    assert n == 1 and seqs[1].truncated
    assert seqs[1].completion == list(range(3, 9)) and seqs[1].sampler_logprobs == [-1.0 * i for i in range(6)]
    # a prompt that alone fills max_seq_len cannot be truncated into a valid sequence
    b = _with(b, 1, prompt_ids=list(range(3, 19)))
    with pytest.raises(BatchError, match="the prompt alone has 16 tokens"):
        _check(b, truncate=True)


@pytest.mark.parametrize("field, value, error, match", [
    pytest.param("sampler_logprobs", lambda b: b.sampler_logprobs[0][:-1], RecordError,
                 r"sampler_logprobs\[0\]: expected \d+ values", id="logprob-length"),
    pytest.param("completion_ids", lambda b: [600] * len(b.completion_ids[0]), BatchError,
                 r"completion_ids\[0\]: expected token ids in \[0, 512\) \(the model's vocabulary\), got min 600",
                 id="id-range"),
    pytest.param("advantages", lambda b: [1.0], RecordError, r"advantages\[0\]: expected one finite float per sequence",
                 id="adv-list"),
])
def test_batch_field_errors(field, value, error, match):
    b = make_batch(4)
    with pytest.raises(error, match=match):
        _check(_with(b, 0, **{field: value(b)}))


def test_train_step_takes_only_a_train_batch():
    """A dict of columns is not a batch: the record is what crosses (what the record checks, it checked)."""
    with pytest.raises(BatchError, match="batch: expected a records.TrainBatch, got dict"):
        _check({"prompt_ids": [[3]], "completion_ids": [[4]], "sampler_logprobs": [[-1.0]], "advantages": [0.0]})


# ---------------------------------------------------------------------------------------------
# the model: experts through the registry, fp32 router, stock names
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", IMPLS)
def test_model_matches_stock_and_keeps_names(model_dirs, arch, impl):
    stock = load_model(model_dirs[arch], "stock")
    model = load_model(model_dirs[arch], impl)
    assert list(model.state_dict()) == list(stock.state_dict())
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in stock.state_dict().items()}
    assert model.config._experts_implementation == {"megamoe": "megamoe", "reference": "megamoe_reference"}[impl]
    routers = [m for m in model.modules() if isinstance(m, Fp32Router)]
    assert len(routers) == model.config.num_hidden_layers
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    calls = MOE_CALLS[impl]
    with torch.no_grad():
        out, ref = model(input_ids=ids).logits, stock(input_ids=ids).logits
    assert MOE_CALLS[impl] - calls == model.config.num_hidden_layers, "the experts did not run through megamoe"
    assert_close(f"{arch}/{impl} logits vs stock", out, ref, FP32_LOGITS_TOL)


def test_router_logits_fp32_under_bf16(model_dirs):
    import megamoe

    model = load_model(model_dirs["qwen3_moe"], "megamoe", dtype=torch.bfloat16)
    router = next(m for m in model.modules() if isinstance(m, Fp32Router))
    assert router.weight.dtype == torch.bfloat16
    h = torch.randn(5, router.hidden_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits, w, ids = router(h)
    assert logits.dtype == torch.float32 and w.dtype == torch.float32 and ids.dtype == torch.int64
    ref_logits = h.float() @ router.weight.float().t()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)
    w_ref, ids_ref = megamoe.route(ref_logits, router.top_k, "softmax", router.renormalize)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch, edit, names", [
    pytest.param("qwen3_moe", lambda sd: sd.pop("model.layers.0.mlp.gate.weight"),
                 ["1 missing keys: model.layers.0.mlp.gate.weight"], id="qwen3-missing"),
    pytest.param("qwen3_moe", lambda sd: sd.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
                 ["missing keys: model.layers.1.mlp.experts.3.up_proj.weight"], id="qwen3-missing-expert"),
    pytest.param("qwen3_moe", lambda sd: sd.__setitem__("model.layers.0.mlp.bogus.weight", torch.zeros(3)),
                 ["1 unexpected keys: model.layers.0.mlp.bogus.weight"], id="qwen3-extra"),
    pytest.param("qwen3_moe", lambda sd: sd.__setitem__("model.layers.1.self_attn.o_proj.weight", torch.zeros(64, 32)),
                 ["model.layers.1.self_attn.o_proj.weight (expected [64, 64], got [64, 32])"], id="qwen3-shape"),
    pytest.param("mixtral", lambda sd: sd.__setitem__("model.layers.0.block_sparse_moe.experts.2.w3.weight", torch.zeros(16, 64)),
                 ["model.layers.0.block_sparse_moe.experts.2.w3.weight (expected [32, 64], got [16, 64])"], id="mixtral-expert-shape"),
    pytest.param("mixtral", lambda sd: (sd.pop("lm_head.weight"), sd.__setitem__("model.extra.weight", torch.zeros(2))),
                 ["missing keys: lm_head.weight", "unexpected keys: model.extra.weight"], id="mixtral-missing-and-extra"),
])
def test_bad_checkpoint_names_the_keys(model_dirs, tmp_path, arch, edit, names):
    bad = _rewrite(model_dirs[arch], tmp_path / "bad", edit)
    with pytest.raises(CheckpointMismatchError) as e:
        load_model(bad, "megamoe")
    for n in names:
        assert n in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# training steps (unsharded, in-process)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_megamoe_and_reference_steps_agree(model_dirs, arch):
    batch = make_batch(8, seed=3)
    runs = {}
    for impl in IMPLS:
        w = TrainerWorker(0, 1, "", 0, str(model_dirs[arch]), impl, BASE_CFG)
        metrics = [w.train_step(batch) for _ in range(3)]
        runs[impl] = (metrics, w.export_weights())
    (m_mm, w_mm), (m_ref, w_ref) = runs["megamoe"], runs["reference"]
    for step, (a, b) in enumerate(zip(m_mm, m_ref)):
        assert a["skipped"] == b["skipped"] == 0
        assert a["loss"] == pytest.approx(b["loss"], rel=FP32_STEP_TOL, abs=1e-7), f"step {step} loss"
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=FP32_STEP_TOL), f"step {step} grad_norm"
    errs = weights_rel_err(w_mm, w_ref)
    worst = max(errs, key=errs.get)
    print(f"[{arch}] megamoe vs reference after 3 steps: worst weight rel_err {errs[worst]:.2e} ({worst})")
    assert errs[worst] <= FP32_STEP_TOL
    # the comparison is not vacuous: the weights moved
    init = TrainerWorker(0, 1, "", 0, str(model_dirs[arch]), "reference", BASE_CFG).export_weights()
    moved = weights_rel_err(w_ref, init)
    assert max(moved.values()) > 100 * FP32_STEP_TOL


def test_nonfinite_loss_skips_the_step(model_dirs):
    w = TrainerWorker(0, 1, "", 0, str(model_dirs["qwen3_moe"]), "megamoe", BASE_CFG)
    good = make_batch(8, seed=4)
    w.train_step(good)
    before = w.export_weights()
    bad = make_batch(8, seed=5)
    # The record refuses a non-finite advantage where it is built; set past it, it stands for any non-finite loss.
    bad.advantages[3] = float("nan")
    m = w.train_step(bad)
    assert m["skipped"] == 1 and m["skipped_total"] == 1 and m["optimizer_steps"] == 1
    assert not math.isfinite(m["loss"])
    assert_same_weights(w.export_weights(), before)
    bad.advantages[3] = float("inf")
    assert w.train_step(bad)["skipped_total"] == 2
    assert_same_weights(w.export_weights(), before)
    # training continues from the last good weights
    m = w.train_step(good)
    assert m["skipped"] == 0 and m["optimizer_steps"] == 2 and math.isfinite(m["loss"])


def test_the_reference_policy_is_the_frozen_initial_weights(model_dirs):
    """trainer.kl_coef's reference on one unsharded fp32 rank. Sharded over two ranks, in bf16 and after a
    checkpoint resume, against a float64 computation of the KL: tests/trainer/test_trainer_fsdp.py
    (test_kl_reference_sharded_bf16_and_after_a_resume_matches_float64); the loss's KL math is
    tests/trainer/test_objectives.py's."""
    cfg = {**BASE_CFG, "loss": "gspo", "kl_coef": 0.1}
    w = TrainerWorker(0, 1, "", 0, str(model_dirs["qwen3_moe"]), "megamoe", cfg)
    before = {n: p.detach().clone() for n, p in w.reference.named_parameters()}
    kls = [w.train_step(make_batch(8, seed=s)) for s in range(2)]
    # Before the first update the policy is the reference: the same weights through the same kernels.
    assert kls[0]["kl/ref_k1"] == 0.0 and kls[0]["kl/ref_k3"] == 0.0
    assert kls[1]["kl/ref_k3"] > 0 and kls[1]["kl/ref_k1"] != 0
    assert not any(p.requires_grad for p in w.reference.parameters())
    assert all(torch.equal(before[n], p) for n, p in w.reference.named_parameters())
    assert TrainerWorker(0, 1, "", 0, str(model_dirs["qwen3_moe"]), "megamoe", BASE_CFG).reference is None


def test_activation_checkpointing_same_step(model_dirs):
    batch = make_batch(8, seed=6)
    out = []
    for ac in (False, True):
        w = TrainerWorker(0, 1, "", 0, str(model_dirs["mixtral"]), "megamoe", {**BASE_CFG, "activation_checkpointing": ac})
        out.append((w.train_step(batch), w.export_weights()))
    assert out[0][0]["loss"] == out[1][0]["loss"] and out[0][0]["grad_norm"] == out[1][0]["grad_norm"]
    assert_same_weights(out[0][1], out[1][1])


def test_truncate_in_train_step(model_dirs):
    w = TrainerWorker(0, 1, "", 0, str(model_dirs["qwen3_moe"]), "reference", {**BASE_CFG, "max_seq_len": 8, "truncate": True})
    b = make_batch(4, seed=7, prompt_len=(3, 3), completion_len=(7, 7))
    m = w.train_step(b)
    assert m["truncated"] == 4 and m["tokens"] == 4 * 5 and m["skipped"] == 0


# ---------------------------------------------------------------------------------------------
# checkpoints (unsharded: DCP without a process group)
# ---------------------------------------------------------------------------------------------
def test_resume_reproduces_next_step_bitwise(model_dirs, tmp_path):
    d = str(model_dirs["qwen3_moe"])
    b1, b2 = make_batch(8, seed=8), make_batch(8, seed=9)
    a = TrainerWorker(0, 1, "", 0, d, "megamoe", BASE_CFG)
    a.train_step(b1)
    a.save_checkpoint(str(tmp_path / "step_00000001"))
    m_a = a.train_step(b2)
    fresh = TrainerWorker(0, 1, "", 0, d, "megamoe", BASE_CFG)
    state = fresh.load_checkpoint(str(tmp_path / "step_00000001"))
    assert state["step"] == 1 and state["optimizer_steps"] == 1
    m_b = fresh.train_step(b2)
    assert m_a == m_b
    assert_same_weights(a.export_weights(), fresh.export_weights())


def test_crash_mid_save_keeps_the_previous_checkpoint(model_dirs, tmp_path, monkeypatch):
    d = str(model_dirs["qwen3_moe"])
    w = TrainerWorker(0, 1, "", 0, d, "megamoe", BASE_CFG)
    w.train_step(make_batch(8, seed=10))
    path = tmp_path / "ckpts" / "step_00000001"
    w.save_checkpoint(str(path))
    saved = w.export_weights()
    w.train_step(make_batch(8, seed=11))

    def crash(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "_write_rank_state", crash)
    with pytest.raises(OSError, match="simulated"):
        w.save_checkpoint(str(path))                       # overwrite in place: crashes halfway
    with pytest.raises(OSError, match="simulated"):
        w.save_checkpoint(str(tmp_path / "ckpts" / "step_00000002"))  # a new step: crashes halfway
    monkeypatch.undo()
    assert ckpt.tmp_path(path.parent / "step_00000002").exists()  # the partial write is there ...
    assert ckpt.latest_checkpoint(path.parent) == path            # ... but never counts as a checkpoint
    r = TrainerWorker(0, 1, "", 0, d, "megamoe", BASE_CFG)
    r.load_checkpoint(str(path))
    assert_same_weights(r.export_weights(), saved)
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        r.load_checkpoint(str(ckpt.tmp_path(path.parent / "step_00000002")))
    w.save_checkpoint(str(tmp_path / "ckpts" / "step_00000002"))  # a later save cleans up and succeeds
    assert ckpt.latest_checkpoint(path.parent).name == "step_00000002"
    assert not ckpt.tmp_path(path.parent / "step_00000002").exists()


def test_checkpoint_of_another_model_names_the_keys(model_dirs, tmp_path):
    q = TrainerWorker(0, 1, "", 0, str(model_dirs["qwen3_moe"]), "megamoe", BASE_CFG)
    q.save_checkpoint(str(tmp_path / "q"))
    m = TrainerWorker(0, 1, "", 0, str(model_dirs["mixtral"]), "megamoe", BASE_CFG)
    with pytest.raises(CheckpointMismatchError, match=r"unexpected keys: .*self_attn.k_norm.weight"):
        m.load_checkpoint(str(tmp_path / "q"))


def test_minibatches_take_several_updates_with_a_fixed_old_policy(model_dirs):
    w = TrainerWorker(0, 1, "", 0, str(model_dirs["qwen3_moe"]), "megamoe", {**BASE_CFG, "minibatches": 2})
    m = w.train_step(make_batch(8, seed=12))
    assert m["optimizer_steps"] == 2 and m["skipped"] == 0
    # the second minibatch is scored by a policy that already took one update: ratio != 1 there
    assert abs(m["loss/ppo_ratio_mean"] - 1.0) > 1e-4


def test_seq_mean_token_mean_aggregation():
    from trainer.loss import aggregate

    per_token = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # sequence means 2 and 4 over 2 sequences; token mean 8 / 3
    assert float(aggregate(per_token, mask, "seq_mean_token_mean", total_tokens=3, total_seqs=2)) == 3.0
    assert float(aggregate(per_token, mask, "token_mean", total_tokens=3, total_seqs=2)) == pytest.approx(8 / 3)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_nonfinite_weights_names_exactly_the_tensors_the_cast_breaks(dtype):
    """trainer.fsdp.nonfinite_weights (the weight sync's refusal) against the per-tensor truth: cast
    each tensor to the sync dtype and look for NaN/Inf. Seeded random weights, each bad in one way."""
    from torch import nn

    from trainer.fsdp import nonfinite_weights

    g = torch.Generator().manual_seed(0)
    m = nn.Module()
    values = {"fine": None, "nan": float("nan"), "inf": float("-inf"), "over_bf16": 3.3999e38,
              "over_fp16": 7.0e4, "edge_fp16": 65504.0}
    for name, bad in values.items():
        t = torch.randn(33, 17, generator=g)
        if bad is not None:
            t.view(-1)[int(torch.randint(0, t.numel(), (1,), generator=g))] = bad
        m.register_parameter(name, nn.Parameter(t))
    m.register_parameter("empty", nn.Parameter(torch.empty(0, 4)))
    m.register_parameter("half_nan", nn.Parameter(torch.randn(5, generator=g).half()))
    m.half_nan.data[2] = float("nan")
    # finite fp16 values whose sum of |x| (2.4e5) is beyond fp16's range: not a NaN/Inf
    m.register_parameter("half_big", nn.Parameter((torch.rand(4096, 64, generator=g) + 0.5).half()))
    want = [n for n, p in m.named_parameters()
            if not torch.isfinite(p.detach().to(dtype) if dtype is not None else p.detach()).all()]
    assert want == [n for n in ("nan", "inf", "over_bf16", "over_fp16", "half_nan")
                    if n not in {None: ("over_bf16", "over_fp16"), torch.bfloat16: ("over_fp16",),
                                 torch.float16: ()}[dtype]]
    assert nonfinite_weights(m, dtype) == want
