"""RolloutWorker on real vLLM (CPU, fp32) with the tiny Qwen3-MoE model, MoE layers through megamoe.

One engine for the whole module (starting one costs ~25 s on 2 cores; the compiled engine's comparison
with an eager one is tests/rollout/test_rollout_serve.py's, against its served policy). Tests that change the
engine's weights put the original weights back before they return.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout.py
"""

from __future__ import annotations

import os

import pytest
import torch

from rollout import moe_method, worker as rollout_worker
from rollout.testing import favour_expert_in_decode, max_abs_diff, processed_logprobs, top_k_top_p_mask

# fp32 vLLM CPU vs a transformers fp32 forward of the same sequences. The bound; measured
# worst on a 2-core x86 CPU (2026-11-30): ~1e-6 (summation order only).
LOGPROB_TOL_FP32 = 1e-4
PROMPTS = ["1 + 2 =", "What is 7 * 8?", "the cat sat on the", "Question: 12 - 5 = ? Answer:"]
N = 2
SAMPLING = {"temperature": 0.7, "max_tokens": 12, "seed": 1234}
LAYERS = 2
LONG_MODEL_LEN = 512  # room for the long prompts below


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rl.make_model import make_model

    root = tmp_path_factory.mktemp("rollout_models")
    return (make_model(root / "qwen_a", arch="qwen3_moe", layers=LAYERS, seed=0),
            make_model(root / "qwen_b", arch="qwen3_moe", layers=LAYERS, seed=1))


@pytest.fixture(scope="module")
def hf(models):
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in models)


@pytest.fixture(scope="module")
def worker(models):
    from rollout.worker import RolloutWorker

    # collective_rpc of a function (rollout.testing.favour_expert_in_decode) needs vLLM's pickle fallback
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    w = RolloutWorker(models[0], "megamoe", dtype="float32", seed=0, max_model_len=LONG_MODEL_LEN,
                      kv_cache_memory_bytes=64 << 20, return_routing=True)
    yield w
    w.close()
    mp.undo()


@pytest.fixture(scope="module")
def baseline(worker):
    """Samples of model A with SAMPLING; tests that touch weights must leave these reproducible."""
    return worker.generate(PROMPTS, N, SAMPLING)


def _hf_logprobs(model, samples, temperature, top_p=None):
    return [processed_logprobs(model, s.prompt_ids, s.completion_ids, temperature, top_p) for s in samples]


def _assert_same_samples(a, b, what):
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b], f"{what}: completions differ"
    la, lb = [s.sampler_logprobs for s in a], [s.sampler_logprobs for s in b]
    assert la == lb, f"{what}: logprobs not bitwise equal (max diff {max_abs_diff(la, lb)})"


