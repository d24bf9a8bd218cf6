"""Fixed-lag async RL (run.max_async_steps, docs/ASYNC.md) end to end on the CPU stack.

    .venv/bin/python -m pytest -q tests/rl/test_rl_async.py

Two `megamoe-rl train` runs of one async config (k=1, 5 steps, routing replay on, the test reward of
tests/rl/test_rl_loop.py injecting the faults): one whose RolloutWorker is killed with the next step's
batch queued on it, and a copy of its run folder as it stood at step 2's checkpoint (step 3's batch in
flight), resumed with evaluation on and stopped by Ctrl-C during step 4. Every training result of the two
must agree value for value (the lag is fixed, the in-flight batches are in the checkpoint, the dead
worker's queue is replayed from the policy versions it needed, evaluation leaves training alone), and
the batch in flight at the Ctrl-C checkpoint must be the one the killed run trained at step 5. A file of
its own, so that `make test`'s workers (--dist loadfile) can run it beside tests/rl/test_rl_faults.py.
The config refusals are pure config tests (tests/rl/test_config.py).

Also here, without a run: the checks every async run goes through (check_sampled_by_version, which
tests/rl/test_rl_async_gpu.py applies to ipc runs on a GPU in bitwise mode), tested on hand-written records;
sleep mode's refusal on CPU and its warning at k >= 1; and the nccl publication at k = 1, the driver's half,
with fake engines (vLLM's NCCL engine cannot receive on CPU: docs/WEIGHT_SYNC.md, "nccl on CPU").
"""

from __future__ import annotations

import json
from typing import Callable

import pytest

from test_rl_loop import (EVAL, STEP_KEYS, explain, fp32_mismatch_over_bounds, numeric_finite, run_train,
                          write_reward_module)
from rl.metrics import read_jsonl


# ---- what every async run must show, whatever its transport (tests/rl/test_rl_async_gpu.py: ipc on CUDA) ----

def stale_steps(records: list[dict]) -> list[int]:
    """The steps whose batch is stale: its version v trained at step t, and an update between them (steps
    v+1 .. t-1) moved the weights, which every update does from the first nonzero gradient on (Adam's
    momentum moves the weights after it; before it, an update of zero gradients leaves them)."""
    moved = [any(x["train/grad_norm"] > 0 for x in records[:i + 1]) for i in range(len(records))]
    return [r["step"] for r in records if any(moved[r["async/policy_version"]:r["step"] - 1])]


def check_sampled_by_version(records: list[dict], rows: list[dict], k: int, off_policy: Callable[[list[dict]], list],
                             samples_per_step: int) -> list[int]:
    """Every batch of a run at lag `k` was sampled by exactly its policy version: the schedule (the batch of
    step t by version max(0, t-1-k), its lag min(t-1, k)), samples.jsonl's lag of every sample, and the
    sampler-trainer mismatch: `off_policy(records)` (the (step, ...) of every record whose mismatch is above
    the numerics' bound: fp32 bounds in fast numerics, 0 in bitwise mode) is exactly the stale steps (a
    batch sampled by other weights than its version's would show up at a step that is not stale, or hide at
    one that is). Returns the stale steps."""
    steps = len(records)
    assert [(r["step"], r["async/policy_version"], r["async/lag"]) for r in records] == \
        [(t, max(0, t - 1 - k), min(t - 1, k)) for t in range(1, steps + 1)]
    stale = stale_steps(records)
    assert [s for s, *_ in off_policy(records)] == stale, \
        [(r["step"], r["async/policy_version"], r["train/grad_norm"], r["mismatch/abs_logp_diff_max"],
          r["mismatch/k3_kl"]) for r in records]
    assert [(r["step"], r["lag"]) for r in rows] == \
        [(t, min(t - 1, k)) for t in range(1, steps + 1) for _ in range(samples_per_step)]
    return stale


def bitwise_off_policy(records: list[dict]) -> list[tuple]:
    """(step, max |dlogp|, k3) of every record whose mismatch is not exactly 0: in run.numerics=bitwise the
    trainer's logprobs equal the sampler's bit for bit when both hold the same weights (docs/BITWISE.md)."""
    return [(r["step"], r["mismatch/abs_logp_diff_max"], r["mismatch/k3_kl"]) for r in records
            if not (r["mismatch/abs_logp_diff_max"] == 0.0 and r["mismatch/k3_kl"] == 0.0)]


