"""moe_impl="stock": vLLM's own MoE kernels, with weight reloads made correct.

vLLM 0.32's CPU MoE prepacks the expert weights after the first load only; a reload copied the
unpacked checkpoint tensors into the prepacked storage and silently changed every expert
(measured here: identical weights moved logprobs by up to 0.44 before the repair
in rollout/adapter.py). These tests fail without that repair.

Model A is stored with fused experts on disk (transformers 5's in-memory names,
`mlp.experts.gate_up_proj [E,2I,H]`), the other checkpoint layout the rollout must load; the other
test modules use make_model's per-expert files.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_stock.py
"""

from __future__ import annotations

import pytest
import torch

from rollout.testing import max_abs_diff, processed_logprobs

LOGPROB_TOL_FP32 = 1e-4  # as in test_rollout.py; measured ~5e-7
PROMPTS = ["1 + 2 =", "What is 7 * 8?", "the cat sat on the"]
N = 2
SAMPLING = {"temperature": 0.9, "max_tokens": 10, "seed": 42}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rl.make_model import make_model

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("rollout_stock")
    a = make_model(root / "a", arch="qwen3_moe", seed=0)
    state = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, str(a / "model.safetensors"), metadata={"format": "pt"})
    return a, make_model(root / "b", arch="qwen3_moe", seed=1)


@pytest.fixture(scope="module")
def hf(models):
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in models)


@pytest.fixture(scope="module")
def worker(models):
    from rollout.worker import RolloutWorker

    w = RolloutWorker(models[0], "stock", dtype="float32", seed=0, max_model_len=128, kv_cache_memory_bytes=64 << 20,
                      return_routing=True)
    yield w
    w.close()


def _logprobs(samples):
    return [s.sampler_logprobs for s in samples]


def test_stock_uses_vllms_kernels_not_megamoe(worker):
    (status,) = worker.status()
    assert status["impl"] == "stock" and status["layer_impls"] == ["stock"], status
    worker.reset_moe_calls()
    worker.generate(PROMPTS, 1, {"max_tokens": 4, "seed": 0})
    assert worker.moe_calls() == {}, "moe_impl='stock' must not call megamoe"


def test_fused_checkpoint_loads_into_the_model(worker, hf):
    samples = worker.generate(PROMPTS, N, SAMPLING)
    ref = [processed_logprobs(hf[0], s.prompt_ids, s.completion_ids, SAMPLING["temperature"]) for s in samples]
    err = max_abs_diff(_logprobs(samples), ref)
    print(f"[rollout] stock, fused checkpoint on disk: max |dlogp| vs transformers(A) = {err:.2e}")
    assert err <= LOGPROB_TOL_FP32


def test_stock_reload_of_identical_weights_is_bitwise_identical(worker, hf):
    before = worker.generate(PROMPTS, N, SAMPLING)
    worker.update_weights(hf[0].state_dict())
    after = worker.generate(PROMPTS, N, SAMPLING)
    assert [s.completion_ids for s in after] == [s.completion_ids for s in before]
    assert _logprobs(after) == _logprobs(before), f"max diff {max_abs_diff(_logprobs(after), _logprobs(before))}"


def test_stock_reload_of_changed_weights_gives_the_new_model(worker, hf):
    worker.update_weights(hf[1].state_dict())
    samples = worker.generate(PROMPTS, N, SAMPLING)
    ref = [processed_logprobs(hf[1], s.prompt_ids, s.completion_ids, SAMPLING["temperature"]) for s in samples]
    err = max_abs_diff(_logprobs(samples), ref)
    print(f"[rollout] stock after update to model B: max |dlogp| vs transformers(B) = {err:.2e}")
    assert err <= LOGPROB_TOL_FP32


def test_stock_returns_routed_experts(worker, hf):
    """moe_impl stock reports vLLM's own routing (the ids vLLM hands the MoE method) while it generates: one row
    per prompt and completion token, every MoE layer, ids in [0, E) except the last token's (sampled, never fed
    back: -1), the same top-k set as transformers' router (fp32)."""
    worker.update_weights(hf[0].state_dict())  # the module's engine holds model B after the reload tests
    samples = worker.generate(PROMPTS, 1, {"max_tokens": 4, "seed": 0})
    cfg = hf[0].config
    for s in samples:
        r = s.routed_experts
        assert r.shape == (len(s.prompt_ids) + len(s.completion_ids), cfg.num_hidden_layers,
                           cfg.num_experts_per_tok)
        assert (r[-1] == -1).all()
        r = r[:-1]
        assert r.min() >= 0 and r.max() < cfg.num_experts
        with torch.no_grad():
            out = hf[0](input_ids=torch.tensor([s.prompt_ids + s.completion_ids[:-1]]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            want = torch.topk(logits.float(), cfg.num_experts_per_tok, dim=-1).indices.sort(-1).values
            assert torch.equal(torch.from_numpy(r[:, layer]).long().sort(-1).values, want)


def test_stock_routing_capture_with_compilation_is_refused_before_start(models):
    """stock's routing is recorded in Python inside vLLM's MoE layer, which torch.compile traces: refused before
    any engine starts, naming the key (no engine is built here)."""
    from rollout.worker import RolloutWorker

    with pytest.raises(ValueError, match=r"return_routing=True \(trainer.routing_replay\) with moe_impl='stock': "
                                         r"expected enforce_eager=True"):
        RolloutWorker(models[0], "stock", return_routing=True, enforce_eager=False)
