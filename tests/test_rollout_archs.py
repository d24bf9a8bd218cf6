"""More MoE architectures through the megamoe hook: OLMoE, and DeepSeek-V2 (shared experts, MLA,
routed_scaling_factor, a dense first layer).

rl.make_model writes Qwen3-MoE and Mixtral only, so the tiny checkpoints here are written from
transformers configs with make_model's tokenizer. Weights are drawn with std 0.1 (not the 0.02 of a
fresh init) so that the experts move the logits clearly and a wrong expert output cannot hide.

- OLMoE: logprobs against a transformers fp32 forward, before and after a weight update.
- DeepSeek-V2: vLLM CPU's MLA path and transformers' DeepSeek-V2 disagree by ~1 in logprob for
  this tiny config even with moe_impl="stock" (vLLM's own kernels; measured 2026-11-30), so the
  reference is vLLM itself: the megamoe engine against the stock engine, before and after an update.
  One sequence per call: with several sequences in a batch, vLLM CPU's MLA attention is not
  reproducible on this config (identical calls differed by up to 3.4 in logprob, with megamoe and
  with stock alike), while one sequence at a time is bitwise reproducible.

    .venv/bin/python -m pytest -q tests/test_rollout_archs.py
"""

from __future__ import annotations

import pytest
import torch

from rollout.testing import max_abs_diff, processed_logprobs

LOGPROB_TOL_FP32 = 1e-4  # as in test_rollout.py; measured ~1e-6
PROMPTS = ["1 + 2 =", "the red bird is"]
N = 2
SAMPLING = {"temperature": 0.8, "max_tokens": 8, "seed": 11}


def _tiny_checkpoint(out, arch: str, seed: int):
    from transformers import AutoModelForCausalLM

    from rl.make_model import EOS_TOKEN, PAD_TOKEN, build_tokenizer

    tok = build_tokenizer(512)
    pad, eos = tok.convert_tokens_to_ids([PAD_TOKEN, EOS_TOKEN])
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                  pad_token_id=pad)
    if arch == "olmoe":
        from transformers import OlmoeConfig

        cfg = OlmoeConfig(**common, intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    else:
        from transformers import DeepseekV2Config

        # MLA head size kv_lora_rank + qk_rope_head_dim = 576: the one vLLM CPU's MLA decode kernel runs.
        cfg = DeepseekV2Config(**common, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                               n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                               kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=64,
                               v_head_dim=32, topk_method="greedy", n_group=1, topk_group=1,
                               routed_scaling_factor=1.5, norm_topk_prob=False, rope_scaling=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model.eval()


def _run(model_dir, impl, update_state, one_at_a_time=False):
    """Samples before and after an update, from one engine that is closed before returning."""
    from rollout.worker import RolloutWorker

    def generate(w):
        if not one_at_a_time:
            return w.generate(PROMPTS, N, SAMPLING)
        return [s for i, p in enumerate(PROMPTS) for s in w.generate([p], 1, {**SAMPLING, "seed": SAMPLING["seed"] + i})]

    w = RolloutWorker(model_dir, impl, dtype="float32", seed=0, max_model_len=128, kv_cache_memory_bytes=64 << 20)
    try:
        status = w.status()[0]
        w.reset_moe_calls()
        before = generate(w)
        calls = w.moe_calls()
        w.update_weights(update_state)
        after = generate(w)
    finally:
        w.close()
    return {"status": status, "calls": calls, "before": before, "after": after}


def _logprobs(samples):
    return [s["logprobs"] for s in samples]


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_olmoe")
    a, b = _tiny_checkpoint(root / "a", "olmoe", 0), _tiny_checkpoint(root / "b", "olmoe", 1)
    return a, b, _run(root / "a", "megamoe", b.state_dict())


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_deepseek")
    _tiny_checkpoint(root / "a", "deepseek_v2", 0)
    b = _tiny_checkpoint(root / "b", "deepseek_v2", 1)
    return {impl: _run(root / "a", impl, b.state_dict(), one_at_a_time=True) for impl in ("megamoe", "stock")}


def test_olmoe_through_megamoe_matches_transformers(olmoe):
    a, b, run = olmoe
    assert run["status"]["architectures"] == ["OlmoeForCausalLM"] and run["status"]["layer_impls"] == ["megamoe"]
    assert run["calls"].get("megamoe", 0) > 0
    for model, samples, what in ((a, run["before"], "model A"), (b, run["after"], "after update to B")):
        ref = [processed_logprobs(model, s["prompt_ids"], s["completion_ids"], SAMPLING["temperature"])
               for s in samples]
        err = max_abs_diff(_logprobs(samples), ref)
        print(f"[rollout] OLMoE megamoe {what}: max |dlogp| vs transformers = {err:.2e}")
        assert err <= LOGPROB_TOL_FP32


def test_deepseek_v2_through_megamoe_matches_vllm_stock(deepseek):
    ours, stock = deepseek["megamoe"], deepseek["stock"]
    # Layer 0 is dense (first_k_dense_replace=1): one MoE layer, with a shared expert.
    assert ours["status"]["hooked_moe_layers"] == 1 and ours["status"]["layer_impls"] == ["megamoe"]
    assert ours["calls"].get("megamoe", 0) > 0 and stock["calls"] == {}
    for phase in ("before", "after"):
        assert [s["completion_ids"] for s in ours[phase]] == [s["completion_ids"] for s in stock[phase]], phase
        err = max_abs_diff(_logprobs(ours[phase]), _logprobs(stock[phase]))
        print(f"[rollout] DeepSeek-V2 megamoe vs vLLM stock, {phase} update: max |dlogp| = {err:.2e}")
        assert err <= LOGPROB_TOL_FP32
    # The update changed the model, so "after" compares the new weights in both engines.
    assert [s["completion_ids"] for s in ours["before"]] != [s["completion_ids"] for s in ours["after"]]
