"""LoRA on a frozen base: low-rank factors on the attention projections, every expert's w13 / w2, the router.

    n = lora.install(model, cfg.lora, compute_dtype=torch.float32)   # after load_model, before FSDP
    lora.effective(module, "gate_up_proj")   # W + (alpha / r) * delta(A, B), what the forward computes with

Conventions are PEFT's: the update of a weight W is scale * delta with scale = alpha / r; A is drawn as
PEFT draws it (kaiming-uniform, a = sqrt(5)) and B is zero, so the initial policy is the base exactly.
- a 2-D weight W [out, in] (q/k/v/o_proj, the router): `lora_A.weight` [r, in], `lora_B.weight` [out, r],
  delta = B @ A (PEFT's lora.Linear; the module gets `lora_A` / `lora_B` children, as PEFT's names).
- a 3-D expert parameter P [E, d1, d2] (gate_up_proj [E, 2I, H], down_proj [E, H, I]): per-expert factors
  `lora_A.<param>` [E, r, d1] and `lora_B.<param>` [E, d2, r], delta[e] = A[e]^T @ B[e]^T [d1, d2]. This is
  PEFT's `target_parameters` (its ParamWrapper) layout, which reads a 3-D parameter as [experts, in, out]:
  its lora_A.weight [r*E, d1] is A reshaped, its lora_B.weight [d2, r*E] is B permuted to (d2, r, E)
  (`peft_tensors` converts).

Why not PEFT itself: PEFT's ParamWrapper handles a 3-D expert parameter by registering a
torch.nn.utils.parametrize parametrization on the experts module around every forward (the parameter is
renamed `parametrizations.<name>.original` meanwhile), takes one parameter per module (w13 and w2 of one
experts module need two stacked wrappers), requires dropout 0, and wraps the base modules (`base_layer.`
names). The trainer's state-dict names are the checkpoint's and the sampler's (weight sync, export,
FSDP2 sharding per decoder layer), and the bitwise mode needs the trainer to compute with exactly the
merged tensor the sampler receives. So the factors live beside the stock parameters, under PEFT's
names, and the adapter is written in PEFT's format (rl/export.py).

How gradients reach the factors through the fused MoE op: the effective weight W + scale * delta is built
inside the layer's forward (`effective`), from the frozen base and the factors, and handed to
megamoe.fused_moe as its w13 / w2; autograd takes the op's weight gradient [E, d1, d2] back to A and B.
Under activation checkpointing the effective weights are rebuilt with the layer, so one layer's exist at
a time. The merge is one function (`merge`) used by the forward and by every export: the base and the
factors in the dtype the forward sees them in (the compute dtype), the sum in fp32, rounded once to the
compute dtype. The sampler's weights (rollout sync, export) are that same tensor, so sampler and trainer
compute with bitwise-equal weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import LORA_ATTENTION, LORA_EXPERTS, LoraSettings

from trainer.lora_merge import FACTORS, _factors, effective, is_factor, merge  # noqa: F401 (lora's API)


class LoraLinearMixin:
    """An nn.Linear (or trainer.bitwise.InvariantLinear) that computes with `effective(self, "weight")`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = effective(self, "weight")
        from trainer.bitwise import InvariantLinear

        if isinstance(self, InvariantLinear):
            from megamoe import invariant

            return invariant.InvariantLinearFn.apply(x, w, self.bias)
        return F.linear(x, w, self.bias)


_LINEAR_CLASSES: dict[type, type] = {}


def _lora_linear_class(base: type) -> type:
    if base not in _LINEAR_CLASSES:
        _LINEAR_CLASSES[base] = type(f"Lora{base.__name__}", (LoraLinearMixin, base), {})
    return _LINEAR_CLASSES[base]


def _new_factors(shape_a, shape_b, device, generator) -> tuple[nn.Parameter, nn.Parameter]:
    a = torch.empty(shape_a, dtype=torch.float32)
    # PEFT's init of lora_A (nn.init.kaiming_uniform_ with a=sqrt(5) on [rows, fan_in]): U(-1/sqrt(fan_in), ..).
    bound = 1.0 / math.sqrt(shape_a[-1])
    a.uniform_(-bound, bound, generator=generator)
    return nn.Parameter(a.to(device)), nn.Parameter(torch.zeros(shape_b, dtype=torch.float32, device=device))


