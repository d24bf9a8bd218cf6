"""The architectures the megamoe rollout hook serves, and the refusal of checkpoints it cannot serve
as the model they describe. Standard library only: a driver checks a checkpoint with it before it
starts vLLM, Ray or a trainer (rl.loop.check_model), and vLLM-side code (rollout.adapter,
rollout.worker) uses the same definitions."""

from __future__ import annotations

# The architectures (config.json `architectures`) whose MoE blocks the hook serves: SwiGLU experts
# routed by softmax top-k (Qwen3-MoE, Mixtral, OLMoE) or DeepSeek's grouped sigmoid top-k with a
# score-correction bias (megamoe.route on both sides), gate rows first in w13 (vLLM's layout for all). Defined here, without vLLM, so that a driver can check a
# checkpoint before it starts anything.
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
    # transformers' DeepseekV3 always routes by sigmoid scores with the score-correction bias; vLLM reads
    # both from config.json (scoring_func, topk_method "noaux_tc") and otherwise uses softmax without it.
    "DeepseekV3ForCausalLM": {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
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
