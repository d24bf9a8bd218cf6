"""Weight sync from the trainer to the rollout engines: one seam, three transports.

    mode = resolve("auto", colocated=True, on_gpu=True)            # -> "ipc"
    push_ipc_local(trainer, [rollout_worker], model_dir=model_dir, dtype="bfloat16")  # one process

Transports (`rollout.weight_sync`):
- `ipc`: trainer rank and vLLM worker on the same GPU, through vLLM's CUDA IPC weight-transfer
  engine (`vllm.distributed.weight_transfer`, backend "ipc"). The trainer packs its tensors, cast to
  the sampler's dtype in the copy, into one GPU buffer it exported once (`IPCBuffer`) and hands
  vLLM's packed update info (names, shapes, dtypes, sizes, the buffer's IPC handle) to the engine,
  which reads the bytes in place; nothing leaves the GPU. Two streams per sync when the engine
  computes the experts with megamoe (moe_impl megamoe / reference, one GPU per engine): first the
  routed experts in kernel format (whole `w13_weight` / `w2_weight` per layer, the layout megamoe
  reads and the trainer holds, copied straight into the engine's parameters), then the rest in
  checkpoint format through vLLM's update session (its layer-wise reload). Otherwise everything in
  checkpoint format. The version-specific calls are in rollout/adapter.py.
- `nccl`: trainer and sampler on different GPUs, through vLLM's NCCL weight-transfer engine (backend
  "nccl"): trainer rank 0 and every engine worker join one NCCL group (rank 0 the trainer, then each
  engine's workers; joined once per run, again when an engine was restarted), and rank 0 broadcasts
  the update in checkpoint format with vLLM's packed producer while each engine receives it with
  the matching consumer into its layer-wise reload (`send_nccl`). Not yet run on two GPUs: opt in
  with rollout.weight_sync=nccl (`auto` keeps files for separate GPUs until it has been).
- `files`: safetensors buckets in /dev/shm (rollout/weights.py): the CPU transport.

Every update is checked before any byte is applied: names, shapes and dtypes of the whole update
against the checkpoint (`RolloutWorker.plan_weight_update`, from metadata alone) and NaN/Inf on
the trainer's GPU (`TrainerWorker.nonfinite_weights`). Each chunk is then checked against that
plan on arrival. A failure *while* chunks are being applied (a process dying, a CUDA error) cannot
be undone without a second copy of the weights: the engine then refuses to sample until a later
update completes (RolloutWorker's broken state), rather than serve a mix of old and new weights.

A client is vLLM's `VLLMWeightSyncClient` shape (init / start / update / finish) plus
`plan_weight_update`, the check of the whole update before it starts; `LocalClient` drives
RolloutWorker objects in this process, rl/weight_sync.py has the Ray one.

This module imports nothing heavy at import time, so the config loader can call `resolve`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

MODES = ("files", "ipc", "nccl")
STREAMED = ("ipc", "nccl")  # the transports of the streamed protocol (plan, init, start, chunks, finish)
AUTO = "auto"
# The packed IPC buffer: vLLM's default for its packed transfer (1 GiB). Larger buffers mean fewer
# round trips per sync (each costs a Ray call and an engine RPC) at the price of GPU memory held
# by the trainer during the sync; benchmarks/bench_weight_sync.py measures the trade.
DEFAULT_IPC_BUCKET_BYTES = 1 << 30


def resolve(mode: str, *, colocated: bool, on_gpu: bool, same_gpu: bool = True, key: str = "rollout.weight_sync") -> str:
    """The transport for a placement; `auto` picks ipc (colocated on one GPU), else files.

    Raises ValueError naming `key`, the value and what would work, for a transport the placement
    cannot run: ipc needs the trainer rank and the engine on one GPU, nccl separate GPUs, and
    neither runs on CPU.
    """
    if mode == AUTO:
        if not on_gpu:
            return "files"
        # Separate GPUs: files, through host memory, until nccl has run on two GPUs (README).
        return "ipc" if colocated and same_gpu else "files"
    if mode not in MODES:
        raise ValueError(f"{key}: expected one of {(AUTO,) + MODES}, got {mode!r}")
    if mode == "files":
        return mode
    if not on_gpu:
        raise ValueError(f"{key}: {mode!r} needs CUDA GPUs (gpus_per_rank and gpus_per_worker > 0); this "
                         f"placement runs on CPU, where {key}=files (or auto) works")
    if mode == "ipc" and not (colocated and same_gpu):
        raise ValueError(f"{key}: 'ipc' needs each trainer rank and its rollout engine on the same GPU "
                         f"(ray.placement=colocated with gpus_per_rank + gpus_per_worker <= 1 per bundle); "
                         f"use {key}=files for this placement")
    if mode == "nccl" and colocated and same_gpu:
        raise ValueError(f"{key}: 'nccl' needs the trainer and the sampler on different GPUs (NCCL "
                         f"cannot join two ranks on one device); this placement shares a GPU, where "
                         f"{key}=ipc works")
    return mode


class LocalClient:
    """vLLM's trainer-side client protocol over RolloutWorker objects in this process."""

    def __init__(self, *workers):
        self.workers = workers

    def begin(self, method: str, args: list[tuple]):
        """Call `method` on every engine (engine i with args[i]) without waiting: an NCCL collective
        needs the engines inside their call while the trainer makes its own. `wait` joins them."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=len(self.workers))
        futures = [pool.submit(getattr(w, method), *a) for w, a in zip(self.workers, args, strict=True)]
        pool.shutdown(wait=False)
        return futures

    def wait(self, pending) -> list:
        return [f.result() for f in pending]

    def plan_weight_update(self, metas: list) -> list[dict]:
        return [w.plan_weight_update(metas) for w in self.workers]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        for w in self.workers:
            w.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        for w in self.workers:
            w.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        for w in self.workers:
            w.update_weight_chunk(update_info)

    def finish_weight_update(self) -> dict:
        return [w.finish_weight_update() for w in self.workers][0]


def refuse_nonfinite(bad: list[str], dtype: str | None) -> None:
    """The refusal of an update with NaN/Inf weights (the trainer's check), before anything moves."""
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"weight sync refused, nothing applied: tensor(s) {', '.join(map(repr, bad[:3]))}{more} "
                         f"hold NaN/Inf in {dtype or 'their dtype'}")


