"""Out-of-tree vLLM model classes: vLLM's own MoE models whose gates compute megamoe's router logits.

vLLM >= 0.32 builds every MoE gate as a pluggable `GateLinear`, which the hook replaces with
`adapter.MegaMoEGate`. vLLM 0.26 (the H200 machine's) builds the gates of Qwen3-MoE, Mixtral and
OLMoE as plain `ReplicatedLinear` layers, whose bf16 logits flipped 1.5–2.7% of the top-k decisions
against the trainer's fp32 router there (docs/CONSISTENCY.md). For those, the classes below are
registered with vLLM's `ModelRegistry` under the same architecture names: each is vLLM's class, and
after building it gives every MoE block's plain `ReplicatedLinear` gate `MegaMoERouterMethod`, which
computes `megamoe.router.router_logits` (fp32, batch invariant): the trainer's Fp32Router function.
Gates that are already `MegaMoEGate` are left as they are, so on vLLM >= 0.32 these classes change
nothing.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from vllm.model_executor.models import mixtral, olmoe, qwen3_moe

from rollout.adapter import MegaMoERouterMethod


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


def _with_megamoe_router(base: type) -> type:
    # vLLM builds model classes as cls(vllm_config=..., prefix=...) and checks the signature.
    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self.megamoe_router_gates = use_megamoe_router(self)

    # Same name as vLLM's class: vLLM reports and checks model classes by name.
    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                         "__qualname__": base.__qualname__})


Qwen3MoeForCausalLM = _with_megamoe_router(qwen3_moe.Qwen3MoeForCausalLM)
MixtralForCausalLM = _with_megamoe_router(mixtral.MixtralForCausalLM)
OlmoeForCausalLM = _with_megamoe_router(olmoe.OlmoeForCausalLM)
