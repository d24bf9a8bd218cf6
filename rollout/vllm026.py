"""What the rollout hook does only for vLLM 0.26, the GPU machine's bundle (rl.stack.CUDA_VLLM_RUN).

When that bundle moves to a vLLM >= 0.32, delete this module, its test
(tests/rollout/test_rollout_vllm026.py) and its call sites (`grep -rn vllm026 rollout/ rl/`); with a
vLLM >= 0.32 nothing here has any effect. Which vLLM runs is decided once, in
rollout/vllm_surface.py (`VLLM.trainer_routing`, `VLLM.triton_attention`); nothing here probes it.

- Plain gates: vLLM 0.26 has the pluggable `GateLinear` (which adapter.MegaMoEGate replaces) but builds
  the gates of Qwen3-MoE, Mixtral and OLMoE as plain `ReplicatedLinear` layers, whose bf16 logits
  flipped 1.5-2.7% of the top-k decisions against the trainer's fp32 router on the H200
  (docs/CONSISTENCY.md). The classes below are vLLM's own, registered with vLLM's `ModelRegistry`
  under the same architecture names (`register`, which rollout.plugin calls): after building, each gives every
  MoE block's plain gate `MegaMoERouterMethod` (a linear method, vLLM's seam for what a linear
  computes), which computes `megamoe.router.router_logits` (fp32, batch invariant): the trainer's
  Fp32Router function. vLLM >= 0.32 builds those gates as GateLinear, which this leaves alone.
- Attention: the bundle carries no FlashAttention, so the GPU tests' engines ask for Triton attention
  (`gpu_engine_kwargs`).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from vllm.model_executor.models import mixtral, olmoe, qwen3_moe

from rollout.adapter import MegaMoERouterMethod
from rollout.models import built_then
from rollout.vllm_surface import VLLM

PLAIN_GATE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")
"""The architectures whose gates vLLM 0.26 builds as plain ReplicatedLinear layers (classes below)."""


def register(impl: str) -> None:
    """Register the plain-gate model classes with vLLM's ModelRegistry (this process), where the hook
    routes with the trainer's router (moe_impl megamoe / reference on a vLLM with a pluggable gate)."""
    if impl == "stock" or not VLLM.trainer_routing:
        return
    from vllm import ModelRegistry

    for arch in PLAIN_GATE_ARCHITECTURES:
        ModelRegistry.register_model(arch, f"{__name__}:{arch}")


def gpu_engine_kwargs() -> dict:
    """Engine arguments a GPU engine needs on this vLLM: the 0.26 bundle has no FlashAttention."""
    return {"attention_config": {"backend": "TRITON_ATTN"}} if VLLM.triton_attention else {}


def use_megamoe_router(model: torch.nn.Module) -> int:
    """Give each MoE block's plain ReplicatedLinear gate MegaMoERouterMethod; returns how many."""
    n = 0
    for name, module in model.named_modules():
        gate = getattr(module, "gate", None)
        if type(gate) is not ReplicatedLinear or not hasattr(module, "experts"):
            continue  # GateLinear (MegaMoEGate) subclasses ReplicatedLinear and needs nothing here
        if type(gate.quant_method) is not UnquantizedLinearMethod or gate.bias is not None:
            raise NotImplementedError(f"megamoe rollout hook: gate {name}.gate is quantized or has a bias; "
                                      "megamoe.router computes unquantized, bias-free gates (use moe_impl='stock')")
        gate.quant_method = MegaMoERouterMethod()
        n += 1
    return n


def _router_after_init(model) -> None:
    model.megamoe_router_gates = use_megamoe_router(model)


Qwen3MoeForCausalLM = built_then(qwen3_moe.Qwen3MoeForCausalLM, __name__, _router_after_init)
MixtralForCausalLM = built_then(mixtral.MixtralForCausalLM, __name__, _router_after_init)
OlmoeForCausalLM = built_then(olmoe.OlmoeForCausalLM, __name__, _router_after_init)
