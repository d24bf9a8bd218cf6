"""The weight sync's records: what the trainer's and the engines' sides hand each other (rollout/sync.py,
rollout/sync_nccl.py, rollout/sync_files.py, rollout/worker.py; docs/WEIGHT_SYNC.md), torch-free.

    EngineAnswer   an engine's plan of an update (RolloutWorker.plan_weight_update)
    PackedChunk    one chunk of the trainer's buffer: its tensors back to back
    ipc_chunk, nccl_chunk, nccl_join   the chunks and the NCCL join as they cross to the engine
    SyncReport     what one sync did (seconds per phase, bytes, chunks, format)
    Publication    a published policy version for the engines to take (published_ipc: an ipc payload)
    FORMATS        the layouts a streamed update comes in

EngineAnswer, Publication and SyncReport cross Ray as themselves (Ray pickles them; an ObjectRef in a
field is not resolved by Ray, so the receiver fetches it); the chunks and the join cross as dicts
(vLLM's RPC carries them on into the engine's worker process). They are the project's terms, not
vLLM's: the engine builds vLLM's wire format from them (rollout/adapter.py), so nothing on the trainer's side imports vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FORMATS = ("kernel", "experts", "checkpoint")
# The layouts a streamed update comes in, most direct first (RolloutWorker.plan_weight_update picks):
# "kernel": every tensor as the engine's own parameter (rollout/kernel_format.py), copied in place,
#   no vLLM reload; where no layer computes from its weights after loading (ipc, one GPU per engine).
# "experts": the routed experts so (megamoe computes them), the rest through vLLM's layer-wise reload.
# "checkpoint": everything through vLLM's layer-wise reload (moe_impl stock, nccl, TP > 1).


@dataclasses.dataclass(frozen=True)
class EngineAnswer:
    """An engine's answer to plan_weight_update(metas, start): its plan, built (and checked) by the engine."""

    format: str
    layout: list | None
    why: dict
    bytes: int
    workers: int = 1  # the engine's ranks in an NCCL group
    tensors: int | None = None
    transfer_group: str | None = None  # the trainer's NCCL group the engine joined (address:port)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"weight sync: an engine's plan names format {self.format!r}, expected one of {FORMATS}")


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


# The chunks and the join as they cross to the engine (EngineEndpoint), in the project's own terms;
# the engine turns them into what its vLLM parses (rollout.adapter.vllm_update_info / nccl_init_info).

def ipc_chunk(chunk: PackedChunk, handle: dict) -> dict:
    """One chunk of the trainer's CUDA IPC buffer: its tensors and the buffer's IPC handle
    ({GPU uuid: torch's rebuild arguments})."""
    return {"transport": "ipc", **dataclasses.asdict(chunk), "ipc_handles": handle}


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


@dataclasses.dataclass(frozen=True)
class Publication:
    """Version `version` of the trainer's weights, published once (`Sender.publish`) for every engine
    to take later, between two of its generate calls (`EngineEndpoint.take_weights`): the pull model
    of run.max_async_steps (docs/WEIGHT_SYNC.md). `payload` is what an engine needs to take it
    without the trainer: for files, the shared export (an object every engine reads; over Ray an
    ObjectRef, which rl.cluster.RolloutHost fetches: Ray resolves no ObjectRef inside a record); for ipc, `published_ipc`'s dict (the chunks
    with their IPC handles into the trainer's buffer that holds version `version`)."""

    version: int
    mode: str
    payload: Any



def published_ipc(*, metas: list, format: str, layout: list | None, nbytes: int, chunks: list[dict],
                  engines: int) -> dict:
    """An ipc Publication's payload: the update's description (metas, as the engines plan it), the
    format and layout their plans agreed on, its bytes, every chunk (`ipc_chunk`, each with the
    handle of its own region of the trainer's buffer) and how many engines are to take it."""
    return {"metas": metas, "format": format, "layout": layout, "bytes": nbytes, "chunks": chunks,
            "engines": engines}
