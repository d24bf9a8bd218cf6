"""The tool task learns (benchmarks/RESULTS.md, "The tool task learns to call the tool, not yet to answer right"):
after rl/warm_start.py's short supervised warm start, RL on configs/tiny_tools_warm.yaml raises the rate of
well-formed calculator calls. One benchmark run (benchmarks/bench_tool_task.py: a made model, the warm start,
one `megamoe-rl train`), ~4-6 minutes on the shared 2-core machine; slow.

Not named test_*.py, so `make test` (pytest's collection of tests/) leaves it out: it would add a train launch
(a Ray start and a vLLM engine) and minutes to the 20-minute suite. Run it by naming it:

    .venv/bin/python -m pytest -q -s -p no:cacheprovider -n 0 tests/rl/guard_tool_task_learns.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


# The benchmark shortened to 20 RL steps, seed 0. The well-formed tool-call rate, mean of steps 16-20 against
# steps 1-5, measured over seeds 0, 1, 2 (2026-12-07, the 2-core machine): 0.456 -> 0.847, 0.331 -> 0.735,
# 0.637 -> 0.787 (rises 0.39, 0.40, 0.15). With the trainer's lr at 1e-12 (`--set trainer.lr=1e-12`: no learning)
# seed 0 measured 0.584 -> 0.591, every step's rate in 0.56-0.62: both bars fail there (0.591 < 0.7, rise 0.006 <
# 0.1). This test measured 0.456 -> 0.847 in 353 s on the shared machine beside another benchmark run (RL 269 s).
# The answer's correctness is not guarded: it does not rise reliably within the budget (seed 0: 0.028 -> 0.091,
# seed 1: 0.047 -> 0.044, seed 2: 0.022 -> 0.053 over the 30-step run; 0.019 -> 0.034 without learning).
GUARD_RL_STEPS = 20
TOOL_CALL_RATE_BAR = 0.7   # mean of the last 5 steps
TOOL_CALL_RISE_BAR = 0.1   # last 5 minus first 5


def rise_failures(summary: dict) -> list[str]:
    rate = summary["tool_call_rate"]
    out = []
    if rate["last"] < TOOL_CALL_RATE_BAR:
        out.append(f"tool-call rate of the last 5 steps {rate['last']:.3f} < {TOOL_CALL_RATE_BAR}")
    if rate["last"] - rate["first"] < TOOL_CALL_RISE_BAR:
        out.append(f"tool-call rate rose {rate['last'] - rate['first']:.3f} < {TOOL_CALL_RISE_BAR}")
    return out


@pytest.mark.slow
def test_rl_raises_the_well_formed_tool_call_rate_after_the_warm_start(tmp_path):
    from benchmarks.bench_tool_task import bench

    summary = bench(tmp_path / "bench", seed=0, rl_steps=GUARD_RL_STEPS)
    print(f"tool-call rate {summary['tool_call_rate']}, correct {summary['correct']}, seconds {summary['seconds']}")
    assert summary["random_model"]["call_logprob"] < -400, summary["random_model"]
    assert [r["step"] for r in summary["per_step"]] == list(range(1, GUARD_RL_STEPS + 1))
    assert rise_failures(summary) == [], summary["per_step"]
