"""Shared pytest fixtures: GPU skips with computed reasons, the files with `slow` tests first, NaN-poisoned
megamoe allocations."""

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
    # The files holding a `slow` test first, each file's tests in their own order (a stable sort).
    # `make test` hands whole files to its pytest-xdist workers in this order (--dist loadfile
    # --no-loadscope-reorder; xdist's own order is by test count, which put the few-test files of
    # minutes-long runs last): the long files overlap first and the short ones even out the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture
def nan_fill():
    """Fill every buffer megamoe allocates with NaN for the duration of the test."""
    from megamoe import alloc
    with alloc.poison(float("nan")):
        yield
