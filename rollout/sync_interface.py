"""The trainer's side of the weight sync, as interfaces and records (rollout/sync.py chooses and
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
- Records: `EngineAnswer` (an engine's plan, as the trainer reads it), `PackedChunk` (one chunk of
  the trainer's buffer), the chunks and the join as they cross (`ipc_chunk`, `nccl_chunk`,
  `nccl_join`), `SyncReport`. Between processes they travel as plain dicts (`to_wire` /
  `from_wire`): Ray and vLLM's RPC carry them, and a dict is what the tests' stand-ins answer. They
  are the project's terms, not vLLM's: the engine builds vLLM's wire format from them
  (rollout/adapter.py), so nothing on the trainer's side imports vLLM.

Imports nothing heavy (the config loader imports rollout.sync).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

FORMATS = ("kernel", "experts", "checkpoint")
# The layouts a streamed update comes in, most direct first (RolloutWorker.plan_weight_update picks):
# "kernel": every tensor as the engine's own parameter (rollout/kernel_format.py), copied in place,
#   no vLLM reload; where no layer computes from its weights after loading (ipc, one GPU per engine).
# "experts": the routed experts so (megamoe computes them), the rest through vLLM's layer-wise reload.
# "checkpoint": everything through vLLM's layer-wise reload (moe_impl stock, nccl, TP > 1).


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
    crosses is the project's own records as plain dicts; vLLM's wire format is built behind this
    endpoint, in the engine's process (rollout/adapter.py), so no trainer process imports vLLM."""

    def plan_weight_update(self, metas: list, start: bool = False) -> dict:
        """Check the whole update (name, shape, dtype name per tensor) and start it: EngineAnswer's wire."""

    def update_weight_chunk(self, chunk: dict) -> dict | None:
        """One chunk (`ipc_chunk` / `nccl_chunk`); the engine's report when it completed the update."""

    def finish_weight_update(self) -> dict: ...

    def abort_weight_update(self, why: str) -> None: ...

    def init_weight_transfer_engine(self, join: dict) -> None:
        """Join the trainer's NCCL group (`nccl_join`)."""

    def update_weights(self, named_tensors) -> dict:
        """A whole update of (name, CPU tensor) through files (rollout/weights.py), all or nothing."""

    def take_weights(self, publication: dict) -> dict:
        """Take a published version (Publication's wire), all or nothing; the engine's report."""


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

    def ask_plans(self, metas: list) -> list[dict]:
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

    def ask_plans(self, metas: list) -> list[dict]:
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


@dataclasses.dataclass(frozen=True)
class EngineAnswer:
    """An engine's answer to plan_weight_update(metas, start=True), read once on arrival."""

    format: str
    layout: list | None
    why: dict
    bytes: int
    workers: int = 1  # the engine's ranks in an NCCL group
    tensors: int | None = None
    transfer_group: str | None = None  # the trainer's NCCL group the engine joined (address:port)

    @classmethod
    def from_wire(cls, answer: dict) -> EngineAnswer:
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in answer]
        if missing:
            raise ValueError(f"weight sync: an engine's plan lacks {missing} (got keys {sorted(answer)})")
        if answer["format"] not in FORMATS:
            raise ValueError(f"weight sync: an engine's plan names format {answer['format']!r}, "
                             f"expected one of {FORMATS}")
        return cls(**{f.name: answer[f.name] for f in dataclasses.fields(cls) if f.name in answer})


@dataclasses.dataclass
class PackedChunk:
    """One chunk of the trainer's buffer: its tensors back to back from byte 0, each `tensor_sizes`
    bytes (the keys of vLLM's packed update info)."""

    names: list = dataclasses.field(default_factory=list)
    shapes: list = dataclasses.field(default_factory=list)
    dtype_names: list = dataclasses.field(default_factory=list)
    tensor_sizes: list = dataclasses.field(default_factory=list)
    offset: int = 0  # where its first tensor starts in the trainer's buffer (a published version's chunks)

    @property
    def nbytes(self) -> int:
        return sum(self.tensor_sizes)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)


# The chunks and the join as they cross to the engine (EngineEndpoint), in the project's own terms;
# the engine turns them into what its vLLM parses (rollout.adapter.vllm_update_info / nccl_init_info).

def ipc_chunk(chunk: PackedChunk, handle: dict) -> dict:
    """One chunk of the trainer's CUDA IPC buffer: its tensors and the buffer's IPC handle
    ({GPU uuid: torch's rebuild arguments})."""
    return {"transport": "ipc", **chunk.to_wire(), "ipc_handles": handle}


def nccl_chunk(metas: list, buffer_bytes: int, num_buffers: int) -> dict:
    """The whole NCCL broadcast as one chunk: (name, shape, dtype name) in the order rank 0 sends,
    and how its packed producer cuts the stream (buffer size, buffers in flight)."""
    return {"transport": "nccl", "names": [n for n, _, _ in metas], "shapes": [list(s) for _, s, _ in metas],
            "dtype_names": [d for _, _, d in metas], "buffer_bytes": buffer_bytes, "num_buffers": num_buffers}


def nccl_join(address: str, port: int, rank_offset: int, world_size: int, buffer_bytes: int,
              num_buffers: int) -> dict:
    """An engine's invitation to the trainer's NCCL group: the rendezvous (rank 0, the trainer, at
    address:port), its first worker's rank, the group's size and the packed broadcast's buffers."""
    return {"address": address, "port": port, "rank_offset": rank_offset, "world_size": world_size,
            "buffer_bytes": buffer_bytes, "num_buffers": num_buffers}


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What one sync did: seconds per phase (the trainer's: check, plan, join, pack, send, finish;
    the engines' own as engine_*; total), bytes of the update, bytes sent, chunks, the format the
    engines took it in and why not a more direct one."""

    seconds: dict
    bytes: int
    sent_bytes: int
    chunks: int
    format: str
    why: dict

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Publication:
    """Version `version` of the trainer's weights, published once (`Sender.publish`) for every engine
    to take later, between two of its generate calls (`EngineEndpoint.take_weights`): the pull model
    of run.max_async_steps (docs/WEIGHT_SYNC.md). `payload` is what an engine needs to take it
    without the trainer: for files, the shared export (an object every engine reads; over Ray an
    ObjectRef, which rl.cluster.RolloutHost resolves); for ipc, `published_ipc`'s dict (the chunks
    with their IPC handles into the trainer's buffer that holds version `version`)."""

    version: int
    mode: str
    payload: Any

    def to_wire(self) -> dict:
        return {"version": self.version, "mode": self.mode, "payload": self.payload}


def published_ipc(*, metas: list, format: str, layout: list | None, nbytes: int, chunks: list[dict],
                  engines: int) -> dict:
    """An ipc Publication's payload: the update's description (metas, as the engines plan it), the
    format and layout their plans agreed on, its bytes, every chunk (`ipc_chunk`, each with the
    handle of its own region of the trainer's buffer) and how many engines are to take it."""
    return {"metas": metas, "format": format, "layout": layout, "bytes": nbytes, "chunks": chunks,
            "engines": engines}


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
