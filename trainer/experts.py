"""megamoe inside transformers MoE models: an experts implementation and an fp32 router.

Experts. transformers 5 decorates its MoE expert modules (Qwen3MoeExperts, MixtralExperts, OlmoeExperts) with
`use_experts_implementation`; their forward looks up `config._experts_implementation` in the
registry `transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS` and calls
`fn(experts_module, hidden_states[T,H], top_k_index[T,k], top_k_weights[T,k])`. We register

    "megamoe"            -> megamoe.fused_moe(..., impl="megamoe")
    "megamoe_reference"  -> megamoe.fused_moe(..., impl="reference")

and the model is loaded with `experts_implementation=<name>`: the supported seam, no patching. The
experts module keeps its own parameters (`gate_up_proj [E,2I,H]`, gate rows first, and
`down_proj [E,H,I]`: the megamoe contract's w13/w2 exactly), so state_dict names and checkpoints
are the stock ones.

Router. transformers' routers compute the router logits with `F.linear` in the parameter dtype
(bf16 under mixed precision) and Qwen3's casts the top-k weights back to that dtype: the "router
in bf16 on one side, fp32 on the other" pitfall that flips top-k choices between sampler and
trainer. transformers has no registry for routers, so for moe_impl megamoe/reference each MoE
block's `gate` is replaced by `Fp32Router`, which keeps the same `weight` parameter (same name,
same object), computes the logits with `megamoe.router.router_logits` (fp32 from upcast operands,
batch invariant) and routes with `megamoe.route`: the functions the sampler side uses too. The block's own forward is unchanged: it calls
`self.gate(h)` and hands the (weights, ids) to `self.experts`.
"""

from __future__ import annotations

import collections
import logging

import torch
from torch import nn

import megamoe
from megamoe.router import router_logits as megamoe_router_logits

log = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATION = {"megamoe": "megamoe", "reference": "megamoe_reference", "stock": None}
"""moe_impl -> the experts_implementation name handed to transformers (None: its own default)."""

MOE_CALLS: collections.Counter[str] = collections.Counter()
"""Calls of the registered experts functions in this process, by megamoe impl (tests read it)."""


def _experts_forward(impl: str):
    def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        MOE_CALLS[impl] += 1
        # top_k_weights arrive in fp32 from Fp32Router; the contract accepts any float dtype for
        # them and applies them in fp32. x and the weights share the compute dtype (FSDP casts both).
        return megamoe.fused_moe(hidden_states, module.gate_up_proj, module.down_proj,
                                 top_k_weights, top_k_index, impl=impl, check_ids=False)

    experts_forward.__name__ = f"{impl}_experts_forward"
    return experts_forward


