"""Weight sync from the trainer to the rollout engines: one seam, three transports.

    mode = resolve("auto", colocated=True, on_gpu=True)            # -> "ipc"
    push_ipc_local(trainer, [rollout_worker], model_dir=model_dir, dtype="bfloat16")  # one process

Transports (`rollout.weight_sync`):
- `ipc`: trainer rank and vLLM worker on the same GPU, through vLLM's CUDA IPC weight-transfer
  engine (`vllm.distributed.weight_transfer`, backend "ipc"). The trainer packs its tensors, cast to
  the sampler's dtype in the copy, into one GPU buffer it exported once (`IPCBuffer`) and hands
  vLLM's packed update info (names, shapes, dtypes, sizes, the buffer's IPC handle) to the engine,
  which reads the bytes in place; nothing leaves the GPU. The engine's plan picks the layout
  (`FORMATS`): where no layer of the engine computes from its weights after loading (megamoe's
  experts, unquantized linears on CUDA, one GPU per engine), every tensor comes in kernel format,
  as the engine's own parameter (q/k/v packed into qkv_proj, the experts whole), and is copied in
  place, with no vLLM reload (rollout/kernel_format.py); else the routed experts so and the rest in
  checkpoint format through vLLM's update session (its layer-wise reload); else everything in
  checkpoint format. The version-specific calls are in rollout/adapter.py.
- `nccl`: trainer and sampler on different GPUs, through vLLM's NCCL weight-transfer engine
  (rollout/sync_nccl.py). Not yet run on two GPUs: opt in with rollout.weight_sync=nccl (`auto`
  keeps files for separate GPUs until it has been).
- `files`: safetensors buckets in /dev/shm (rollout/weights.py): the CPU transport.

Every update is checked before any byte is applied: names, shapes and dtypes of the whole update
against the checkpoint (`RolloutWorker.plan_weight_update`, from metadata alone) and NaN/Inf on
the trainer's GPU (`TrainerWorker.nonfinite_weights`). The two run at once: the engines plan and
start the update while the trainer checks, and a refusal aborts the started update
(`RolloutWorker.abort_weight_update`), which leaves an engine that received nothing serving its
previous weights. Each chunk is then checked against that plan on arrival, and the engines end the
update when its last planned tensor arrives. A failure *while* chunks are being applied (a process
dying, a CUDA error, the trainer's stream failing between chunks) cannot be undone without a second
copy of the weights: the engine then refuses to sample until a later update completes
(RolloutWorker's broken state), rather than serve a mix of old and new weights. With several
trainer ranks, a failure on one of them (a refusal, rank 0's call to the engines, a rank's packing
between chunks) raises on every rank, so none waits for a rank that left.

A client drives the engines: `begin` / `wait` (calls made to every engine at once: the plan and
start, NCCL's init handshake and receive), `update_weights`, `finish_weight_update` (an update the
last chunk did not end), `abort_weight_update`; `LocalClient` drives RolloutWorker objects in this
process, rl/weight_sync.py has the Ray one.

This module imports nothing heavy at import time, so the config loader can call `resolve`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterable

MODES = ("files", "ipc", "nccl")
STREAMED = ("ipc", "nccl")  # the transports of the streamed protocol (plan and start, chunks)
# The layouts a streamed update comes in, most direct first (RolloutWorker.plan_weight_update picks):
# "kernel": every tensor as the engine's own parameter (rollout/kernel_format.py), copied in place,
#   no vLLM reload; where no layer computes from its weights after loading (ipc, one GPU per engine).
# "experts": the routed experts so (megamoe computes them), the rest through vLLM's layer-wise reload.
# "checkpoint": everything through vLLM's layer-wise reload (moe_impl stock, nccl, TP > 1).
FORMATS = ("kernel", "experts", "checkpoint")
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

    @property
    def engines(self) -> int:
        return len(self.workers)

    def begin(self, method: str, args: list[tuple]):
        """Call `method` on every engine (engine i with args[i]) without waiting: an NCCL collective
        needs the engines inside their call while the trainer makes its own. `wait` joins them."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=len(self.workers))
        futures = [pool.submit(getattr(w, method), *a) for w, a in zip(self.workers, args, strict=True)]
        pool.shutdown(wait=False)
        return futures

    def wait(self, pending) -> list:
        from concurrent.futures import wait

        wait(pending)  # every call has ended before a failure is raised (an abort must come after them)
        return [f.result() for f in pending]

    def abort_weight_update(self, why: str) -> None:
        for w in self.workers:
            w.abort_weight_update(why)

    def update_weights(self, update_info: dict) -> list:
        return [w.update_weight_chunk(update_info) for w in self.workers]

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
    so each engine finds the copy on its own GPU, and the ranks agree at each chunk's boundaries
    (`agreed`: a barrier that also carries a failure to every rank).
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

    def agreed(self, step, doing: str):
        """step() on this rank, then every rank's outcome at this chunk boundary, in place of a
        barrier: returns step's result once every rank's step returned; otherwise raises on every
        rank, the failing rank its own exception and the others a RuntimeError naming it (`doing`:
        what it failed at), so no rank is left at the next boundary waiting for one that left. A
        failure inside a collective of the stream (a rank's FSDP gather) is not covered: the other
        ranks then wait in that collective until the process group's timeout."""
        result, failure = None, None
        try:
            result = step()
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            failure = e
        if self.multi_rank:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([failure is not None], dtype=torch.int32, device=self.tensor.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():  # someone failed: every rank learns who and why
                words = [None] * dist.get_world_size()
                dist.all_gather_object(words, failure and f"{type(failure).__name__}: {failure}")
                if failure is None:
                    rank, word = next((r, w) for r, w in enumerate(words) if w is not None)
                    raise RuntimeError(f"weight sync: trainer rank {rank} failed {doing}: {word}")
        if failure is not None:
            raise failure
        return result

    def chunks(self, named_tensors: Iterable, dtype, limit: int | None = None) -> Iterable[dict]:
        """Pack (name, GPU tensor) pairs, cast to `dtype` (None: as they are), into chunks of at most
        `limit` bytes (default: the buffer); each chunk is yielded as {names, shapes, dtype_names,
        tensor_sizes} once its bytes are on the GPU. A pair may carry a list of tensors instead: one
        tensor, their concatenation along dim 0 (a kernel-format parameter such as qkv_proj), each
        part copied into its place. The consumer must be done with a chunk before the generator is
        resumed."""
        import torch

        limit = self.nbytes if limit is None else limit
        if not 0 < limit <= self.nbytes:
            raise ValueError(f"limit: expected 0 < limit <= {self.nbytes} (the buffer), got {limit}")

        chunk, used = _new_chunk(), 0
        for name, t in named_tensors:
            parts = list(t) if isinstance(t, (list, tuple)) else [t]
            t = parts[0]
            if any(p.dim() == 0 or p.shape[1:] != t.shape[1:] for p in parts[1:]):
                raise ValueError(f"tensor {name!r}: its parts {[list(p.shape) for p in parts]} do not stack "
                                 "along dim 0")
            shape = [sum(p.shape[0] for p in parts), *t.shape[1:]] if len(parts) > 1 else list(t.shape)
            out_dtype = dtype or t.dtype
            size = sum(p.numel() for p in parts) * out_dtype.itemsize
            if size > limit:
                raise ValueError(f"tensor {name!r} is {size} bytes, more than an IPC chunk's {limit} "
                                 f"(rollout.ipc_bucket_bytes); use at least {size}")
            if used and used + size > limit:
                self._synchronize()
                yield chunk
                chunk, used = _new_chunk(), 0
            if used % out_dtype.itemsize:
                raise ValueError(f"tensor {name!r} ({out_dtype}) would start at byte {used} of the IPC buffer, "
                                 "which is not a multiple of its element size: one dtype per sync")
            at = used
            for p in parts:
                n = p.numel() * out_dtype.itemsize
                self.tensor[at:at + n].view(out_dtype).view(p.shape).copy_(p)
                at += n
            chunk["names"].append(name)
            chunk["shapes"].append(shape)
            chunk["dtype_names"].append(str(out_dtype).removeprefix("torch."))
            chunk["tensor_sizes"].append(size)
            used += size
        if used:
            self._synchronize()
            yield chunk

    def _synchronize(self) -> None:
        """The chunk's bytes are in the buffer (the copies are queued on this process's stream)."""
        import torch

        if self.tensor.is_cuda:
            torch.cuda.current_stream(self.tensor.device).synchronize()


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
    "format", "why"} (why: the engines' reasons a more direct format was not taken).

    Nothing is applied before the whole update passed two checks: NaN/Inf in the sampler's dtype
    on every rank's GPU (`TrainerWorker.nonfinite_weights`, all-reduced), and the engines' plan of
    the update's names, shapes and dtypes (`RolloutWorker.plan_weight_update`, from metadata
    alone); either raises ValueError, on every rank. The two run at once: rank 0 asks the engines to
    plan and start the update, then checks while they do, and aborts the started update
    (`abort_weight_update`) if either check refuses it or the stream fails before its end. Then
    the stream, in the format the engines' plan names (`FORMATS`): "kernel", every engine
    parameter packed from its trainer tensors in the plan's layout; "experts", the routed experts
    first, fused, then the rest in checkpoint format through vLLM's reload; "checkpoint",
    everything through vLLM's reload. The engines end the update when its last tensor arrives.

    Phases (seconds): check (with the engines' plan and start under way), plan (waiting for them
    after the check), pack (gathering and casting into the buffer, on this rank), send (the
    engines' chunk calls, as this rank sees them), finish; and the engines' own time per phase as
    engine_* (RolloutWorker.finish_weight_update), so that send minus engine_kernel and
    engine_reload is the transport's overhead.
    """
    import torch

    from rollout import adapter, weights as wts

    rank = trainer.rank
    clock = Clock()
    dtype = trainer.sync_dtype(dtype)

    def decide(plans, metas):
        fmt, layout = agreed_format(plans), plans[0]["layout"]
        # the tensors as they travel: in kernel format the engine's (qkv_proj is larger than q_proj)
        sent = [(name, shape, dtype) for name, shape, dtype, _ in layout] if fmt == "kernel" else metas
        return {"buffer_bytes": plan_buffer_bytes(sent, bucket_bytes), "format": fmt, "why": plans[0]["why"],
                "layout": layout, "bytes": plans[0]["bytes"]}

    decision = checked_and_started(trainer, client, dtype, clock, decide)
    spec = checkpoint_spec(model_dir)
    out_dtype = getattr(torch, dtype) if dtype else None
    fmt = decision["format"]
    if fmt == "kernel":
        streams = [lambda: kernel_stream(trainer, decision["layout"])]
    elif fmt == "experts":  # the experts whole first, then the rest in checkpoint format
        streams = [lambda fused=fused: wts.to_checkpoint_names(
                       spec, trainer.iter_device_weights(lambda n: wts.is_fused_experts(spec, n) == fused),
                       kernel_experts=True) for fused in (True, False)]
    else:
        streams = [lambda: wts.to_checkpoint_names(spec, trainer.iter_device_weights())]
    sent = {"bytes": 0, "chunks": 0}
    done = None
    with abort_on_failure(client if rank == 0 else None, "the trainer's stream failed"):
        buf = ipc_buffer(decision["buffer_bytes"])
        for stream in streams:
            chunks = buf.chunks(stream(), out_dtype, decision["buffer_bytes"])
            # every rank's copy of the chunk is on its GPU (None: the stream's end, on every rank)
            while (chunk := buf.agreed(lambda: next(chunks, None), "packing a chunk")) is not None:
                clock.lap("pack")
                # the engines are done with the chunk once this returns: the buffer may be overwritten
                done = buf.agreed(lambda: client.update_weights(adapter.ipc_update_info(chunk, buf.handle))
                                  if rank == 0 else None, "handing a chunk to the engines")
                clock.lap("send")
                sent["bytes"] += sum(chunk["tensor_sizes"])
                sent["chunks"] += 1
    return finished_report(rank, client, clock, done, bytes=decision["bytes"], sent_bytes=sent["bytes"],
                           chunks=sent["chunks"], format=fmt, why=decision["why"])


def checked_and_started(trainer, client, dtype: str | None, clock: "Clock", decide) -> dict:
    """The checks of a streamed sync, with the engines' update started once they pass: rank 0 asks
    every engine to plan and start (`RolloutWorker.plan_weight_update(metas, start=True)`), every
    rank checks its weights for NaN/Inf on its GPU meanwhile, then rank 0 takes
    `decide(plans, metas)` (raising to refuse). Returns that decision on every rank; a refusal
    (ValueError, the NaN/Inf one first) raises on every rank, with the engines' update aborted."""
    rank = trainer.rank
    metas = trainer.weight_metadata(dtype)
    planning = client.begin("plan_weight_update", [(metas, True)] * client.engines) if rank == 0 else None
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


def kernel_stream(trainer, layout: list) -> Iterable[tuple[str, list]]:
    """(engine parameter, [its trainer tensors, in order]) per entry of a kernel-format plan's
    layout, the trainer's tensors read once each in the layout's order (the same on every rank)."""
    tensors = trainer.iter_device_weights(names=[n for *_, parts in layout for n in parts])
    for engine_name, _, _, parts in layout:
        got = [next(tensors) for _ in parts]
        if [n for n, _ in got] != list(parts):
            raise RuntimeError(f"kernel-format stream: expected {parts} for {engine_name!r}, the trainer gave "
                               f"{[n for n, _ in got]}")
        yield engine_name, [t for _, t in got]


def rank0_decides(rank: int, decide, client) -> dict:
    """`decide(client)` on rank 0 (a step only rank 0 takes with the engines: their plan of the
    update, joining their NCCL group), its dict on every rank; a failure there raises on every rank
    (ValueError for a refusal), so no rank waits for another."""
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


def finished_report(rank: int, client, clock: "Clock", done: list | None, **result) -> dict:
    """The sync's report: `result` plus the seconds per phase, the engines' own as engine_*
    (RolloutWorker.finish_weight_update). `done`: the engines' answers to the last chunk, their
    finish reports when that chunk completed the update; otherwise rank 0 ends it here."""
    engine = {}
    if rank == 0:
        if not done or any(d is None for d in done):
            done = [client.finish_weight_update()]
        engine = {f"engine_{k}": v for k, v in (done[0] or {}).get("seconds", {}).items()}
    clock.lap("finish")
    return {"seconds": {**clock.laps, **engine, "total": clock.total()}, **result}


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


def push_ipc_local(trainer, workers: list, *, model_dir: str, dtype: str | None,
                   bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES, client=None) -> dict:
    """One CUDA IPC sync from a one-rank trainer into RolloutWorkers of this process (tests and
    benchmarks; rl/weight_sync.py runs the same `send_ipc` inside the trainer's Ray actors).
    `client` replaces LocalClient(*workers)."""
    return send_ipc(trainer, client or LocalClient(*workers), model_dir=model_dir, dtype=dtype,
                    bucket_bytes=bucket_bytes)


def agreed_format(plans: list[dict]) -> str:
    """The format (`FORMATS`) the engines' plans take the update in; they must all agree, and on a
    kernel-format layout (one stream serves every engine)."""
    if len({(p["format"], repr(p["layout"])) for p in plans}) != 1:
        raise ValueError(f"weight sync: the engines take the update in different layouts "
                         f"({sorted({p['format'] for p in plans})}: their moe_impl, tensor_parallel_size or model "
                         "differ); one sync streams one layout")
    return plans[0]["format"]