class IPCBuffer:
    """One GPU buffer of this trainer process, exported for CUDA IPC once and reused by every sync.

    Each chunk of a sync is packed into it (each tensor cast to the sampler's dtype in the copy,
    on the GPU) and handed to the engines as vLLM's packed IPC update info; the engine reads it in
    place. vLLM ships a producer (`packed_ipc_producer`) that allocates and exports a new buffer per
    sync; vLLM 0.26's consumer then releases the mapping once per chunk, which drives torch's
    cross-process reference count negative, so every dropped buffer stays allocated (vLLM 0.32
    documents this in its PackedBufferImporter): on the H200 the RL run's GPU memory grew by the
    bucket size, ~1 GiB, per sync (RESULTS.md). A buffer that is never dropped cannot leak, so the
    trainer keeps this one for the run; its size is the bucket, or the whole update if smaller.

    With several trainer ranks every rank packs its own full copy; the handles are gathered once,
    so each engine finds the copy on its own GPU, and a barrier brackets each chunk.
    """

    def __init__(self, nbytes: int):
        import torch
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        _, args = reduce_tensor(self.tensor)
        handle = {str(torch.cuda.get_device_properties(self.tensor.device).uuid): args}
        self.multi_rank = dist.is_initialized() and dist.get_world_size() > 1
        if self.multi_rank:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, handle)
            handle = {k: v for h in gathered for k, v in h.items()}
        self.handle = handle

    def barrier(self) -> None:
        if self.multi_rank:
            import torch.distributed as dist

            dist.barrier()

    def chunks(self, named_tensors: Iterable, dtype, limit: int | None = None) -> Iterable[dict]:
        """Pack (name, GPU tensor) pairs, cast to `dtype` (None: as they are), into chunks of at most
        `limit` bytes (default: the buffer); each chunk is yielded as {names, shapes, dtype_names,
        tensor_sizes} once its bytes are on the GPU. The consumer must be done with a chunk before
        the generator is resumed."""
        import torch

        limit = self.nbytes if limit is None else limit
        if not 0 < limit <= self.nbytes:
            raise ValueError(f"limit: expected 0 < limit <= {self.nbytes} (the buffer), got {limit}")

        chunk, used = _new_chunk(), 0
        for name, t in named_tensors:
            out_dtype = dtype or t.dtype
            size = t.numel() * out_dtype.itemsize
            if size > limit:
                raise ValueError(f"tensor {name!r} is {size} bytes, more than an IPC chunk's {limit} "
                                 f"(rollout.ipc_bucket_bytes); use at least {size}")
            if used and used + size > limit:
                torch.cuda.current_stream().synchronize()
                yield chunk
                chunk, used = _new_chunk(), 0
            if used % out_dtype.itemsize:
                raise ValueError(f"tensor {name!r} ({out_dtype}) would start at byte {used} of the IPC buffer, "
                                 "which is not a multiple of its element size: one dtype per sync")
            self.tensor[used:used + size].view(out_dtype).view(t.shape).copy_(t)
            chunk["names"].append(name)
            chunk["shapes"].append(list(t.shape))
            chunk["dtype_names"].append(str(out_dtype).removeprefix("torch."))
            chunk["tensor_sizes"].append(size)
            used += size
        if used:
            torch.cuda.current_stream().synchronize()
            yield chunk


