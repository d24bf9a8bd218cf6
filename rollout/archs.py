"""The architectures the megamoe rollout hook serves, and the refusal of checkpoints it cannot serve
as the model they describe. Standard library only: a driver checks a checkpoint with it before it
starts vLLM, Ray or a trainer (rl.loop.check_model), and vLLM-side code (rollout.adapter,
rollout.worker) uses the same definitions."""

from __future__ import annotations

# The architectures (config.json `architectures`) whose MoE blocks the hook serves: SwiGLU experts
# routed by softmax top-k (Qwen3-MoE, Mixtral, OLMoE) or DeepSeek's grouped sigmoid top-k with a
# score-correction bias (megamoe.route on both sides), gate rows first in w13 (vLLM's layout for all);
# gpt-oss's biased experts with a clamped SwiGLU, gate and up rows interleaved (the hook de-interleaves
# them after loading), routed by softmax top-k of biased router logits. Defined here, without vLLM, so
# that a driver can check a checkpoint before it starts anything.
SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
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
    # vLLM's GptOss (0.32) computes its experts with swigluoai's fixed alpha 1.702 and limit 7.0, builds
    # every RMSNorm with eps 1e-5 and q/k/v/o with biases, and has an lm_head of its own (nothing tied);
    # transformers reads all of them from the config. (hidden_act: neither side reads it for gpt-oss.)
    "GptOssForCausalLM": {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "attention_bias": True,
                          "tie_word_embeddings": False},
}


def gpt_oss_layer_types(layers: int) -> list[str]:
    """gpt-oss's attention per layer as vLLM's GptOss builds it: a sliding window on even layers."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _rope_type(get) -> str:
    rope = get("rope_parameters") or get("rope_scaling") or {}
    return str(rope.get("rope_type", rope.get("type", "default")))


# Settings vLLM's class computes from other fields, as (field, what the config says, what vLLM computes).
# gpt-oss: vLLM puts the sliding window on even layers whatever `layer_types` says, and always computes
# YaRN RoPE (from rope_parameters' factor, beta_fast, ...).
VLLM_DERIVED_CONFIG = {
    "GptOssForCausalLM": (
        ("layer_types", lambda get: get("layer_types"), lambda get: gpt_oss_layer_types(get("num_hidden_layers"))),
        ("rope_parameters.rope_type", _rope_type, lambda get: "yarn"),
    ),
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
    architecture and every setting vLLM's class of it would silently compute differently, or a
    quantization (mxfp4, fp8, ...: the hook serves unquantized experts only)."""
    def get(name, default=None):
        return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)

    arch = check_architectures(get("architectures"), where)
    quant = get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise NotImplementedError(f"{where}: {arch} sets quantization_config (quant_method {str(method)!r}); the "
                                  "megamoe rollout hook and trainer compute unquantized experts only, so the "
                                  "checkpoint is refused (use its bf16 / fp32 weights)")
    bad = [f"{name}={get(name)!r} (vLLM computes {want!r})" for name, want in VLLM_FIXED_CONFIG[arch].items()
           if get(name, want) != want]
    for name, have, want in VLLM_DERIVED_CONFIG.get(arch, ()):
        if have(get) != want(get):
            bad.append(f"{name}={have(get)!r} (vLLM computes {want(get)!r})")
    if bad:
        raise NotImplementedError(f"{where}: {arch} sets " + ", ".join(bad) + f"; vLLM's {arch} does not implement "
                                  "this (it would sample a different model from the trainer's), so the megamoe "
                                  "rollout hook refuses the checkpoint")
    return arch