def _disk_state(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


# -- the hook -----------------------------------------------------------------------------------

@pytest.mark.slow  # the module's engine starts here (marked so that conftest.py hands this file out early)
def test_megamoe_runs_in_the_engine_worker_process(worker):
    (status,) = worker.status()
    assert status["pid"] != os.getpid(), "the model must run in vLLM's worker process, not the driver"
    # On CPU the engine core (the scheduler) runs in this process, the model in the worker process
    # (rollout.worker._engine_core_placement: one vLLM process fewer to start; on CUDA vLLM's own
    # engine-core process), and the variable that asks vLLM for it is not left set for later engines.
    from vllm.v1.engine.core_client import InprocClient
    core = worker.llm.llm_engine.engine_core
    assert isinstance(core, InprocClient) != torch.cuda.is_available(), type(core)
    assert rollout_worker.ENV_MULTIPROCESSING not in os.environ
    assert status["registered"] and status["impl"] == "megamoe"
    assert status["hooked_moe_layers"] == LAYERS and status["layer_impls"] == ["megamoe"]
    # Every layer routes itself from megamoe.router's logits (the trainer's router), gate by gate.
    assert status["self_routed_moe_layers"] == LAYERS and status["megamoe_router_gates"] == LAYERS, status
    # eager on CPU by default (vLLM's compiled engine, which the plugin supports too, is
    # tests/rollout/test_rollout_serve.py's, compared there against an eager engine)
    assert status["compilation"] == {"mode": "NONE", "graphs": 0, "cudagraphs_captured": 0}, status["compilation"]

    worker.reset_moe_calls()
    samples = worker.generate(PROMPTS, N, SAMPLING)
    calls = worker.moe_calls()
    # Every forward pass runs each MoE layer once: at least one pass per generated token position.
    generated = max(len(s.completion_ids) for s in samples)
    assert set(calls) == {"megamoe"}, f"expected calls of megamoe only, got {calls}"
    assert calls["megamoe"] >= LAYERS * generated and calls["megamoe"] % LAYERS == 0, calls
    assert moe_method.moe_calls() == {}, "the driver process must not compute the MoE"


def test_samples_are_records_counted_from_the_offset_and_stamped_with_the_version(worker, baseline):
    """generate returns records.Sample (the record the driver queues, scores and trains on): prompt_index
    counts from `offset` (a worker's slice of a step's prompts), policy_version is the caller's stamp."""
    from records import Sample

    assert len(baseline) == len(PROMPTS) * N
    assert [s.prompt_index for s in baseline] == [i for i in range(len(PROMPTS)) for _ in range(N)]
    for s in baseline:
        assert type(s) is Sample and s.policy_version == 0 and s.reward is None and s.loss_mask is None
        assert len(s.sampler_logprobs) == len(s.completion_ids) >= 1
        assert all(lp <= 0.0 for lp in s.sampler_logprobs)
    shifted = worker.generate(PROMPTS, N, SAMPLING, offset=5, policy_version=3)
    assert [s.prompt_index for s in shifted] == [5 + s.prompt_index for s in baseline]
    assert {s.policy_version for s in shifted} == {3}
    _assert_same_samples(shifted, baseline, "offset and policy_version change nothing else")
    for bad in ({"offset": -1}, {"policy_version": True}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}: expected an int >= 0"):
            worker.generate(PROMPTS, N, SAMPLING, **bad)


def test_seeded_generation_is_reproducible(worker, baseline):
    _assert_same_samples(worker.generate(PROMPTS, N, SAMPLING), baseline, "same seed")
    other = worker.generate(PROMPTS, N, {**SAMPLING, "seed": 99})
    assert [s.completion_ids for s in other] != [s.completion_ids for s in baseline], \
        "another seed drew the same completions"


def _long_prompts(count: int, words: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    vocab = ["apples", "Mary", "has", "bought", "twelve", "each", "costs", "dollars", "how", "many", "left",
             "after", "she", "gives", "3", "to", "her", "brother", "and", "then", "sells", "half", "of", "them"]
    return [f"Problem {i}: " + " ".join(rng.choice(vocab) for _ in range(words)) + "\nAnswer:" for i in range(count)]


def test_long_prompts_over_one_prefill_step_sample_reproducibly(worker, hf):
    """A batch of prompts of a few hundred tokens whose prefill exceeds one scheduler step's token
    budget: the engine samples it (seeded), reproducibly, with the transformers logprobs. vLLM CPU
    used to die here ("CPU Generator does not use offset", rollout.adapter.whole_prefill_kwargs)."""
    from rollout.adapter import DEFAULT_BATCHED_TOKENS

    prompts = _long_prompts(16, 80, seed=3)
    sampling = {"temperature": 1.0, "max_tokens": 8, "seed": 77}
    first = worker.generate(prompts, 2, sampling)
    lengths = [len(s.prompt_ids) for s in first[::2]]
    assert min(lengths) >= 200 and max(lengths) + sampling["max_tokens"] <= LONG_MODEL_LEN, lengths
    assert sum(len(s.prompt_ids) for s in first) > DEFAULT_BATCHED_TOKENS, "the batch must not fit one step"
    _assert_same_samples(worker.generate(prompts, 2, sampling), first, "long prompts, same seed")
    err = max_abs_diff([s.sampler_logprobs for s in first], _hf_logprobs(hf[0], first, sampling["temperature"]))
    print(f"[rollout] long prompts ({min(lengths)}-{max(lengths)} tokens): max |dlogp| vs transformers {err:.2e}")
    assert err <= LOGPROB_TOL_FP32


# -- numbers the trainer must reproduce ---------------------------------------------------------

def test_processed_logprobs_match_transformers_fp32(worker, baseline, hf):
    ours = [s.sampler_logprobs for s in baseline]
    ref = _hf_logprobs(hf[0], baseline, SAMPLING["temperature"])
    err = max_abs_diff(ours, ref)
    print(f"[rollout] megamoe fp32 vs transformers fp32, T={SAMPLING['temperature']}: max |dlogp| = {err:.2e}")
    assert err <= LOGPROB_TOL_FP32
    # The comparison can tell models and processing apart: raw (T=1) logprobs and another model's
    # logprobs of the same tokens are far outside the tolerance.
    assert max_abs_diff(ours, _hf_logprobs(hf[0], baseline, 1.0)) > 100 * LOGPROB_TOL_FP32
    assert max_abs_diff(ours, _hf_logprobs(hf[1], baseline, SAMPLING["temperature"])) > 100 * LOGPROB_TOL_FP32


def test_top_p_logprobs_match_transformers_fp32(worker, hf):
    """top-p: compared where the nucleus boundary is unambiguous (random tiny models are nearly uniform,
    so a token can sit within rounding of the cut-off; fp32 summation order then decides)."""
    temperature, top_p = 0.8, 0.9
    samples = worker.generate(PROMPTS, N, {"temperature": temperature, "top_p": top_p, "max_tokens": 12, "seed": 7})
    compared, skipped, worst = 0, 0, 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logits = hf[0](input_ids=ids).logits[0].float()
        start = len(s.prompt_ids) - 1
        for j, (tok, lp) in enumerate(zip(s.completion_ids, s.sampler_logprobs)):
            row = logits[start + j: start + j + 1] / temperature
            cum = row.softmax(-1).sort(dim=-1).values.cumsum(-1)
            if float((cum - (1 - top_p)).abs().min()) < 1e-5:
                skipped += 1
                continue
            ref = torch.log_softmax(top_k_top_p_mask(row, None, top_p), -1)[0, tok].item()
            unfiltered = torch.log_softmax(row, -1)[0, tok].item()
            assert lp > unfiltered + 1e-3, "top-p renormalisation missing from the processed logprob"
            worst = max(worst, abs(lp - ref))
            compared += 1
    print(f"[rollout] top-p={top_p}: max |dlogp| = {worst:.2e} over {compared} tokens ({skipped} at the boundary)")
    assert compared >= 0.9 * (compared + skipped)
    assert worst <= LOGPROB_TOL_FP32


# -- weight updates -----------------------------------------------------------------------------

def test_update_with_identical_weights_is_bitwise_identical(worker, models, baseline):
    info = worker.update_weights(_disk_state(models[0]))  # on-disk, per-expert names
    assert info["tensors"] == len(_disk_state(models[0]))
    _assert_same_samples(worker.generate(PROMPTS, N, SAMPLING), baseline, "after reloading identical weights")


def test_update_with_changed_weights_gives_the_new_model(worker, models, hf, baseline):
    state_b = hf[1].state_dict()  # transformers names: fused experts.gate_up_proj [E,2I,H], down_proj [E,H,I]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state_b)
    try:
        worker.update_weights(list(state_b.items()))
        # The layer holds the trainer's fused tensors as they are: the kernel's layout.
        w13, w2 = worker.read_experts(0)
        assert torch.equal(w13, state_b["model.layers.0.mlp.experts.gate_up_proj"])
        assert torch.equal(w2, state_b["model.layers.0.mlp.experts.down_proj"])
        samples = worker.generate(PROMPTS, N, SAMPLING)
        err = max_abs_diff([s.sampler_logprobs for s in samples], _hf_logprobs(hf[1], samples, SAMPLING["temperature"]))
        print(f"[rollout] after update to model B: max |dlogp| vs transformers(B) = {err:.2e}")
        assert err <= LOGPROB_TOL_FP32
        assert max_abs_diff([s.sampler_logprobs for s in samples],
                            _hf_logprobs(hf[0], samples, SAMPLING["temperature"])) > 100 * LOGPROB_TOL_FP32
    finally:
        worker.update_weights(hf[0].state_dict())
    _assert_same_samples(worker.generate(PROMPTS, N, SAMPLING), baseline, "after updating back to model A")


def _bad_update(kind, state):
    state = dict(state)
    if kind == "missing":
        name = "model.layers.1.mlp.experts.down_proj"
        del state[name]
    elif kind == "extra":
        name = "model.layers.0.mlp.experts.bias"
        state[name] = torch.randn(8, 64)
    elif kind == "misshaped":
        name = "model.layers.0.mlp.experts.gate_up_proj"
        state[name] = state[name][:, :-2]
    elif kind == "nonfinite":
        name = "model.layers.1.self_attn.q_proj.weight"
        state[name] = state[name].clone()
        state[name][0, 0] = float("nan")
    return name, state


@pytest.mark.parametrize("kind", ["missing", "extra", "misshaped", "nonfinite"])
def test_bad_update_names_the_tensor_and_keeps_the_previous_weights(worker, models, hf, baseline, kind):
    # Model B's values, so that a half-applied update could not hide behind identical weights.
    name, state = _bad_update(kind, hf[1].state_dict())
    with pytest.raises((ValueError, TypeError), match=name.replace(".", r"\.")) as e:
        worker.update_weights(state)
    print(f"[rollout] {kind}: {e.value}")
    _assert_same_samples(worker.generate(PROMPTS, N, SAMPLING), baseline, f"after the rejected {kind} update")


def test_worker_process_validates_too(worker, baseline, hf):
    """The worker re-validates what arrives (the driver's check is not the only line)."""
    from rollout import weights

    plan = [(n, t) for n, t in hf[1].state_dict().items() if n != "model.norm.weight"]
    folder = weights.bucket_folder(1 << 20)
    try:
        paths = weights.write_buckets(plan, folder, bucket_bytes=1 << 16)
        assert len(paths) > 1  # exercises several buckets
        for i, path in enumerate(paths):
            worker.llm.collective_rpc("megamoe_stage_weights", args=("bad", i, path))
        (result,) = worker.llm.collective_rpc("megamoe_commit_weights", args=("bad", len(paths)))
    finally:
        import shutil
        shutil.rmtree(folder)
    assert not result["ok"] and result["stage"] == "validate" and "model.norm.weight" in result["error"], result
    _assert_same_samples(worker.generate(PROMPTS, N, SAMPLING), baseline, "after a worker-side rejection")


# -- argument errors (no engine needed) ---------------------------------------------------------

def test_unknown_moe_impl_is_rejected(models):
    from rollout.worker import RolloutWorker

    with pytest.raises(ValueError, match="moe_impl: expected one of .*'megamoe'.*got 'fused'"):
        RolloutWorker(models[0], "fused")


def test_unsupported_architecture_is_rejected(tmp_path):
    import json

    from safetensors.torch import save_file

    from rollout.worker import RolloutWorker

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"architecture \['LlamaForCausalLM'\] is not supported"):
        RolloutWorker(tmp_path, "megamoe")


def test_unknown_sampling_key_is_rejected(worker):
    with pytest.raises(ValueError, match=r"sampling: unknown key\(s\) \['presence_penalty'\]"):
        worker.generate(PROMPTS, 1, {"presence_penalty": 0.5})


def test_reference_with_cuda_graphs_is_refused_on_gpu(models, monkeypatch):
    # The unfused reference reads routing counts to the host: not capturable in a CUDA graph. The
    # refusal comes before any engine starts (torch.cuda.is_available is faked: this is a CPU test).
    from rollout.worker import RolloutWorker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="enforce_eager: expected True or None with moe_impl='reference'"):
        RolloutWorker(models[0], "reference", enforce_eager=False)


