"""The trainer's side of the weight sync, as interfaces and records (rollout/sync.py chooses and
runs the transports; rollout/sync_engine.py is the engine's side).

    sender = rollout.sync.sender("ipc", model_dir=..., dtype="bfloat16")   # the one place a mode is chosen
    report = sender.send(trainer, LocalClient(worker))                    # -> SyncReport

- `Sender`: one transport (ipc: rollout/sync.py, nccl: rollout/sync_nccl.py); `send(weights,
  engines) -> SyncReport`, run in the trainer's process on every trainer rank.
- `TrainerWeights`: what a transport needs of the trainer (trainer.worker.TrainerWorker has it;
  trainer/ does not import rollout/, so this is a Protocol, not a base class).
- `Engines`: what a transport needs of the engines; `EngineClient` is the one implementation, its
  calls reaching RolloutWorker objects of this process (`LocalClient`) or RolloutWorker actors
  (rl.weight_sync.RayClient) through a `Calls`.
- Records: `EngineAnswer` (an engine's plan, as the trainer reads it), `PackedChunk` (one chunk of
  the trainer's buffer), `SyncReport`. Between processes they travel as plain dicts (`to_wire` /
  `from_wire`): Ray and vLLM's RPC carry them, and a dict is what the tests' stand-ins answer.

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


class Engines(Protocol):
    """What a transport asks of the engines it syncs (all of them at once)."""

    @property
    def engines(self) -> int: ...

    def begin(self, method: str, args: list[tuple]) -> Any:
        """RolloutWorker.`method`(*args[i]) on engine i, not waited for."""

    def wait(self, pending) -> list: ...

    def update_weights(self, update_info: dict) -> list: ...

    def finish_weight_update(self) -> dict: ...

    def abort_weight_update(self, why: str) -> None: ...


class Calls(Protocol):
    """How a call reaches every engine: `begin` starts it on each (engine i with args[i]) and
    returns at once, `wait` joins, `each` calls every engine and returns their answers (a failure
    raised after every engine returned, or at the first, as the mechanism does)."""

    count: int

    def begin(self, method: str, args: list[tuple]) -> Any: ...

    def wait(self, pending) -> list: ...

    def each(self, method: str, *args) -> list: ...


class EngineClient:
    """The trainer's calls into the engines' streamed-update protocol (RolloutWorker's plan_weight_update,
    update_weight_chunk, finish_weight_update, abort_weight_update, init_weight_transfer_engine),
    written once over `calls`."""

    def __init__(self, calls: Calls):
        self.calls = calls

    @property
    def engines(self) -> int:
        return self.calls.count

    def begin(self, method: str, args: list[tuple]):
        """`method` on every engine (engine i with args[i]) without waiting: an NCCL collective needs
        the engines inside their call while the trainer makes its own, and the plan runs while the
        trainer checks its weights. `wait` joins them."""
        return self.calls.begin(method, args)

    def wait(self, pending) -> list:
        return self.calls.wait(pending)

    def update_weights(self, update_info: dict) -> list:
        """One chunk to every engine; returns once all are done with it (its buffer may then be reused)."""
        return self.calls.each("update_weight_chunk", update_info)

    def finish_weight_update(self) -> dict:
        return self.calls.each("finish_weight_update")[0]

    def abort_weight_update(self, why: str) -> None:
        self.calls.each("abort_weight_update", why)


class LocalCalls:
    """Calls to RolloutWorker objects of this process: `begin` on threads, `each` one after another."""

    def __init__(self, workers):
        self.workers = list(workers)
        self.count = len(self.workers)

    def begin(self, method: str, args: list[tuple]):
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=len(self.workers))
        futures = [pool.submit(getattr(w, method), *a) for w, a in zip(self.workers, args, strict=True)]
        pool.shutdown(wait=False)
        return futures

    def wait(self, pending) -> list:
        from concurrent.futures import wait

        wait(pending)  # every call has ended before a failure is raised (an abort must come after them)
        return [f.result() for f in pending]

    def each(self, method: str, *args) -> list:
        return [getattr(w, method)(*args) for w in self.workers]


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

    @property
    def nbytes(self) -> int:
        return sum(self.tensor_sizes)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)


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


class Sender(abc.ABC):
    """One transport of the weight sync, trainer side (rollout.sync.sender picks it by mode)."""

    mode: str

    def __init__(self, *, model_dir: str, dtype: str | None, bucket_bytes: int):
        self.model_dir, self.dtype, self.bucket_bytes = str(model_dir), dtype, bucket_bytes

    @abc.abstractmethod
    def send(self, weights: TrainerWeights, engines: Engines) -> SyncReport:
        """The trainer's weights into every engine, all or nothing checked first (rollout/sync.py's
        invariants); run on every trainer rank, rank 0 driving `engines` (None on the others).
        ValueError: refused before anything was applied; any other error after the engines started
        leaves them refusing to sample until a later sync completes."""
