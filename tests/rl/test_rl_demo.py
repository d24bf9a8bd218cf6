"""The CPU demo learns the task, not only its format: `megamoe-rl train --config configs/tiny.yaml`.

    .venv/bin/python -m pytest -q -s tests/rl/test_rl_demo.py        (~4.5 minutes on 2 busy cores)

The digit task's reward is 0.5 x format (the completion starts with a digit) + 0.5 x exact match
(that digit is the prompt's). The format half alone takes the total reward from ~0 to 0.5 while the
model answers one fixed digit (right 1 time in 10), so the test asserts the correctness half: the
exact-match reward of the last 5 steps. It also asserts the sampler-trainer mismatch at the fp32
bounds of tests/rl/test_rl_loop.py at every step of the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl import config as C
from rl.metrics import read_jsonl
from test_rl_loop import FP32_MAX_ABS_LOGP_DIFF, fp32_mismatch_over_bounds

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
# Exact match, mean of the last 5 steps. Chance is 0.1 (a digit policy that ignores the prompt); the
# configuration of 2026-12-04 (8 prompts x 8 samples, lr 1e-2, 30 steps) ended at 0.10 with the format
# half at 1.0, and fails this bar. configs/tiny.yaml measured 0.705 (2026-12-05, the 2-core machine: 7
# of the 10 digits copied) and 0.555 with the same code on the 2-core machine of 2026-12-07
# (benchmarks/RESULTS.md "The CPU demo learns the digit"). A run is deterministic on one machine; the
# bar leaves room for another CPU's rounding to take another path (one digit fewer learned costs ~0.1).
EXACT_MATCH_BAR = 0.5


@pytest.mark.slow
def test_tiny_demo_learns_the_digit_not_only_the_format(tmp_path, ray_cluster):
    run_dir = tmp_path / "demo"
    steps = C.load(TINY).run.steps
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rl.cli", "train", "--config", str(TINY),
                           f"run.out_dir={run_dir}", "run.progress=false"],
                          cwd=ROOT, env={**os.environ, **ray_cluster}, capture_output=True, text=True, timeout=900,
                          start_new_session=True)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    exact = [r["reward/exact_match/mean"] for r in records]
    fmt = [r["reward/format/mean"] for r in records]
    last_exact, last_fmt = sum(exact[-5:]) / 5, sum(fmt[-5:]) / 5
    worst = max(r["mismatch/abs_logp_diff_max"] for r in records)
    print(f"demo: {steps} steps, exact match first-5 {sum(exact[:5]) / 5:.3f} -> last-5 {last_exact:.3f}, format "
          f"last-5 {last_fmt:.3f}, max |dlogp| {worst:.2e} (bound {FP32_MAX_ABS_LOGP_DIFF:.0e}), "
          f"max k3 {max(r['mismatch/k3_kl'] for r in records):.2e}, wall {wall:.0f} s")
    assert last_exact >= EXACT_MATCH_BAR, (last_exact, exact)
    assert last_fmt >= 0.9, (last_fmt, fmt)
    # Sampler and trainer on the same fp32 weights at every step, while the policy sharpens.
    assert fp32_mismatch_over_bounds(records) == []
    assert (run_dir / "plot.png").is_file()
