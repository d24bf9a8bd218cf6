"""Multi-turn episodes at any lag k = run.max_async_steps, the driver's half (rl/loop.py, rl/pipeline.py,
rl/episode_step.py), in pure Python: the real Loop (its run, steps, evaluation, checkpoints and resume) over
stand-in actors.

    .venv/bin/python -m pytest -q tests/rl/test_episode_pipeline.py

The stand-ins keep Ray's actor semantics where the schedule depends on them: each rollout worker runs the calls
made to it one at a time, in the order they were made, in a thread of its own (`Engine`), so a flight of episodes
in its driver thread really runs while the driver scores, trains and publishes; its weights are a policy version,
set by the `take_weights` queued behind its generate calls. Each generate call takes `delay` seconds and records
the version it was stamped with, the weights it ran on and its sampling seed (which names the draw and the turn).
An engine's output is a function of its context, its seed and its weights only. The trainer counts its steps
(its weights are the version it publishes) and writes its count into a checkpoint. ray.get / ray.wait / ray.put
are replaced by their equivalents on these futures (no Ray starts). The end-to-end runs of episodes in flight
(vLLM, Ray, the FSDP2 trainer) are tests/rl/test_rl_faults.py's.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import threading
import time
import types

import pytest

from test_rl_loop import TINY
from rl import config as C
from rl.metrics import read_jsonl

TIMING = ("time/", "throughput/", "eval/time_s")
STEPS = 6
# The digit task's string prompts as episodes of up to three assistant turns: the environment below asks back
# "Sure?" after each; 3 prompts x 2 samples over two rollout workers (an uneven split); evaluation every step.
BASE = ["rollout.num_workers=2", "rollout.n=2", "run.prompts_per_step=3", f"run.steps={STEPS}", "rollout.max_tokens=8",
        "rollout.max_model_len=128", "trainer.max_seq_len=128", "run.progress=false", "run.samples_every=1",
        "env.environment=test_episode_pipeline:AskAgain", "env.max_turns=3", "eval.every=1", "eval.data.task=digit",
        "eval.data.task_size=4", "eval.n=2", "trainer.checkpoint_every=0"]
TURN = 1_000_003  # rl.episode_step.TURN_SEED_STRIDE, written out: the test's own reading of a seed
CALL = 1_000_000_007  # rl.pipeline.Scoring.prompts: the seed stride of dynamic sampling's extra calls
EVAL = 500_000_000  # rl.evaluation.EVAL_SEED_OFFSET


class AskAgain:
    """A verifiers-shape environment: asks back until the assistant has spoken 3 times."""

    def is_completed(self, messages, state, **kwargs):
        return state["turn"] >= 3

    def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Sure?"}]


def draw_of(seed: int, offset: int) -> tuple:
    """(step, call, turn) of a training draw's generate call, ("eval",) for the evaluation's, from its seed
    (run.seed 0: the step's seed + call x CALL + turn x TURN + the episode's index)."""
    s = seed - offset
    if EVAL <= s < CALL:
        return ("eval",)
    call, rest = divmod(s, CALL)
    turn, step = divmod(rest, TURN)
    return step, call, turn


class Engine:
    """A rollout worker (module docstring); `calls`: (draw_of, stamped version, weights) per generate call."""

    def __init__(self, tok, delay: float, die_at: int | None = None):
        self.tok, self.delay, self.die_at = tok, delay, die_at  # die_at: dies at its die_at-th training call
        self.thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.weights, self.calls, self.dead = 0, [], False
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.generate = types.SimpleNamespace(remote=lambda *a, **kw: self.thread.submit(self._generate, *a, **kw))
        self.take_weights = types.SimpleNamespace(remote=lambda pub: self.thread.submit(self._take, pub))
        self.sleep = types.SimpleNamespace(remote=lambda level: self.thread.submit(
            self.calls.append, (("sleep",), level, self.weights)))

    def _take(self, pub):
        self.weights = pub.version

    def _generate(self, prompts, n, sampling, offset, policy_version, max_tokens=None):
        import ray

        from records import Sample

        key = draw_of(sampling["seed"], offset)
        self.dead = self.dead or self.die_at == 1 + sum(c[0][0] != "eval" for c in self.calls) and key[0] != "eval"
        if self.dead:
            raise ray.exceptions.RayActorError()
        time.sleep(self.delay)
        self.calls.append((key if key[0] == "eval" else key[:2], policy_version, self.weights))
        out = []
        for i, ctx in enumerate(prompts):
            rng = random.Random(f"{sampling['seed'] + i} {self.weights} {len(ctx)}")
            ids = self.tok(f"{rng.randrange(10)} ok", add_special_tokens=False)["input_ids"] + [self.eos]
            ids = ids[:(max_tokens or [sampling["max_tokens"]] * len(prompts))[i]]
            out += [Sample(prompt_index=offset + i, prompt_ids=list(ctx), completion_ids=ids,
                           sampler_logprobs=[-rng.uniform(0.01, 5.0) for _ in ids],
                           text=self.tok.decode(ids, skip_special_tokens=True),
                           finish_reason="stop" if ids[-1] == self.eos else "length", policy_version=policy_version)
                    for _ in range(n)]
        return out, self.delay


class Trainer:
    """A trainer rank: its weights are the number of train_steps it made (a policy version)."""

    def __init__(self, on_step=None):
        self.version, self.on_step = 0, on_step
        for name in ("train_step", "publish_weights", "save_checkpoint", "load_checkpoint"):
            fn = getattr(self, "_" + name)
            setattr(self, name, types.SimpleNamespace(remote=lambda *a, fn=fn: done(fn(*a))))

    def _train_step(self, batch):
        self.version += 1
        if self.on_step:
            self.on_step(self.version)
        return {"loss": 0.5 / self.version, "step": self.version}

    def _publish_weights(self, send, engines, version):
        assert version == self.version, (version, self.version)
        return types.SimpleNamespace(mode="files", version=version)

    def _save_checkpoint(self, path):
        from pathlib import Path

        Path(path).mkdir(parents=True)
        (Path(path) / "trainer.json").write_text(json.dumps({"version": self.version}))

    def _load_checkpoint(self, path):
        from pathlib import Path

        self.version = json.loads((Path(path) / "trainer.json").read_text())["version"]


def done(value) -> cf.Future:
    f = cf.Future()
    f.set_result(value)
    return f


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rl.make_model import make_model

    return make_model(tmp_path_factory.mktemp("episode_pipeline") / "m", layers=1, seed=0)


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.get / ray.wait / ray.put on the stand-ins' futures; trainer.checkpoint.verify of their checkpoints."""
    import ray

    import trainer.checkpoint

    def wait(refs, num_returns=1):
        finished, _ = cf.wait(refs, return_when=cf.FIRST_COMPLETED)
        first = next(r for r in refs if r in finished)
        return [first], [r for r in refs if r is not first]

    monkeypatch.setattr(ray, "get", lambda x, timeout=None: [r.result() for r in x] if isinstance(x, list)
                        else x.result())
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "put", lambda value: done(value))
    monkeypatch.setattr(trainer.checkpoint, "verify", lambda path: path)


