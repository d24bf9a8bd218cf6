"""More MoE architectures through the megamoe hook: DeepSeek-V2 (shared experts, MLA,
routed_scaling_factor, a dense first layer) in vLLM, and the checkpoints of every family that the hook
and the trainer must refuse. The end-to-end runs of each family (GRPO steps with megamoe on both sides,
then `megamoe-rl consistency`) are files of their own: test_rollout_archs_olmoe.py,
test_rollout_archs_deepseek.py and test_rollout_archs_gpt_oss.py (each takes minutes on 2 cores, and
`make test` runs each file in one worker); their shared names (ROOT, LOGPROB_TOL_FP32) are defined here.

- A checkpoint that vLLM's class would serve as another model (OLMoE with a GELU MLP, gpt-oss with
  another SwiGLU limit, a DeepSeek-V3 that routes otherwise, ...) is refused while vLLM builds the
  model, before any weight is loaded, naming the class and the setting; the trainer refuses it before
  reading weights too. A quantized (mxfp4) gpt-oss checkpoint is refused before anything starts.
- DeepSeek-V2: vLLM CPU's MLA path and transformers' DeepSeek-V2 disagree by ~1 in logprob for
  this tiny config even with moe_impl="stock" (vLLM's own kernels; measured 2026-11-30), so the
  reference is vLLM itself: the megamoe engine against the stock engine, before and after an update.
  One sequence per call: with several sequences in a batch, vLLM CPU's MLA attention is not
  reproducible on this config (identical calls differed by up to 3.4 in logprob, with megamoe and
  with stock alike), while one sequence at a time is bitwise reproducible. Its tiny checkpoint is
  written from a transformers config with make_model's tokenizer (make_model does not write
  DeepSeek), weights drawn with std 0.1 so that the experts move the logits clearly.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_archs.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout.testing import max_abs_diff

ROOT = Path(__file__).resolve().parents[2]
LOGPROB_TOL_FP32 = 1e-4  # as in test_rollout.py; measured ~1e-6 (OLMoE GRPO steps: 4.8e-7)


def train_tiny(config: Path, run_dir: Path, *overrides: str, ray: dict | None = None):
    """`megamoe-rl train --config <config> [overrides]` for two steps into run_dir, in a subprocess of its
    own session (Ray, one vLLM CPU engine, one FSDP2 trainer rank), sized as tests/rl/test_rl_loop.py's
    runs; the finished process (the family files' end-to-end runs, tests/rl/test_bitwise.py's). `ray`: the
    environment of a Ray cluster to join (tests/conftest.py's `ray_cluster`), else it starts its own."""
    import os
    import subprocess
    import sys

    from test_rl_loop import RUN_TIMEOUT_S, SMALL

    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(ray or {})}
    return subprocess.run([sys.executable, "-m", "rl.cli", "train", "--config", str(config), f"run.out_dir={run_dir}",
                           *SMALL, "run.steps=2", *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, start_new_session=True)


def check_grpo_steps(proc, run_dir: Path, arch: str, architecture: str, tol, tag: str) -> list[dict]:
    """A `train_tiny` run of make-model arch `arch` finished both steps with megamoe on both sides
    (a RolloutWorker starts only when every MoE layer of its engine is hooked with its moe_impl, a
    trainer only when every block's experts and router run on it), one optimizer update per step,
    finite metrics, and the trainer's logprobs of the sampled tokens within tol(step) of the sampler's
    (at step 2 the sampler runs the weights step 1 pushed to it). Returns the metrics records."""
    from test_rl_loop import STEP_KEYS, explain, numeric_finite

    from rl import config as C
    from rl.metrics import read_jsonl

    assert proc.returncode == 0, explain(proc)
    cfg = C.load(run_dir / "config.yaml")
    assert (cfg.model.make.arch, cfg.rollout.moe_impl, cfg.trainer.moe_impl) == (arch, "megamoe", "megamoe")
    assert json.loads((run_dir / "model" / "config.json").read_text())["architectures"] == [architecture]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2], explain(proc)
    for r in records:
        assert not numeric_finite(r, STEP_KEYS), (r["step"], r)
        assert r["train/optimizer_steps"] == r["step"] and r["train/grad_norm"] > 0, r
        print(f"[{tag} grpo] step {r['step']}: max |dlogp| sampler vs trainer {r['mismatch/abs_logp_diff_max']:.2e}")
        assert r["mismatch/abs_logp_diff_max"] <= tol(r["step"]), r
    return records
PROMPTS = ["1 + 2 =", "the red bird is"]
N = 2
SAMPLING = {"temperature": 0.8, "max_tokens": 8, "seed": 11}


