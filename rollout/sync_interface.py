"""The trainer's side of the weight sync, as interfaces (rollout/sync.py chooses and
runs the transports; rollout/sync_engine.py is the engine's side).

    sender = rollout.sync.sender("ipc", model_dir=..., dtype="bfloat16")   # the one place a mode is chosen
    report = sender.send(trainer, LocalClient(worker))                    # -> SyncReport

- `Sender`: one transport (ipc: rollout/sync.py, nccl: rollout/sync_nccl.py, files:
  rollout/sync_files.py); `send(weights, engines) -> SyncReport`, run in the trainer's process on
  every trainer rank.
- `TrainerWeights`: what a transport needs of the trainer (trainer.worker.TrainerWorker has it;
  trainer/ does not import rollout/, so this is a Protocol, not a base class).
- `EngineEndpoint`: the engine's typed endpoint (RolloutWorker's update methods). `Engines`: what a
  transport needs of all the engines at once; `EngineClient` is the one implementation, its calls
  (typed method calls on an EngineEndpoint, no method names as strings) reaching RolloutWorker
  objects of this process (`LocalClient`) or RolloutWorker actors (rl.weight_sync.RayClient)
  through a `Calls`.
- The records that cross (EngineAnswer, PackedChunk, the chunks and the join, SyncReport,
  Publication) are records/weights.py's, torch-free: the project's terms, not vLLM's; the engine
  builds vLLM's wire format from them (rollout/adapter.py), so nothing on the trainer's side imports vLLM.

Imports nothing heavy (the config loader imports rollout.sync).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, Protocol

from records.weights import EngineAnswer, Publication, SyncReport


class TrainerWeights(Protocol):
    """What a transport reads of one trainer rank (trainer.worker.TrainerWorker)."""

    rank: int

    def sync_dtype(self, dtype: str | None) -> str | None:
        """The dtype name a sync sends in (None: as held)."""

    def weight_metadata(self, dtype: str | None) -> list[tuple[str, list[int], str]]:
        """(name, full shape, dtype name) of every tensor, no data moved."""

    def nonfinite_weights(self, dtype: str | None) -> list[str]:
        """Names of the tensors holding NaN/Inf once cast to `dtype`; every rank calls it (a collective)."""

    def iter_device_weights(self, select=None, names: list[str] | None = None) -> Iterator[tuple[str, Any]]:
        """(name, full tensor on this rank's device), the names `select` accepts or exactly `names`
        in order; every rank iterates to the end (the gathers are collectives)."""

    def export_weights(self, dtype: str | None) -> list[tuple[str, Any]]:
        """(name, full CPU tensor in `dtype`) of every weight on rank 0, [] on the others; every rank
        calls it (a collective)."""


class EngineEndpoint(Protocol):
    """The engine's typed endpoint of the weight sync: the methods of rollout.worker.RolloutWorker a
    sender reaches (rl.cluster.RolloutHost forwards the same methods over Ray). Everything that
    crosses is the project's own records (records/weights.py); vLLM's wire format is built behind this
    endpoint, in the engine's process (rollout/adapter.py), so no trainer process imports vLLM."""

    def plan_weight_update(self, metas: list, start: bool = False) -> EngineAnswer:
        """Check the whole update (name, shape, dtype name per tensor) and start it: the engine's plan."""

    def update_weight_chunk(self, chunk: dict) -> dict | None:
        """One chunk (`ipc_chunk` / `nccl_chunk`); the engine's report when it completed the update."""

    def finish_weight_update(self) -> dict: ...

    def abort_weight_update(self, why: str) -> None: ...

    def init_weight_transfer_engine(self, join: dict) -> None:
        """Join the trainer's NCCL group (`nccl_join`)."""

    def update_weights(self, named_tensors) -> dict:
        """A whole update of (name, CPU tensor) through files (rollout/weights.py), all or nothing."""

    def take_weights(self, publication: Publication) -> dict:
        """Take a published version, all or nothing; the engine's report ({"version", ...})."""


class Engines(Protocol):
    """What a transport asks of the engines it syncs (all of them at once); EngineClient is the one
    implementation. `plan`, `receive` and `join` return at once (`wait` joins them)."""

    @property
    def engines(self) -> int: ...

    def plan(self, metas: list) -> Any:
        """plan_weight_update(metas, start=True) on every engine, not waited for."""

    def receive(self, chunk: dict) -> Any:
        """update_weight_chunk(chunk) on every engine, not waited for (an NCCL receive)."""

    def join(self, joins: list[dict]) -> Any:
        """init_weight_transfer_engine(joins[i]) on engine i, not waited for (a rendezvous)."""

    def wait(self, pending) -> list: ...

    def update_weights(self, chunk: dict) -> list: ...

    def finish_weight_update(self) -> dict: ...

    def abort_weight_update(self, why: str) -> None: ...

    def load_whole(self, named_tensors: list) -> list[dict]:
        """update_weights(named_tensors) on every engine, the tensors shared rather than copied per engine."""

    def share(self, obj) -> Any:
        """`obj` made readable by every engine, once (a Publication's payload)."""

    def ask_plans(self, metas: list) -> list[EngineAnswer]:
        """plan_weight_update(metas) on every engine, nothing started, waited for: their answers."""


class Calls(Protocol):
    """How a call reaches every engine. `begin(ops)` runs ops[i](endpoint i) on every engine and
    returns at once, where each op is a function of an `EngineEndpoint` (a typed method call, e.g.
    `lambda e: e.finish_weight_update()`); `wait` joins; `share(obj)` makes one object every engine
    reads (Ray's object store) instead of one copy per call."""

    count: int

    def begin(self, ops: list) -> Any: ...

    def wait(self, pending) -> list: ...

    def share(self, obj) -> Any: ...


class EngineClient:
    """The trainer's calls into the engines' update protocol (EngineEndpoint), written once over
    `calls`."""

    def __init__(self, calls: Calls):
        self.calls = calls

    @property
    def engines(self) -> int:
        return self.calls.count

    def _each(self, op) -> list:
        return self.calls.wait(self.calls.begin([op] * self.calls.count))

    def plan(self, metas: list):
        """Every engine plans and starts the update; not waited for: the plan runs while the
        trainer checks its weights."""
        return self.calls.begin([lambda e: e.plan_weight_update(metas, True)] * self.calls.count)

    def receive(self, chunk: dict):
        """Every engine receives `chunk`; not waited for: an NCCL collective needs the engines inside
        their call while the trainer makes its own."""
        return self.calls.begin([lambda e: e.update_weight_chunk(chunk)] * self.calls.count)

    def join(self, joins: list[dict]):
        return self.calls.begin([lambda e, j=j: e.init_weight_transfer_engine(j) for j in joins])

    def wait(self, pending) -> list:
        return self.calls.wait(pending)

    def update_weights(self, chunk: dict) -> list:
        """One chunk to every engine; returns once all are done with it (its buffer may then be reused)."""
        return self._each(lambda e: e.update_weight_chunk(chunk))

    def finish_weight_update(self) -> dict:
        return self._each(lambda e: e.finish_weight_update())[0]

    def abort_weight_update(self, why: str) -> None:
        self._each(lambda e: e.abort_weight_update(why))

    def load_whole(self, named_tensors: list) -> list[dict]:
        shared = self.calls.share(named_tensors)
        return self._each(lambda e: e.update_weights(shared))

    def share(self, obj):
        return self.calls.share(obj)

    def ask_plans(self, metas: list) -> list[EngineAnswer]:
        return self._each(lambda e: e.plan_weight_update(metas, False))


class LocalCalls:
    """Calls to RolloutWorker objects of this process, on threads (an NCCL rendezvous needs every
    engine inside its call at once)."""

    def __init__(self, workers):
        self.workers = list(workers)
        self.count = len(self.workers)

    def begin(self, ops: list):
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=len(self.workers))
        futures = [pool.submit(op, w) for w, op in zip(self.workers, ops, strict=True)]
        pool.shutdown(wait=False)
        return futures

    def wait(self, pending) -> list:
        from concurrent.futures import wait

        wait(pending)  # every call has ended before a failure is raised (an abort must come after them)
        return [f.result() for f in pending]

    def share(self, obj):
        return obj


