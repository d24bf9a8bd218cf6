"""The MoE contract's input checks, shared by every implementation.

    fused_moe(x[T,H], w13[E,2I,H], w2[E,H,I], topk_weights[T,k], topk_ids[T,k],
              b13[E,2I] = None, b2[E,H] = None, activation = SWIGLU) -> y[T,H]

    gu   = w13[e] @ x[t] + b13[e]          (gate = gu[:I], up = gu[I:]; no bias: + 0)
    h    = activation(gate, up)            (`Activation` below)
    y[t] = sum_j topk_weights[t,j] * (w2[e] @ h + b2[e]),   e = topk_ids[t,j]

Every check runs before any compute and raises ValueError/TypeError naming the argument, the
expected and the actual value. The id range check reads the ids (one reduction); it is the only
check that looks at data, and it can be switched off with ``check_ids=False`` where a host
synchronisation is unwanted (CUDA-graph capture).

The implementation names below are the project's one definition of them; importing them does not
import torch (the config loaders need them for `--help` / `--dry-run`), so torch is imported where
a check runs and the dtype tuples are looked up on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MEGAMOE = "megamoe"
"""The fused Triton kernel on CUDA; on CPU a torch implementation with its semantics and reduction order."""
REFERENCE = "reference"
"""The unfused path: permute -> grouped GEMM -> SwiGLU -> grouped GEMM -> weighted un-permute."""
IMPLS = (MEGAMOE, REFERENCE)
"""Implementations of the contract in this library (`fused_moe(..., impl=)`)."""

STOCK = "stock"
"""Not an implementation of this library: the host framework's own MoE (vLLM's kernels in rollout/,
transformers' experts in trainer/). Named here because both hosts accept it and share nothing
below megamoe; megamoe itself never runs it."""
HOST_IMPLS = IMPLS + (STOCK,)
"""What a host's MoE layers can run (`rollout.moe_impl`, `trainer.moe_impl`, MEGAMOE_MOE_IMPL)."""

FAST = "fast"
"""Numerics outside the MoE: each host's own kernels (vLLM's attention, GEMMs, rotary; torch's in the trainer)."""
BITWISE = "bitwise"
"""Numerics outside the MoE: both hosts run megamoe.invariant's batch-invariant linears and attention (and
the same rotary and activation formulas), so the trainer's logprobs are the sampler's, bit for bit."""
NUMERICS = (FAST, BITWISE)
"""`run.numerics`, MEGAMOE_NUMERICS."""



SILU = "silu"
"""SwiGLU: h = silu(gate) * up (Qwen3-MoE, Mixtral, OLMoE, DeepSeek)."""
CLAMPED_SWIGLU = "clamped_swiglu"
"""gpt-oss's SwiGLU: gate' = min(gate, limit), up' = clamp(up, -limit, limit),
h = (up' + 1) * gate' * sigmoid(alpha * gate') (transformers' GptOssExperts, vLLM's "swigluoai")."""
ACTIVATIONS = (SILU, CLAMPED_SWIGLU)
"""The expert activations the contract computes (`Activation.name`)."""