def _tiny_deepseek_v2(out, seed: int):
    """A tiny DeepSeek-V2 checkpoint (see the module docstring); returns the transformers model."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    from rl.make_model import EOS_TOKEN, PAD_TOKEN, build_tokenizer

    tok = build_tokenizer(512)
    pad, eos = tok.convert_tokens_to_ids([PAD_TOKEN, EOS_TOKEN])
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                  pad_token_id=pad)
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
        blockers = w.llm.collective_rpc("megamoe_engine_params")[0]["blockers"]
        w.reset_moe_calls()
        before = generate(w)
        calls = w.moe_calls()
        w.update_weights(update_state)
        after = generate(w)
    finally:
        w.close()
    return {"status": status, "calls": calls, "before": before, "after": after, "blockers": blockers}


def _logprobs(samples):
    return [s.sampler_logprobs for s in samples]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_deepseek")
    _tiny_deepseek_v2(root / "a", 0)
    b = _tiny_deepseek_v2(root / "b", 1)
    return {impl: _run(root / "a", impl, b.state_dict(), one_at_a_time=True) for impl in ("megamoe", "stock")}


@pytest.mark.slow  # two vLLM engines (the module's `deepseek`)
def test_deepseek_v2_through_megamoe_matches_vllm_stock(deepseek):
    ours, stock = deepseek["megamoe"], deepseek["stock"]
    # Layer 0 is dense (first_k_dense_replace=1): one MoE layer, with a shared expert.
    assert ours["status"]["hooked_moe_layers"] == 1 and ours["status"]["layer_impls"] == ["megamoe"]
    assert ours["calls"].get("megamoe", 0) > 0 and stock["calls"] == {}
    for phase in ("before", "after"):
        assert [s.completion_ids for s in ours[phase]] == [s.completion_ids for s in stock[phase]], phase
        err = max_abs_diff(_logprobs(ours[phase]), _logprobs(stock[phase]))
        print(f"[rollout] DeepSeek-V2 megamoe vs vLLM stock, {phase} update: max |dlogp| = {err:.2e}")
        assert err <= LOGPROB_TOL_FP32
    # The update changed the model, so "after" compares the new weights in both engines.
    assert [s.completion_ids for s in ours["before"]] != [s.completion_ids for s in ours["after"]]


@pytest.mark.slow  # the module's `deepseek` engines
def test_deepseek_v2_keeps_its_mla_and_stock_experts_out_of_kernel_format(deepseek):
    """rollout.adapter.kernel_format_blockers on vLLM's real classes: MLA derives matrices from kv_b_proj
    after loading, vLLM's own MoE method repacks its experts, CPU vLLM repacks its linears; a weight sync
    must load those through vLLM's reload (rollout/kernel_format.py)."""
    ours, stock = deepseek["megamoe"]["blockers"], deepseek["stock"]["blockers"]
    assert any("MLA" in b for b in ours) and any("MLA" in b for b in stock), ours[:3]
    assert not any("experts after loading" in b for b in ours)  # megamoe keeps w13 / w2 as loaded
    assert any("experts after loading" in b for b in stock), stock[:3]
    assert any("processes its weights after loading (cpu)" in b for b in ours), ours[:3]


def test_deepseek_v3_config_vllm_would_route_otherwise_is_refused():
    from rollout.archs import check_model_config

    good = _config_json("deepseek_v3")
    assert check_model_config(good, where="model x") == "DeepseekV3ForCausalLM"
    for field, value in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        with pytest.raises(NotImplementedError, match=rf"^model x: DeepseekV3ForCausalLM sets {field}="):
            check_model_config({**good, field: value}, where="model x")


def test_quantized_gpt_oss_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """An mxfp4 gpt-oss checkpoint (gpt-oss-20b/120b as published): the driver's check (rl.base_model,
    before Ray, vLLM or a trainer start), the rollout hook's check and the trainer refuse it, naming the
    class and the quantization; the trainer before transformers reads a weight."""
    import transformers

    from rl.base_model import check_model
    from rl.config import ConfigError
    from rl.make_model import make_model
    from rollout.archs import check_model_config
    from trainer.model import load_model

    model = make_model(tmp_path / "mxfp4", arch="gpt_oss", layers=2)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    named = "GptOssForCausalLM sets quantization_config (quant_method 'mxfp4'); the megamoe rollout hook and trainer"
    with pytest.raises(NotImplementedError) as err:
        check_model_config(json.loads((model / "config.json").read_text()), where="model x")
    assert str(err.value).startswith(f"model x: {named}"), err.value
    with pytest.raises(ConfigError, match=r"^model.path: .* holds a GptOssForCausalLM \(model_type 'gpt_oss'\): "
                                          + named.replace("(", r"\(").replace(")", r"\)")):
        check_model(model)

    def no_load(*args, **kwargs):
        raise AssertionError("from_pretrained was called: the weights were read before the refusal")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ValueError, match=r"^GptOssForCausalLM: quantization_config \(quant_method 'mxfp4'\): megamoe "
                                         r"computes unquantized experts only"):
        load_model(model, "megamoe")


