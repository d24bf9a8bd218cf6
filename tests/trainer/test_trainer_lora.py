"""LoRA (trainer/lora.py): gradients of the factors through the fused MoE op and the attention projections
against float64 references, the initial policy equal to the base, only adapters trained, the merged weights
that leave the trainer equal to the ones its forward computes with, PEFT's adapter layout.

    .venv/bin/python -m pytest -q tests/trainer/test_trainer_lora.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megamoe
from megamoe.testing import rel_err
from trainer import lora
from trainer.config import ConfigError, LoraSettings, TrainerWorkerConfig
from trainer.model import load_model
from trainer.testing import make_batch
from trainer.worker import TrainerWorker

# Relative Frobenius error of fp32 gradients against float64 ground truth on these sizes (T <= 32, H = 64),
# measured 2026-12-07 on the 2-core x86 machine: 3.4e-7 (the expert op), 8.6e-7 (the whole model's factors);
# 1e-5 is the contract's fp32 tolerance (>= 11x margin).
FP32_GRAD_TOL = 1e-5
LORA = {"enabled": True, "rank": 4, "alpha": 8.0}
BASE = {"fsdp": False, "lr": 1e-2, "micro_batch_size": 4, "lora": LORA}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rl.make_model import make_model

    return make_model(tmp_path_factory.mktemp("lora") / "qwen3", arch="qwen3_moe", seed=3)


def _randomize_b(model, seed: int = 7) -> None:
    """B is zero at init (the delta vanishes and A gets no gradient); tests that look at gradients give it values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def test_expert_factor_gradients_match_a_float64_low_rank_reference():
    """Through megamoe.fused_moe (impl megamoe): the effective expert weights built by lora.merge; reference:
    float64, per token and expert, the base path plus the low-rank path x -> A -> B (never merged)."""
    g = torch.Generator().manual_seed(0)
    T, H, I, E, k, r, scale = 24, 64, 32, 8, 2, 4, 2.0
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    # PEFT's ParamWrapper layout: P [E, d1, d2], A [E, r, d1], B [E, d2, r], delta[e] = A[e]^T B[e]^T
    a13, b13 = torch.randn(E, r, 2 * I, generator=g) * 0.1, torch.randn(E, H, r, generator=g) * 0.1
    a2, b2 = torch.randn(E, r, H, generator=g) * 0.1, torch.randn(E, I, r, generator=g) * 0.1
    weights, ids = megamoe.route(torch.randn(T, E, generator=g), k, "softmax", True)
    gy = torch.randn(T, H, generator=g)

    fac = [t.clone().requires_grad_() for t in (a13, b13, a2, b2)]
    y = megamoe.fused_moe(x, lora.merge(w13, fac[0], fac[1], scale), lora.merge(w2, fac[2], fac[3], scale),
                          weights, ids, impl="megamoe")
    (y * gy).sum().backward()

    ref = [t.double().clone().requires_grad_() for t in (a13, b13, a2, b2)]
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            # W_eff x = W x + scale * (A^T B^T) x  computed as  W x + scale * A^T (B^T x)
            h = w13d[e] @ xd[t] + scale * (ref[0][e].T @ (ref[1][e].T @ xd[t]))
            act = torch.nn.functional.silu(h[:I]) * h[I:]
            out[t] += weights[t, j].double() * (w2d[e] @ act + scale * (ref[2][e].T @ (ref[3][e].T @ act)))
    (out * gy.double()).sum().backward()
    assert rel_err(y, out) < FP32_GRAD_TOL
    for name, got, want in zip(("A13", "B13", "A2", "B2"), fac, ref):
        err = rel_err(got.grad, want.grad)
        assert err < FP32_GRAD_TOL, f"{name}: rel err {err:.2e}"


