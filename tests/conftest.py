"""Shared pytest fixtures: GPU skips with computed reasons, NaN-poisoned megamoe allocations."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# tests/ mirrors the packages (tests/megamoe, tests/rollout, ...) and is not a package itself: test
# modules share helpers by plain import (`from test_rl_loop import SMALL`), so every test folder is
# on the path whichever file pytest was asked to run.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith(("_", ".")):
        sys.path.insert(0, str(_folder))

# Without a GPU, Triton kernels run on the CPU through Triton's interpreter. The variable is read
# when a kernel is decorated, so it is set here, before any test imports megamoe's kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _gpu_reason(n: int) -> str | None:
    if not torch.cuda.is_available():
        return f"needs {n} CUDA GPU(s); torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    have = torch.cuda.device_count()
    if have < n:
        return f"needs {n} CUDA GPUs; torch.cuda.device_count() is {have}"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multigpu" in item.keywords:
            reason = _gpu_reason(2)
        elif "gpu" in item.keywords:
            reason = _gpu_reason(1)
        else:
            continue
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def nan_fill():
    """Fill every buffer megamoe allocates with NaN for the duration of the test."""
    from megamoe import alloc
    with alloc.poison(float("nan")):
        yield
