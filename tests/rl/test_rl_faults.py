"""Faults of the RL loop on the CPU stack: a TrainerWorker killed mid-step, `--resume`, Ctrl-C; the run is
one of multi-turn episodes (docs/MULTI_TURN.md) at lag 1 (run.max_async_steps=1, docs/ASYNC.md), so these are
also the resume and evaluation tests of episodes in flight.

    .venv/bin/python -m pytest -q tests/rl/test_rl_faults.py

Two runs of `megamoe-rl train` in one run folder, the faults injected by the test's reward
function (tests/rl/test_rl_loop.py, REWARD_MODULE: its Nth call) at exact points. Every completion is an
episode of up to three assistant turns (EPISODES: the test module's verifiers-shape environment asks back
"Sure?"; a turn ends on the stop string "e", which the random model writes often, or at 8 tokens, which ends
the episode). At lag 1 the episodes of step t + 1 run (in the driver's episode thread) while step t trains; the
batch of step t is of policy version max(0, t - 2); a checkpoint scores the episodes in flight and keeps their
scored batch in inflight.json, so the training reward is called once per step, the step after a checkpoint's
call coming at the checkpoint:
1. checkpoint every 2 steps, samples.jsonl and an evaluation (of episodes) every step; during step 4 (the
   reward's 4th call: steps 1, 2, step 3's batch at step 2's checkpoint, step 4) the trainer's process is
   killed (SIGKILL): the run ends with exit 1 and one paragraph, in train.log and on the terminal, naming
   the actor, the step, the cause, the last checkpoint (step 2, intact, with step 3's episodes scored in
   flight) and the command that continues the run. Step 3 was done and logged but not checkpointed.
2. that command (`... --resume`): continues at step 3 from that checkpoint (metrics.jsonl,
   samples.jsonl and eval_samples.jsonl drop step 3's stale lines, keep steps 1-2 and go on), training
   step 3 on the checkpoint's batch in flight; during step 4 (the resumed process's 1st reward call) the
   driver gets SIGINT (Ctrl-C): step 4 finishes, a checkpoint is written (with step 5's episodes scored in
   flight), every actor is stopped, exit 130, and the run is resumable from step 4.
   Every batch was sampled by exactly its version: the steps whose sampler-trainer mismatch is above the fp32
   bound are exactly the stale ones (tests/rl/test_rl_async.py, check_sampled_by_version).
   Step 3 ran twice, uninterrupted in run 1 and resumed from step 2's checkpoint in run 2: every result of
   it (metrics, the transcripts in samples.jsonl, the evaluation after it) must be equal.
The paragraph's root cause for an actor that raises (rather than dies) is tested on Ray's own
exception objects below, without a cluster. Multi-turn episodes on-policy (k = 0) run end to end on the engine
in tests/rl/test_divergence.py (bitwise three-turn episodes) and through the whole loop, with stand-in actors, in
tests/rl/test_episode_pipeline.py.
"""


from __future__ import annotations

import json
import os
import shlex
import sys

import pytest

from test_rl_async import check_sampled_by_version, stale_steps
from test_rl_loop import (EVAL, STEP_KEYS, TIMING, explain, fp32_mismatch_over_bounds, numeric_finite, run_cli,  # noqa: F401
                          run_train, train_records, two_checkpoints, wandb_offline_history, write_reward_module)
from rl.metrics import read_jsonl


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _latest(run_dir):
    return json.loads((run_dir / "checkpoints" / "latest.json").read_text())


