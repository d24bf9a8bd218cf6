"""The nccl transport of the weight sync (rollout/sync.py is the seam): trainer and engines on
different GPUs, through vLLM's NCCL weight-transfer engine (backend "nccl").

    NcclSender(model_dir=..., dtype="bfloat16", bucket_bytes=..., address=<rank 0's address>).send(trainer, client)

Trainer rank 0 and every engine worker join one NCCL group (rank 0 the trainer, then each engine's
tensor-parallel workers; joined once per run, again when an engine is new or restarted or the set
of engines changes), and rank 0 broadcasts the update in checkpoint format with vLLM's packed
producer while each engine receives it with the matching consumer into its layer-wise reload. The
checks before anything moves are IpcSender's (rollout/sync_stream.py). Not yet run on two GPUs (README).
"""

from __future__ import annotations

from rollout.sync_stream import (DEFAULT_IPC_BUCKET_BYTES, Clock, StreamDecision, abort_on_failure, agreed_format,
                                 checked_and_started, checkpoint_spec, finished_report, plan_buffer_bytes,
                                 rank0_decides)
from records.weights import EngineAnswer, SyncReport, nccl_chunk, nccl_join
from rollout.sync_interface import Engines, Sender, TrainerWeights

# vLLM's packed broadcast keeps this many buffers in flight on each side (its default).
NCCL_NUM_BUFFERS = 2
_NCCL: dict = {}  # this trainer process's NCCL group: {"key": (world size, buffer), "token", "group"}


def nccl_world(answers: list[EngineAnswer]) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the trainer-engines NCCL group: the trainer is
    rank 0, then each engine's workers (its answer's `workers`: tensor-parallel ranks) in turn."""
    offsets, nxt = [], 1
    for a in answers:
        offsets.append(nxt)
        nxt += a.workers
    return nxt, offsets


def checkpoint_metadata(spec, metas: list) -> list[tuple[str, list[int], str]]:
    """(on-disk name, shape, dtype name) of the checkpoint-format stream the trainer's tensors
    (`metas`) become, in the order `to_checkpoint_names` yields them (computed on meta tensors: no
    data); an NCCL receiver needs it before the first byte."""
    import torch

    from rollout import weights as wts

    meta = ((n, torch.empty(shape, dtype=getattr(torch, dt), device="meta")) for n, shape, dt in metas)
    return [(n, list(t.shape), str(t.dtype).removeprefix("torch."))
            for n, t in wts.to_checkpoint_names(spec, meta, kernel_experts=False)]


def _free_port(address: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _nccl_group(client: Engines, decision: StreamDecision, address: str):
    """The NCCL group of this trainer process and the engines: the one joined before when every
    engine reports its token (address:port) and the size and buffer are unchanged; else a new one
    on a fresh port (a new or restarted engine, another set of engines), every engine joining while
    rank 0 opens its end (a rendezvous)."""
    key = (decision.world_size, decision.buffer_bytes)
    if _NCCL.get("key") == key and all(g == _NCCL["token"] for g in decision.groups):
        return _NCCL["group"]
    _NCCL.clear()
    port = _free_port(address)
    pending = client.join([nccl_join(address, port, off, decision.world_size, decision.buffer_bytes, NCCL_NUM_BUFFERS)
                           for off in decision.offsets])
    group = trainer_group(address, port, decision.world_size)
    client.wait(pending)
    _NCCL.update(key=key, token=f"{address}:{port}", group=group)
    return group


# The trainer's end of vLLM's NCCL weight-transfer protocol. vLLM defines that protocol (its stateless
# process group's rendezvous and its packed broadcast, which the engine's consumer must mirror), so
# trainer rank 0 speaks it with vLLM's own producer: the one place a trainer process imports vLLM,
# only for rollout.weight_sync=nccl, inside these two functions (ipc and files import none of it).

def trainer_group(address: str, port: int, world_size: int):
    """The trainer's end (rank 0) of the NCCL group with the engines (vLLM's stateless group and
    PyNccl communicator on the current CUDA device); returns once every engine worker joined."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init({"master_address": address, "master_port": port, "world_size": world_size})


def broadcast(group, named_tensors, dtype, buffer_bytes: int, num_buffers: int) -> None:
    """Broadcast (name, CUDA tensor) pairs from rank 0 with vLLM's packed producer, each cast to
    `dtype` (None: as it is). The producer packs on its own streams: each cast first waits for the
    stream that made the tensor (the gather of a sharded parameter)."""
    import torch
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    made_on = torch.cuda.current_stream()

    def cast(item):
        torch.cuda.current_stream().wait_stream(made_on)
        t = item[1]
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    packed_nccl_broadcast_producer(iterator=iter(named_tensors), group=group, src=0, post_iter_func=cast,
                                   buffer_size_bytes=buffer_bytes, num_buffers=num_buffers)


