"""run.numerics=bitwise where it cannot be provided is refused before any work, naming what is missing:
the config (rl/config.py), the model's architecture (rl/base_model.py), the consistency command, the
trainer's loader, the RolloutWorker (before its engine starts) and the vLLM plugin's variable. No engine
starts in this file."""

from __future__ import annotations

import os
import re

import pytest

from test_rollout_archs import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.parametrize("override,key,expected", [
    ("rollout.moe_impl=reference", "rollout.moe_impl", "'megamoe'"),
    ("trainer.moe_impl=stock", "trainer.moe_impl", "'megamoe'"),
    ("rollout.top_p=0.9", "rollout.top_p", "1.0"),
    ("rollout.gpus_per_worker=1", "trainer.gpus_per_rank", "> 0 as the sampler's rollout.gpus_per_worker=1.0 "
     "(both sides on CPU, fp32, or both on CUDA"),
    ("trainer.gpus_per_rank=1", "trainer.gpus_per_rank", "0 as the sampler's rollout.gpus_per_worker=0.0"),
    ("rollout.engine_kwargs={tensor_parallel_size: 2}", "rollout.engine_kwargs.tensor_parallel_size", "1"),
    ("rollout.engine_kwargs={enforce_eager: false}", "rollout.engine_kwargs.enforce_eager", "true or unset on CPU"),
])
def test_config_refuses_what_bitwise_cannot_compute(override, key, expected):
    from rl import config as C

    with pytest.raises(C.ConfigError, match=rf"tiny.yaml: {key}: expected {re.escape(expected)}.*with run.numerics=bitwise"):
        C.load(TINY, ["run.numerics=bitwise", override])
    if "gpus" not in key:  # fast numerics: no objection (a GPU placement brings checks of its own)
        C.load(TINY, [override])


def test_config_numerics_names_its_choices_and_reaches_the_trainer_ranks():
    from rl import config as C

    with pytest.raises(C.ConfigError, match=r"run.numerics.*'fast'.*'bitwise'"):
        C.load(TINY, ["run.numerics=exact"])
    cfg = C.load(TINY, ["run.numerics=bitwise"])
    assert C.trainer_worker_config(cfg).numerics == "bitwise"
    assert C.trainer_worker_config(C.load(TINY)).numerics == "fast"


def test_architecture_without_a_measured_bitwise_path_is_refused(tmp_path):
    from rl import config as C
    from rl.base_model import resolve_model
    from rl.make_model import make_model

    cfg = C.load(TINY, ["run.numerics=bitwise", "model.make.arch=gpt_oss", f"run.out_dir={tmp_path}"])
    with pytest.raises(C.ConfigError, match=r"model.make.arch: .*GptOssForCausalLM; run.numerics=bitwise "
                                            r"expects one of \('Qwen3MoeForCausalLM', 'OlmoeForCausalLM', "
                                            r"'MixtralForCausalLM'\)"):
        resolve_model(cfg, tmp_path)
    deepseek = make_model(tmp_path / "deepseek", arch="deepseek_v3")
    cfg = C.load(TINY, ["run.numerics=bitwise", "model.make=null", f"model.path={deepseek}"])
    with pytest.raises(C.ConfigError, match=r"model.path: .*DeepseekV3ForCausalLM"):
        resolve_model(cfg, tmp_path)


def test_consistency_in_bitwise_mode_takes_megamoe_alone(tmp_path):
    from rl import config as C
    from rl.consistency import ConsistencyError, prepare

    cfg = C.load(TINY, ["run.numerics=bitwise", f"run.out_dir={tmp_path}"])
    with pytest.raises(ConsistencyError, match=r"--impls: expected megamoe alone with run.numerics=bitwise"):
        prepare(cfg, impls=("megamoe", "stock"), out_dir=tmp_path)


def test_trainer_loader_refuses_bitwise_without_megamoe(tmp_path):
    from rl.make_model import make_model
    from trainer.model import load_model

    model = make_model(tmp_path / "m")
    with pytest.raises(ValueError, match=r"numerics='bitwise': expected moe_impl='megamoe'"):
        load_model(model, "reference", numerics="bitwise")
    with pytest.raises(ValueError, match=r"numerics: expected one of \('fast', 'bitwise'\)"):
        load_model(model, "megamoe", numerics="exact")


def test_trainer_model_in_bitwise_mode_runs_invariant_linears_and_attention(tmp_path):
    from torch import nn

    from rl.make_model import make_model
    from trainer.bitwise import ATTENTION, InvariantLinear
    from trainer.model import load_model

    model = load_model(make_model(tmp_path / "m"), "megamoe", numerics="bitwise")
    assert model.config._attn_implementation == ATTENTION
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is InvariantLinear for m in linears)
    # same parameter names as the fast model's (checkpoints, weight sync and FSDP2 see no change)
    assert set(model.state_dict()) == set(load_model(tmp_path / "m", "megamoe").state_dict())