def _new_chunk() -> dict:
    return {"names": [], "shapes": [], "dtype_names": [], "tensor_sizes": []}


_BUFFERS: dict[int, IPCBuffer] = {}  # this process's buffer, by CUDA device index


def ipc_buffer(nbytes: int) -> IPCBuffer:
    """This process's IPC buffer on the current CUDA device, created at the first sync; a sync that
    needs more (a bigger bucket) replaces it (the old one is then not reclaimed: see IPCBuffer)."""
    import torch

    device = torch.cuda.current_device()
    buf = _BUFFERS.get(device)
    if buf is None or buf.nbytes < nbytes:
        buf = _BUFFERS[device] = IPCBuffer(nbytes)
    return buf


def plan_buffer_bytes(metas: Iterable, bucket_bytes: int) -> int:
    """The IPC buffer a sync of `metas` ((name, shape, dtype name)) needs: the bucket, or the whole
    update if smaller. Raises ValueError naming rollout.ipc_bucket_bytes when one tensor is larger
    than the bucket (before anything moves)."""
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


def send_ipc(trainer, client, *, model_dir: str, dtype: str | None,
             bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES) -> dict:
    """One CUDA IPC sync of `trainer`'s weights into the engines behind `client`, run in the
    trainer's process on every trainer rank (each rank's copy serves the engine on its GPU; rank 0
    drives the client). Returns {"seconds": {phase: s}, "bytes", "sent_bytes", "chunks",
    "kernel_experts"}.

    Nothing is applied before the whole update passed two checks: NaN/Inf in the sampler's dtype
    on every rank's GPU (`TrainerWorker.nonfinite_weights`, all-reduced), and the engines' plan of
    the update's names, shapes and dtypes (`RolloutWorker.plan_weight_update`, from metadata
    alone); either raises ValueError, on every rank. Then the stream: with kernel-format experts
    (the engines' plan says so) the routed experts first, fused, then the rest in checkpoint format
    through vLLM's reload; else everything in checkpoint format.

    Phases (seconds): check, plan, start, pack (gathering and casting into the buffer, on this
    rank), send (the engines' chunk calls, as this rank sees them), finish; and the engines' own
    time per phase as engine_* (RolloutWorker.finish_weight_update), so that send minus
    engine_kernel and engine_reload is the transport's overhead.
    """
    import torch

    from rollout import adapter, weights as wts

    rank = trainer.rank
    clock = _Clock()
    dtype = trainer.sync_dtype(dtype)
    metas = trainer_checked_metas(trainer, dtype, clock)

    def decide(client):
        buffer_bytes = plan_buffer_bytes(metas, bucket_bytes)
        plans = client.plan_weight_update(metas)
        return {"buffer_bytes": buffer_bytes, "kernel": agreed_kernel_experts(plans), "bytes": plans[0]["bytes"]}

    decision = _rank0_decides(rank, decide, client)
    clock.lap("plan")
    spec = _checkpoint_spec(model_dir)
    out_dtype = getattr(torch, dtype) if dtype else None
    buf = ipc_buffer(decision["buffer_bytes"])
    kernel = decision["kernel"]
    if kernel:
        passes = [lambda n: wts.is_fused_experts(spec, n), lambda n: not wts.is_fused_experts(spec, n)]
    else:
        passes = [lambda n: True]
    if rank == 0:
        if adapter.ipc_needs_init():
            client.init_weight_transfer_engine({"packed": True})
        client.start_weight_update()
    clock.lap("start")
    sent = {"bytes": 0, "chunks": 0}
    for select in passes:
        stream = wts.to_checkpoint_names(spec, trainer.iter_device_weights(select), kernel_experts=kernel)
        for chunk in buf.chunks(stream, out_dtype, decision["buffer_bytes"]):
            buf.barrier()  # every rank's copy of this chunk is on its GPU
            clock.lap("pack")
            if rank == 0:
                client.update_weights(adapter.ipc_update_info(chunk, buf.handle))
            buf.barrier()  # the engines are done with it: the buffer may be overwritten
            clock.lap("send")
            sent["bytes"] += sum(chunk["tensor_sizes"])
            sent["chunks"] += 1
    return _finished(rank, client, clock, bytes=decision["bytes"], sent_bytes=sent["bytes"], chunks=sent["chunks"],
                     kernel_experts=kernel)


