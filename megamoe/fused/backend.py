"""Which backend computes a call: "triton" (CUDA, or the Triton interpreter on CPU with
TRITON_INTERPRET=1) or "torch" (the CPU implementation, megamoe/fused/cpu.py). An explicit choice
that cannot run raises; nothing falls back."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend(x: torch.Tensor, backend: str) -> None:
    """ValueError unless `backend` can compute on x (its device and, under the interpreter, dtype)."""
    if backend == "triton":
        if x.device.type == "cuda":
            return
        if x.device.type == "cpu" and interpreting():
            if x.dtype != torch.float32:
                raise ValueError(f"x: the Triton interpreter runs fp32 only (its bf16 tl.dot is wrong), got {x.dtype}")
            return
        raise ValueError(f"backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU), got device {x.device}")
    if backend != "torch":
        raise ValueError(f"backend: expected 'triton' or 'torch', got {backend!r}")


def pick_backend(x: torch.Tensor, backend: str | None) -> str:
    """`backend`, or by default triton on CUDA and torch elsewhere; checked by `check_backend`."""
    backend = backend or ("triton" if x.is_cuda else "torch")
    check_backend(x, backend)
    return backend
