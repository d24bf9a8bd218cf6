"""Routing capture, host side, in vLLM's worker process: the experts every token was routed to while the
engine generated it (prefill and decode steps alike), per request (rollout routing replay,
docs/ROUTING_REPLAY.md).

The MoE ops write each step's routing into one static buffer, a slot per layer, row r = the r-th token of the
step's batch (rollout/moe_method.py: capture_routing). While a session is on, a wrapper around the model runner's
`execute_model` queues a copy of the step's rows to the host right after the step was launched (on CUDA
behind it on the stream, into pinned memory, without waiting: the next step is prepared meanwhile, as
vLLM's asynchronous scheduling intends; a constant number of operations per step, whatever its numbers of
layers and requests); `take` files every landed step's rows under the request they belong to, at the token's
position in its sequence, from the runner's own view of each step it ran:
`input_batch.req_ids` (the batch's request order), the scheduler's `num_scheduled_tokens` per request
(the rows are laid out request after request in that order) and the runner's `positions` (each row's
position in its sequence). A token computed twice (a preempted request recomputed) keeps its last routing;
a token never computed (a prefix-cache hit) has none (-1 rows, the trainer routes it itself).

Reached through the worker extension (rollout.extension.megamoe_routing_capture):
    "check"  -> {"blockers": [...]}    why this engine's MoE layers cannot report their experts
    "start"  -> {}                     forget earlier requests, file every following step's rows
    "take"   -> {"layers": [...], "requests": {vLLM request id: (positions bytes int32, ids bytes int16,
                 shape [tokens, L, k])}, "steps": n, "read_s": seconds spent reading} since the last
                start or take; the session goes on with nothing filed
    "take_json" -> the same with {"positions": [...], "ids": nested lists} per request
"""

from __future__ import annotations

import time
from collections import deque
from itertools import chain, repeat

import numpy as np
import torch

from rollout import moe_method

