"""Batch-invariant GEMMs on CPU-style BLAS: a[M,K] @ b[K,N] in fixed blocks of ROWS rows.

BLAS libraries pick their kernel (and so their rounding) by the problem size; computing every call
on a zero-padded block of exactly ROWS rows makes a row's result depend only on that row and b,
bitwise, however many rows share the call. Used by megamoe's CPU expert GEMMs and by the router
logits both sides of an RL run compute.
"""

from __future__ import annotations

import torch

ROWS = 32
"""Rows per GEMM call. Small, so a decode step pads little; fixed, for batch invariance."""


def rows_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """a @ b (same dtype as the operands), computed ROWS rows at a time."""
    M = a_MK.shape[0]
    if M == 0:
        return a_MK.new_zeros(0, b_KN.shape[1])
    pad = (-M) % ROWS
    if pad:
        a_MK = torch.cat([a_MK, a_MK.new_zeros(pad, a_MK.shape[1])])
    return torch.cat([blk @ b_KN for blk in a_MK.split(ROWS)])[:M]