def _attach(module: nn.Module, pname: str, a: nn.Parameter, b: nn.Parameter, scale: float) -> None:
    if not hasattr(module, "lora_A"):
        module.lora_A = nn.ParameterDict()
        module.lora_B = nn.ParameterDict()
    module.lora_A[pname] = a
    module.lora_B[pname] = b
    module.lora_scale = float(scale)


def targets_of(model: nn.Module, cfg: LoraSettings) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, parameter name) of every weight `cfg.targets` selects, in module order. A
    target that matches nothing in this model is a ValueError naming it."""
    from trainer.experts import INTERLEAVED_EXPERTS, Fp32Router, block_router, moe_blocks

    out, hit = [], {t: 0 for t in cfg.targets}
    routers = {id(block_router(b)) for _, b in moe_blocks(model)}
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in LORA_ATTENTION and leaf in cfg.targets and isinstance(m, nn.Linear) and ".self_attn." in f".{name}":
            out.append((name, m, "weight"))
            hit[leaf] += 1
        elif hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and any(t in cfg.targets for t in LORA_EXPERTS):
            if type(m).__name__ in INTERLEAVED_EXPERTS:
                raise ValueError(f"trainer.lora.targets: {name} ({type(m).__name__}) holds its experts interleaved "
                                 "and transposed (gpt-oss); LoRA on those experts is not supported, drop "
                                 f"{[t for t in cfg.targets if t in LORA_EXPERTS]} from the targets")
            for p in LORA_EXPERTS:
                if p in cfg.targets:
                    out.append((name, m, p))
                    hit[p] += 1
        elif "router" in cfg.targets and id(m) in routers:
            if not isinstance(m, Fp32Router):
                raise ValueError(f"trainer.lora.targets: 'router' needs trainer.moe_impl megamoe or reference "
                                 f"(its Fp32Router computes with the merged weight), got {type(m).__name__} at {name}")
            out.append((name, m, "weight"))
            hit["router"] += 1
    missing = [t for t, n in hit.items() if n == 0]
    if missing:
        raise ValueError(f"trainer.lora.targets: {missing} match no weight of {type(model).__name__} (attention "
                         f"projections under self_attn, experts with gate_up_proj/down_proj, the MoE router)")
    return out


def install(model: nn.Module, cfg: LoraSettings, *, seed: int = 0, compute_dtype: torch.dtype = torch.float32) -> int:
    """Freeze the model and add fp32 factors (A drawn from `seed`, B zero) to every target; returns the
    number of adapted weights. Run after load_model (and trainer.bitwise.install) and before FSDP2.
    `compute_dtype`: the dtype the forward sees the weights in (FSDP2's param_dtype, or the base's own);
    exports merge in it, as the forward does."""
    if not cfg.enabled:
        raise ValueError("trainer.lora.enabled: install() called with LoRA disabled")
    cfg.validate("trainer.lora")
    targets = targets_of(model, cfg)
    if any(p in LORA_EXPERTS for _, _, p in targets):
        impl = getattr(model.config, "_experts_implementation", None)
        if impl not in ("megamoe", "megamoe_reference"):
            raise ValueError(f"trainer.lora.targets: adapters on the experts need trainer.moe_impl 'megamoe' or "
                             f"'reference' (transformers' own experts would ignore them), got experts_implementation "
                             f"{impl!r}")
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(int(seed))
    r = cfg.rank
    for name, m, p in targets:
        w = getattr(m, p)
        if w.dim() == 2:
            out_f, in_f = w.shape
            a, b = _new_factors((r, in_f), (out_f, r), w.device, g)
        else:
            E, d1, d2 = w.shape
            a, b = _new_factors((E, r, d1), (E, d2, r), w.device, g)
        _attach(m, "weight" if w.dim() == 2 else p, a, b, cfg.scale)
        if isinstance(m, nn.Linear) and not isinstance(m, LoraLinearMixin):
            m.__class__ = _lora_linear_class(type(m))
    model.lora_settings = cfg
    model.lora_compute_dtype = compute_dtype
    return len(targets)


def adapted(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """state-dict name of every adapted base weight -> (lora_A name, lora_B name, scale)."""
    out = {}
    for mname, m in model.named_modules():
        a = getattr(m, "lora_A", None)
        if not isinstance(a, nn.ParameterDict):
            continue
        for p in a.keys():
            base = f"{mname}.{p}" if mname else p
            out[base] = (f"{mname}.lora_A.{p}", f"{mname}.lora_B.{p}", float(m.lora_scale))
    return out


def mergers(model: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor],
            dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """For an export of the full weights: base name -> fn(full base tensor) -> the merged tensor, in the base's
    held dtype, of the value the forward computes with: base and factors cast to `dtype` (the compute dtype)
    first, merged by `merge`. `gather` turns a (sharded) parameter into its full tensor; every rank must call
    the returned functions in the same order (each gathers its factors)."""
    state = model.state_dict(keep_vars=True)
    out = {}
    for base, (na, nb, scale) in adapted(model).items():
        def fn(full, na=na, nb=nb, scale=scale):
            a, b = gather(state[na]), gather(state[nb])
            return merge(full.to(dtype), a.to(dtype), b.to(dtype), scale).to(full.dtype)
        out[base] = fn
    return out


def trainable(model: nn.Module) -> Iterator[nn.Parameter]:
    return (p for p in model.parameters() if p.requires_grad)


# -- PEFT's on-disk format ------------------------------------------------------------------------------


def peft_tensors(factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's factors (state-dict names -> full tensors) in PEFT's adapter_model.safetensors names and
    layouts: `base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r] for a 2-D weight;
    for a 3-D expert parameter P [E, d1, d2] PEFT's ParamWrapper (peft 0.21): transformers' experts modules
    carry no `is_transposed`, so PEFT reads P as [experts, out=d1, in=d2], with lora_A.weight [E*r, d2]
    (viewed [E, r, d2]) and lora_B.weight [d1, r*E] (viewed [d1, r, E]), delta[e] = B_e @ A_e. Ours is
    delta[e] = A[e]^T @ B[e]^T with A [E, r, d1], B [E, d2, r]: PEFT's A_e is our B[e]^T and its B_e our
    A[e]^T. PEFT targets two parameters of one experts module with stacked wrappers, the later target
    outermost: gate_up_proj's factors sit under `<experts>.base_layer.` when down_proj is adapted too."""
    out = {}
    experts_params: dict[str, set[str]] = {}
    for name in factors:
        mod, kind, p = name.rsplit(".", 2)
        if p != "weight":
            experts_params.setdefault(mod, set()).add(p)
    for name, t in factors.items():
        mod, kind, p = name.rsplit(".", 2)
        if p == "weight":
            out[f"base_model.model.{mod}.{kind}.weight"] = t.contiguous()
            continue
        E, r = t.shape[0], t.shape[1] if kind == "lora_A" else t.shape[2]
        if kind == "lora_B":  # ours [E, d2, r] -> PEFT's lora_A [E*r, d2]
            peft_kind, flat = "lora_A", t.transpose(1, 2).reshape(E * r, t.shape[1])
        else:  # ours [E, r, d1] -> PEFT's lora_B [d1, r*E]
            peft_kind, flat = "lora_B", t.permute(2, 1, 0).reshape(t.shape[2], r * E)
        inner = p == "gate_up_proj" and "down_proj" in experts_params[mod]
        out[f"base_model.model.{mod}.{'base_layer.' if inner else ''}{peft_kind}.weight"] = flat.contiguous()
    return out


