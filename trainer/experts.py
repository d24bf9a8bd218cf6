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
block's `gate` (gpt-oss: `router`) is replaced by `Fp32Router`, which keeps the same `weight` parameter (same name,
same object), computes the logits with `megamoe.router.router_logits` (fp32 from upcast operands,
batch invariant) and routes with `megamoe.route`: the functions the sampler side uses too. The block's own forward is unchanged: it calls
`self.gate(h)` (`self.router(h)`) and hands the (weights, ids) to `self.experts`.

gpt-oss (`GptOssExperts`, decorated with the registry too in transformers 5.19): biased experts with a
clamped SwiGLU, held as `gate_up_proj [E, H, 2I]` (transposed, gate and up columns interleaved: gate =
[..., ::2], up = [..., 1::2]), `gate_up_proj_bias [E, 2I]` (interleaved the same way), `down_proj
[E, I, H]` and `down_proj_bias [E, H]`. The parameters stay as they are (names and layout: checkpoints,
export and weight sync are the stock ones); `gpt_oss_megamoe_weights` converts them to megamoe's layout
inside each forward (transpose + de-interleave, a differentiable copy) and the experts run
`megamoe.fused_moe(..., b13, b2, activation=clamped_swiglu(alpha, limit))`. What the copy costs: one
copy of the layer's expert weights per forward, 3*E*I*H + 2*E*I elements (gpt-oss-20b: 0.80 G
elements, 1.6 GB in bf16, per layer), which the autograd op keeps for the backward, plus the inverse copy
of their gradients there. Without activation checkpointing a step so holds one such copy per layer
until its backward (24 layers of gpt-oss-20b: 38 GB per rank); with `trainer.activation_checkpointing`
one at a time. Its router (`GptOssTopKRouter`: logits = x @ W.T + b, top-k of the logits, softmax over
those k) becomes an `Fp32Router` with the router bias (the stock Parameter, trained): softmax over all E,
top-k, renormalised, the same weights mathematically, and what vLLM's FusedMoE (renormalize=True) is
routed with on the sampler side by the same `megamoe.route`, so both sides agree bitwise.

DeepSeek-V3 (shared experts, sigmoid scores with a score-correction bias, group-limited top-k, a routed
scaling factor). Its block is replaced as a whole by `SharedExpertsMoE` (same child modules, so the
same parameter and buffer names), because two of its steps must be computed the way the sampler's
vLLM computes them, bitwise:
- vLLM (0.32) multiplies the routed experts' *output* by routed_scaling_factor (its MoE runner, with
  the DeepSeek decoder's apply_routed_scale_to_output); transformers multiplies the top-k *weights*.
  The same number, rounded differently: here the output is scaled, as vLLM does.
