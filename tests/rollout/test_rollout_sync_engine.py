"""The engine's update object (rollout/sync_engine.py) alone, no engine: every step from every state,
the illegal ones refused with the state unchanged, the legal ones landing where the protocol says.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_sync_engine.py
"""

from __future__ import annotations

import pytest

from rollout.sync_engine import EnginePlan, EngineUpdate, IllegalTransition, State

PLAN = EnginePlan(format="experts", tensors={"a.w13_weight": ((2, 4, 3), "bfloat16"), "b.weight": ((3,), "bfloat16")},
                  kernel_names={"a.w13_weight": "a.routed.w13_weight"}, layout=None, why={})
KERNEL_CHUNK = [("a.w13_weight", [2, 4, 3], "bfloat16")]
REST_CHUNK = [("b.weight", [3], "bfloat16")]


def _in(state: str) -> EngineUpdate:
    """An update brought into `state` through legal steps only."""
    u = EngineUpdate()
    if state == "idle":
        return u
    u.planned(PLAN)
    if state == "planned":
        return u
    u.started()
    if state == "streaming":
        return u
    if state == "streaming, session open":
        u.receive(KERNEL_CHUNK)
        u.session_opened()
        return u
    u.receive(KERNEL_CHUNK)
    if state == "broken":
        u.fail("a chunk failed")
        return u
    u.receive(REST_CHUNK)
    u.complete()
    assert state == "done"
    return u


STATES = ["idle", "planned", "streaming", "streaming, session open", "done", "broken"]

# Written from the protocol (rollout/worker.py's streamed updates), not read from the module: each step
# and the states it may be taken from. abort and discard are legal everywhere (see below).
STEPS = {
    "plan": (lambda u: u.planned(PLAN), {"idle", "planned", "done", "broken"}),
    "start": (lambda u: u.started(), {"planned"}),
    "receive": (lambda u: u.receive(REST_CHUNK), {"streaming", "streaming, session open"}),
    "open session": (lambda u: u.session_opened(), {"streaming"}),
    "finish": (lambda u: u.missing(), {"streaming", "streaming, session open"}),
    "fail": (lambda u: u.fail("x"), {"streaming", "streaming, session open"}),
    "files update": (lambda u: u.applied_whole(), {"idle", "planned", "done", "broken"}),
}


def _snapshot(u: EngineUpdate) -> tuple:
    return (u.state, u.plan, set(u.received), u.session_open, u.broken)


BROKEN = "broken"  # the snapshot's `broken` holds a reason (its words are the code's)
BOTH = {"a.w13_weight", "b.weight"}

# Where each legal step lands, written from the protocol (module docstring of rollout/sync_engine.py):
# (step, state) -> (what the step returns, (state, plan, received, session open, broken) after it).
# A plan outlives a files update (it was not started), a broken reason outlives a new plan, and what
# arrived is counted only while a stream runs.
LANDS = {
    ("plan", "idle"): (None, (State.PLANNED, PLAN, set(), False, None)),
    ("plan", "planned"): (None, (State.PLANNED, PLAN, set(), False, None)),
    ("plan", "done"): (None, (State.PLANNED, PLAN, set(), False, None)),
    ("plan", "broken"): (None, (State.PLANNED, PLAN, set(), False, BROKEN)),
    ("start", "planned"): (None, (State.STREAMING, PLAN, set(), False, None)),
    ("receive", "streaming"): (False, (State.STREAMING, PLAN, {"b.weight"}, False, None)),
    ("receive", "streaming, session open"): (False, (State.STREAMING, PLAN, BOTH, True, None)),
    ("open session", "streaming"): (None, (State.STREAMING, PLAN, set(), True, None)),
    ("finish", "streaming"): (sorted(BOTH), (State.STREAMING, PLAN, set(), False, None)),
    ("finish", "streaming, session open"): (["b.weight"], (State.STREAMING, PLAN, {"a.w13_weight"}, True, None)),
    ("fail", "streaming"): (False, (State.BROKEN, None, set(), False, BROKEN)),
    ("fail", "streaming, session open"): (True, (State.BROKEN, None, set(), False, BROKEN)),
    ("files update", "idle"): (None, (State.DONE, None, set(), False, None)),
    ("files update", "planned"): (None, (State.PLANNED, PLAN, set(), False, None)),
    ("files update", "done"): (None, (State.DONE, None, set(), False, None)),
    ("files update", "broken"): (None, (State.DONE, None, set(), False, None)),
}


def test_the_landing_table_covers_exactly_the_legal_steps():
    assert set(LANDS) == {(step, state) for step, (_, legal) in STEPS.items() for state in legal}


