"""Run a pytest selection as N concurrent pytest processes and report every collected test's outcome.

    python3 benchmarks/device/shard_tests.py --shards 8 --timeout 500 --out runs/h200/gpu_tests -- \
        -m gpu tests/megamoe/test_fused.py tests/trainer/test_trainer_gpu.py
    python3 benchmarks/device/shard_tests.py --shards 3 --mem-per-shard-gib 0 --out /tmp/o -- tests/x.py  # CPU

(--out outside $OUT on the lent machine: two files per shard would pass the 8 files that come back;
h200_stack.sh's `gpu_tests` stage concatenates the shards' logs into one.)

Why: the op's GPU tests spend most of their time compiling (each ground-truth shape compiles the
kernels anew, ~20-40 s on the H200 machine's CPU), one after another in one process, so the whole
`-m gpu tests/megamoe/test_fused.py` outlasted a 600 s device call. Compiling is CPU work and the machine has
16 cores: N processes, each running every N-th collected test, share the GPU (the tests time nothing).

The processes share one GPU, so --shards is an upper bound: the script runs
min(--shards, free GPU memory // --mem-per-shard-gib) processes (at least one), the free memory read
from the first visible CUDA device (torch.cuda.mem_get_info, in a subprocess that exits before the
shards start) or given with --gpu-free-gib. --mem-per-shard-gib is the most GPU memory one process of
the selection holds; 0 turns the sizing off (a CPU selection). DEFAULT_SHARD_GIB is an estimate for
the op's and the trainer's GPU tests, not a measured peak: eight processes fit the H200's 139.8 GiB
(98 of 98 passed), and on an 80 GB H100 eight failed 2 of 98 tests with CUDA out-of-memory (both pass
alone), so together they peaked above ~79 GiB, while six passed 98 of 98 in 506 s (2026-12-07). 12 GiB
keeps eight on the H200 and gives six on the H100 (16 GiB gave four there: too slow for a call). The peak per process can be read on the GPU machine with
`nvidia-smi --query-compute-apps=pid,used_memory --format=csv -l 1` during a run.

Each shard writes its log and a JUnit XML file under --out; the outcome of a test is read from the
XML only. The script prints one line per collected test (passed / failed / error / skipped / not
run: a shard killed by --timeout leaves its remaining tests "not run") and exits 0 only when every
collected test passed. A skipped test is not a pass.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

GIB = 1 << 30
DEFAULT_SHARD_GIB = 12.0
"""GPU memory one pytest process of `-m gpu` tests/megamoe/test_fused.py test_expert_options.py
tests/trainer/test_trainer_gpu.py may hold at its peak, in GiB: an estimate (module docstring)."""


def free_gpu_bytes() -> int:
    """Free memory of the first visible CUDA device, read in a subprocess (its CUDA context is gone
    when the shards start)."""
    code = "import torch; print(torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else -1)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    words = proc.stdout.split()
    if proc.returncode != 0 or not words or int(words[-1]) < 0:
        raise SystemExit("shard_tests: --mem-per-shard-gib: no CUDA device to read the free memory of "
                         f"({(proc.stderr or proc.stdout).strip()[-500:] or 'torch.cuda.is_available() is False'}); "
                         "give --gpu-free-gib, or --mem-per-shard-gib 0 for a selection that uses no GPU")
    return int(words[-1])


def plan_shards(requested: int, tests: int, free_bytes: int | None, per_shard_bytes: int) -> tuple[int, str]:
    """(processes, why): at most `requested` and `tests`, and no more than the GPU's free memory holds
    at `per_shard_bytes` each (per_shard_bytes 0: not sized by memory); at least 1."""
    n = min(requested, tests)
    if per_shard_bytes <= 0:
        return n, f"--shards {requested}, not sized by GPU memory"
    fit = int(free_bytes // per_shard_bytes)
    why = (f"--shards {requested}; {free_bytes / GIB:.1f} GiB free on the GPU holds {fit} processes of "
           f"{per_shard_bytes / GIB:.1f} GiB")
    if fit < 1:
        why += " (fewer than one: one process, which may still run out of memory)"
    return max(1, min(n, fit)), why


def collect(pytest_args: list[str]) -> list[str]:
    """The node ids pytest selects for these arguments (in pytest's order)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                           *pytest_args], capture_output=True, text=True)
    ids = [ln.strip() for ln in proc.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    if proc.returncode not in (0, 5):  # 5: nothing selected (main says so)
        raise SystemExit(f"shard_tests: collection failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return ids


def junit_key(node: str) -> tuple[str, str]:
    """The (classname, name) pytest's JUnit XML gives a node id: tests/a.py::C::t[p] -> ("tests.a.C", "t[p]")."""
    path, *parts = node.split("::")
    return ".".join([path[:-3].replace("/", ".") if path.endswith(".py") else path, *parts[:-1]]), parts[-1]


def outcomes(xml_path: str) -> dict[tuple[str, str], str]:
    """{junit key: passed | failed | error | skipped} from one shard's JUnit XML (absent file: {})."""
    if not os.path.exists(xml_path):
        return {}
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        key = (case.get("classname", ""), case.get("name", ""))
        # a test whose teardown errs after it passed appears twice; the worse outcome stays
        new = ("failed" if "failure" in kinds else "error" if "error" in kinds
               else "skipped" if "skipped" in kinds else "passed")
        out[key] = new if out.get(key, "passed") == "passed" else out[key]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("shard_tests: expected `[options] -- PYTEST_ARGS`, got no `--`")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=500.0, help="seconds for the whole run (each shard is killed then)")
    ap.add_argument("--out", required=True, help="folder for the shards' logs and XML files")
    ap.add_argument("--mem-per-shard-gib", type=float, default=DEFAULT_SHARD_GIB,
                    help="GPU memory one process may hold at its peak; the processes are as many as the free "
                         "GPU memory holds, at most --shards (default %(default)s; 0: not sized, for CPU tests)")
    ap.add_argument("--gpu-free-gib", type=float, default=None,
                    help="free GPU memory to size by (default: read from the first visible CUDA device)")
    args = ap.parse_args(argv[:cut])
    pytest_args = argv[cut + 1:]
    if args.shards < 1:
        raise SystemExit(f"shard_tests: --shards: expected an int >= 1, got {args.shards}")
    if args.mem_per_shard_gib < 0:
        raise SystemExit(f"shard_tests: --mem-per-shard-gib: expected a number >= 0, got {args.mem_per_shard_gib}")
    if args.gpu_free_gib is not None and args.gpu_free_gib <= 0:
        raise SystemExit(f"shard_tests: --gpu-free-gib: expected a number > 0, got {args.gpu_free_gib}")
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    ids = collect(pytest_args)
    if not ids:
        print("shard_tests: no test selected")
        return 1
    free = None
    if args.mem_per_shard_gib > 0:
        free = int(args.gpu_free_gib * GIB) if args.gpu_free_gib is not None else free_gpu_bytes()
    n, why = plan_shards(args.shards, len(ids), free, int(args.mem_per_shard_gib * GIB))
    print(f"shard_tests: {len(ids)} tests in {n} processes ({why})", flush=True)
    shards = [ids[i::n] for i in range(n)]
    # the selection's own options (markers, -k) stay; the node ids replace its paths
    opts = [a for i, a in enumerate(pytest_args) if a.startswith("-") or (i and pytest_args[i - 1] in ("-m", "-k"))]
    procs = []
    for i, nodes in enumerate(shards):
        log = open(os.path.join(args.out, f"shard{i}.log"), "w")
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA",
               f"--junitxml={os.path.join(args.out, f'shard{i}.xml')}", *opts, *nodes]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = start + args.timeout
    for p, log in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
    seen = {}
    for i in range(len(shards)):
        seen.update(outcomes(os.path.join(args.out, f"shard{i}.xml")))
    status = {n: seen.get(junit_key(n), "not run") for n in ids}
    for n in ids:
        print(f"{status[n].upper():8s} {n}")
    counts = {s: sum(v == s for v in status.values()) for s in ("passed", "failed", "error", "skipped", "not run")}
    print(f"shard_tests: {len(ids)} collected, " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
          + f" in {time.monotonic() - start:.0f} s over {len(shards)} processes (logs: {args.out})")
    return 0 if counts["passed"] == len(ids) else 1


if __name__ == "__main__":
    sys.exit(main())
