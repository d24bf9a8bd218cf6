"""RolloutWorker as a Ray actor (as rl/ runs it), on the tiny Mixtral, moe_impl="reference".

Covers a second architecture (Mixtral: `block_sparse_moe` and w1/w3/w2 on disk, `mlp` and fused
gate_up_proj/down_proj in transformers), the `reference` implementation, and weights travelling
trainer -> Ray -> RolloutWorker -> vLLM worker process.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_ray.py
"""

from __future__ import annotations

import pytest
import torch

from rollout.testing import max_abs_diff, processed_logprobs

LOGPROB_TOL_FP32 = 1e-4  # as in test_rollout.py; measured ~5e-7
PROMPTS = ["1 + 2 =", "the dog ran to the"]
N = 2
SAMPLING = {"temperature": 0.8, "max_tokens": 10, "seed": 3}

pytestmark = pytest.mark.slow  # Ray and a vLLM engine in an actor


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rl.make_model import make_model

    root = tmp_path_factory.mktemp("rollout_mixtral")
    return make_model(root / "a", arch="mixtral", seed=0), make_model(root / "b", arch="mixtral", seed=1)


@pytest.fixture(scope="module")
def hf(models):
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in models)


@pytest.fixture(scope="module")
def actor(models):
    import ray

    from rollout.worker import RolloutWorker

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        a = ray.remote(RolloutWorker).options(num_cpus=1).remote(
            str(models[0]), "reference", dtype="float32", seed=0, max_model_len=128, kv_cache_memory_bytes=64 << 20)
        yield a
        ray.get(a.close.remote())
    finally:
        ray.shutdown()


def _check_against(hf_model, samples, what):
    ref = [processed_logprobs(hf_model, s.prompt_ids, s.completion_ids, SAMPLING["temperature"]) for s in samples]
    err = max_abs_diff([s.sampler_logprobs for s in samples], ref)
    print(f"[rollout] mixtral reference (Ray actor) {what}: max |dlogp| vs transformers = {err:.2e}")
    assert err <= LOGPROB_TOL_FP32


def test_ray_actor_generates_through_reference(actor, hf):
    import ray

    (status,) = ray.get(actor.status.remote())
    assert status["architectures"] == ["MixtralForCausalLM"]
    assert status["layer_impls"] == ["reference"] and status["hooked_moe_layers"] == 2, status
    ray.get(actor.reset_moe_calls.remote())
    samples = ray.get(actor.generate.remote(PROMPTS, N, SAMPLING))
    calls = ray.get(actor.moe_calls.remote())
    assert set(calls) == {"reference"} and calls["reference"] > 0, calls
    _check_against(hf[0], samples, "model A")


def test_ray_actor_takes_transformers_weights(actor, hf):
    import ray

    state_b = hf[1].state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state_b  # transformers' in-memory Mixtral names
    ray.get(actor.update_weights.remote(list(state_b.items())))
    samples = ray.get(actor.generate.remote(PROMPTS, N, SAMPLING))
    _check_against(hf[1], samples, "after update to model B")
    assert max_abs_diff([s.sampler_logprobs for s in samples],
                        [processed_logprobs(hf[0], s.prompt_ids, s.completion_ids, SAMPLING["temperature"])
                         for s in samples]) > 100 * LOGPROB_TOL_FP32