def register_experts_implementations() -> None:
    """Add megamoe's experts functions to transformers' registry (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for impl, name in EXPERTS_IMPLEMENTATION.items():
        if name is not None and name not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(name, _experts_forward(impl))


def check_experts_eligible(module: nn.Module, name: str) -> None:
    """megamoe computes gated SwiGLU experts in transformers' concatenated [gate; up] layout without
    biases; anything else fails here, at setup, never mid-step."""
    problems = []
    if not getattr(module, "has_gate", False):
        problems.append("has_gate=False (expected gated experts)")
    if getattr(module, "has_bias", False):
        problems.append("has_bias=True (expected no expert biases)")
    if getattr(module, "is_transposed", False):
        problems.append("is_transposed=True (expected gate_up_proj [E, 2I, H])")
    if not getattr(module, "is_concatenated", True):
        problems.append("is_concatenated=False (expected [gate; up] rows, not interleaved)")
    if getattr(module, "_is_expert_parallel", False):
        problems.append("expert parallel (transformers' EP sharding is not supported)")
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r} (expected 'silu': the contract's SwiGLU)")
    if not hasattr(module, "gate_up_proj") or not hasattr(module, "down_proj"):
        problems.append("missing gate_up_proj/down_proj parameters")
    if problems:
        raise ValueError(f"{name}: experts module {type(module).__name__} cannot run on megamoe: "
                         + "; ".join(problems))


class Fp32Router(nn.Module):
    """Top-k softmax router with fp32 logits, routed by `megamoe.route`.

    Returns what transformers' TopKRouters return, `(router_logits fp32 [T,E], top_k_weights fp32
    [T,k], top_k_index int64 [T,k])`, so the MoE block's forward uses it unchanged.
    """

    def __init__(self, weight: nn.Parameter, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = weight  # the stock router's Parameter itself: same name, same storage
        self.top_k = int(top_k)
        self.num_experts = weight.shape[0]
        self.hidden_dim = weight.shape[1]
        self.renormalize = bool(renormalize)

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        # megamoe's batch-invariant fp32 router GEMM: the function the rollout's gate computes too
        # (rollout/adapter.py), so both sides route from bitwise-equal logits.
        router_logits = megamoe_router_logits(hidden_states, self.weight)
        # check_finite=False: a NaN here must reach the loss (the step is then skipped and counted)
        # instead of raising mid-step, and the check would synchronise a GPU once per layer.
        weights, ids = megamoe.route(router_logits, self.top_k, "softmax", self.renormalize,
                                     check_finite=False)
        return router_logits, weights, ids

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, fp32 logits"


# transformers' softmax top-k routers whose semantics Fp32Router reproduces, and whether each one
# renormalises its top-k weights to sum 1 (Mixtral always; Qwen3-MoE and OLMoE as norm_topk_prob says,
# which OLMoE-1B-7B leaves False).
ROUTER_RENORMALIZE = {
    "MixtralTopKRouter": lambda gate: True,
    "Qwen3MoeTopKRouter": lambda gate: bool(gate.norm_topk_prob),
    "OlmoeTopKRouter": lambda gate: bool(gate.norm_topk_prob),
}


def _router_renormalize(gate: nn.Module) -> bool:
    kind = type(gate).__name__
    if kind not in ROUTER_RENORMALIZE:
        raise ValueError(f"router {kind}: expected one of {tuple(ROUTER_RENORMALIZE)} (the softmax top-k "
                         "routers whose semantics Fp32Router reproduces)")
    return ROUTER_RENORMALIZE[kind](gate)


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) for every MoE block: a module with a `gate` router and an `experts` module."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), nn.Module) and hasattr(m.experts, "gate_up_proj")
            and isinstance(getattr(m, "gate", None), nn.Module)]


def check_megamoe_eligible(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every MoE block's experts and router can run on megamoe (else a ValueError naming the module,
    its class and what it needs); returns the blocks. Reads only module attributes and the config,
    so a model built on the meta device is checked before any weight is loaded (trainer.model)."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no MoE block (a module with `gate` and `experts.gate_up_proj`) found")
    for name, block in blocks:
        check_experts_eligible(block.experts, f"{name}.experts")
        if not isinstance(block.gate, Fp32Router):
            _router_renormalize(block.gate)  # an unknown router raises, naming its class
    return blocks


def install_megamoe(model: nn.Module, moe_impl: str) -> int:
    """Check every experts module and replace every router by Fp32Router; return the block count.

    The model must have been loaded with experts_implementation=EXPERTS_IMPLEMENTATION[moe_impl].
    """
    want = EXPERTS_IMPLEMENTATION[moe_impl]
    have = model.config._experts_implementation
    if have != want:
        raise ValueError(f"model.config._experts_implementation: expected {want!r} for moe_impl={moe_impl!r}, "
                         f"got {have!r}")
    blocks = check_megamoe_eligible(model)
    for name, block in blocks:
        gate = block.gate
        if not isinstance(gate, Fp32Router):
            block.gate = Fp32Router(gate.weight, gate.top_k, _router_renormalize(gate))
    log.info("trainer MoE: %d blocks compute experts with megamoe impl=%r and route with megamoe.route (fp32)",
             len(blocks), moe_impl)
    return len(blocks)