# Multi-turn episodes (docs/MULTI_TURN.md) of up to 3 turns of up to 8 tokens, each turn ending on "e", at lag 1.
# Routing replay on: each episode's routing is merged over its turns' captures (rl/episodes.py, merge_routing).
EPISODES = ("env.environment=loop_test_rewards:AskAgain", "env.max_turns=3", "rollout.stop=[e]",
            "rollout.max_tokens=8", "rollout.max_model_len=128", "trainer.max_seq_len=128",
            "trainer.routing_replay=true", "run.max_async_steps=1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_cluster):
    work = tmp_path_factory.mktemp("rl_faults")
    reward = write_reward_module(work)
    run_dir = work / "run"
    # Killed in step 4 (the reward's 4th call): step 3 is logged (metrics, samples, evaluation) after
    # the last checkpoint (step 2), so the resume has stale lines to drop.
    # No plot or TensorBoard events (~2 s at each run's end; tests/rl/test_rl_loop.py's run checks both).
    common = ("trainer.checkpoint_every=2", "run.wandb.mode=offline", "run.samples_every=1", "run.plot=false",
              "run.tensorboard=false", *EVAL, *EPISODES, "--reward", reward)
    killed = run_train(run_dir, "run.steps=6", *common, action="kill_trainer@4", cwd=work,
                       ray=ray_cluster)
    after_kill = {"metrics": read_jsonl(run_dir / "metrics.jsonl"), "latest": _latest(run_dir),
                  "inflight": json.loads((run_dir / "checkpoints" / "step_000002" / "inflight.json").read_text()),
                  "pids": json.loads((run_dir / "actors.json").read_text()),
                  "log": (run_dir / "train.log").read_text(),
                  "samples": read_jsonl(run_dir / "samples.jsonl"),
                  "eval_samples": read_jsonl(run_dir / "eval_samples.jsonl")}
    # The run is continued with the command its failure paragraph gives.
    said = [ln for ln in killed.stderr.splitlines() if "continue the run with: " in ln]
    if not said:
        pytest.fail("the killed run printed no command to continue it\n" + explain(killed))
    words = shlex.split(said[-1].split("continue the run with: ", 1)[1])
    assert words[:2] == ["megamoe-rl", "train"], said
    resumed = run_cli([sys.executable, "-m", "rl.cli", *words[1:]], run_dir, action="sigint@1", cwd=work,
                      ray=ray_cluster)
    return {"dir": run_dir, "killed": killed, "after_kill": after_kill, "resumed": resumed, "resume_argv": words,
            "ray": ray_cluster["RAY_ADDRESS"]}


@pytest.mark.slow  # two `megamoe-rl train` runs (the module's `runs`)
def test_dead_trainer_ends_the_run_with_one_paragraph(runs):
    p = runs["killed"]
    a = runs["after_kill"]
    assert p.returncode == 1, explain(p)
    ckpt = runs["dir"] / "checkpoints" / "step_000002"
    said = [ln for ln in p.stderr.splitlines() if "The run failed:" in ln]
    assert len(said) == 1, explain(p)
    text = said[0].split(" ERROR ", 1)[1]
    assert text.startswith(f"The run failed: TrainerWorker rank 0 died in train_step at step 4: ActorDiedError: "
                           f"the actor's process (pid {a['pids']['trainer'][0]}) is gone"), text
    assert f"(tracebacks: {runs['dir'] / 'traceback.txt'}). The last complete checkpoint is step 2 ({ckpt}); " \
           f"continue the run with: megamoe-rl train --config " in text, text
    assert text.endswith(" --reward loop_test_rewards:first_char_is_answer --resume"), text
    assert "Traceback" not in text and "ray::" not in text
    logged = [ln for ln in a["log"].splitlines() if "The run failed:" in ln]
    assert len(logged) == 1 and logged[0].endswith(text), a["log"][-3000:]
    assert "Traceback" in (runs["dir"] / "traceback.txt").read_text()
    assert a["latest"] == {"step": 2, "path": "step_000002"}
    assert [r["step"] for r in a["metrics"]] == [0, 1, 2, 3]  # evaluation before step 1, then steps 1-3
    assert (runs["dir"] / "checkpoints" / "step_000002" / "meta.json").is_file()
    # The surviving rollout actor was stopped with the run.
    assert not any(_alive(pid) for pid in a["pids"]["rollout"])


@pytest.mark.slow
def test_resume_continues_the_step_count_and_the_metrics_file(runs):
    p = runs["resumed"]
    assert "--resume" in runs["resume_argv"] and f"run.out_dir={runs['dir']}" in runs["resume_argv"]
    assert [r["step"] for r in read_jsonl(runs["dir"] / "metrics.jsonl")] == [0, 1, 2, 3, 4], explain(p)
    records = train_records(runs["dir"])
    for r in records:
        assert not numeric_finite(r, STEP_KEYS), r
    # The trainer's own counter came back from the checkpoint: its 3rd train_step is loop step 3.
    assert [r["train/step"] for r in records] == [1, 2, 3, 4]
    # Lag 1: the batch of step t is of version max(0, t - 2) (samples.jsonl's lag column too, 16 episodes a
    # step), and the steps whose sampler-trainer mismatch is above the fp32 bound are exactly the stale ones
    # (an update moved the weights since the batch's version): each batch was sampled by its version's weights,
    # the resumed run's too (step 3's from the checkpoint's inflight.json, step 4's by the new RolloutWorker).
    # That step 4's batch was made by the checkpoint's weights, not the base model's (Loop.run's resume-time
    # push), shows only through the value-for-value resume equality of single-turn async
    # (tests/rl/test_rl_async.py): here it is stale either way.
    print("resumed run (step, version, grad norm, max |dlogp|, k3):",
          [(r["step"], r["async/policy_version"], r["train/grad_norm"], r["mismatch/abs_logp_diff_max"],
            r["mismatch/k3_kl"]) for r in records])
    stale = check_sampled_by_version(records, read_jsonl(runs["dir"] / "samples.jsonl"), 1,
                                     fp32_mismatch_over_bounds, 16)
    assert 1 not in stale and fp32_mismatch_over_bounds(records[:1]) == []
    log = (runs["dir"] / "train.log").read_text()
    assert "resumed from" in log and "step_000002" in log
    assert "resume: 1 batch(es) in flight at the checkpoint (steps [3])" in log


@pytest.mark.slow
def test_resume_drops_the_samples_files_stale_steps(runs):
    # The killed run had logged step 3 (after its last checkpoint, step 2) in both files.
    a = runs["after_kill"]
    assert [r["step"] for r in a["samples"]] == [s for s in (1, 2, 3) for _ in range(16)]
    assert [r["step"] for r in a["eval_samples"]] == [s for s in (0, 1, 2, 3) for _ in range(32)]
    # After the resume: each step once, in order (4 prompts x 4 samples; 8 eval prompts x 4), step 3's
    # lines those of the resumed run only. With Loop.run's truncation of the samples files deleted, step 3
    # appeared twice in each.
    samples = read_jsonl(runs["dir"] / "samples.jsonl")
    evals = read_jsonl(runs["dir"] / "eval_samples.jsonl")
    assert [r["step"] for r in samples] == [s for s in (1, 2, 3, 4) for _ in range(16)], explain(runs["resumed"])
    assert [r["step"] for r in evals] == [s for s in (0, 1, 2, 3, 4) for _ in range(32)]
    assert [(r["prompt_index"], r["sample_index"]) for r in samples if r["step"] == 3] == \
        [(i, j) for i in range(4) for j in range(4)]
    # Steps 1-2 are the killed run's lines, kept as they were.
    assert samples[:32] == a["samples"][:32] and evals[:96] == a["eval_samples"][:96]


@pytest.mark.slow
def test_a_multi_turn_run_resumed_mid_way_equals_the_uninterrupted_run(runs):
    """Step 3 of the killed run (uninterrupted since step 1) and of the resumed run (from step 2's checkpoint):
    the same episodes, rewards, update and evaluation, value for value. Step 3's episodes were in flight at the
    checkpoint: both runs scored them there, and the resumed one trained on what inflight.json kept of them (the
    scored batch, the rewards and env/* metrics, the transcripts); what else a resume needs beyond the trainer's
    checkpoint is a function of the config and the step: the data position (the prompts of step s), the
    sampler's seeds (of step s and turn t) and the environment (one instance per run, no state across steps)."""
    a = runs["after_kill"]
    # Step 3's batch (0-based 2), of version 1, scored at the checkpoint: 16 episodes with their rewards.
    assert [(b["step"], b["version"], len(b["scored"]["samples"])) for b in a["inflight"]] == [(2, 1, 16)]
    assert len(a["inflight"][0]["scored"]["rewards"]["total"]) == 16
    before = {r["step"]: r for r in a["metrics"]}[3]
    after = {r["step"]: r for r in read_jsonl(runs["dir"] / "metrics.jsonl")}[3]
    # Multi-turn indeed: episodes of more than one turn, environment tokens in the trainer's sequences, and the
    # evaluation's episodes too.
    assert before["env/turns_mean"] > 1.5 and before["env/env_token_frac"] > 0.2, before
    assert before["eval/env/turns_mean"] > 1.5 and before["eval/env/env_token_frac"] > 0.2, before
    timing = TIMING + ("eval/time_s",)
    differ = [(k, before[k], after.get(k)) for k in before if not k.startswith(timing) and before[k] != after.get(k)]
    assert differ == [], differ
    assert [r for r in a["samples"] if r["step"] == 3] == \
        [r for r in read_jsonl(runs["dir"] / "samples.jsonl") if r["step"] == 3]
    assert [r for r in a["eval_samples"] if r["step"] == 3] == \
        [r for r in read_jsonl(runs["dir"] / "eval_samples.jsonl") if r["step"] == 3]
    # samples.jsonl holds the whole transcript: the environment's turns between the assistant's.
    assert any("Sure?" in r["completion"] for r in a["samples"]), a["samples"][0]
    print("multi-turn run by step (turns, env token share, max |dlogp|, routing agree, step s):",
          [(r["step"], r["env/turns_mean"], round(r["env/env_token_frac"], 3), r["mismatch/abs_logp_diff_max"],
            r["routing/agree"], round(r["time/step_s"], 1)) for r in train_records(runs["dir"])])


@pytest.mark.slow
def test_routing_replay_of_episodes_is_the_trainers_own_routing(runs):
    """Every episode's routing, merged over its turns' captures, covers its whole sequence (sampled and
    environment tokens) but the last token (sampled, never fed back: one per episode, 16 a step), and for a batch
    that is not stale, in fp32 megamoe, it is exactly the routing the trainer's own routers pick
    (docs/ROUTING_REPLAY.md); a stale batch's routing is its sampler's (version), replayed all the same."""
    for records in (runs["after_kill"]["metrics"][1:], train_records(runs["dir"])):
        stale = stale_steps(records)
        for r in records:
            assert r["routing/unrouted_tokens"] == 16 and r["routing/replayed_tokens"] > 0, (r["step"], r)
            assert "routing/load_cv_l0" in r, r  # the routing's expert-load metrics
            if r["step"] not in stale:
                assert r["routing/agree"] == 1.0, (r["step"], r["routing/agree"])


@pytest.mark.slow
def test_both_runs_join_the_ray_cluster_of_ray_address_and_leave_it_up(runs):
    """$RAY_ADDRESS (tests/conftest.py's `ray_cluster`): each start joins that cluster rather than starting a
    local instance (tests/rl/test_rl_loop.py's run starts one), and the killed run's end leaves it up for the
    resumed run (Loop's _run shuts down only a Ray instance it started)."""
    log = (runs["dir"] / "train.log").read_text()
    assert log.count(f"joining the Ray cluster at {runs['ray']}") == 2, log[-3000:]
    assert "starting a local Ray instance" not in log


@pytest.mark.slow
def test_ctrl_c_stops_every_actor_and_leaves_a_resumable_run(runs):
    p = runs["resumed"]
    assert p.returncode == 130, explain(p)
    assert "stopped by Ctrl-C after step 4" in p.stderr
    assert _latest(runs["dir"]) == {"step": 4, "path": "step_000004"}
    assert (runs["dir"] / "checkpoints" / "step_000004" / "meta.json").is_file()
    # Step 5's episodes (0-based 4, version 3) were in flight: scored at this checkpoint (the reward's 2nd call).
    inflight = json.loads((runs["dir"] / "checkpoints" / "step_000004" / "inflight.json").read_text())
    assert [(b["step"], b["version"], len(b["scored"]["samples"])) for b in inflight] == [(4, 3, 16)]
    pids = json.loads((runs["dir"] / "actors.json").read_text())
    assert not any(_alive(pid) for pid in pids["trainer"] + pids["rollout"]), pids


@pytest.mark.slow
def test_the_resumed_run_continues_the_same_wandb_run(runs):
    # run.wandb.mode=offline: each start writes an offline W&B run; both carry the id kept in the run folder.
    files, history = wandb_offline_history(runs["dir"])
    run_id = (runs["dir"] / "wandb_id.txt").read_text().strip()
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2, files
    records = read_jsonl(runs["dir"] / "metrics.jsonl")
    assert sorted(history) == [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [history[r["step"]]["reward/mean"] for r in records[1:]] == [r["reward/mean"] for r in records[1:]]
    assert [history[r["step"]]["eval/reward_mean"] for r in records] == [r["eval/reward_mean"] for r in records]


# ---- the failure paragraph, from Ray's own exception objects (no cluster) ----------------------

def _ray_errors() -> dict:
    """What ray.get raises for an actor method that raised, a constructor that raised and a process
    that died, built the way Ray builds them."""
    import ray
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    def task_error(fn, exc):
        tb = f'Traceback (most recent call last):\n  File "w.py", line 3, in {fn}\n    raise\n{type(exc).__name__}: {exc}'
        return ray.exceptions.RayTaskError(f"WorkerHost.{fn}", tb, exc, pid=4321)

    gone = ActorDiedErrorContext(
        error_message="The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
                      "exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some "
                      "common causes include: (1) the process was killed by the OOM killer", pid=4321,
        class_name="WorkerHost", actor_id=b"\x01" * 16)
    return {"raised": task_error("call", ValueError("sequence 3: 70 tokens > max_seq_len=64")).as_instanceof_cause(),
            "init": ray.exceptions.ActorDiedError(task_error("__init__", RuntimeError("no GPU\nfound"))),
            "died": ray.exceptions.ActorDiedError(gone)}


@pytest.mark.parametrize("kind, died, root", [
    pytest.param("raised", False, ("ValueError", "sequence 3: 70 tokens > max_seq_len=64"), id="method-raised"),
    pytest.param("init", False, ("RuntimeError", "no GPU found"), id="constructor-raised"),
    pytest.param("died", True, ("ActorDiedError", "the actor's process (pid 4321) is gone: Worker unexpectedly exits "
                                "with a connection error code 2. End of file. (killed, out of memory, or crashed)"),
                 id="process-died"),
])
def test_root_cause_is_what_happened_in_the_actor_without_rays_wrapping(kind, died, root):
    from rl.failures import ActorError, root_cause

    e = _ray_errors()[kind]
    assert root_cause(e) == root
    err = ActorError("TrainerWorker rank 1", "train_step", "step 7", e)
    assert err.died is died and (err.root_type, err.root_message) == root


def test_failure_paragraph_names_actor_step_cause_checkpoint_and_the_command(two_checkpoints, tmp_path):
    import shutil

    from rl.failures import ActorError, failure_paragraph

    e = ActorError("TrainerWorker rank 1", "train_step", "step 3", _ray_errors()["raised"])
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 2, "path": "step_000002"}))
    cmd = "megamoe-rl train --config c.yaml run.out_dir=x"
    text = failure_paragraph(e, run, cmd, trace=run / "traceback.txt")
    assert text == (f"The run failed: TrainerWorker rank 1 raised an exception in train_step at step 3: ValueError: "
                    f"sequence 3: 70 tokens > max_seq_len=64 (tracebacks: {run / 'traceback.txt'}). The last complete "
                    f"checkpoint is step 2 ({run / 'checkpoints' / 'step_000002'}); continue the run with: {cmd} --resume")
    assert "\n" not in text and "Ray" not in text
    fresh = failure_paragraph(RuntimeError("placement group was not placed"), tmp_path / "fresh", cmd, "start")
    assert fresh == (f"The run failed: the driver failed at start: RuntimeError: placement group was not placed. "
                     f"No checkpoint was written; start the run again with: {cmd} --overwrite")
