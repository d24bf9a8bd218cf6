"""The steps of a streamed weight sync that the ipc and nccl senders share (rollout/sync.py,
rollout/sync_nccl.py): the checks before anything moves, rank 0's decisions reaching every
trainer rank, aborting a started update, the report.

Invariants of a streamed sync: what the trainer's side checks, where, and why there (the engine's,
E1-E4, are in rollout/sync_engine.py):
- T1 NaN/Inf, on every rank's GPU in the sampler's dtype (`TrainerWeights.nonfinite_weights`,
  all-reduced): only the trainer holds the tensors, and an fp32 value beyond the 16-bit range
  becomes Inf in the cast. Runs while the engines plan (E1); a refusal from either aborts the
  started update before any byte moves.
- T2 the engines agree on one format and layout (`agreed_format`): one stream serves them all.
- T3 every tensor fits the buffer (`plan_buffer_bytes`, naming rollout.ipc_bucket_bytes), checked
  on the plan before the first chunk.
- T4 the stream is the plan: a kernel-format stream reads the trainer's tensors in the layout's
  order and checks each name (`kernel_stream`); a packed tensor's parts stack along dim 0 and
  every tensor starts at a multiple of its element size (`IPCBuffer.chunks`). The engine checks
  each chunk again on arrival (E2): it cannot trust another process's stream.
- T5 the trainer ranks move in step: rank 0's decisions reach every rank (`rank0_decides`), and at
  each chunk boundary every rank learns whether any failed (`IPCBuffer.agreed`), so a failure on
  one rank raises on all and none waits for a rank that left.
- T6 all or nothing: an update ends applied whole (the chunk bringing its last planned tensor, or
  `finish_weight_update`), aborted before any chunk (the engine keeps its weights), or broken (the
  engine refuses to sample until a complete update): a failure *while* chunks are being applied (a
  process dying, a CUDA error, the trainer's stream failing between chunks) cannot be undone
  without a second copy of the weights.
A failure inside one of the stream's collectives (a rank's FSDP gather) is not covered by T5: the
other ranks wait in that collective until the process group's timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterable

from records.weights import EngineAnswer, SyncReport
from rollout.sync_interface import Engines, TrainerWeights

# The packed IPC buffer: vLLM's default for its packed transfer (1 GiB). Larger buffers mean fewer
# round trips per sync (each costs a Ray call and an engine RPC) at the price of GPU memory held
# by the trainer during the sync; benchmarks/bench_weight_sync.py measures the trade.
DEFAULT_IPC_BUCKET_BYTES = 1 << 30


def refuse_nonfinite(bad: list[str], dtype: str | None) -> None:
    """The refusal of an update with NaN/Inf weights (the trainer's check), before anything moves."""
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"weight sync refused, nothing applied: tensor(s) {', '.join(map(repr, bad[:3]))}{more} "
                         f"hold NaN/Inf in {dtype or 'their dtype'}")