- The shared experts are a dense SwiGLU MLP on every token. Each side's dense GEMMs round differently
  (vLLM CPU: oneDNN with a prepacked weight; transformers: F.linear), so both sides compute it as
  megamoe.fused_moe with one expert, weight 1 for every token (`megamoe.moe.dense_mlp`): the same op,
  the same weights ([gate; up] rows, the layout of vLLM's merged gate_up_proj).
"""

from __future__ import annotations

import collections
import logging

import torch
from torch import nn

import megamoe
from megamoe.contract import clamped_swiglu
from megamoe.moe import dense_mlp
from megamoe.router import router_logits as megamoe_router_logits
from trainer import lora_merge

log = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATION = {"megamoe": "megamoe", "reference": "megamoe_reference", "stock": None}
"""moe_impl -> the experts_implementation name handed to transformers (None: its own default)."""

MOE_CALLS: collections.Counter[str] = collections.Counter()
"""Calls of the registered experts functions in this process, by megamoe impl (tests read it)."""


# Experts classes in gpt-oss's layout (transposed, interleaved, biased; clamped SwiGLU with the module's
# `alpha` and `limit`), which `gpt_oss_megamoe_weights` converts (module docstring).
INTERLEAVED_EXPERTS = ("GptOssExperts",)


def gpt_oss_megamoe_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13 [E,2I,H] gate rows then up rows, w2 [E,H,I], b13 [E,2I], b2 [E,H]) of a GptOssExperts module,
    differentiable copies of its parameters in megamoe's layout (the cost: module docstring)."""
    gu_E2IH = module.gate_up_proj.transpose(1, 2)  # [E, 2I, H], rows interleaved gate0, up0, gate1, ...
    w13_E2IH = torch.cat([gu_E2IH[:, 0::2], gu_E2IH[:, 1::2]], dim=1)
    b = module.gate_up_proj_bias
    b13_E2I = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
    w2_EHI = module.down_proj.transpose(1, 2).contiguous()
    return w13_E2IH, w2_EHI, b13_E2I, module.down_proj_bias


def _experts_forward(impl: str):
    def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        MOE_CALLS[impl] += 1
        # top_k_weights arrive in fp32 from Fp32Router; the contract accepts any float dtype for
        # them and applies them in fp32. x and the weights share the compute dtype (FSDP casts both).
        if type(module).__name__ in INTERLEAVED_EXPERTS:
            w13, w2, b13, b2 = gpt_oss_megamoe_weights(module)
            return megamoe.fused_moe(hidden_states, w13, w2, top_k_weights, top_k_index, impl=impl, b13=b13, b2=b2,
                                     activation=clamped_swiglu(module.alpha, module.limit), check_ids=False)
        # LoRA (trainer/lora.py): the effective weights W + scale * delta, built here, inside the layer's forward.
        return megamoe.fused_moe(hidden_states, lora_merge.effective(module, "gate_up_proj"),
                                 lora_merge.effective(module, "down_proj"), top_k_weights, top_k_index, impl=impl,
                                 check_ids=False)

    experts_forward.__name__ = f"{impl}_experts_forward"
    return experts_forward


def register_experts_implementations() -> None:
    """Add megamoe's experts functions to transformers' registry (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for impl, name in EXPERTS_IMPLEMENTATION.items():
        if name is not None and name not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(name, _experts_forward(impl))


def _interleaved_problems(module: nn.Module) -> list[str]:
    """What keeps a gpt-oss experts module (INTERLEAVED_EXPERTS) from `gpt_oss_megamoe_weights`."""
    problems = []
    for flag, want in (("has_gate", True), ("has_bias", True), ("is_transposed", True), ("is_concatenated", False)):
        if getattr(module, flag, None) is not want:
            problems.append(f"{flag}={getattr(module, flag, None)!r} (expected {want}: gpt-oss's layout)")
    for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        if not isinstance(getattr(module, p, None), torch.Tensor):
            problems.append(f"missing {p}")
    try:
        clamped_swiglu(getattr(module, "alpha", None), getattr(module, "limit", None))
    except ValueError as e:
        problems.append(f"alpha={getattr(module, 'alpha', None)!r}, limit={getattr(module, 'limit', None)!r} "
                        f"(the clamped SwiGLU's: {e})")
    return problems


def check_experts_eligible(module: nn.Module, name: str) -> None:
    """megamoe computes gated SwiGLU experts in transformers' concatenated [gate; up] layout without
    biases, or gpt-oss's biased, interleaved, clamped-SwiGLU experts (INTERLEAVED_EXPERTS); anything
    else fails here, at setup, never mid-step."""
    kind = type(module).__name__
    if not hasattr(module, "has_gate"):
        # Not decorated with use_experts_implementation: its forward never reaches the registry.
        raise ValueError(f"{name}: experts module {kind} cannot run on megamoe: its class does not dispatch "
                         "through transformers' experts registry (no use_experts_implementation)")
    problems = []
    if kind in INTERLEAVED_EXPERTS:
        problems = _interleaved_problems(module)
        if getattr(module, "_is_expert_parallel", False):
            problems.append("expert parallel (transformers' EP sharding is not supported)")
        if problems:
            raise ValueError(f"{name}: experts module {kind} cannot run on megamoe: " + "; ".join(problems))
        return
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
    """Top-k router with fp32 logits, routed by `megamoe.route` (softmax top-k; or DeepSeek-V3's sigmoid
    with a score-correction bias and group-limited top-k, see `megamoe.route`).

    Returns what transformers' TopKRouters return, `(router_logits fp32 [T,E], top_k_weights fp32
    [T,k], top_k_index int64 [T,k])`, so the MoE block's forward uses it unchanged. A router `bias`
    (gpt-oss) is added to the logits by `megamoe.router.router_logits`. The weights carry no
    routed scaling factor: `SharedExpertsMoE` scales the experts' output instead (module docstring).
    """

    def __init__(self, weight: nn.Parameter, top_k: int, renormalize: bool, *, scoring: str = "softmax",
                 bias: nn.Parameter | None = None, e_score_correction_bias: torch.Tensor | None = None,
                 n_group: int = 1, topk_group: int = 1):
        super().__init__()
        self.weight = weight  # the stock router's Parameter itself: same name, same storage
        # gpt-oss's router bias (logits = x @ W.T + b): the stock Parameter too, trained; None elsewhere.
        self.register_parameter("bias", bias)
        self.top_k = int(top_k)
        self.num_experts = weight.shape[0]
        self.hidden_dim = weight.shape[1]
        self.renormalize = bool(renormalize)
        self.scoring = scoring
        self.n_group, self.topk_group = int(n_group), int(topk_group)
        if e_score_correction_bias is not None:
            # The stock router's buffer itself (a buffer there too: same state_dict name, not trained).
            self.register_buffer("e_score_correction_bias", e_score_correction_bias)
        else:
            self.e_score_correction_bias = None
        # Routing replay (trainer/replay.py): set only inside trainer.replay.routing_replay.
        self.replay = None

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        # megamoe's batch-invariant fp32 router GEMM: the function the rollout's gate computes too
        # (rollout/adapter.py), so both sides route from bitwise-equal logits.
        router_logits = megamoe_router_logits(hidden_states, lora_merge.effective(self, "weight"), self.bias)
        # check_finite=False: a NaN here must reach the loss (the step is then skipped and counted)
        # instead of raising mid-step, and the check would synchronise a GPU once per layer.
        weights, ids = megamoe.route(router_logits, self.top_k, self.scoring, self.renormalize,
                                     e_score_correction_bias=self.e_score_correction_bias, n_group=self.n_group,
                                     topk_group=self.topk_group, check_finite=False)
        if self.replay is not None:
            weights, ids = self.replay.apply(self, router_logits, weights, ids)
        return router_logits, weights, ids

    def extra_repr(self) -> str:
        grouped = (f", scoring={self.scoring}, bias={self.e_score_correction_bias is not None}, "
                   f"n_group={self.n_group}, topk_group={self.topk_group}") if self.scoring != "softmax" else ""
        bias = ", router bias" if self.bias is not None else ""
        return (f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}{grouped}{bias}, "
                "fp32 logits")


class SharedMLP(nn.Module):
    """transformers' DeepseekV3MLP (shared experts) computed by `megamoe.moe.dense_mlp`; its own Linear
    modules, so the names stay `gate_proj` / `up_proj` / `down_proj`."""

    def __init__(self, mlp: nn.Module, impl: str):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        w13 = torch.cat([self.gate_proj.weight, self.up_proj.weight])  # [gate; up]: vLLM's gate_up_proj
        y = dense_mlp(x.reshape(-1, shape[-1]), w13, self.down_proj.weight, self.impl)
        return y.view(shape)


class SharedExpertsMoE(nn.Module):
    """DeepSeek-V3's MoE block on megamoe: y = shared_experts(x) + routed_scaling_factor * experts(x),
    the routed part through the experts registry (megamoe) on Fp32Router's routing, the shared part
    through `SharedMLP`, in vLLM's order of operations (module docstring)."""

    def __init__(self, block: nn.Module, router: Fp32Router, routed_scaling_factor: float, impl: str):
        super().__init__()
        self.experts = block.experts
        self.gate = router
        self.shared_experts = SharedMLP(block.shared_experts, impl)
        self.routed_scaling_factor = float(routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        h_TH = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = self.gate(h_TH)
        routed = self.experts(h_TH, ids, weights)
        if self.routed_scaling_factor != 1.0:
            routed = routed * self.routed_scaling_factor
        return (self.shared_experts(h_TH) + routed).view(shape)


def _deepseek_v3_router(gate: nn.Module) -> dict:
    return dict(renormalize=bool(gate.norm_topk_prob), scoring="sigmoid",
                e_score_correction_bias=gate.e_score_correction_bias, n_group=int(gate.num_group),
                topk_group=int(gate.topk_group))


# transformers' routers whose semantics Fp32Router reproduces, and Fp32Router's arguments for each:
# softmax top-k renormalised to sum 1 (Mixtral always; Qwen3-MoE and OLMoE as norm_topk_prob says, which
# OLMoE-1B-7B leaves False; gpt-oss's softmax over the top-k logits, with its router bias), or DeepSeek-V3's
# sigmoid top-k with its bias and groups.
ROUTER_ARGS = {
    "MixtralTopKRouter": lambda gate: dict(renormalize=True),
    "Qwen3MoeTopKRouter": lambda gate: dict(renormalize=bool(gate.norm_topk_prob)),
    "OlmoeTopKRouter": lambda gate: dict(renormalize=bool(gate.norm_topk_prob)),
    "DeepseekV3TopkRouter": _deepseek_v3_router,
    "GptOssTopKRouter": lambda gate: dict(renormalize=True, bias=gate.bias),
}
# The MoE block's attribute that holds its router: `gate`, or `router` (gpt-oss's GptOssMLP).
ROUTER_ATTRS = ("gate", "router")
# MoE blocks whose own forward cannot run on megamoe bitwise like the sampler (see the module docstring),
# replaced as a whole by SharedExpertsMoE.
SHARED_EXPERTS_BLOCKS = ("DeepseekV3MoE",)


def _router_args(gate: nn.Module) -> dict:
    kind = type(gate).__name__
    if kind not in ROUTER_ARGS:
        raise ValueError(f"router {kind}: expected one of {tuple(ROUTER_ARGS)} (the routers whose semantics "
                         "Fp32Router reproduces)")
    return ROUTER_ARGS[kind](gate)


def _check_block(block: nn.Module, name: str) -> None:
    """A block with shared experts must be one SharedExpertsMoE computes (the SwiGLU MLP it reads)."""
    shared = getattr(block, "shared_experts", None)
    if shared is None or isinstance(block, SharedExpertsMoE):
        return
    kind = type(block).__name__
    if kind not in SHARED_EXPERTS_BLOCKS:
        raise ValueError(f"{name}: MoE block {kind} has shared experts; megamoe computes those of "
                         f"{SHARED_EXPERTS_BLOCKS} only")
    missing = [p for p in ("gate_proj", "up_proj", "down_proj") if not isinstance(getattr(shared, p, None), nn.Linear)]
    if missing or any(getattr(shared, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError(f"{name}.shared_experts: {type(shared).__name__} cannot run on megamoe: expected bias-free "
                         f"gate_proj/up_proj/down_proj nn.Linear layers (missing: {missing})")


def router_attr(block: nn.Module) -> str | None:
    """The name of the MoE block's router attribute (ROUTER_ATTRS), or None."""
    return next((a for a in ROUTER_ATTRS if isinstance(getattr(block, a, None), nn.Module)), None)


def block_router(block: nn.Module) -> nn.Module:
    """The MoE block's router module (`gate` or `router`)."""
    return getattr(block, router_attr(block))


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) for every MoE block: a module with a router (`gate` or `router`) and an `experts` module."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), nn.Module) and hasattr(m.experts, "gate_up_proj")
            and router_attr(m) is not None]


def check_megamoe_eligible(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every MoE block's experts and router can run on megamoe (else a ValueError naming the module,
    its class and what it needs); returns the blocks. Reads only module attributes and the config,
    so a model built on the meta device is checked before any weight is loaded (trainer.model)."""
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise ValueError(f"{type(model).__name__}: quantization_config (quant_method {str(method)!r}): megamoe "
                         "computes unquantized experts only (use the checkpoint's bf16 / fp32 weights)")
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no MoE block (a module with `gate` or `router` and "
                         "`experts.gate_up_proj`) found")
    for name, block in blocks:
        check_experts_eligible(block.experts, f"{name}.experts")
        _check_block(block, name)
        router = block_router(block)
        if not isinstance(router, Fp32Router):
            _router_args(router)  # an unknown router raises, naming its class
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
        attr = router_attr(block)
        gate = getattr(block, attr)
        if isinstance(gate, Fp32Router):
            continue
        router = Fp32Router(gate.weight, gate.top_k, **_router_args(gate))
        if type(block).__name__ in SHARED_EXPERTS_BLOCKS:
            parent_name, _, child = name.rpartition(".")
            model.get_submodule(parent_name).register_module(
                child, SharedExpertsMoE(block, router, gate.routed_scaling_factor, moe_impl))
        else:
            setattr(block, attr, router)
    log.info("trainer MoE: %d blocks compute experts with megamoe impl=%r and route with megamoe.route (fp32)",
             len(blocks), moe_impl)
    return len(blocks)
