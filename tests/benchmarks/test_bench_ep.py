"""benchmarks/bench_ep.py runs (gloo, 2 CPU processes, tiny shape): the mechanics, not the speed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.smoke
def test_bench_ep_smoke_run_prints_every_row(tmp_path):
    out = tmp_path / "ep.md"
    r = subprocess.run([sys.executable, "benchmarks/bench_ep.py", "--cpu", "--world", "2", "--shapes", "tiny",
                        "--tokens", "16", "--reps", "1", "--warmup", "0", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny")]
    assert [row.split(" | ")[1] for row in rows] == ["T=16 fwd", "T=16 fwd+bwd"], rows
    for impl in ("megamoe EP", "one-launch EP", "unfused EP", "compute only"):
        assert f"{impl} " in rows[0], (impl, rows[0])
    assert "megamoe EP: " in rows[1] and "one-launch EP: " in rows[1] and "x vs unfused" in rows[1], rows[1]
    # each time printed as it is measured (a run cut by a time limit keeps them)
    for impl, mode in (("megamoe EP", "fwd"), ("one-launch EP", "fwd"), ("unfused EP", "fwd"), ("compute only", "fwd"),
                       ("megamoe EP", "fwd+bwd"), ("unfused EP", "fwd+bwd"), ("one-launch EP", "fwd+bwd")):
        assert re.search(rf"^  tiny T=16 {impl} {re.escape(mode)}: [\d.]+ ms$", r.stdout, re.M), (impl, mode, r.stdout)