def _record(step: int, version: int, grad_norm: float, diff: float) -> dict:
    return {"step": step, "async/policy_version": version, "async/lag": step - 1 - version,
            "train/grad_norm": grad_norm, "mismatch/abs_logp_diff_max": diff, "mismatch/k3_kl": diff * diff / 2}


def test_check_sampled_by_version_catches_a_batch_of_other_weights():
    """The check on hand-written records of k = 1 in bitwise mode (steps 1-5, step 1's update without a
    gradient, so step 2's batch is not stale): passes on the true pattern; a stale batch at mismatch 0 (sampled
    by the trainer's newer weights), a fresh one above it (by other weights), a wrong version or a lag missing
    from samples.jsonl each fail it."""
    grads, diffs = [0.0, 0.5, 0.4, 0.3, 0.2], [0.0, 0.0, 0.1, 0.2, 0.3]
    records = [_record(t, max(0, t - 2), g, d) for t, g, d in zip(range(1, 6), grads, diffs)]
    rows = [{"step": t, "lag": min(t - 1, 1)} for t in range(1, 6) for _ in range(2)]
    assert check_sampled_by_version(records, rows, 1, bitwise_off_policy, 2) == [3, 4, 5]
    for step, diff in ((4, 0.0), (2, 1e-7)):
        bad = [_record(step, r["async/policy_version"], r["train/grad_norm"], diff) if r["step"] == step else r
               for r in records]
        with pytest.raises(AssertionError):
            check_sampled_by_version(bad, rows, 1, bitwise_off_policy, 2)
    with pytest.raises(AssertionError):
        check_sampled_by_version([dict(r, **{"async/policy_version": 2}) if r["step"] == 5 else r for r in records],
                                 rows, 1, bitwise_off_policy, 2)
    with pytest.raises(AssertionError):
        check_sampled_by_version(records, rows[:-1], 1, bitwise_off_policy, 2)


# Metrics that are timings, or that count the injected fault, rather than results of the run.
NOT_RESULTS = ("time/", "throughput/", "rollout/restarts_total")


def result_differences(a: list[dict], b: list[dict]) -> list[tuple]:
    """(step, key, a's value, b's value) of every result (NOT_RESULTS aside) that differs between two runs'
    metrics records."""
    return [(x["step"], k, x[k], y.get(k)) for x, y in zip(a, b, strict=True) for k in x
            if not k.startswith(NOT_RESULTS) and x[k] != y.get(k)]


# ---- async (run.max_async_steps=1): lag, reproducibility, resume, a rollout worker killed ---------

# trainer.keep_checkpoints=3: the killed run keeps step 2's checkpoint (steps 2, 4, 5) for the resumed one.
ASYNC = ("run.steps=5", "run.max_async_steps=1", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3",
         "run.plot=false", "run.export_final=false", "run.tensorboard=false", "run.samples_every=1",
         "trainer.routing_replay=true")


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory, ray_cluster):
    """Two runs of one async config. `killed` loses its RolloutWorker while step 4's batch is queued on it
    (the reward's 3rd call, during step 3) and runs to step 5 (checkpoints after steps 2, 4, 5). `resumed`:
    a copy of that run folder as it stood when step 2's checkpoint was the latest (step 3's batch in flight;
    the later checkpoints removed, the later log lines for the resume to drop), resumed with evaluation on
    (test_rl_loop.py's EVAL: every step) and stopped by Ctrl-C during step 4 (the reward's 2nd call there):
    step 4 finishes and its checkpoint holds step 5's batch in flight."""
    import shutil

    work = tmp_path_factory.mktemp("rl_async")
    reward = write_reward_module(work)
    killed_dir, resumed_dir = work / "killed", work / "resumed"
    killed = run_train(killed_dir, *ASYNC, "--reward", reward, action="kill_rollout@3", cwd=work, ray=ray_cluster)
    inflight = json.loads((killed_dir / "checkpoints" / "step_000002" / "inflight.json").read_text())
    resumed = None
    if killed.returncode == 0:
        shutil.copytree(killed_dir, resumed_dir)
        for later in sorted((resumed_dir / "checkpoints").glob("step_*"))[1:]:
            shutil.rmtree(later)
        (resumed_dir / "checkpoints" / "latest.json").write_text(json.dumps({"step": 2, "path": "step_000002"}))
        resumed = run_train(resumed_dir, *ASYNC, *EVAL, "--reward", reward, "--resume", action="sigint@2", cwd=work,
                            ray=ray_cluster)
    return {"killed": killed, "killed_dir": killed_dir, "inflight": inflight, "resumed": resumed,
            "resumed_dir": resumed_dir}


