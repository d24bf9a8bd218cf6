"""The routing capture without an engine: the MoE ops' buffers (rollout/moe_method.py) and the host side that
files each step's rows under their request and position (rollout/capture.py), on a stand-in for vLLM's model
runner with the attributes the capture reads (input_batch.req_ids / num_reqs, positions) and a scheduler
output (num_scheduled_tokens). The engine-level tests are in test_rollout.py and test_rollout_serve.py.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_capture.py
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from rollout import capture, moe_method

L, K, E = 2, 3, 8


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    monkeypatch.setenv(moe_method.CAPTURE_ENV_VAR, "1")
    monkeypatch.setattr(moe_method, "_STORE", {})
    monkeypatch.setattr(moe_method, "_SLOTS", {})
    monkeypatch.setattr(capture, "_SESSION", capture._Session())
    yield


def _step(session, reqs: list[tuple[str, int, int]], gen: torch.Generator, write_layers=range(L)):
    """One engine step: reqs = (request id, first position, tokens) in batch order; the ops write random ids."""
    rows = sum(n for _, _, n in reqs)
    ids = {layer: torch.randint(0, E, (rows, K), generator=gen) for layer in range(L)}
    for layer in write_layers:
        moe_method.capture_routing(layer, ids[layer])
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=[r for r, _, _ in reqs] + ["stale"], num_reqs=len(reqs)),
        positions=torch.cat([torch.arange(p, p + n) for _, p, n in reqs] + [torch.tensor([99])]))
    out = types.SimpleNamespace(total_num_scheduled_tokens=rows, num_scheduled_tokens={r: n for r, _, n in reqs})
    session.after_step(runner, out)
    return torch.stack([ids[layer] for layer in range(L)], dim=1)  # [rows, L, K]


def test_steps_are_filed_under_their_request_and_position():
    """Two requests: a prefill step of both, then decode steps in another batch order (the runner reorders); each
    sequence's routing is its rows at its positions, and its last token (never computed) is -1."""
    gen = torch.Generator().manual_seed(0)
    s = capture._SESSION
    s.on = True
    want = {"0_7-abcd1234": torch.full((6, L, K), -1), "1_7-ef015678": torch.full((5, L, K), -1)}
    got = _step(s, [("0_7-abcd1234", 0, 3), ("1_7-ef015678", 0, 3)], gen)
    want["0_7-abcd1234"][:3], want["1_7-ef015678"][:3] = got[:3], got[3:]
    for p in (3, 4):
        got = _step(s, [("1_7-ef015678", p, 1), ("0_7-abcd1234", p, 1)], gen)
        want["1_7-ef015678"][p], want["0_7-abcd1234"][p] = got[0], got[1]
    taken = capture.routing_capture(None, "take", ())
    assert taken["layers"] == list(range(L)) and taken["steps"] == 3
    out = capture.split_requests(taken, ["0_7", "1_7"], [6, 5])
    for seq, key in zip(out, ("0_7-abcd1234", "1_7-ef015678")):
        assert seq.dtype == np.int16 and torch.equal(torch.from_numpy(seq).long(), want[key].long())
    # the session goes on with nothing filed: a next take is empty, the step after it is filed
    assert capture.routing_capture(None, "take", ())["requests"] == {}
    _step(s, [("2_7-00000000", 0, 2)], gen)
    assert list(capture.routing_capture(None, "take", ())["requests"]) == ["2_7-00000000"]


def test_a_row_no_op_wrote_this_step_raises():
    gen = torch.Generator().manual_seed(1)
    s = capture._SESSION
    s.on = True
    _step(s, [("a-00000000", 0, 4)], gen)
    _step(s, [("a-00000000", 4, 2)], gen, write_layers=[0])
    with pytest.raises(RuntimeError, match=r"layer 1 did not write row 0 of a 2-row step"):  # checked on landing
        capture.routing_capture(None, "take", ())


def test_steps_are_checked_and_filed_together_every_land_every_steps():
    """after_step only queues; every LAND_EVERY queued steps the landed ones are checked and filed as one batch
    (a code per step and request: the same request last in one step and first in the next is no jump)."""
    gen = torch.Generator().manual_seed(5)
    s = capture._SESSION
    s.on = True
    want = [_step(s, [("a-00000000", i, 1), ("b-00000000", 7, 1)], gen) for i in range(capture.LAND_EVERY - 1)]
    assert not s.landed and len(s.pending) == capture.LAND_EVERY - 1
    want.append(_step(s, [("b-00000000", 7, 1), ("a-00000000", capture.LAND_EVERY - 1, 1)], gen))
    assert len(s.landed) == 1 and not s.pending
    got = capture.routing_capture(None, "take", ())
    assert got["steps"] == capture.LAND_EVERY
    a, b = capture.split_requests(got, ["a", "b"], [capture.LAND_EVERY + 1, 9])
    assert torch.equal(torch.from_numpy(a[:capture.LAND_EVERY]).long(),
                       torch.stack([w[0] for w in want[:-1]] + [want[-1][1]]))
    assert torch.equal(torch.from_numpy(b[7]).long(), want[-1][0])  # position 7 recomputed: the last step's