@dataclass(frozen=True)
class Activation:
    """The experts' activation h = f(gate, up): `SWIGLU`, or `clamped_swiglu(alpha, limit)`.

    alpha and limit belong to CLAMPED_SWIGLU only (None for SILU). Gradients follow torch's
    autograd of the formulas above: clamp passes the gradient where the input lies inside
    [min, max], bounds included."""
    name: str = SILU
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self):
        if self.name not in ACTIVATIONS:
            raise ValueError(f"activation.name: expected one of {ACTIVATIONS}, got {self.name!r}")
        if self.name == SILU:
            if self.alpha is not None or self.limit is not None:
                raise ValueError(f"activation: {SILU!r} takes no alpha or limit, got alpha={self.alpha!r}, "
                                 f"limit={self.limit!r}")
            return
        for field in ("alpha", "limit"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"activation.{field}: expected a finite number > 0 for {CLAMPED_SWIGLU!r}, "
                                 f"got {v!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "limit", float(self.limit))


SWIGLU = Activation(SILU)
"""The default activation: silu(gate) * up."""


def clamped_swiglu(alpha: float = 1.702, limit: float = 7.0) -> Activation:
    """gpt-oss's activation (defaults: gpt-oss-20b/120b's swiglu_alpha and swiglu_limit)."""
    return Activation(CLAMPED_SWIGLU, alpha=alpha, limit=limit)


def check_activation(activation) -> Activation:
    if not isinstance(activation, Activation):
        raise TypeError(f"activation: expected a megamoe.contract.Activation (SWIGLU or clamped_swiglu(...)), "
                        f"got {type(activation).__name__}")
    return activation


def check_biases(b13, b2, s: "MoEShape", x) -> bool:
    """Both expert biases or neither: b13 [E, 2I] (gate biases, then up, as w13's rows) and
    b2 [E, H], in x's dtype and on its device. Returns whether they are given."""
    import torch

    if b13 is None and b2 is None:
        return False
    if (b13 is None) != (b2 is None):
        raise ValueError(f"b13, b2: expected both expert biases or neither, got b13={'None' if b13 is None else 'a tensor'}"
                         f", b2={'None' if b2 is None else 'a tensor'} (pass zeros for a missing one)")
    for name, t, want in (("b13", b13, (s.E, 2 * s.I)), ("b2", b2, (s.E, s.H))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {list(want)} ([E, {'2I' if name == 'b13' else 'H'}]), "
                             f"got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: expected the dtype of x ({x.dtype}), got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: expected the device of x ({x.device}), got {t.device}")
    return True


def _dtypes() -> dict[str, tuple]:
    import torch

    return {"FLOAT_DTYPES": (torch.float32, torch.bfloat16, torch.float16),
            "INDEX_DTYPES": (torch.int32, torch.int64)}


def __getattr__(name: str):
    # FLOAT_DTYPES (float32, bfloat16, float16) and INDEX_DTYPES (int32, int64): torch's dtypes, made
    # when first asked for (PEP 562) so that the names above import without torch.
    if name in ("FLOAT_DTYPES", "INDEX_DTYPES"):
        return _dtypes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class MoEShape:
    T: int
    H: int
    I: int  # noqa: E741  (the legend's name)
    E: int
    k: int


def check_impl(impl: str) -> str:
    if not (isinstance(impl, str) and impl in IMPLS):
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    return impl


def check_moe_inputs(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                     topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor,
                     *, check_ids: bool = True) -> MoEShape:
    """Validate the contract's five tensors; return the sizes of the shape legend."""
    import torch

    dt = _dtypes()
    FLOAT_DTYPES, INDEX_DTYPES = dt["FLOAT_DTYPES"], dt["INDEX_DTYPES"]  # noqa: N806 - the module's names
    named = {"x": x_TH, "w13": w13_E2IH, "w2": w2_EHI,
             "topk_weights": topk_weights_Tk, "topk_ids": topk_ids_Tk}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, want in (("x", 2), ("w13", 3), ("w2", 3), ("topk_weights", 2), ("topk_ids", 2)):
        if named[name].dim() != want:
            raise ValueError(f"{name}: expected {want} dimensions, got shape {tuple(named[name].shape)}")
    for name in ("x", "w13", "w2", "topk_weights"):
        if named[name].dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a floating dtype in {FLOAT_DTYPES}, got {named[name].dtype}")
    if topk_ids_Tk.dtype not in INDEX_DTYPES:
        raise TypeError(f"topk_ids: expected an integer dtype in {INDEX_DTYPES}, got {topk_ids_Tk.dtype}")
    if w13_E2IH.dtype != x_TH.dtype or w2_EHI.dtype != x_TH.dtype:
        raise TypeError(f"w13, w2: expected the dtype of x ({x_TH.dtype}), got {w13_E2IH.dtype} and {w2_EHI.dtype}")
    if any(t.device != x_TH.device for t in named.values()):
        raise ValueError(
            f"all tensors must be on one device, got {', '.join(f'{n}={t.device}' for n, t in named.items())}")

    T, H = x_TH.shape
    E, two_I, H13 = w13_E2IH.shape
    if H13 != H:
        raise ValueError(f"w13: expected shape [E, 2I, H={H}] (H of x), got {tuple(w13_E2IH.shape)}")
    if two_I % 2 or two_I <= 0:
        raise ValueError(f"w13: expected an even, positive second dimension 2I, got {two_I}")
    I = two_I // 2  # noqa: E741
    if tuple(w2_EHI.shape) != (E, H, I):
        raise ValueError(f"w2: expected shape [E={E}, H={H}, I={I}] (from w13 and x), got {tuple(w2_EHI.shape)}")
    if topk_ids_Tk.shape[0] != T:
        raise ValueError(f"topk_ids: expected shape [T={T}, k] (T of x), got {tuple(topk_ids_Tk.shape)}")
    k = topk_ids_Tk.shape[1]
    if k < 1:
        raise ValueError(f"topk_ids: expected k >= 1 columns, got {tuple(topk_ids_Tk.shape)}")
    if tuple(topk_weights_Tk.shape) != (T, k):
        raise ValueError(
            f"topk_weights: expected shape [T={T}, k={k}] (as topk_ids), got {tuple(topk_weights_Tk.shape)}")
    if E < 1 or H < 1:
        raise ValueError(f"w13: expected E >= 1 and H >= 1, got shape {tuple(w13_E2IH.shape)}")
    if check_ids and topk_ids_Tk.numel() > 0 and topk_ids_Tk.device.type != "meta":
        lo, hi = int(topk_ids_Tk.min()), int(topk_ids_Tk.max())
        if lo < -1 or hi >= E:
            raise ValueError(f"topk_ids: expected ids in [-1, E={E}), got min {lo}, max {hi}")
    return MoEShape(T=T, H=H, I=I, E=E, k=k)
