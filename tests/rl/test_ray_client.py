"""rl.weight_sync.RayClient under rollout.sync's checks, over real Ray actors: an engine's refusal
reaches the trainer as a refusal, and the abort reaches every engine after its plan-and-start call
(Ray runs one caller's calls to an actor in order), so none is left inside an unfinished update.

    .venv/bin/python -m pytest -q tests/rl/test_ray_client.py
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # Ray


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


class _Trainer:
    """What rollout.sync.checked_and_started asks of a one-rank trainer."""

    rank = 0

    def __init__(self, bad=()):
        self.bad = list(bad)

    def weight_metadata(self, dtype):
        return [("model.embed_tokens.weight", [8, 4], "bfloat16")]

    def nonfinite_weights(self, dtype):
        return self.bad


def _engines(ray, behaviours):
    """One actor per (refuse, plan seconds), with RolloutHost's typed endpoint, recording its events."""

    class Engine:
        def __init__(self, refuse, seconds):
            self.refuse, self.seconds, self.updating, self.events = refuse, seconds, False, []

        def plan_weight_update(self, metas, start=False):
            import time

            from records.weights import EngineAnswer

            time.sleep(self.seconds)
            if self.refuse:
                self.events.append("refused")
                raise ValueError("tensor 'model.embed_tokens.weight': planned [9, 4], got [8, 4]")
            self.updating = start
            self.events.append("started")
            return EngineAnswer(format="kernel", layout=[], why={}, bytes=64)

        def abort_weight_update(self, why):
            self.events.append(f"aborted: {why}" if self.updating else "abort: nothing started")
            self.updating = False

        def state(self):
            return self.updating, self.events

    actor = ray.remote(Engine).options(num_cpus=0)
    return [actor.remote(refuse, seconds) for refuse, seconds in behaviours]


@pytest.mark.parametrize("case", ["engine refuses", "trainer refuses"])
def test_a_refusal_aborts_every_engines_started_update(ray_local, case):
    from rl.weight_sync import RayClient
    from rollout.sync import Clock, checked_and_started

    ray = ray_local
    # a fast engine that refuses beside a slow one that starts: the refusal returns first
    hosts = _engines(ray, [(case == "engine refuses", 0.0), (False, 1.0)])
    trainer = _Trainer(bad=["model.layers.0.mlp.gate.weight"] if case == "trainer refuses" else ())
    match = "planned \\[9, 4\\]" if case == "engine refuses" else "hold NaN/Inf"
    with pytest.raises(ValueError, match=match):
        checked_and_started(trainer, RayClient(hosts), "bfloat16", Clock(), lambda plans, metas: {"plans": plans})
    states = ray.get([h.state.remote() for h in hosts])
    assert not any(updating for updating, _ in states), states
    slow_events = states[1][1]
    assert slow_events[0] == "started" and slow_events[1].startswith("aborted: the trainer refused the update"), states
    assert len(slow_events) == 2, states


def test_accepted_plans_reach_the_trainer_and_nothing_is_aborted(ray_local):
    from rl.weight_sync import RayClient
    from rollout.sync import Clock, checked_and_started

    ray = ray_local
    hosts = _engines(ray, [(False, 0.0), (False, 0.2)])
    decision = checked_and_started(_Trainer(), RayClient(hosts), "bfloat16", Clock(),
                                   lambda plans, metas: {"plans": plans, "metas": metas})
    assert [p.format for p in decision["plans"]] == ["kernel", "kernel"]
    assert decision["metas"] == _Trainer().weight_metadata("bfloat16")
    assert ray.get([h.state.remote() for h in hosts]) == [(True, ["started"]), (True, ["started"])]