LAND_EVERY = 16
"""Steps queued before the landed ones are checked and filed together: fewer host calls per step, and a bound on
the pinned host memory the queued copies hold (LAND_EVERY steps' rows, plus those still in flight)."""


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`: on CUDA queued on the current stream into pinned memory (no wait), else a clone."""
    if not t.is_cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _Session:
    def __init__(self):
        self.on = False
        self.layers: list[int] | None = None
        self.pending: deque = deque()  # steps whose rows are on their way to the host, oldest first
        # steps on the host, in order: (req_ids, counts, positions, ids)
        self.landed: list[tuple[list[str], np.ndarray, np.ndarray, np.ndarray]] = []
        self.steps = 0
        self.read_s = 0.0

    def after_step(self, runner, scheduler_output) -> None:
        """Queue the copy of the step's rows and positions to the host (on CUDA behind the step, without waiting
        for it: vLLM's asynchronous scheduling keeps preparing the next step meanwhile). A constant number of
        calls per step, whatever its number of requests (the rows are split into requests once, in `take`);
        every LAND_EVERY steps the landed ones are checked and filed together (_land)."""
        rows = int(scheduler_output.total_num_scheduled_tokens)
        if rows == 0:
            return
        t0 = time.perf_counter()
        batch = runner.input_batch
        req_ids = list(batch.req_ids[:batch.num_reqs])
        scheduled = scheduler_output.num_scheduled_tokens
        counts = list(map(scheduled.get, req_ids, repeat(0)))
        # every scheduled request in the batch (vLLM schedules at least one token for each it names)
        if sum(counts) != rows or len(scheduled) != len(req_ids) - counts.count(0):
            raise RuntimeError(f"routing capture: the batch's requests {req_ids} with {counts} scheduled tokens do "
                               f"not lay out the step's {rows} rows ({dict(scheduled)})")
        layers, ids = moe_method.read_routing(rows)
        if self.layers is None:
            self.layers = layers
        elif layers != self.layers:
            raise RuntimeError(f"routing capture: layers {layers} wrote this step, {self.layers} before")
        positions = getattr(runner.positions, "gpu", runner.positions)[:rows]
        ids_host, positions_host = _to_host(ids), _to_host(positions)
        landed = None
        if ids.is_cuda:
            landed = torch.cuda.Event()
            landed.record()
        self.pending.append((req_ids, counts, ids_host, positions_host, landed))
        if len(self.pending) >= LAND_EVERY:
            self._land(wait=False)
        self.steps += 1
        self.read_s += time.perf_counter() - t0

    def _land(self, wait: bool) -> None:
        """File the pending steps whose copies have landed (or, with `wait`, all of them), in step order, checked
        together: every row written by every layer, each request's rows in a step consecutive positions. The
        pinned host buffers go back to the allocator here."""
        ready = []
        while self.pending:
            landed = self.pending[0][-1]
            if landed is not None and not landed.query():
                if not wait:
                    break
                landed.synchronize()
            ready.append(self.pending.popleft())
        if not ready:
            return
        ids = torch.cat([step[2] for step in ready])
        if bool((ids == moe_method.UNWRITTEN).all(dim=2).any()):
            for step in ready:  # the step and row to name
                moe_method.check_written(self.layers, step[2])
        positions = torch.cat([step[3] for step in ready]).to(torch.int32).numpy()
        counts = np.fromiter(chain.from_iterable(step[1] for step in ready), dtype=np.int64)
        req_ids = [r for step in ready for r in step[0]]
        # within a step a request's rows are consecutive positions (a prefill chunk); a code per (step, request)
        request = np.repeat(np.arange(len(counts)), counts)
        broken = np.flatnonzero((request[1:] == request[:-1]) & (np.diff(positions) != 1))
        if broken.size:
            i = int(request[broken[0]])
            start = int(counts[:i].sum())
            raise RuntimeError(f"routing capture: request {req_ids[i]}'s rows hold positions "
                               f"{positions[start:start + counts[i]].tolist()}, expected consecutive ones")
        self.landed.append((req_ids, counts, positions, ids.numpy()))

    def _by_request(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every landed row under its request, in step order: {request id: (positions, ids [n, L, k])}, the
        requests in order of first appearance."""
        if not self.landed:
            return {}
        names: dict[str, int] = {}
        codes = np.concatenate([np.repeat(np.fromiter((names.setdefault(r, len(names)) for r in req_ids),
                                                      dtype=np.int64, count=len(req_ids)), counts)
                                for req_ids, counts, _, _ in self.landed])
        positions = np.concatenate([p for _, _, p, _ in self.landed])
        ids = np.concatenate([i for _, _, _, i in self.landed])
        order = np.argsort(codes, kind="stable")  # grouped by request, step order kept within each
        rows = np.bincount(codes, minlength=len(names))
        ends = np.cumsum(rows)
        starts = ends - rows
        positions, ids = positions[order], ids[order]
        # a request in a step's batch with no token scheduled there (and none elsewhere) has nothing to file
        return {name: (positions[starts[c]:ends[c]], ids[starts[c]:ends[c]]) for name, c in names.items() if rows[c]}

    def take(self) -> dict:
        t0 = time.perf_counter()
        self._land(wait=True)
        out = {req: (pos.astype(np.int32).tobytes(), ids.tobytes(), list(ids.shape))
               for req, (pos, ids) in self._by_request().items()}
        self.read_s += time.perf_counter() - t0
        got = {"layers": self.layers or [], "requests": out, "steps": self.steps, "read_s": self.read_s}
        on = self.on
        self.__init__()
        self.on = on  # a session goes on: one round trip per generate call (take), not two
        return got


_SESSION = _Session()


def _install(worker) -> None:
    """Wrap this worker's model runner's execute_model once: after every step, file the step's routing while a
    session is on (the wrapper is one attribute check when none is)."""
    runner = worker.model_runner
    if getattr(runner, "_megamoe_capture", False):
        return
    inner = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        out = inner(scheduler_output, *args, **kwargs)
        if _SESSION.on:
            _SESSION.after_step(runner, scheduler_output)
        return out

    runner.execute_model = execute_model
    runner._megamoe_capture = True


def routing_capture(worker, action: str, blockers) -> dict:
    if action == "check":
        found = list(blockers)
        if not moe_method.capture_enabled():
            found.append(f"the engine was started without {moe_method.CAPTURE_ENV_VAR}=1, so its MoE ops write no "
                         "routing (RolloutWorker(return_routing=True) sets it)")
        return {"blockers": found}
    if action == "start":
        _install(worker)
        _SESSION.__init__()
        _SESSION.on = True
        return {}
    if action == "take_json":  # the same as plain lists (vLLM's HTTP /collective_rpc answers JSON)
        got = _SESSION.take()
        got["requests"] = {rid: {"positions": np.frombuffer(p, dtype=np.int32).tolist(),
                                 "ids": np.frombuffer(i, dtype=np.int16).reshape(shape).tolist()}
                           for rid, (p, i, shape) in got["requests"].items()}
        return got
    if action != "take":
        raise ValueError(f"action: expected 'check', 'start', 'take' or 'take_json', got {action!r}")
    return _SESSION.take()


def split_requests(got: dict, keys: list[str], lengths: list[int]) -> list[np.ndarray]:
    """Per sequence (keys[i]: the request id the caller gave vLLM, lengths[i]: prompt + completion tokens) an
    int16 array [lengths[i], L, k] of the captured routing, -1 rows where no step computed the token (the
    last token of a sequence, which is sampled but never fed back; prefix-cache hits). vLLM's request id is
    the caller's id with a suffix `-<8 random characters>` (vLLM 0.32; none on 0.26). Raises when a key
    matches no captured request or several, or a captured position lies outside its sequence."""
    L = len(got["layers"])
    by_key: dict[str, list[str]] = {}
    for rid in got["requests"]:
        base = rid.rsplit("-", 1)[0] if "-" in rid else rid
        by_key.setdefault(base, []).append(rid)
        if base != rid:
            by_key.setdefault(rid, []).append(rid)
    out = []
    for key, n in zip(keys, lengths, strict=True):
        found = by_key.get(key, [])
        if len(found) != 1:
            raise RuntimeError(f"routing capture: request {key!r} matches {len(found)} captured requests {found} "
                               f"(captured: {sorted(got['requests'])[:8]})")
        pos_b, ids_b, shape = got["requests"][found[0]]
        pos = np.frombuffer(pos_b, dtype=np.int32)
        ids = np.frombuffer(ids_b, dtype=np.int16).reshape(shape)
        if L and shape[1] != L:
            raise RuntimeError(f"routing capture: request {key!r} has {shape[1]} layers, expected {L}")
        if len(pos) and (pos.min() < 0 or pos.max() >= n):
            raise RuntimeError(f"routing capture: request {key!r} has routing at positions {pos.min()}..{pos.max()}, "
                               f"its sequence has {n} tokens")
        seq = np.full((n, shape[1], shape[2]), moe_method.UNWRITTEN, dtype=np.int16)
        seq[pos] = ids  # a position computed twice (preemption) keeps its last routing
        out.append(seq)
    return out