# -- kernel format (rollout/kernel_format.py): the names vLLM really gives the parameters -------------

def test_every_engine_parameter_is_made_of_named_checkpoint_tensors(worker, models, hf):
    """A kernel-format update names vLLM's parameters from the checkpoint's by the model's
    packed_modules_mapping: here every parameter of vLLM's own Qwen3-MoE is reached, and CPU vLLM is
    reported as what keeps this engine in checkpoint format (it repacks its linears after loading).
    Shapes are not compared: CPU vLLM drops a repacked linear's weight ([0])."""
    from rollout.kernel_format import kernel_targets
    from rollout.weights import CheckpointSpec, plan_metadata

    engine = worker.llm.collective_rpc("megamoe_engine_params")[0]
    spec = CheckpointSpec.from_dir(models[0])
    metas = [(n, list(t.shape), "float32") for n, t in hf[0].state_dict().items()]  # the trainer's names
    update = plan_metadata(spec, metas, kernel_experts=True)
    targets = kernel_targets(update, engine["params"], engine["packed"])
    assert set(targets) == set(engine["params"])
    assert [len(p) for n, p in targets.items() if n.endswith("qkv_proj.weight")] == [3] * LAYERS
    assert len(engine["experts"]) == 2 * LAYERS and all(e in engine["params"] for e in engine["experts"])
    assert engine["blockers"] and all("(cpu)" in b for b in engine["blockers"]), engine["blockers"][:3]