@pytest.mark.slow  # two `megamoe-rl train` runs (the module's `async_runs`)
def test_async_lag_is_fixed_and_a_killed_rollout_worker_regenerates_its_queue(async_runs):
    p = async_runs["killed"]
    assert p.returncode == 0, explain(p)
    records = read_jsonl(async_runs["killed_dir"] / "metrics.jsonl")
    assert records[-1]["rollout/restarts_total"] == 1
    assert "restarting it with its queue of weights and generations" in \
        (async_runs["killed_dir"] / "train.log").read_text()
    for r in records:
        assert not numeric_finite(r, STEP_KEYS + ("time/rollout_busy_s",)), (r["step"], r)
    # The batch of step t was sampled by the policy after t-2 updates (t-1: the first step's, by the
    # initial weights): lag 1 at every step but the first; samples.jsonl's lag column, 4 prompts x 4
    # samples a step. Step 1 is on-policy: the sampler-trainer mismatch at the fp32 bound; a stale batch
    # (this seed's step 1 has no reward signal, so step 2's batch is not stale) far above it (k3 2.6e-2 to
    # 4.1e-4 measured, 2026-12-07).
    rows = read_jsonl(async_runs["killed_dir"] / "samples.jsonl")
    stale = check_sampled_by_version(records, rows, 1, fp32_mismatch_over_bounds, 16)
    assert len(stale) >= 3, [(r["step"], r["train/grad_norm"]) for r in records]
    # Routing replay under async (docs/ROUTING_REPLAY.md): every batch carries the routing its sampler captured
    # while generating it (the replacement worker's regenerated batch too) and the trainer computes with it; a
    # batch that is not stale routes exactly as the trainer's own routers (fp32 megamoe: bitwise); each sample's
    # last token, never fed back to the engine, has none (16 a step).
    for r in records:
        assert r["routing/unrouted_tokens"] == 16 and r["routing/replayed_tokens"] > 0, (r["step"], r)
        assert "routing/load_cv_l0" in r, r  # the routing's expert-load metrics, every step
        if r["step"] not in stale:
            assert r["routing/agree"] == 1.0, (r["step"], r["routing/agree"])
    # The checkpoint after step 2 holds step 3's batch, sampled by version 1 (the resumed run trains on it).
    assert [(b["step"], b["version"], len(b["samples"])) for b in async_runs["inflight"]] == [(2, 1, 16)]


def _inflight(run_dir, step: int) -> list[dict]:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "inflight.json").read_text())


@pytest.mark.slow
def test_async_run_resumed_with_evaluation_and_stopped_equals_the_killed_one(async_runs):
    a_dir, b_dir = async_runs["killed_dir"], async_runs["resumed_dir"]
    p = async_runs["resumed"]
    assert p is not None, "the killed run failed, so nothing was resumed"
    assert p.returncode == 130, explain(p)  # Ctrl-C: step 4 finished and checkpointed, then exit 130
    log = (b_dir / "train.log").read_text()
    assert "resume: 1 batch(es) in flight at the checkpoint (steps [3])" in log
    assert "stopped by Ctrl-C after step 4; continue with --resume" in log
    a = read_jsonl(a_dir / "metrics.jsonl")
    b = read_jsonl(b_dir / "metrics.jsonl")
    # The copy's lines of steps 3-5 were dropped by the resume and steps 3-4 written again (with evaluation).
    assert [r["step"] for r in b] == [1, 2, 3, 4], explain(p)
    assert [k for r in b[2:] for k in ("eval/reward_mean", "eval/pass@4") if not isinstance(r.get(k), float)] == []
    assert [r["eval/policy_version"] for r in b[2:]] == [3, 4]
    # Every training result equals, value for value, the killed run's (which never evaluated): the one whose
    # RolloutWorker died with a batch queued on it, uninterrupted. Evaluation adds its eval/* keys and nothing else.
    b_train = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in b]
    assert [sorted(set(x) ^ set(y)) for x, y in zip(a, b_train)] == [[]] * 4
    differ = result_differences(a[:4], b_train)
    assert differ == [], differ[:5]
    rows_a, rows_b = read_jsonl(a_dir / "samples.jsonl"), read_jsonl(b_dir / "samples.jsonl")
    assert [(r["step"], r["completion"], r["reward"]) for r in rows_b] == \
        [(r["step"], r["completion"], r["reward"]) for r in rows_a if r["step"] <= 4]
    # The Ctrl-C checkpoint holds step 5's batch, sampled by version 3 after an evaluation of version 3 on the
    # same engine: every sample equal (ids, logprobs, routing) to the batch the killed run had in flight at
    # its step 4 checkpoint and trained at step 5.
    got, want = _inflight(b_dir, 4), _inflight(a_dir, 4)
    assert [(f["step"], f["version"], len(f["samples"])) for f in got] == [(4, 3, 16)]
    assert [f["samples"] for f in got] == [f["samples"] for f in want]