def test_model_factor_gradients_match_float64(model_dir):
    """The whole LoRA model (attention and experts adapted) on megamoe in fp32: the factors' gradients against
    float64 ground truth from transformers' own model (stock experts and router, float64), whose adapted weights
    are substituted by W + scale * delta(A, B) of float64 factor leaves (torch.func.functional_call)."""
    cfg = LoraSettings(**LORA)
    m32 = load_model(model_dir, "megamoe")
    lora.install(m32, cfg, seed=1)
    _randomize_b(m32)
    from transformers import AutoModelForCausalLM

    m64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager")
    state = dict(m32.named_parameters())
    leaves = {n: p.detach().double().requires_grad_() for n, p in state.items() if lora.is_factor(n)}
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(2))

    logits = m32(input_ids=ids).logits
    torch.log_softmax(logits, -1)[..., 5].sum().backward()
    adapted = lora.adapted(m32)
    subst = {base: lora.merge(state[base].detach().double(), leaves[na], leaves[nb], s)
             for base, (na, nb, s) in adapted.items()}
    ref = torch.func.functional_call(m64, subst, args=(), kwargs={"input_ids": ids}).logits
    torch.log_softmax(ref, -1)[..., 5].sum().backward()
    assert rel_err(logits, ref) < FP32_GRAD_TOL
    kinds = {n.rsplit(".", 3)[-3] for n in leaves}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "experts"} <= kinds
    errs = {n: rel_err(state[n].grad, leaves[n].grad) for n in leaves}
    worst = max(errs, key=errs.get)
    assert errs[worst] < FP32_GRAD_TOL, (worst, errs[worst])
    for n in leaves:
        assert state[n].grad.abs().sum() > 0, f"{n}: no gradient reached this factor"


def test_initial_policy_is_the_base_bitwise_and_only_factors_train(model_dir):
    base = load_model(model_dir, "megamoe")
    m = load_model(model_dir, "megamoe")
    n = lora.install(m, LoraSettings(**LORA))
    assert n == 2 * 4 + 2 * 2  # 2 layers x (q, k, v, o) + 2 layers x (w13, w2)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, base(input_ids=ids).logits)
    trainable = [name for name, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_factor(name) for name in trainable)
    # PEFT's names
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in trainable
    assert "model.layers.1.mlp.experts.lora_B.down_proj" in trainable