def plan_buffer_bytes(metas: Iterable, bucket_bytes: int) -> int:
    """The IPC buffer a sync of `metas` ((name, shape, dtype name)) needs: the bucket, or the whole
    update if smaller. Raises ValueError naming rollout.ipc_bucket_bytes when one tensor is larger
    than the bucket (T3, before anything moves)."""
    import math

    import torch

    total, largest = 0, ("", 0)
    for name, shape, dtype in metas:
        size = math.prod(shape) * getattr(torch, dtype).itemsize
        total += size
        largest = max(largest, (name, size), key=lambda x: x[1])
    if largest[1] > bucket_bytes:
        raise ValueError(f"rollout.ipc_bucket_bytes: tensor {largest[0]!r} is {largest[1]} bytes, more than the "
                         f"bucket ({bucket_bytes}); use at least {largest[1]}")
    return min(bucket_bytes, -(-total // (1 << 20)) * (1 << 20))


@dataclasses.dataclass(frozen=True)
class StreamDecision:
    """Rank 0's decision on a streamed sync, the same on every rank: the format and layout the
    engines take it in (EngineAnswer), why not a more direct one, the update's bytes, the buffer
    each chunk fills; for nccl the group (`world_size`, each engine's rank `offsets`, the `groups`
    the engines had joined)."""

    format: str
    why: dict
    bytes: int
    buffer_bytes: int
    layout: list | None = None
    world_size: int | None = None
    offsets: list | None = None
    groups: list | None = None


def checked_and_started(trainer: TrainerWeights, client: Engines | None, dtype: str | None, clock: "Clock",
                        decide):
    """The checks of a streamed sync (T1 and E1), with the engines' update started once they pass:
    rank 0 asks every engine to plan and start (`RolloutWorker.plan_weight_update(metas,
    start=True)`), every rank checks its weights for NaN/Inf on its GPU meanwhile, then rank 0
    takes `decide(plans, metas)` (the engines' EngineAnswers as they came; raising to refuse). Returns
    that decision on every rank; a refusal (ValueError, the NaN/Inf one first) raises on every
    rank, with the engines' update aborted."""
    rank = trainer.rank
    metas = trainer.weight_metadata(dtype)
    planning = client.plan(metas) if rank == 0 else None
    bad = trainer.nonfinite_weights(dtype)  # on every rank's GPU while the engines plan
    clock.lap("check")

    def on_rank0(client):
        with abort_on_failure(client, "the trainer refused the update"):
            try:
                plans = client.wait(planning)
            except Exception:
                refuse_nonfinite(bad, dtype)  # the weights' own fault is named first
                raise
            refuse_nonfinite(bad, dtype)
            return decide(plans, metas)

    decision = rank0_decides(rank, on_rank0, client)
    clock.lap("plan")
    return decision


@contextlib.contextmanager
def abort_on_failure(client, why: str):
    """Abort the engines' started update (`client.abort_weight_update`) when the block raises, then
    re-raise; client None: this rank does not drive the engines."""
    try:
        yield
    except BaseException as e:
        if client is not None:
            try:
                client.abort_weight_update(f"{why}: {type(e).__name__}: {e}")
            except Exception as abort_error:  # noqa: BLE001 - the first failure is the one to report
                e.add_note(f"abort_weight_update failed too: {type(abort_error).__name__}: {abort_error}")
        raise


def rank0_decides(rank: int, decide, client):
    """`decide(client)` on rank 0 (a step only rank 0 takes with the engines: their plan of the
    update, joining their NCCL group), its result on every rank; a failure there raises on every
    rank (ValueError for a refusal), so no rank waits for another (T5)."""
    decision, failure, error = None, None, None
    if rank == 0:
        try:
            decision = decide(client)
        except Exception as e:  # noqa: BLE001 - re-raised here; the other ranks must not wait for rank 0
            failure = e
            error = (ValueError, str(e)) if isinstance(e, ValueError) else (RuntimeError,
                                                                            f"rank 0: {type(e).__name__}: {e}")
    decision, error = _from_rank0((decision, error))
    if failure is not None:
        raise failure
    if error is not None:
        raise error[0](error[1])
    return decision


def finished_report(rank: int, client: Engines | None, clock: "Clock", done: list | None, **result) -> SyncReport:
    """The sync's report: `result` plus the seconds per phase, the engines' own as engine_*
    (RolloutWorker.finish_weight_update). `done`: the engines' answers to the last chunk, their
    finish reports when that chunk completed the update; otherwise rank 0 ends it here."""
    engine = {}
    if rank == 0:
        if not done or any(d is None for d in done):
            done = [client.finish_weight_update()]
        engine = {f"engine_{k}": v for k, v in (done[0] or {}).get("seconds", {}).items()}
    clock.lap("finish")
    return SyncReport(seconds={**clock.laps, **engine, "total": clock.total()}, **result)


@functools.lru_cache(maxsize=4)
def checkpoint_spec(model_dir: str):
    """The base checkpoint's layout (read once per folder: its safetensors headers; a run's base
    model does not change while it runs)."""
    from rollout import weights as wts

    return wts.CheckpointSpec.from_dir(model_dir)


class Clock:
    """Seconds per named phase, summed over laps (a phase may recur, e.g. pack/send per chunk)."""

    def __init__(self):
        self.t0 = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.t0


def _from_rank0(obj):
    """Rank 0's object on every rank of the trainer's process group (itself when there is one rank)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agreed_format(answers: list[EngineAnswer]) -> str:
    """The format (`FORMATS`) the engines' plans take the update in; they must all agree, and on a
    kernel-format layout (T2: one stream serves every engine)."""
    if len({(a.format, repr(a.layout)) for a in answers}) != 1:
        raise ValueError(f"weight sync: the engines take the update in different layouts "
                         f"({sorted({a.format for a in answers})}: their moe_impl, tensor_parallel_size or model "
                         "differ); one sync streams one layout")
    return answers[0].format