@pytest.mark.parametrize("kwargs,missing", [
    (dict(moe_impl="stock"), "moe_impl='megamoe'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=1"),
    (dict(architecture="GptOssForCausalLM"), "an architecture in ('Qwen3MoeForCausalLM', 'OlmoeForCausalLM', "
                                             "'MixtralForCausalLM')"),
    (dict(engine_kwargs={"compilation_config": {"custom_ops": ["none"]}}), "compilation_config.custom_ops="),
    # a compiled CPU engine: Dynamo could not trace the batch-invariant linear (the engine died at start)
    (dict(enforce_eager=False), "enforce_eager=True or None on CPU"),
])
def test_rollout_worker_refuses_bitwise_before_the_engine(kwargs, missing):
    from rollout.worker import _check_numerics

    args = dict(moe_impl="megamoe", architecture="Qwen3MoeForCausalLM", tensor_parallel_size=1, engine_kwargs={})
    assert _check_numerics("bitwise", **args)["compilation_config"]["custom_ops"][1:] == ["-rotary_embedding",
                                                                                           "-silu_and_mul"]
    with pytest.raises(ValueError, match=r"numerics='bitwise': needs .*" + re.escape(missing)):
        _check_numerics("bitwise", **{**args, **kwargs})
    assert _check_numerics("fast", **{**args, **kwargs}) == {}
    with pytest.raises(ValueError, match=r"numerics: expected one of \('fast', 'bitwise'\)"):
        _check_numerics("exact", **args)


def test_rollout_worker_on_cuda_needs_the_batch_invariant_kernels_and_their_engine_settings(monkeypatch):
    """The CUDA branch of the engine checks, on this CPU machine: CUDA faked visible. vLLM CPU 0.32 lacks
    vLLM 0.26's batch-invariant module: refused naming it; with the kernels there, the engine arguments the
    mode sets (TRITON_ATTN, no torch.compile, decode CUDA graphs) and the ones that contradict it."""
    import torch

    from rollout import bitwise, invariant_kernels
    from rollout import worker as W

    args = dict(moe_impl="megamoe", architecture="Qwen3MoeForCausalLM", tensor_parallel_size=1, engine_kwargs={})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        invariant_kernels.require()
        has_kernels = True
    except ImportError:
        has_kernels = False
    if not has_kernels:
        with pytest.raises(ValueError, match=r"numerics='bitwise': needs numerics='bitwise' on CUDA needs vLLM's "
                                             r"batch-invariant kernels \(vllm.model_executor.layers.batch_invariant"):
            W._check_numerics("bitwise", **args)
    monkeypatch.setattr(invariant_kernels, "require", lambda: None)
    out = W._check_numerics("bitwise", **{**args, "engine_kwargs": {"compilation_config": {
        "cudagraph_capture_sizes": [1, 2]}}})
    assert out["attention_config"] == {"backend": "TRITON_ATTN"}
    assert out["compilation_config"] == {"cudagraph_capture_sizes": [1, 2], "custom_ops": bitwise.CUSTOM_OPS,
                                         **bitwise.CUDA_COMPILATION}
    for engine_kwargs, missing in (({"attention_config": {"backend": "FLASH_ATTN"}}, "attention_config.backend="
                                    "'TRITON_ATTN' (got 'FLASH_ATTN'"),
                                   ({"compilation_config": {"mode": 3}}, "compilation_config.mode=0 (got 3)"),
                                   ({"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
                                    "compilation_config.cudagraph_mode='FULL_DECODE_ONLY' (got 'PIECEWISE')")):
        with pytest.raises(ValueError, match=re.escape(missing)):
            W._check_numerics("bitwise", **{**args, "engine_kwargs": engine_kwargs})
    # the batch-invariant environment: set for a bitwise engine, removed again for a later fast one
    monkeypatch.delenv(bitwise.ENV_BATCH_INVARIANT, raising=False)
    monkeypatch.setitem(W._SET_BATCH_INVARIANT, "by_us", False)
    W._batch_invariant_env("bitwise")
    assert os.environ[bitwise.ENV_BATCH_INVARIANT] == "1"
    W._batch_invariant_env("fast")
    assert bitwise.ENV_BATCH_INVARIANT not in os.environ
    monkeypatch.setenv(bitwise.ENV_BATCH_INVARIANT, "1")  # the user's own setting stays
    W._batch_invariant_env("bitwise")
    W._batch_invariant_env("fast")
    assert os.environ[bitwise.ENV_BATCH_INVARIANT] == "1"


def test_plugin_variable_is_checked(monkeypatch):
    from rollout import plugin

    monkeypatch.setenv(plugin.NUMERICS_ENV_VAR, "exact")
    with pytest.raises(ValueError, match=r"MEGAMOE_NUMERICS: expected one of \('fast', 'bitwise'\)"):
        plugin.configured_numerics()
    monkeypatch.setenv(plugin.NUMERICS_ENV_VAR, "bitwise")
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    monkeypatch.setitem(plugin.STATE, "registered", False)
    with pytest.raises(ValueError, match=r"MEGAMOE_NUMERICS=bitwise: expected MEGAMOE_MOE_IMPL set too"):
        plugin.register()


@pytest.mark.parametrize("kwargs,owner", [("{numerics: bitwise}", "run.numerics"), ("{seed: 3}", "run.seed"),
                                          ("{weight_sync: ipc}", "rollout.weight_sync")])
def test_engine_kwargs_cannot_set_what_the_run_derives(kwargs, owner):
    """rollout.engine_kwargs reaches RolloutWorker unchanged: a key the run sets from another setting would
    make the sampler and the trainer disagree (numerics) or be overwritten silently; refused naming the owner."""
    from rl import config as C

    with pytest.raises(C.ConfigError, match=rf"rollout.engine_kwargs: expected no key the run derives from another "
                                            rf"setting \(set {re.escape(owner)} instead\)"):
        C.load(TINY, [f"rollout.engine_kwargs={kwargs}"])