def test_sleep_mode_is_refused_on_cpu_saying_why_and_at_k_1_says_what_it_costs(caplog):
    """vLLM's sleep mode (rollout.sleep_level) needs CUDA: refused on CPU at any lag, with the reason. On a GPU it
    loads at k >= 1 as at k = 0 (tests/rl/test_config.py), and the pipeline's Training says once, when it is made,
    that an engine sleeps only after the generations queued on it, so training then does not overlap generation."""
    import logging

    from test_rl_loop import TINY

    from rl import config as C
    from rl.pipeline import Training

    for k in (0, 1):
        with pytest.raises(C.ConfigError, match=r"tiny.yaml: rollout.sleep_level: expected 0 on CPU \(vLLM's sleep mode needs "
                                                r"CUDA: rollout.gpus_per_worker and trainer.gpus_per_rank > 0\), got 1$"):
            C.load(TINY, ["rollout.sleep_level=1", f"run.max_async_steps={k}"])
    gpu = ["rollout.gpus_per_worker=1", "trainer.gpus_per_rank=1", "rollout.sleep_level=2"]
    with caplog.at_level(logging.WARNING, logger="megamoe.rl"):
        Training(C.load(TINY, gpu), actors=None)
        assert caplog.messages == []
        Training(C.load(TINY, gpu + ["run.max_async_steps=1"]), actors=None)
    (message,) = caplog.messages
    assert message.startswith("rollout.sleep_level=2 with run.max_async_steps=1: an engine can sleep only once the "
                              "generations queued on it are done, and the trainer trains only once it sleeps, so "
                              "training does not overlap generation (scoring still does); the lag stays 1."), message


# ---- async with nccl: the driver's half, on CPU (vLLM's NCCL engine cannot receive there: docs/WEIGHT_SYNC.md) ----

class _Call:
    """A call queued on a fake actor: it runs when a `ray.get` reaches it, after every call queued before it
    on that actor (Ray runs one caller's calls to an actor in order)."""

    def __init__(self, actor, fn):
        self.actor, self.fn, self.value = actor, fn, None


class _Engine:
    """A rollout worker whose weights are a policy version: 0, model_dir's, when it starts."""

    def __init__(self):
        self.weights, self.queue, self.dead, self.made = 0, [], False, []  # made: (stamp, weights) per generate
        self.generate = self

    def remote(self, prompts, n, sampling, *, offset, policy_version):
        from records import Sample

        def run():
            self.made.append((policy_version, self.weights))
            return [Sample(prompt_index=offset + i, prompt_ids=[1], completion_ids=[2], sampler_logprobs=[-0.5],
                           text="x", finish_reason="length", policy_version=policy_version)
                    for i in range(len(prompts)) for _ in range(n)], 0.0
        call = _Call(self, run)
        self.queue.append(call)
        return call

    def run_until(self, call):
        import ray

        while call in self.queue:
            if self.dead:
                raise ray.exceptions.RayActorError()
            c = self.queue.pop(0)
            c.value = c.fn()
        return call.value