def node_address() -> str:
    """This process's node address as Ray sees it (what the engines reach), 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except ImportError:
        return "127.0.0.1"


class NcclSender(Sender):
    """The NCCL transport: trainer and engines on other GPUs (see the module docstring). Runs in
    the trainer's process on every trainer rank (each gathers the full tensors; rank 0 sends).
    `address`: rank 0's address the engines reach for the rendezvous.

    The same checks as IpcSender before anything moves (T1; E1, which for nccl is the checkpoint
    format: vLLM's NCCL engine loads what it receives through the model's load_weights). Then one
    update: the engines enter their receive (vLLM's packed consumer) with the stream's metadata
    while rank 0 broadcasts the same stream, cast to the sampler's dtype, with vLLM's packed
    producer (`bucket_bytes` per buffer, NCCL_NUM_BUFFERS in flight). A failure inside the
    broadcast cannot be undone: the engines then refuse to sample until a later update completes
    (T6, as for ipc)."""

    mode = "nccl"

    def __init__(self, *, model_dir: str, dtype: str | None, bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES,
                 address: str | None = None):
        super().__init__(model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes)
        self.address = address

    def publish(self, weights: TrainerWeights, engines: Engines | None, version: int):
        """Not built (NotImplementedError, saying why): an NCCL transfer is a broadcast, one
        collective whose sender (trainer rank 0) and receivers (every engine's workers) must all be
        inside it at once, so an engine cannot take a version later from something the trainer left
        behind, as ipc's buffer allows. A pull over NCCL is a take the trainer joins: the driver
        queues rank 0's send of v on the trainer and each engine's take of v behind its generate
        calls, and both block until the last engine's queue reaches its take."""
        raise NotImplementedError(
            "rollout.weight_sync='nccl': publishing a version for the engines to take later is not built: an NCCL "
            "transfer is a broadcast, which needs trainer rank 0 and every engine inside the same collective at "
            "once, so nothing the trainer leaves behind can be taken later; it would be a take the trainer joins "
            "(its send and each engine's take queued to meet), docs/WEIGHT_SYNC.md 'Taking a version later'")

    def send(self, weights: TrainerWeights, engines: Engines | None) -> SyncReport:
        import torch

        from rollout import weights as wts

        rank = weights.rank
        clock = Clock()
        dtype = weights.sync_dtype(self.dtype)
        spec = checkpoint_spec(self.model_dir)
        stream_metas: list = []

        def decide(answers: list[EngineAnswer], metas):
            if agreed_format(answers) != "checkpoint":
                raise ValueError("rollout.weight_sync: 'nccl' streams checkpoint format; these engines expect "
                                 "kernel-format tensors (built for weight_sync='ipc')")
            stream_metas[:] = checkpoint_metadata(spec, metas)
            world_size, offsets = nccl_world(answers)
            return StreamDecision(format="checkpoint", why=answers[0].why, bytes=answers[0].bytes,
                                  buffer_bytes=plan_buffer_bytes(stream_metas, self.bucket_bytes),
                                  world_size=world_size, offsets=offsets,
                                  groups=[a.transfer_group for a in answers])

        decision = checked_and_started(weights, engines, dtype, clock, decide)
        out_dtype = getattr(torch, dtype) if dtype else None
        joined = {}

        def join(client):
            with abort_on_failure(client, "the trainer could not join the engines' NCCL group"):
                joined["group"] = _nccl_group(client, decision, self.address or node_address())
            return {}

        rank0_decides(rank, join, engines)  # a failure to join raises on every rank, before their gathers
        clock.lap("join")
        stream = wts.to_checkpoint_names(spec, weights.iter_device_weights(), kernel_experts=False)
        if rank == 0:
            pending = engines.receive(nccl_chunk(stream_metas, decision.buffer_bytes, NCCL_NUM_BUFFERS))
            broadcast(joined["group"], stream, out_dtype, decision.buffer_bytes, NCCL_NUM_BUFFERS)
            torch.cuda.synchronize()  # the broadcasts read live parameters: done before the next step
            done = engines.wait(pending)
        else:
            done = None
            for _ in stream:  # the full tensors are gathered collectively: every rank takes part
                pass
        clock.lap("send")
        return finished_report(rank, engines, clock, done, bytes=decision.bytes, sent_bytes=decision.bytes,
                               chunks=1, format="checkpoint", why=decision.why)


def send_nccl(trainer, client, *, model_dir: str, dtype: str | None,
              bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES, address: str | None = "127.0.0.1") -> SyncReport:
    """NcclSender's sync and its report."""
    return NcclSender(model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes, address=address).send(trainer, client)
