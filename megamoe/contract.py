"""The MoE contract's input checks, shared by every implementation.

    fused_moe(x[T,H], w13[E,2I,H], w2[E,H,I], topk_weights[T,k], topk_ids[T,k]) -> y[T,H]

Every check runs before any compute and raises ValueError/TypeError naming the argument, the
expected and the actual value. The id range check reads the ids (one reduction); it is the only
check that looks at data, and it can be switched off with ``check_ids=False`` where a host
synchronisation is unwanted (CUDA-graph capture).

The implementation names below are the project's one definition of them; importing them does not
import torch (the config loaders need them for `--help` / `--dry-run`), so torch is imported where
a check runs and the dtype tuples are looked up on first use.
"""

from __future__ import annotations

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