def trainer_checked_metas(trainer, dtype: str | None, clock: "_Clock") -> list:
    """The trainer's (name, shape, dtype name) per tensor, once its NaN/Inf check passed on every
    rank's GPU (ValueError naming the tensors otherwise, before anything moves)."""
    refuse_nonfinite(trainer.nonfinite_weights(dtype), dtype)
    clock.lap("check")
    return trainer.weight_metadata(dtype)


def _rank0_decides(rank: int, decide, client) -> dict:
    """`decide(client)` on rank 0 (the engines' plan of the update), its dict on every rank; a
    failure there raises on every rank (ValueError for a refusal), so no rank waits for another."""
    decision, failure = None, None
    if rank == 0:
        try:
            decision = decide(client)
        except Exception as e:  # noqa: BLE001 - re-raised here; the other ranks must not wait for rank 0
            failure = e
            decision = {"error": str(e) if isinstance(e, ValueError) else f"rank 0: {type(e).__name__}: {e}",
                        "refused": isinstance(e, ValueError)}
    decision = _from_rank0(decision)
    if failure is not None:
        raise failure
    if "error" in decision:
        raise (ValueError if decision["refused"] else RuntimeError)(decision["error"])
    return decision


# -- nccl ------------------------------------------------------------------------------------------

# vLLM's packed broadcast keeps this many buffers in flight on each side (its default).
NCCL_NUM_BUFFERS = 2
_NCCL: dict = {}  # this trainer process's NCCL group: {"key": (world size, buffer), "token", "group"}