def peft_config(cfg: LoraSettings, base_model: str, factor_names: list[str]) -> dict:
    """adapter_config.json's content for `cfg` (PEFT's LoraConfig keys)."""
    modules = sorted({n.rsplit(".", 2)[0].rsplit(".", 1)[-1] for n in factor_names if n.endswith(".weight")
                      and n.rsplit(".", 2)[0].rsplit(".", 1)[-1] in LORA_ATTENTION})
    params = []
    # PEFT wraps in this order (the first innermost, as peft_tensors names them): gate_up_proj, then down_proj.
    for want in LORA_EXPERTS:
        for n in factor_names:
            mod, _kind, p = n.rsplit(".", 2)
            suffix = f"{mod.rsplit('.', 2)[-2]}.{mod.rsplit('.', 1)[-1]}.{p}"  # e.g. mlp.experts.gate_up_proj
            if p == want and suffix not in params:
                params.append(suffix)
    # transformers 5's routers are not nn.Linear: PEFT reaches their weight as a target parameter (2-D).
    for n in factor_names:
        mod, _kind, p = n.rsplit(".", 2)
        leaf = mod.rsplit(".", 1)[-1]
        if p == "weight" and leaf not in LORA_ATTENTION:
            suffix = f"{mod.rsplit('.', 2)[-2]}.{leaf}.weight"  # e.g. mlp.gate.weight
            if suffix not in params:
                params.append(suffix)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "bias": "none",
        "target_modules": modules, "target_parameters": params or None, "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