def test_worker_steps_only_the_adapters_and_exports_the_merged_weights(model_dir):
    w = TrainerWorker(0, 1, "127.0.0.1", 0, str(model_dir), "megamoe", BASE)
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    m = w.train_step(make_batch(8, seed=1))
    assert m["optimizer_steps"] == 1
    state_params = {id(p) for p in w.optimizer.state}
    named = dict(w.model.named_parameters())
    factors = {id(p) for n, p in named.items() if lora.is_factor(n)}
    assert state_params == factors and {id(p) for g in w.optimizer.param_groups for p in g["params"]} == factors
    for n, p in named.items():
        if lora.is_factor(n) and ".lora_B." in n:
            assert not torch.equal(p, before[n]), f"{n} did not move"
        elif not lora.is_factor(n):
            assert torch.equal(p, before[n]), f"frozen {n} changed"
    # The export: the base's names only, adapted weights merged exactly as the forward merges them.
    exported = dict(w.export_weights())
    assert not any(lora.is_factor(n) for n in exported)
    assert set(exported) == {n for n in named if not lora.is_factor(n)}
    mods = dict(w.model.named_modules())
    adapted = lora.adapted(w.model)
    assert len(adapted) == 12
    for name in adapted:
        mod, _, p = name.rpartition(".")
        with torch.no_grad():
            assert torch.equal(exported[name], lora.effective(mods[mod], p)), name
        assert not torch.equal(exported[name], before[name]), f"{name}: the merge added nothing"
    # A model loaded from the merged weights, without LoRA (what the sampler holds), computes the trainer's
    # logits bit for bit.
    plain = load_model(model_dir, "megamoe")
    plain.load_state_dict(exported, strict=True)
    ids = torch.randint(3, 500, (3, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(w.model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_peft_layout_reconstructs_the_delta_with_peft_formula():
    """adapter_model.safetensors' tensors, put back together the way PEFT's ParamWrapper computes its delta (peft
    0.21, an experts module without `is_transposed`, as transformers' are: the parameter read as [E, out, in],
    einsum 'o r e, e r i -> e o i' over lora_B [d1, r*E] viewed (d1, r, E) and lora_A [r*E, d2] viewed (E, r, d2)),
    and lora.Linear's (B @ A), give the trainer's delta. Checked against peft 0.21.2 itself on 2026-12-07: its
    merge_and_unload of an exported adapter gave the export's merged weights (peft is not a test dependency)."""
    g = torch.Generator().manual_seed(5)
    E, r, d1, d2 = 4, 3, 10, 6
    A, B = torch.randn(E, r, d1, generator=g), torch.randn(E, d2, r, generator=g)
    a2, b2 = torch.randn(r, d1, generator=g), torch.randn(d2, r, generator=g)
    names = {"m.mlp.experts.lora_A.gate_up_proj": A, "m.mlp.experts.lora_B.gate_up_proj": B,
             "m.mlp.experts.lora_A.down_proj": A + 1, "m.mlp.experts.lora_B.down_proj": B + 1,
             "m.self_attn.q_proj.lora_A.weight": a2, "m.self_attn.q_proj.lora_B.weight": b2}
    out = lora.peft_tensors(names)
    assert set(out) == {"base_model.model.m.mlp.experts.base_layer.lora_A.weight",
                        "base_model.model.m.mlp.experts.base_layer.lora_B.weight",
                        "base_model.model.m.mlp.experts.lora_A.weight", "base_model.model.m.mlp.experts.lora_B.weight",
                        "base_model.model.m.self_attn.q_proj.lora_A.weight",
                        "base_model.model.m.self_attn.q_proj.lora_B.weight"}
    pa, pb = out["base_model.model.m.mlp.experts.base_layer.lora_A.weight"], \
        out["base_model.model.m.mlp.experts.base_layer.lora_B.weight"]
    assert pa.shape == (r * E, d2) and pb.shape == (d1, r * E)
    peft_delta = torch.einsum("o r e, e r i -> e o i", pb.reshape(d1, -1, E), pa.reshape(E, -1, d2))
    zero = torch.zeros(E, d1, d2)
    torch.testing.assert_close(peft_delta, lora.merge(zero, A, B, 1.0), rtol=1e-6, atol=1e-6)
    lin = out["base_model.model.m.self_attn.q_proj.lora_B.weight"] @ out["base_model.model.m.self_attn.q_proj.lora_A.weight"]
    torch.testing.assert_close(lin, lora.merge(torch.zeros(d2, d1), a2, b2, 1.0), rtol=1e-6, atol=1e-6)


def test_lora_config_refusals(model_dir):
    with pytest.raises(ConfigError, match=r"lora\.dropout"):
        TrainerWorkerConfig.from_dict({"lora": {"enabled": True, "dropout": 0.1}})
    with pytest.raises(ConfigError, match=r"lora\.targets"):
        TrainerWorkerConfig.from_dict({"lora": {"enabled": True, "targets": ["q_proj", "w1"]}})
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        TrainerWorkerConfig.from_dict({"lora": {"enabled": True, "rank": 0}})
    m = load_model(model_dir, "stock")
    with pytest.raises(ValueError, match="moe_impl 'megamoe' or 'reference'"):
        lora.install(m, LoraSettings(enabled=True, targets=["gate_up_proj"]))
    with pytest.raises(ValueError, match="router"):
        lora.install(m, LoraSettings(enabled=True, targets=["router"]))


def test_router_adapter_changes_routing_logits_and_gets_gradients(model_dir):
    m = load_model(model_dir, "megamoe")
    lora.install(m, dataclasses.replace(LoraSettings(**LORA), targets=["router"]))
    _randomize_b(m)
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(0))
    m(input_ids=ids).logits.square().mean().backward()
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert names == [f"model.layers.{i}.mlp.gate.lora_{x}.weight" for i in range(2) for x in "AB"]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters() if p.requires_grad)


def test_bf16_base_without_fsdp_merges_in_bf16_and_the_sampler_weights_match(tmp_path):
    """The one-GPU layout (trainer.fsdp false, bf16 compute): the frozen base held in bf16, fp32 factors, the
    merged weights rounded once to bf16; a bf16 model holding the exported weights computes the trainer's logits
    bit for bit. The model has an explicit GQA head layout from make-model (4 query heads, 1 KV head)."""
    from rl.make_model import make_model

    d = make_model(tmp_path / "gqa", arch="qwen3_moe", hidden=64, heads=4, kv_heads=1, head_dim=32, dtype="bfloat16",
                   seed=2)
    w = TrainerWorker(0, 1, "127.0.0.1", 0, str(d), "megamoe", {**BASE, "dtype": "bfloat16"})
    assert w.model.model.layers[0].self_attn.k_proj.weight.shape == (32, 64)
    assert {p.dtype for n, p in w.model.named_parameters()} == {torch.bfloat16, torch.float32}
    assert all(p.dtype == torch.float32 for n, p in w.model.named_parameters() if lora.is_factor(n))
    w.train_step(make_batch(8, seed=1))
    exported = dict(w.export_weights())
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    plain = load_model(d, "megamoe", dtype=torch.bfloat16)
    plain.load_state_dict(exported, strict=True)
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(w.model(input_ids=ids).logits, plain(input_ids=ids).logits)
    w.close()


def _fsdp_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    w = TrainerWorker(rank, 2, "127.0.0.1", port, model_dir, "megamoe", {**BASE, "fsdp": True})
    m = w.train_step(make_batch(8, seed=1))
    named = dict(w.export_weights())
    opt = sorted(n for n, p in w.model.named_parameters() if p in w.optimizer.state)
    if rank == 0:
        torch.save({"metrics": m, "weights": named, "opt": opt}, out)
    w.close()


@pytest.mark.slow  # two processes with a gloo group (no Ray)
def test_fsdp2_two_ranks_train_the_adapters_as_one_rank_does(model_dir, tmp_path):
    """FSDP2 over two gloo ranks (torch.multiprocessing, fully_shard per decoder layer with frozen base weights
    and trainable factors in one group): one step's merged export equals the unsharded worker's to fp32 rounding
    (FP32_GRAD_TOL: the reduce-scatter sums the two ranks' gradients in another order), and only factors have
    optimizer state."""
    import torch.multiprocessing as mp

    from trainer.testing import free_port

    out = tmp_path / "rank0.pt"
    mp.start_processes(_fsdp_rank, args=(free_port(), str(model_dir), str(out)), nprocs=2, start_method="spawn")
    got = torch.load(out, weights_only=False)
    w = TrainerWorker(0, 1, "127.0.0.1", 0, str(model_dir), "megamoe", BASE)
    want_m = w.train_step(make_batch(8, seed=1))
    want = dict(w.export_weights())
    assert got["opt"] and all(lora.is_factor(n) for n in got["opt"])
    assert set(got["weights"]) == set(want)
    errs = {n: rel_err(got["weights"][n], want[n]) for n in want}
    assert max(errs.values()) < FP32_GRAD_TOL, max(errs.items(), key=lambda kv: kv[1])
    assert abs(got["metrics"]["loss"] - want_m["loss"]) < FP32_GRAD_TOL * abs(want_m["loss"]) + 1e-9
    base = load_model(model_dir, "megamoe").state_dict()
    assert all(not torch.equal(want[n], base[n]) for n in lora.adapted(w.model))
    w.close()
