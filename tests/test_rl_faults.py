"""Faults of the RL loop on the CPU stack: a TrainerWorker killed mid-step, `--resume`, Ctrl-C.

    .venv/bin/python -m pytest -q tests/test_rl_faults.py

Two runs of `megamoe-rl train` in one run folder, the faults injected by the test's reward
function (tests/test_rl_loop.py, REWARD_MODULE) at exact points:
1. checkpoint every 2 steps; during step 3 the trainer's process is killed (SIGKILL): the run ends
   with exit 1, naming the last checkpoint (step 2), which is intact.
2. `--resume`: continues at step 3 from that checkpoint (metrics.jsonl keeps steps 1-2 and goes
   on); during step 4 the driver gets SIGINT (Ctrl-C): step 4 finishes, a checkpoint is written,
   every actor is stopped, exit 130, and the run is resumable from step 4.
"""

from __future__ import annotations

import json
import os

import pytest

from test_rl_loop import STEP_KEYS, explain, numeric_finite, run_train, write_reward_module
from rl.metrics import read_jsonl


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _latest(run_dir):
    return json.loads((run_dir / "checkpoints" / "latest.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("rl_faults")
    reward = write_reward_module(work)
    run_dir = work / "run"
    common = ("trainer.checkpoint_every=2", "--reward", reward)
    killed = run_train(run_dir, "run.steps=6", *common, action="kill_trainer@3", cwd=work)
    after_kill = {"metrics": read_jsonl(run_dir / "metrics.jsonl"), "latest": _latest(run_dir),
                  "pids": json.loads((run_dir / "actors.json").read_text())}
    resumed = run_train(run_dir, "run.steps=6", *common, "--resume", action="sigint@2", cwd=work)
    return {"dir": run_dir, "killed": killed, "after_kill": after_kill, "resumed": resumed}


def test_dead_trainer_ends_the_run_with_the_last_checkpoint(runs):
    p = runs["killed"]
    assert p.returncode == 1, explain(p)
    assert "TrainerWorker died during train_step at step 3" in p.stderr, explain(p)
    assert "the last checkpoint is step 2" in p.stderr and "--resume" in p.stderr
    a = runs["after_kill"]
    assert a["latest"] == {"step": 2, "path": "step_000002"}
    assert [r["step"] for r in a["metrics"]] == [1, 2]
    assert (runs["dir"] / "checkpoints" / "step_000002" / "meta.json").is_file()
    # The surviving rollout actor was stopped with the run.
    assert not any(_alive(pid) for pid in a["pids"]["rollout"])


def test_resume_continues_the_step_count_and_the_metrics_file(runs):
    p = runs["resumed"]
    records = read_jsonl(runs["dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4], explain(p)
    for r in records:
        assert not numeric_finite(r, STEP_KEYS), r
    # The trainer's own counter came back from the checkpoint: its 3rd train_step is loop step 3.
    assert [r["train/step"] for r in records] == [1, 2, 3, 4]
    assert "resumed from" in (runs["dir"] / "train.log").read_text()
    assert "step_000002" in (runs["dir"] / "train.log").read_text()


def test_ctrl_c_stops_every_actor_and_leaves_a_resumable_run(runs):
    p = runs["resumed"]
    assert p.returncode == 130, explain(p)
    assert "stopped by Ctrl-C after step 4" in p.stderr
    assert _latest(runs["dir"]) == {"step": 4, "path": "step_000004"}
    assert (runs["dir"] / "checkpoints" / "step_000004" / "meta.json").is_file()
    pids = json.loads((runs["dir"] / "actors.json").read_text())
    assert not any(_alive(pid) for pid in pids["trainer"] + pids["rollout"]), pids