def test_a_step_is_filed_once_its_copy_has_landed_and_take_waits_for_the_rest():
    """On CUDA a step's rows reach the host behind the step (an event marks their landing): after_step keeps
    only the steps whose copies have landed, in order, without waiting; take waits for every pending one.
    Stand-in events here (the CUDA path itself runs in the GPU rollout tests)."""

    class Landing:
        def __init__(self):
            self.done, self.waited = False, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited, self.done = True, True

    gen = torch.Generator().manual_seed(3)
    s = capture._SESSION
    s.on = True
    want = _step(s, [("a-00000000", 0, 2)], gen)  # CPU: no event, filed at the next landing
    first, second = Landing(), Landing()
    s.pending.append((["b-00000000"], [1], torch.full((1, L, K), 5, dtype=torch.int16), torch.tensor([0]), first))
    s.pending.append((["c-00000000"], [1], torch.full((1, L, K), 6, dtype=torch.int16), torch.tensor([0]), second))
    s._land(wait=False)
    assert [step[0] for step in s.landed] == [["a-00000000"]] and len(s.pending) == 2  # neither landed: no wait
    second.done = True
    s._land(wait=False)
    assert [step[0] for step in s.landed] == [["a-00000000"]] and len(s.pending) == 2  # in order: the second waits
    got = capture.routing_capture(None, "take", ())
    assert first.waited and not second.waited and not s.pending
    assert sorted(got["requests"]) == ["a-00000000", "b-00000000", "c-00000000"]
    b = capture.split_requests(got, ["b", "a"], [2, 3])
    assert b[0][0].tolist() == [[5] * K] * L and torch.equal(torch.from_numpy(b[1][:2]).long(), want.long())


def test_rows_that_do_not_lay_out_the_batch_raise():
    gen = torch.Generator().manual_seed(2)
    s = capture._SESSION
    s.on = True
    moe_method.capture_routing(0, torch.randint(0, E, (3, K), generator=gen))
    moe_method.capture_routing(1, torch.randint(0, E, (3, K), generator=gen))
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=["a", "b"], num_reqs=2),
                                   positions=torch.arange(3))
    out = types.SimpleNamespace(total_num_scheduled_tokens=3, num_scheduled_tokens={"a": 1, "c": 2})
    with pytest.raises(RuntimeError, match=r"do not lay out the step's 3 rows"):
        s.after_step(runner, out)


def test_matching_requests_to_samples_is_exact():
    """A key matching no captured request or several, or routing past a sequence's end, raises: never a shift."""
    row = (np.arange(2, dtype=np.int32).tobytes(), np.zeros((2, L, K), np.int16).tobytes(), [2, L, K])
    got = {"layers": list(range(L)), "requests": {"3-aaaaaaaa": row, "13-bbbbbbbb": row}}
    assert capture.split_requests(got, ["3", "13"], [3, 3])[0][2].tolist() == [[-1] * K] * L
    with pytest.raises(RuntimeError, match=r"request '1' matches 0 captured requests"):
        capture.split_requests(got, ["1"], [3])
    with pytest.raises(RuntimeError, match=r"request '3' has routing at positions 0..1, its sequence has 1 tokens"):
        capture.split_requests(got, ["3"], [1])
    twice = {"layers": got["layers"], "requests": {"3-aaaaaaaa": row, "3-cccccccc": row}}
    with pytest.raises(RuntimeError, match=r"request '3' matches 2 captured requests"):
        capture.split_requests(twice, ["3"], [3])


def test_buffers_off_without_the_variable_and_fixed_once_in_a_cuda_graph(monkeypatch):
    ids = torch.randint(0, E, (5, K), generator=torch.Generator().manual_seed(3))
    monkeypatch.delenv(moe_method.CAPTURE_ENV_VAR)
    moe_method.capture_routing(0, ids)
    assert moe_method._STORE == {}
    monkeypatch.setenv(moe_method.CAPTURE_ENV_VAR, "1")
    moe_method.capture_routing(0, ids)
    assert torch.equal(moe_method._STORE["ids"][moe_method._SLOTS[0], :5].long(), ids)
    monkeypatch.setitem(moe_method._IN_GRAPH, "seen", True)  # a graph holds the buffer: it may not be replaced
    with pytest.raises(RuntimeError, match=r"layer 0 saw 9999 rows .* during/after a CUDA-graph capture"):
        moe_method.capture_routing(0, torch.zeros(9999, K, dtype=torch.long))


