"""Run a pytest selection as N concurrent pytest processes and report every collected test's outcome.

    python3 benchmarks/device/shard_tests.py --shards 8 --timeout 500 --out runs/h200/gpu_tests -- \
        -m gpu tests/megamoe/test_fused.py tests/trainer/test_trainer_gpu.py

(--out outside $OUT on the lent machine: two files per shard would pass the 8 files that come back;
h200_stack.sh's `gpu_tests` stage concatenates the shards' logs into one.)

Why: the op's GPU tests spend most of their time compiling (each ground-truth shape compiles the
kernels anew, ~20-40 s on the H200 machine's CPU), one after another in one process, so the whole
`-m gpu tests/megamoe/test_fused.py` outlasted a 600 s device call. Compiling is CPU work and the machine has
16 cores: N processes, each running every N-th collected test, share the GPU (the tests time nothing).

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
    args = ap.parse_args(argv[:cut])
    pytest_args = argv[cut + 1:]
    if args.shards < 1:
        raise SystemExit(f"shard_tests: --shards: expected an int >= 1, got {args.shards}")
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    ids = collect(pytest_args)
    if not ids:
        print("shard_tests: no test selected")
        return 1
    shards = [ids[i::args.shards] for i in range(min(args.shards, len(ids)))]
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
