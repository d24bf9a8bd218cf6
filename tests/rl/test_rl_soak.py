"""Soak: 300 steps of the tiny config on CPU, a rollout actor killed and the driver interrupted and resumed once.

    MEGAMOE_SOAK=1 .venv/bin/python -m pytest -q -s tests/rl/test_rl_soak.py     (~2 minutes on 2 cores)

Not part of `make test`: it skips unless MEGAMOE_SOAK=1 (2 more minutes than the suite's budget
has room for). Run 1 kills the RolloutWorker at step 50 (the loop replaces it) and gets SIGINT at
step 150 (it finishes the step, checkpoints, exits 130); run 2 resumes and finishes. While they
run, the test samples every second the resident memory of the driver, of Ray's own processes and
of each actor with its child processes (vLLM's engine core and worker), and the space used in
/dev/shm (the machine's: other processes' use shows up there too); a sample taken while an actor is
missing (replaced, or the run shutting down) is dropped. It checks that the run
finishes, that metrics.jsonl has every step once, in order, that the sampler-trainer mismatch stays
at the fp32 bound at every step (the first after the restart and after the resume included: a sampler
on stale weights fails), that memory and /dev/shm stay flat
(median over an early window of steps against a late one, both after start-up and the restart:
WINDOWS, MAX_GROWTH_MIB), and that no process of either run is left behind; it prints the numbers.

Measured 2026-12-03, the 2-core CPU machine: 300 steps in 1.8 min. Early -> late window, run 1 /
run 2: driver +0.0 / +0.2 MiB (of ~500), trainer +2.4 / +1.3 MiB (of ~518), rollout with vLLM's
processes +16.3 / +5.4 MiB (of ~2000), Ray's processes +2.3 / +3.2 MiB (of ~540), /dev/shm +0.7 /
-0.4 MiB; 37 processes seen, none left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import threading
import time

import pytest

from rl.metrics import read_jsonl
from test_rl_loop import CLI, SMALL, fp32_mismatch_over_bounds, write_reward_module

STEPS = 300
KILL_AT, SIGINT_AT = 50, 150
# Growth allowed between the second and the last quarter of a run's samples (CPU, tiny model):
# the allocators of torch and vLLM settle within a few MB once warm; 64 MiB is a leak of ~0.4 MiB
# per step over 150 steps.
MAX_GROWTH_MIB = 64
SAMPLE_S = 1.0
# Steps whose samples are compared, per run: steady state after start-up (and, in run 1, after the
# rollout restart at step 50), early window against late window.
WINDOWS = {"run 1": ((60, 90), (120, 150)), "run 2": ((180, 210), (270, 300))}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("MEGAMOE_SOAK") != "1",
                                 reason="a 300-step run (~2 min on 2 cores) outside the suite's budget; set MEGAMOE_SOAK=1 to run it")]


def _tree(pid: int) -> list:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _rss(procs) -> int:
    import psutil

    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _run(run_dir, args, action, seen: set):
    """One `megamoe-rl train` run, sampled while it runs: (process, stderr, samples). Every process
    of the driver's tree (Ray's own, the actors, vLLM's) goes into `seen` as (pid, create_time)."""
    env = dict(os.environ, RL_TEST_RUN_DIR=str(run_dir), RL_TEST_ACTION=action)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(CLI + [f"run.out_dir={run_dir}", *SMALL, *args], cwd=run_dir.parent, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    samples: list[dict] = []
    stop = threading.Event()

    def sample():
        while not stop.wait(SAMPLE_S):
            try:
                step = len((run_dir / "metrics.jsonl").read_text().splitlines())
                pids = json.loads((run_dir / "actors.json").read_text())
            except (OSError, ValueError):
                continue
            tree = _tree(proc.pid)
            seen.update((q.pid, q.create_time()) for q in tree)
            actors = {k: [q for p in v for q in _tree(p)] for k, v in pids.items()}
            if not all(actors.values()):
                continue  # an actor is being replaced, or the run is shutting down: not a steady-state sample
            in_actors = {q.pid for v in actors.values() for q in v}
            samples.append({"step": step, "driver": _rss(tree[:1]), "trainer": _rss(actors["trainer"]),
                            "rollout": _rss(actors["rollout"]),
                            "ray": _rss(q for q in tree[1:] if q.pid not in in_actors),
                            "shm": shutil.disk_usage("/dev/shm").used})

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        _, err = proc.communicate(timeout=40 * 60)
    finally:
        stop.set()
        t.join()
    return proc, err, samples


def _growth(samples: list[dict], key: str, windows) -> tuple[float, float, float]:
    """(median over the early window's samples, over the late window's, growth) in MiB."""
    (a0, a1), (b0, b1) = windows
    early = [s[key] for s in samples if a0 <= s["step"] < a1]
    late = [s[key] for s in samples if b0 <= s["step"] <= b1]
    assert early and late, (key, windows, [s["step"] for s in samples])
    a, b = statistics.median(early) / 2**20, statistics.median(late) / 2**20
    assert a > 0 and b > 0, (key, a, b)  # measured processes, not absent ones
    return a, b, b - a


def _alive(seen: set) -> list[str]:
    import psutil

    out = []
    for pid, created in seen:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def test_soak_300_steps_with_a_killed_rollout_and_a_resumed_interrupt(tmp_path):
    reward = write_reward_module(tmp_path)
    run_dir = tmp_path / "run"
    common = (f"run.steps={STEPS}", "--reward", reward)
    seen: set = set()
    t0 = time.time()
    first, err1, s1 = _run(run_dir, common, f"kill_rollout@{KILL_AT},sigint@{SIGINT_AT}", seen)
    assert first.returncode == 130, err1[-4000:]
    second, err2, s2 = _run(run_dir, (*common, "--resume"), "", seen)
    minutes = (time.time() - t0) / 60
    assert second.returncode == 0, err2[-4000:]

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "gaps or duplicates in metrics.jsonl"
    restarts = [r["rollout/restarts_total"] for r in records]
    # Killed while step 50's rewards were scored; the resumed run counts its own restarts.
    assert restarts[:KILL_AT - 1] == [0] * (KILL_AT - 1) and set(restarts[KILL_AT - 1:SIGINT_AT]) == {1}, restarts
    assert set(restarts[SIGINT_AT:]) == {0}
    assert "RolloutWorker 0 died" in (run_dir / "train.log").read_text()
    # The sampler holds the trainer's weights at every step: after the restart (step 51) and after the
    # resume (step 151) as well (bounds: tests/rl/test_rl_loop.py). Measured 2026-12-05: max |dlogp|
    # 8.1e-6 and k3 6.4e-13 over the 300 steps, 9.5e-7 at steps 51 and 151.
    assert fp32_mismatch_over_bounds(records) == []

    report = [f"soak: {STEPS} steps in {minutes:.1f} min; samples every {SAMPLE_S:.0f} s: run 1 {len(s1)}, run 2 {len(s2)}; "
              f"resident memory (each actor with its child processes) and /dev/shm used, median over the steps"]
    failures = []
    for name, samples in (("run 1", s1), ("run 2", s2)):
        (a0, a1), (b0, b1) = WINDOWS[name]
        for key in ("driver", "ray", "trainer", "rollout", "shm"):
            a, b, g = _growth(samples, key, WINDOWS[name])
            report.append(f"  {name} {key:8s} steps {a0}-{a1}: {a:8.1f} MiB, steps {b0}-{b1}: {b:8.1f} MiB ({g:+.1f} MiB)")
            if g > MAX_GROWTH_MIB:
                failures.append(f"{name} {key} grew {g:.1f} MiB (> {MAX_GROWTH_MIB})")
    time.sleep(5)  # Ray's processes exit after the driver
    left = _alive(seen)
    report.append(f"  processes seen: {len(seen)}, left behind: {left or 'none'}")
    print("\n".join(report))
    assert not failures, "\n".join(report)
    assert not left, left