def test_layers_in_any_write_order_and_requests_across_steps():
    """Slots follow the order layers first write (here 1 before 0), the rows come back by sorted layer; a request
    seen in several steps among others keeps its rows in step order, a recomputed position included (the
    later routing wins in split_requests); positions that jump inside one step's rows raise; a layer routing to
    another k than the layers before it raises."""
    gen = torch.Generator().manual_seed(4)
    s = capture._SESSION
    s.on = True
    steps = []
    for reqs in ([("a-00000000", 0, 2), ("b-00000000", 0, 1)], [("c-00000000", 0, 3), ("a-00000000", 2, 1)],
                 [("a-00000000", 2, 1), ("b-00000000", 1, 1)]):  # a's position 2 twice (a recompute)
        rows = sum(n for _, _, n in reqs)
        ids = {layer: torch.randint(0, E, (rows, K), generator=gen) for layer in (1, 0)}
        for layer in (1, 0):
            moe_method.capture_routing(layer, ids[layer])
        runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=[r for r, _, _ in reqs],
                                                                         num_reqs=len(reqs)),
                                       positions=torch.cat([torch.arange(p, p + n) for _, p, n in reqs]))
        s.after_step(runner, types.SimpleNamespace(total_num_scheduled_tokens=rows,
                                                   num_scheduled_tokens={r: n for r, _, n in reqs}))
        steps.append(torch.stack([ids[0], ids[1]], dim=1))
    assert moe_method._SLOTS == {1: 0, 0: 1}
    got = capture.routing_capture(None, "take", ())
    assert got["layers"] == [0, 1] and list(got["requests"]) == ["a-00000000", "b-00000000", "c-00000000"]
    a, b, c = capture.split_requests(got, ["a", "b", "c"], [4, 3, 4])
    assert torch.equal(torch.from_numpy(a[:2]).long(), steps[0][:2]) and torch.equal(
        torch.from_numpy(a[2]).long(), steps[2][0])  # the recompute's routing, not step 2's
    assert torch.equal(torch.from_numpy(b[:2]).long(), torch.stack([steps[0][2], steps[2][1]]))
    assert torch.equal(torch.from_numpy(c[:3]).long(), steps[1][:3]) and (c[3] == moe_method.UNWRITTEN).all()
    pos_a = np.frombuffer(got["requests"]["a-00000000"][0], dtype=np.int32)
    assert pos_a.tolist() == [0, 1, 2, 2]
    # positions that jump inside one step's rows
    for layer in (0, 1):
        moe_method.capture_routing(layer, torch.randint(0, E, (2, K), generator=gen))
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=["d-00000000"], num_reqs=1),
                                   positions=torch.tensor([0, 2]))
    s.after_step(runner, types.SimpleNamespace(total_num_scheduled_tokens=2, num_scheduled_tokens={"d-00000000": 2}))
    with pytest.raises(RuntimeError, match=r"request d-00000000's rows hold positions \[0, 2\], expected consecutive"):
        capture.routing_capture(None, "take", ())
    with pytest.raises(RuntimeError, match=r"layer 2 routes to k=2 experts .* the layers before it to k=3"):
        moe_method.capture_routing(2, torch.zeros(1, 2, dtype=torch.long))


def test_one_layer_read_is_a_copy_the_unwritten_marking_leaves_alone():
    """With a single layer the buffer's [rows, 1, k] view is already contiguous: the read must still copy, or the
    marking that follows it would clear the rows it returned (bench_replay's 1-layer run caught it)."""
    ids = torch.randint(0, E, (5, K), generator=torch.Generator().manual_seed(5))
    moe_method.capture_routing(0, ids)
    layers, got = moe_method.read_routing(5)
    assert layers == [0] and torch.equal(got[:, 0].long(), ids)
    assert (moe_method._STORE["ids"][0, :5] == moe_method.UNWRITTEN).all()


def test_a_request_with_no_token_scheduled_is_not_filed():
    """vLLM's batch can hold a request the step scheduled nothing for (absent from num_scheduled_tokens): its
    count is 0, it owns no row, and a take without any of its rows does not list it."""
    s = capture._SESSION
    s.on = True
    ids = {layer: torch.randint(0, E, (2, K), generator=torch.Generator().manual_seed(6)) for layer in range(L)}
    for layer in range(L):
        moe_method.capture_routing(layer, ids[layer])
    batch = types.SimpleNamespace(req_ids=["w-00000000", "a-00000000"], num_reqs=2)
    runner = types.SimpleNamespace(input_batch=batch, positions=torch.arange(2))
    s.after_step(runner, types.SimpleNamespace(total_num_scheduled_tokens=2, num_scheduled_tokens={"a-00000000": 2}))
    got = capture.routing_capture(None, "take", ())
    assert list(got["requests"]) == ["a-00000000"]
    assert torch.equal(torch.from_numpy(capture.split_requests(got, ["a"], [3])[0][:2]).long(),
                       torch.stack([ids[0], ids[1]], dim=1))