def run(model_dir, run_dir, *over, start=0, delay=0.0, stop_at=None, engines=None):
    """The real rl.loop.Loop on the stand-ins, from `start` (> 0: --resume); stop_at: Ctrl-C during that train step.
    Returns (exit code, the engines, metrics.jsonl, samples.jsonl)."""
    from transformers import AutoTokenizer

    from rl.loop import Loop

    cfg = C.load(TINY, [*BASE, *over, f"run.out_dir={run_dir}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    loop = Loop(cfg, run_dir, start, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    engines = engines or [Engine(tok, delay) for _ in range(cfg.rollout.num_workers)]

    def stop(version):
        if version == stop_at:
            loop.stop_requested = True

    def start_actors():
        loop.actors.rollouts, loop.actors.trainers = engines, [Trainer(stop)]
        loop.actors.pids = {"trainer": [0], "rollout": [0] * len(engines)}

    loop.actors.start = start_actors
    try:
        code = loop.run()
    finally:
        if loop.scoring.episodes is not None:
            loop.scoring.episodes.close()
    return code, engines, read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "samples.jsonl")


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_every_turn_of_a_batch_is_generated_by_its_version_and_the_lag_is_single_turns(fake_ray, model_dir, tmp_path,
                                                                                       k):
    """The batch trained at step t (1-based) is episodes of version max(0, t-1-k), as single-turn async's; every
    generate call of every turn ran on the weights it was stamped with, although the flights run in their thread
    while the driver trains and publishes (Publication.publish waits for them first: without that wait, a flight's
    later turns ran on the next version's weights and this failed); each evaluation's episodes are of the version
    it reports."""
    code, engines, metrics, _ = run(model_dir, tmp_path / "run", f"run.max_async_steps={k}", delay=0.01)
    assert code == 0
    train = [r for r in metrics if r["step"] > 0]
    assert [r["async/policy_version"] for r in train] == [max(0, t - 1 - k) for t in range(1, STEPS + 1)]
    assert [r["async/lag"] for r in train] == [min(t - 1, k) for t in range(1, STEPS + 1)]
    assert [r["eval/policy_version"] for r in metrics] == list(range(STEPS + 1))
    assert all(r["env/turns_mean"] == 3.0 for r in train), [r["env/turns_mean"] for r in train]
    assert all(r["time/weight_sync/episodes_wait_s"] >= 0.0 for r in train)  # the publication's wait, reported
    for w in engines:
        assert len(w.calls) == STEPS * 3 + (STEPS + 1) * 3  # 3 turns per training flight and per evaluation
        assert [c for c in w.calls if c[1] != c[2]] == [], w.calls  # (draw, stamped version, weights)
        steps = [key[0] for key, *_ in w.calls if key[0] != "eval"]
        assert steps == sorted(steps)  # the flights in step order, each flight's turns together


def test_flights_run_one_after_another_and_the_run_does_not_depend_on_timing(fake_ray, model_dir, tmp_path):
    """k = 2 with dynamic sampling: every draw's turns (a step's flight, an extra draw, an evaluation) reach each
    worker together, one draw after another: the extra draws of step s queue behind the flight in flight (step
    s + 2) and run by the version last published, as single-turn's extra calls. (With two threads for the episodes,
    or the extra draws run from the driver's thread, draws interleaved on the workers and this failed.) Two runs
    whose engines take 0 and 20 ms a call write the same metrics and samples, timings aside."""
    over = ("run.max_async_steps=2", "data.dynamic_sampling=true", "data.max_extra_generates=2")
    slow = run(model_dir, tmp_path / "slow", *over, delay=0.02)
    fast = run(model_dir, tmp_path / "fast", *over, delay=0.0)
    assert slow[0] == fast[0] == 0
    assert without_timing(slow[2]) == without_timing(fast[2])
    assert slow[3] == fast[3]
    train = [r for r in slow[2] if r["step"] > 0]
    assert sum(r["dynamic_sampling/generate_calls"] - 1 for r in train) >= 2, train  # extra draws happened
    for w in slow[1]:
        draws = [key if key[0] != "eval" else ("eval", weights) for key, _, weights in w.calls]
        runs = [d for i, d in enumerate(draws) if i == 0 or d != draws[i - 1]]
        assert len(runs) == len(set(runs)), runs  # no draw's turns interrupted by another's
        assert [c for c in w.calls if c[1] != c[2]] == []
        for step, call in {d for d in draws if d[0] != "eval" and d[1] > 0}:  # step s's extra draws: version s
            assert {v for key, v, _ in w.calls if key == (step, call)} == {step}
            if step + 2 < STEPS:  # behind the flight of step s + 2, queued before it
                assert draws.index((step + 2, 0)) < draws.index((step, call)), draws


@pytest.mark.parametrize("k", [1, 2])
def test_a_run_resumed_with_episodes_in_flight_equals_the_uninterrupted_run(fake_ray, model_dir, tmp_path, k):
    """Checkpoint every 2 steps; the second run is stopped (Ctrl-C) in step 2 and resumed. The episodes in flight at
    the checkpoint are scored there, in both runs, and inflight.json holds what Scoring made of them; the resumed
    run trains on exactly those (it generates none of them again) and writes the same metrics and samples. (With
    the checkpoint keeping the episodes' samples unscored, as a single-turn batch's, this failed.)"""
    over = (f"run.max_async_steps={k}", "trainer.checkpoint_every=2")
    whole = run(model_dir, tmp_path / "whole", *over)
    stopped = run(model_dir, tmp_path / "resumed", *over, stop_at=2)
    assert whole[0] == 0 and stopped[0] == 130
    inflight = json.loads((tmp_path / "resumed" / "checkpoints" / "step_000002" / "inflight.json").read_text())
    assert [d["step"] for d in inflight] == list(range(2, 2 + k)) and all("scored" in d for d in inflight)
    resumed = run(model_dir, tmp_path / "resumed", *over, start=2)
    assert resumed[0] == 0
    assert without_timing(resumed[2]) == without_timing(whole[2])
    assert resumed[3] == whole[3]
    regenerated = {key[0] for w in resumed[1] for key, *_ in w.calls if key[0] != "eval"}
    assert regenerated == set(range(2 + k, STEPS)), regenerated


def test_a_rollout_worker_that_dies_during_a_flight_in_flight_ends_the_run(fake_ray, model_dir, tmp_path):
    """k = 1: a worker dies in the second turn of step 4's episodes (0-based flight 3), which run in their thread
    while the driver trains step 3; the driver gets the error where it waits for that flight (the publication of
    version 3) and the run ends naming the worker, as a death during a k = 0 step's episodes does (rl/loop.py
    reports it; --resume continues from the last checkpoint). The episodes' thread is gone after the run (with
    EpisodeStep.close not shutting it down, it stayed and this failed)."""
    from transformers import AutoTokenizer

    from rl.failures import ActorError

    tok = AutoTokenizer.from_pretrained(model_dir)
    engines = [Engine(tok, 0.01), Engine(tok, 0.01, die_at=3 * 3 + 2)]
    with pytest.raises(ActorError) as e:
        run(model_dir, tmp_path / "run", "run.max_async_steps=1", engines=engines)
    assert (e.value.actor, e.value.method, e.value.where) == ("RolloutWorker 1", "generate", "step 3"), e.value
    # Its last call that ran is flight 3's first turn; the turn it died in was the last any worker got.
    engines[0].thread.shutdown(wait=True)
    assert engines[1].calls[-1][0] == engines[0].calls[-1][0] == (3, 0)
    assert len(engines[0].calls) == len(engines[1].calls) + 1
    for _ in range(100):
        if not any(t.name.startswith("episodes") for t in threading.enumerate()):
            break
        time.sleep(0.01)
    assert not any(t.name.startswith("episodes") for t in threading.enumerate())


def test_close_stops_a_flight_before_its_next_turn(fake_ray, model_dir, tmp_path):
    """EpisodeStep.close (the run ends): the flight running in the episodes' thread sends no further turn and ends
    with Stopped; a flight queued behind it never starts. (Without the check, the flight ran its 3 turns.)"""
    from transformers import AutoTokenizer

    from rl.episode_step import EpisodeStep, Stopped
    from rl.pipeline import Generation, Scoring

    cfg = C.load(TINY, [*BASE, "run.max_async_steps=1"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    step = EpisodeStep(cfg, tok, model_dir)
    engines = [Engine(tok, 0.05), Engine(tok, 0.05)]
    gen = Generation(cfg, types.SimpleNamespace(rollouts=engines, get=lambda refs, names, method: [r.result()
                                                                                                   for r in refs]))
    from rl.data import PromptSource

    scoring = Scoring(cfg, PromptSource.from_config(cfg.data, seed=0), None, None, step)
    first = step.submit(gen, 0, *scoring.prompts(0))
    second = step.submit(gen, 1, *scoring.prompts(1))
    time.sleep(0.02)  # the first flight's first turn is on the engines
    step.close()
    with pytest.raises(Stopped):
        gen.collect(first)
    assert second.future.cancelled()
    assert max(len(w.calls) for w in engines) == 1


def test_an_engine_sleeps_only_once_the_episodes_in_flight_are_done(fake_ray, model_dir, tmp_path, caplog):
    """rollout.sleep_level (CUDA only: set here past the config's CPU refusal) at k = 1: Training.step waits for the
    flight of episodes in flight before it queues the engines' sleep, so no turn of it finds an engine asleep (with
    the weights gone at level 2). Without that wait, the sleep landed between two turns and this failed."""
    import dataclasses

    from transformers import AutoTokenizer

    from rl.actors import Actors
    from rl.episode_step import EpisodeStep
    from rl.pipeline import Generation, Scoring, Training
    from rl.data import PromptSource

    cfg = C.load(TINY, [*BASE, "run.max_async_steps=1"])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sleep_level=1))
    tok = AutoTokenizer.from_pretrained(model_dir)
    actors = Actors(cfg, tmp_path, model_dir, "files")
    actors.rollouts, actors.trainers = [Engine(tok, 0.02), Engine(tok, 0.02)], [Trainer()]
    gen = Generation(cfg, actors)
    step = EpisodeStep(cfg, tok, model_dir)
    try:
        scoring = Scoring(cfg, PromptSource.from_config(cfg.data, seed=0), None, None, step)
        step.submit(gen, 1, *scoring.prompts(1))
        Training(cfg, actors, gen).step(batch=None)  # the stand-in trainer takes any batch
    finally:
        step.close()
    for w in actors.rollouts:
        assert [key for key, *_ in w.calls] == [(1, 0)] * 3 + [("sleep",)], w.calls