def test_routed_experts_equal_the_trainers(models, baseline):
    """Rollout routing replay: the experts the engine (megamoe, eager, return_routing=True) routed every token
    to while it generated the samples (prefill and decode steps, rollout/capture.py) are the experts the
    trainer's megamoe model picks from the same sequences, bitwise (fp32, CPU); the last completion token,
    sampled but never fed back, has none (-1). The compiled engine's capture: test_rollout_serve.py."""
    from trainer.experts import moe_blocks
    from trainer.model import load_model

    routed = [s.routed_experts for s in baseline]
    model = load_model(models[0], "megamoe")
    seen = []
    hooks = [b.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
             for _, b in moe_blocks(model)]
    try:
        for s, r in zip(baseline, routed, strict=True):
            seen.clear()
            with torch.no_grad():
                model(input_ids=torch.tensor([s.prompt_ids + s.completion_ids]))
            want = torch.stack(seen, dim=1)  # [T, L, k]
            assert r.dtype.name == "int16" and tuple(r.shape) == tuple(want.shape), (r.shape, want.shape)
            assert torch.equal(torch.from_numpy(r[:-1]).long(), want[:-1])
            assert (r[-1] == -1).all()
    finally:
        for h in hooks:
            h.remove()
    assert len({r.tobytes() for r in routed}) > 1, "distinct sequences must not all route alike"