class LocalClient(EngineClient):
    """The client over RolloutWorker objects of this process (tests, benchmarks)."""

    def __init__(self, *workers):
        super().__init__(LocalCalls(workers))


class Sender(abc.ABC):
    """One transport of the weight sync, trainer side (rollout.sync.sender picks it by mode). A
    sender is a small picklable object: the driver builds it and hands it to every trainer rank's
    actor (rl.cluster.TrainerHost.send_weights), where `send` runs."""

    mode: str

    def __init__(self, *, model_dir: str, dtype: str | None, bucket_bytes: int):
        self.model_dir, self.dtype, self.bucket_bytes = str(model_dir), dtype, bucket_bytes

    @abc.abstractmethod
    def send(self, weights: TrainerWeights, engines: Engines) -> SyncReport:
        """The trainer's weights into every engine, all or nothing checked first (rollout/sync.py's
        invariants); run on every trainer rank, rank 0 driving `engines` (None on the others).
        ValueError: refused before anything was applied; any other error after the engines started
        leaves them refusing to sample until a later sync completes."""

    @abc.abstractmethod
    def publish(self, weights: TrainerWeights, engines: Engines | None, version: int) -> Publication | None:
        """Version `version` of the trainer's weights, made once for every engine to take later
        (Publication); run on every trainer rank, rank 0 returning it (None on the others). files and
        ipc publish; nccl raises NotImplementedError naming why (docs/WEIGHT_SYNC.md, the pull model)."""
