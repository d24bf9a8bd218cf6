"""vLLM general plugin: make vLLM's MoE models compute their routed experts with megamoe.

Registered in pyproject.toml under the `vllm.general_plugins` entry point, so vLLM calls
`register()` in every one of its processes (driver, engine core, workers). Configuration comes
from one environment variable that `rollout.worker.RolloutWorker` sets before it creates the
engine, so every process vLLM spawns inherits it:

    MEGAMOE_MOE_IMPL unset      the plugin does nothing: vLLM runs untouched
    MEGAMOE_MOE_IMPL=megamoe    routed experts through megamoe.fused_moe(impl="megamoe")
    MEGAMOE_MOE_IMPL=reference  routed experts through megamoe.fused_moe(impl="reference")
    MEGAMOE_MOE_IMPL=stock      vLLM's own MoE kernels, with the weight-reload repair (adapter.py)

Why this module imports nothing but the standard library: vLLM loads a plugin with
`entry_point.load()` inside `try/except Exception: logger.exception(...)`, so an exception raised
while *importing* this module is logged and swallowed, and the engine would quietly run vLLM's own
MoE. `register()` itself is called outside that try, so everything that can fail (the value of the
variable, importing megamoe and vLLM internals, the registration) happens inside `register()`,
where an exception stops the engine from starting. A second line of defence is in
`rollout.extension`: the worker extension refuses to import when the plugin did not run.
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "MEGAMOE_MOE_IMPL"
MOE_IMPLS = ("megamoe", "reference", "stock")

# The architectures (config.json `architectures`) whose MoE blocks the hook serves: SwiGLU experts
# routed by softmax top-k (Qwen3-MoE, Mixtral, OLMoE) or by vLLM's DeepSeek router, gate rows first in
# w13 (vLLM's layout for all of them). Defined here, without vLLM, so that a driver can check a
# checkpoint before it starts anything; rollout.adapter re-exports it.
SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)

# config.json settings that vLLM's classes of these architectures do not read (vLLM 0.26 and 0.32
# alike): their routed experts are SwiGLU whatever `hidden_act` says, and vLLM's OLMoE has no
# `clip_qkv` and builds every RMSNorm with eps 1e-5. A checkpoint that sets one of them otherwise
# would be sampled as a different model from the one the trainer trains, so `check_model_config`
# refuses it. {architecture: {field: the value vLLM computes with}}; an absent field has that value
# by transformers' defaults.
VLLM_FIXED_CONFIG: dict[str, dict[str, object]] = {
    **{arch: {"hidden_act": "silu"} for arch in SUPPORTED_ARCHITECTURES},
    "OlmoeForCausalLM": {"hidden_act": "silu", "clip_qkv": None, "rms_norm_eps": 1e-5},
}


def check_architectures(architectures, where: str) -> str:
    """The first of `architectures` that the hook serves, or a ValueError naming them all."""
    archs = list(architectures or [])
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(f"{where}: architecture {archs} is not supported by the megamoe rollout hook; "
                         f"supported: {SUPPORTED_ARCHITECTURES}")
    return supported[0]


def check_model_config(config, where: str) -> str:
    """A checkpoint's config (config.json as a dict, or a transformers config) that the hook serves
    as the model it describes; returns its architecture. Raises NotImplementedError naming the
    architecture and every setting vLLM's class of it would silently compute differently."""
    def get(name, default=None):
        return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)

    arch = check_architectures(get("architectures"), where)
    bad = [f"{name}={get(name)!r} (vLLM computes {want!r})" for name, want in VLLM_FIXED_CONFIG[arch].items()
           if get(name, want) != want]
    if bad:
        raise NotImplementedError(f"{where}: {arch} sets " + ", ".join(bad) + f"; vLLM's {arch} does not implement "
                                  "this (it would sample a different model from the trainer's), so the megamoe "
                                  "rollout hook refuses the checkpoint")
    return arch

logger = logging.getLogger(__name__)

# What register() did in this process; read by rollout.extension (in vLLM's worker process).
STATE: dict[str, object] = {"called": False, "impl": None, "registered": False}


def configured_impl() -> str | None:
    """The validated value of MEGAMOE_MOE_IMPL, or None when it is unset or empty."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    if value not in MOE_IMPLS:
        raise ValueError(f"{ENV_VAR}: expected one of {MOE_IMPLS} (or unset to leave vLLM alone), "
                         f"got {value!r}")
    return value


def register() -> None:
    """vLLM's entry point. Raises (and so stops engine start-up) when misconfigured or broken."""
    STATE["called"] = True
    impl = configured_impl()
    STATE["impl"] = impl
    if impl is None:
        return
    if STATE["registered"]:
        return
    from rollout import adapter  # heavy imports (vLLM internals, megamoe) happen here, loudly

    adapter.register_moe_method(impl)
    STATE["registered"] = True
    logger.info("megamoe plugin: vLLM MoE layers use moe_impl=%s in process %d", impl, os.getpid())