def _landed(u: EngineUpdate) -> tuple:
    state, plan, received, session, broken = _snapshot(u)
    return state, plan, received, session, BROKEN if broken is not None else None


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("step", list(STEPS))
def test_every_step_lands_where_the_protocol_says_or_is_refused_changing_nothing(state, step):
    do, legal = STEPS[step]
    u = _in(state)
    before = _snapshot(u)
    if state in legal:
        returned, after = LANDS[step, state]
        assert do(u) == returned
        assert _landed(u) == after
        # what the engine may do there: sample unless broken or mid-stream
        assert (u.refusal("sample") is None) is (after[0] is not State.STREAMING and after[4] is None)
        return
    with pytest.raises(IllegalTransition, match=f"the engine's update is {u.state.value}"):
        do(u)
    assert _snapshot(u) == before


def test_a_plan_made_before_a_files_update_still_streams_after_it():
    """The sequence the landing table guards: a files update between an engine's plan and its start
    (rl/loop.py restarting a worker with files while the trainer planned) keeps the plan, so the
    streamed update that follows is checked against it and completes."""
    u = _in("planned")
    u.applied_whole()
    u.started()
    assert u.receive(KERNEL_CHUNK) is True and u.receive(REST_CHUNK) is False
    assert u.complete() == {"tensors": 2, "seconds": {}} and u.state is State.DONE


def test_complete_is_refused_until_every_planned_tensor_arrived():
    u = _in("streaming")
    u.receive(KERNEL_CHUNK)
    with pytest.raises(IllegalTransition, match="1 planned tensor"):
        u.complete()
    assert u.state is State.STREAMING
    u.receive(REST_CHUNK)
    assert u.complete()["tensors"] == 2 and u.state is State.DONE and u.plan is None


@pytest.mark.parametrize("chunks, match", [
    ([[("nope", [1], "bfloat16")]], "not in the planned update"),
    ([REST_CHUNK, REST_CHUNK], "arrived twice"),
    ([[("b.weight", [4], "bfloat16")]], r"planned \[3\] bfloat16, got \[4\] bfloat16"),
    ([[("b.weight", [3], "float32")]], "got .* float32"),
    ([KERNEL_CHUNK + REST_CHUNK], "mixes kernel-format"),
])
def test_a_chunk_out_of_the_plan_is_refused_naming_the_tensor(chunks, match):
    u = _in("streaming")
    with pytest.raises(ValueError, match=match):
        for c in chunks:
            u.receive(c)


def test_kernel_chunks_after_the_session_opened_are_refused():
    u = _in("streaming")
    u.receive(REST_CHUNK)
    u.session_opened()
    with pytest.raises(ValueError, match="must come first"):
        u.receive(KERNEL_CHUNK)


@pytest.mark.parametrize("state, after, broken", [
    ("idle", State.IDLE, False),
    ("planned", State.PLANNED, False),  # nothing started: the plan stays
    ("done", State.DONE, False),
    ("broken", State.BROKEN, True),
    ("streaming", State.IDLE, False),  # no chunk arrived: back where it was, serving its old weights
    ("streaming, session open", State.BROKEN, True),  # a chunk arrived: a mix of old and new
])
def test_abort_is_legal_everywhere_and_breaks_only_an_update_that_received_a_chunk(state, after, broken):
    u = _in(state)
    session = u.session_open
    assert u.aborted("the trainer refused") is session  # the caller must end vLLM's open session
    assert u.state is after and (u.broken is not None) is broken
    assert (u.refusal("sample") is None) is not broken


def test_broken_outlives_a_new_plan_until_an_update_completes():
    u = _in("broken")
    u.planned(PLAN)
    assert u.state is State.PLANNED and "refusing to sample: a streamed weight update failed" in u.refusal("sample")
    u.started()
    u.aborted("the trainer refused")  # nothing arrived: back to broken, not to a healthy rest
    assert u.state is State.BROKEN and u.refusal("sample")
    u.planned(PLAN)
    u.started()
    assert "in progress" not in u.refusal("sample")  # the broken reason is named first
    u.receive(KERNEL_CHUNK)
    u.receive(REST_CHUNK)
    u.complete()
    assert u.state is State.DONE and u.broken is None and u.refusal("sample") is None


def test_a_discarded_engine_refuses_until_a_whole_update_lands():
    u = _in("done")
    u.discarded("slept at level 2")
    assert u.state is State.BROKEN and u.refusal("score") == "refusing to score: slept at level 2"
    u.applied_whole()
    assert u.state is State.DONE and u.refusal("score") is None