def nccl_world(plans: list[dict]) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the trainer-engines NCCL group: the trainer is
    rank 0, then each engine's workers (its plan's `workers`: tensor-parallel ranks) in turn."""
    offsets, nxt = [], 1
    for p in plans:
        offsets.append(nxt)
        nxt += int(p["workers"])
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


def _nccl_group(client, decision: dict, address: str):
    """The NCCL group of this trainer process and the engines: the one joined before when every
    engine reports its token (address:port) and the size and buffer are unchanged; else a new one
    on a fresh port (a new or restarted engine, another set of engines), every engine joining while
    rank 0 opens its end (a rendezvous)."""
    from rollout import adapter

    key = (decision["world_size"], decision["buffer_bytes"])
    if _NCCL.get("key") == key and all(g == _NCCL["token"] for g in decision["groups"]):
        return _NCCL["group"]
    _NCCL.clear()
    port = _free_port(address)
    infos = [(adapter.nccl_init_info(address, port, off, decision["world_size"], decision["buffer_bytes"],
                                     NCCL_NUM_BUFFERS),) for off in decision["offsets"]]
    pending = client.begin("init_weight_transfer_engine", infos)
    group = adapter.nccl_trainer_group(address, port, decision["world_size"])
    client.wait(pending)
    _NCCL.update(key=key, token=f"{address}:{port}", group=group)
    return group


def send_nccl(trainer, client, *, model_dir: str, dtype: str | None,
              bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES, address: str = "127.0.0.1") -> dict:
    """One NCCL sync of `trainer`'s weights into the engines behind `client` (on other GPUs), run
    in the trainer's process on every trainer rank (each gathers the full tensors; rank 0 sends).
    `address`: rank 0's address the engines reach for the rendezvous. Returns what send_ipc does.

    The same checks as send_ipc before anything moves (NaN/Inf on every rank's GPU; the engines'
    plan from metadata alone, which for nccl is the checkpoint format: vLLM's NCCL engine loads
    what it receives through the model's load_weights). Then one update: the engines enter their
    receive (vLLM's packed consumer) with the stream's metadata while rank 0 broadcasts the same
    stream, cast to the sampler's dtype, with vLLM's packed producer (`bucket_bytes` per buffer,
    NCCL_NUM_BUFFERS in flight). A failure inside the broadcast cannot be undone: the engines then
    refuse to sample until a later update completes (as for ipc)."""
    import torch

    from rollout import adapter, weights as wts

    rank = trainer.rank
    clock = _Clock()
    dtype = trainer.sync_dtype(dtype)
    metas = trainer_checked_metas(trainer, dtype, clock)
    spec = _checkpoint_spec(model_dir)
    stream_metas: list = []

    def decide(client):
        plans = client.plan_weight_update(metas)
        if agreed_kernel_experts(plans):
            raise ValueError("rollout.weight_sync: 'nccl' streams checkpoint format; these engines expect "
                             "kernel-format experts (built for weight_sync='ipc')")
        stream_metas[:] = checkpoint_metadata(spec, metas)
        world_size, offsets = nccl_world(plans)
        return {"buffer_bytes": plan_buffer_bytes(stream_metas, bucket_bytes), "bytes": plans[0]["bytes"],
                "world_size": world_size, "offsets": offsets,
                "groups": [p.get("transfer_group") for p in plans]}

    decision = _rank0_decides(rank, decide, client)
    clock.lap("plan")
    out_dtype = getattr(torch, dtype) if dtype else None
    group = None
    if rank == 0:
        group = _nccl_group(client, decision, address)
        client.start_weight_update()
    clock.lap("start")
    stream = wts.to_checkpoint_names(spec, trainer.iter_device_weights(), kernel_experts=False)
    if rank == 0:
        info = adapter.nccl_update_info(stream_metas, decision["buffer_bytes"], NCCL_NUM_BUFFERS)
        pending = client.begin("update_weight_chunk", [(info,)] * len(decision["offsets"]))
        adapter.nccl_send(group, stream, out_dtype, decision["buffer_bytes"], NCCL_NUM_BUFFERS)
        torch.cuda.synchronize()  # the broadcasts read live parameters: done before the next step
        client.wait(pending)
    else:
        for _ in stream:  # the full tensors are gathered collectively: every rank takes part
            pass
    clock.lap("send")
    return _finished(rank, client, clock, bytes=decision["bytes"], sent_bytes=decision["bytes"], chunks=1,
                     kernel_experts=False)


def _finished(rank: int, client, clock: "_Clock", **result) -> dict:
    """End the engines' update (rank 0) and return the sync's report: `result` plus the seconds per
    phase, the engines' own as engine_* (RolloutWorker.finish_weight_update)."""
    engine = {}
    if rank == 0:
        done = client.finish_weight_update()
        engine = {f"engine_{k}": v for k, v in (done or {}).get("seconds", {}).items()}
    clock.lap("finish")
    return {"seconds": {**clock.laps, **engine, "total": clock.total()}, **result}


@functools.lru_cache(maxsize=4)
def _checkpoint_spec(model_dir: str):
    """The base checkpoint's layout (read once per folder: its safetensors headers; a run's base
    model does not change while it runs)."""
    from rollout import weights as wts

    return wts.CheckpointSpec.from_dir(model_dir)


class _Clock:
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


def push_ipc_local(trainer, workers: list, *, model_dir: str, dtype: str | None,
                   bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES, client=None) -> dict:
    """One CUDA IPC sync from a one-rank trainer into RolloutWorkers of this process (tests and
    benchmarks; rl/weight_sync.py runs the same `send_ipc` inside the trainer's Ray actors).
    `client` replaces LocalClient(*workers)."""
    return send_ipc(trainer, client or LocalClient(*workers), model_dir=model_dir, dtype=dtype,
                    bucket_bytes=bucket_bytes)


def agreed_kernel_experts(plans: list[dict]) -> bool:
    """Whether the engines' plans take the experts in kernel format; they must all agree (one stream)."""
    kinds = {bool(p["kernel_experts"]) for p in plans}
    if len(kinds) != 1:
        raise ValueError("weight sync: the engines disagree on kernel-format experts (their moe_impl or "
                         "tensor_parallel_size differ); one sync streams one layout")
    return kinds.pop()