# -- a checkpoint the hook cannot serve as the model it describes --------------------------------------

CLASS_OF = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def _config_json(arch: str, **changes) -> dict:
    """config.json of make_model's tiny `arch` model, with `changes`."""
    from rl.make_model import build_config

    cfg = build_config(arch=arch, layers=2, hidden=64, experts=8, topk=2, intermediate=32, vocab=512,
                       pad_id=0, eos_id=2).to_dict()
    return {**cfg, "architectures": [CLASS_OF[arch]], **changes}


@pytest.mark.parametrize("arch,changes,named", [
    pytest.param("olmoe", {"hidden_act": "gelu"}, "hidden_act='gelu' (vLLM computes 'silu')", id="olmoe-gelu"),
    pytest.param("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0 (vLLM computes None)", id="olmoe-clip-qkv"),
    pytest.param("olmoe", {"rms_norm_eps": 1e-6}, "rms_norm_eps=1e-06 (vLLM computes 1e-05)", id="olmoe-norm-eps"),
    pytest.param("qwen3_moe", {"hidden_act": "relu"}, "hidden_act='relu' (vLLM computes 'silu')", id="qwen3-relu"),
    pytest.param("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu' (vLLM computes 'silu')", id="mixtral-gelu"),
    # gpt-oss: another activation (vLLM's swigluoai has alpha 1.702 and limit 7.0 built in), and attention
    # vLLM lays out by itself (sliding window on even layers, always YaRN, always an lm_head of its own).
    pytest.param("gpt_oss", {"swiglu_limit": 10.0}, "swiglu_limit=10.0 (vLLM computes 7.0)", id="gpt-oss-limit"),
    pytest.param("gpt_oss", {"swiglu_alpha": 1.0}, "swiglu_alpha=1.0 (vLLM computes 1.702)", id="gpt-oss-alpha"),
    pytest.param("gpt_oss", {"layer_types": ["full_attention", "full_attention"]},
                 "layer_types=['full_attention', 'full_attention'] (vLLM computes ['sliding_attention', "
                 "'full_attention'])", id="gpt-oss-layer-types"),
    pytest.param("gpt_oss", {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
                 "rope_parameters.rope_type='default' (vLLM computes 'yarn')", id="gpt-oss-rope"),
    pytest.param("gpt_oss", {"tie_word_embeddings": True}, "tie_word_embeddings=True (vLLM computes False)",
                 id="gpt-oss-tied"),
])
def test_model_config_vllm_would_compute_differently_is_refused(arch, changes, named):
    """config.json as a dict (what a driver reads) and as transformers' config (what vLLM holds)."""
    from transformers import AutoConfig

    from rollout.archs import check_model_config

    cls = CLASS_OF[arch]
    bad = _config_json(arch, **changes)
    for config in (bad, AutoConfig.for_model(**bad)):
        with pytest.raises(NotImplementedError) as err:
            check_model_config(config, where="model x")
        assert str(err.value).startswith(f"model x: {cls} sets {named}; vLLM's {cls} does not implement"), err.value
    good = _config_json(arch)
    assert check_model_config(good, where="model x") == check_model_config(AutoConfig.for_model(**good), where="") == cls


@pytest.mark.slow  # a vLLM engine start
def test_olmoe_with_another_activation_is_refused_before_weights_load(tmp_path, capfd, monkeypatch):
    """Both sides, on one checkpoint whose experts are GELU-gated: vLLM's OLMoE would compute SwiGLU
    experts from it silently. The engine stops while vLLM builds the model (no weight is loaded:
    vLLM's weight-loading log line never appears); the trainer stops before transformers reads it."""
    import transformers

    from rl.make_model import make_model
    from rollout.worker import RolloutWorker
    from trainer.model import load_model

    model = make_model(tmp_path / "gelu", arch="olmoe", layers=1)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))

    # vLLM's "WorkerProc initialization failed ..." (its engine core runs in this process on CPU; from an
    # engine-core process it reads "Engine core initialization failed"); the cause is logged
    with pytest.raises(Exception, match="initialization failed"):
        RolloutWorker(model, "megamoe", dtype="float32", seed=0, max_model_len=64, kv_cache_memory_bytes=16 << 20)
    log = "".join(capfd.readouterr())  # the engine's processes write to this process's stdout/stderr
    assert "OlmoeForCausalLM sets hidden_act='gelu' (vLLM computes 'silu')" in log, log[-3000:]
    # vLLM CPU 0.32 logs this line after every load (it is in the log of a good start of this model).
    assert "Loading weights took" not in log, log[-3000:]

    def no_load(*args, **kwargs):
        raise AssertionError("from_pretrained was called: the weights were read before the refusal")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ValueError, match=r"experts module OlmoeExperts cannot run on megamoe: hidden_act='gelu'"):
        load_model(model, "megamoe")