class _Actors:
    """rl.actors.Actors as the pipeline's Generation and Publication use it, with rollout.weight_sync=nccl."""

    weight_sync, trainers, model_dir, where = "nccl", ["trainer"], "model", "step"

    def __init__(self, workers: int):
        self.rollouts = [_Engine() for _ in range(workers)]
        self.restarts = 0

    def rollout_fault(self, e, j, method):
        import ray

        assert isinstance(e, ray.exceptions.RayActorError), e

    def replace_rollout(self, j, why, method, what):
        self.restarts += 1
        self.rollouts[j] = _Engine()


@pytest.fixture
def nccl_pipeline(monkeypatch):
    """(Generation, Publication, the trainer's version as a one-item list, the actors) for nccl at k = 1 with
    two fake engines; the stream (rl.weight_sync.push) sets every targeted engine's weights to the trainer's
    version, and refuses an engine with a generation still queued (a broadcast needs it idle)."""
    import ray

    from test_rl_loop import TINY

    from records.weights import SyncReport
    from rl import config as C
    from rl import weight_sync
    from rl.pipeline import Generation, Publication

    monkeypatch.setattr(ray, "get", lambda call: call.actor.run_until(call) if call.actor else call.value)
    monkeypatch.setattr(ray, "put", lambda value: _Call(None, None))
    trainer = [0]

    def push(mode, trainers, rollouts, **kw):
        assert mode == "nccl"
        for w in rollouts:
            assert not w.queue, "streamed into an engine with generations queued"
            w.weights = trainer[0]
        return SyncReport(seconds={"send": 0.0, "total": 0.0}, bytes=0, sent_bytes=0, chunks=1, format="checkpoint",
                          why={})

    monkeypatch.setattr(weight_sync, "push", push)
    cfg = C.load(TINY, ["rollout.num_workers=2", "rollout.n=2", "run.steps=5", "run.max_async_steps=1"])
    actors = _Actors(2)
    gen = Generation(cfg, actors)
    return gen, Publication(cfg, actors, gen), trainer, actors


def _step(gen, pub, trainer, s, steps=5, k=1, scoring=lambda: None):
    """rl/loop.py's run_step, its Scoring aside (`scoring` runs in its place): queue steps s .. s+k, pop step s,
    train, publish s + 1."""
    queued = gen.pending[-1].step + 1 if gen.pending else s
    for t in range(queued, min(s + k, steps - 1) + 1):
        gen.submit(t, None, ["p0", "p1", "p2"], {"seed": t})
    flight = gen.pop(s)
    scoring()
    trainer[0] += 1
    pub.trained()
    pub.publish(s + 1)
    return flight


def test_nccl_at_lag_1_streams_once_the_engines_are_idle_and_each_batch_is_made_by_its_version(nccl_pipeline):
    gen, pub, trainer, actors = nccl_pipeline
    flights = [_step(gen, pub, trainer, s) for s in range(5)]
    assert [f.version for f in flights] == [0, 0, 1, 2, 3]
    assert all(s.policy_version == f.version for f in flights for s in f.samples)
    for w in actors.rollouts:  # every generate ran on the weights of the version it was stamped with
        assert [stamp for stamp, _ in w.made] == [0, 0, 1, 2, 3] and all(a == b for a, b in w.made), w.made


def test_nccl_engine_killed_mid_queue_regenerates_a_generation_of_the_held_version_else_the_run_ends(nccl_pipeline):
    """A generation of the version the trainer still holds (queued behind its publication: evaluation, dynamic
    sampling's extra call) is streamed onto the replacement and made again; one of an older version cannot be
    (the trainer holds only its current weights), and the run ends saying so."""
    from rl.failures import RolloutFailed

    gen, pub, trainer, actors = nccl_pipeline
    _step(gen, pub, trainer, 0)
    actors.rollouts[1].dead = True
    samples = gen.generate(None, ["q0", "q1"], {"seed": 99})
    assert actors.restarts == 1 and actors.rollouts[1].made == [(1, 1)]
    assert [s.policy_version for s in samples] == [1] * 4
    _step(gen, pub, trainer, 1)

    def die():  # while step 3 is scored, with step 4's batch (version 2) queued on it
        actors.rollouts[0].dead = True

    with pytest.raises(RolloutFailed, match=r"needs policy version 2, which rollout.weight_sync=nccl no longer "
                                            r"holds .*--resume"):
        _step(gen, pub, trainer, 2, scoring=die)  # the publication of version 3 waits for that batch first
    assert actors.restarts == 2
