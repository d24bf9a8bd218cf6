"""Out-of-tree vLLM model classes: vLLM's own MoE models whose gates compute megamoe's router logits.

vLLM >= 0.32 builds every MoE gate as a pluggable `GateLinear`, which the hook replaces with
`adapter.MegaMoEGate`. vLLM 0.26 (the H200 machine's) builds the gates of Qwen3-MoE, Mixtral and
OLMoE as plain `ReplicatedLinear` layers, whose bf16 logits flipped 1.5–2.7% of the top-k decisions
against the trainer's fp32 router there (docs/CONSISTENCY.md). For those, the classes below are
registered with vLLM's `ModelRegistry` under the same architecture names: each is vLLM's class, and
after building it gives every MoE block's plain `ReplicatedLinear` gate `MegaMoERouterMethod`, which
computes `megamoe.router.router_logits` (fp32, batch invariant): the trainer's Fp32Router function.
Gates that are already `MegaMoEGate` are left as they are, so on vLLM >= 0.32 these classes change
nothing for Qwen3-MoE, Mixtral and OLMoE.

DeepSeek-V2/V3 (vLLM's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM): besides the gates, each MoE
block's shared experts (vLLM's DeepseekV2MLP) become `MegaMoESharedMLP`: the same module with its
parameters, weight loaders and names, computing `moe_method.shared_experts` (megamoe.fused_moe with one
expert, the trainer's function for them) instead of vLLM's dense GEMMs, whose rounding differs from
the trainer's. vLLM's MoE runner holds the shared-experts module object itself and calls it, and the
module is built inside vLLM's DeepseekV2MoE, so there is no layer registry to reach it through: the
instance gets the subclass (`__class__`), the one narrow step where no registry exists. Its linears
keep their weights unpacked (`KeepWeightLinearMethod`), which megamoe reads.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from vllm.model_executor.models import deepseek_v2, mixtral, olmoe, qwen3_moe

from rollout import moe_method
from rollout.adapter import _REGISTERED, KeepWeightLinearMethod, MegaMoERouterMethod


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


class MegaMoESharedMLP(deepseek_v2.DeepseekV2MLP):
    """vLLM's DeepSeek shared-experts MLP computed by megamoe (module docstring)."""

    def forward(self, x):
        return moe_method.shared_experts(x, self.gate_up_proj.weight, self.down_proj.weight, self.megamoe_impl)


def use_megamoe_shared_experts(model: torch.nn.Module) -> int:
    """Give each DeepSeek MoE block's shared-experts MLP megamoe's computation; returns how many."""
    impl = _REGISTERED["impl"]
    n = 0
    for name, module in model.named_modules():
        shared = getattr(module, "shared_experts", None)
        if shared is None or not hasattr(module, "experts") or isinstance(shared, MegaMoESharedMLP):
            continue
        if type(shared) is not deepseek_v2.DeepseekV2MLP:
            raise NotImplementedError(f"megamoe rollout hook: {name}.shared_experts is {type(shared).__name__}; the "
                                      "hook computes vLLM's DeepseekV2MLP shared experts only (use moe_impl='stock')")
        for proj in (shared.gate_up_proj, shared.down_proj):
            if type(proj.quant_method) is not UnquantizedLinearMethod or proj.bias is not None or proj.tp_size != 1:
                raise NotImplementedError(f"megamoe rollout hook: {name}.shared_experts is quantized, biased or "
                                          "tensor-parallel; megamoe computes it whole and unquantized "
                                          "(use moe_impl='stock')")
            proj.quant_method = KeepWeightLinearMethod()
        shared.__class__ = MegaMoESharedMLP
        shared.megamoe_impl = impl
        n += 1
    return n


def _with_megamoe_router(base: type, shared_experts: bool = False) -> type:
    # vLLM builds model classes as cls(vllm_config=..., prefix=...) and checks the signature.
    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self.megamoe_router_gates = use_megamoe_router(self)
        self.megamoe_shared_experts = use_megamoe_shared_experts(self) if shared_experts else 0

    # Same name as vLLM's class: vLLM reports and checks model classes by name.
    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                         "__qualname__": base.__qualname__})


Qwen3MoeForCausalLM = _with_megamoe_router(qwen3_moe.Qwen3MoeForCausalLM)
MixtralForCausalLM = _with_megamoe_router(mixtral.MixtralForCausalLM)
OlmoeForCausalLM = _with_megamoe_router(olmoe.OlmoeForCausalLM)
DeepseekV2ForCausalLM = _with_megamoe_router(deepseek_v2.DeepseekV2ForCausalLM, shared_experts=True)
DeepseekV3ForCausalLM = _with_megamoe_router(deepseek_v2.DeepseekV3ForCausalLM, shared_experts=True)
