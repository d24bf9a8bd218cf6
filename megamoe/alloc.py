"""Every buffer megamoe's kernels write is allocated here, so tests can poison new allocations.

`poison(value)` (a context manager; tests use the `nan_fill` fixture) fills each new buffer with
`value` (NaN): an output element a kernel forgot to write then fails the comparison instead of
silently holding whatever memory held before.
"""

from __future__ import annotations

import contextlib

import torch

_POISON: float | None = None


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if _POISON is not None and t.is_floating_point():
        t.fill_(_POISON)
    return t


@contextlib.contextmanager
def poison(value: float = float("nan")):
    global _POISON
    old, _POISON = _POISON, value
    try:
        yield
    finally:
        _POISON = old