def test_decode_time_routing_is_what_the_trainer_replays(worker, models):
    """The capture records each token's routing at the step that computed it: with the engine's routers made to
    favour expert E-1 on the rows that compute generated tokens only (rollout.testing.favour_expert_in_decode),
    every token a decode step computed (the completion's, but its last)
    carries E-1 and every prompt token the prefill's routing (the trainer's own, bitwise); the trainer, replaying,
    calls its experts with the decode-time experts, where its own router picks others."""
    from trainer.experts import moe_blocks
    from trainer.model import load_model
    from trainer.replay import routing_replay

    model = load_model(models[0], "megamoe")
    E = model.config.num_experts
    assert worker.llm.collective_rpc(favour_expert_in_decode, args=(True, E - 1)) == [LAYERS]
    try:
        samples = worker.generate(PROMPTS, N, {**SAMPLING, "seed": 99})
    finally:
        worker.llm.collective_rpc(favour_expert_in_decode, args=(False, E - 1))
    seen = []
    hooks = [b.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
             for _, b in moe_blocks(model)]
    own_has_it = replayed_has_it = decode_tokens = 0
    try:
        for s in samples:
            P, C = len(s.prompt_ids), len(s.completion_ids)
            r = torch.from_numpy(s.routed_experts).long()  # [T, L, k]
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            seen.clear()
            with torch.no_grad():
                model(input_ids=ids)
            own = torch.stack(seen, dim=1)
            assert torch.equal(r[:P], own[:P])  # prefill: not flipped, the trainer's own routing
            decode = r[P:P + C - 1]
            assert (decode == E - 1).any(dim=2).all(), "a decode-computed token without the decode-time expert"
            seen.clear()
            valid = torch.ones(P + C, dtype=torch.bool)
            with torch.no_grad(), routing_replay(model, r.permute(1, 0, 2), valid, replay=True):
                model(input_ids=ids)
            replayed = torch.stack(seen, dim=1)
            assert torch.equal(replayed[:P + C - 1], r[:P + C - 1])  # the last token: no routing, the trainer's
            decode_tokens += C - 1
            own_has_it += int((own[P:P + C - 1] == E - 1).any(dim=2).all(dim=1).sum())
            replayed_has_it += int((replayed[P:P + C - 1] == E - 1).any(dim=2).all(dim=1).sum())
    finally:
        for h in hooks:
            h.remove()
    assert replayed_has_it == decode_tokens > own_has_it, (replayed_has_it, decode_tokens, own_has_it)
