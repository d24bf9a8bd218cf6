"""Weight sync from the trainer to the rollout engines: one seam, three transports.

    mode = resolve("auto", colocated=True, on_gpu=True)                      # -> "ipc"
    report = sender(mode, model_dir=model_dir, dtype="bfloat16").send(trainer, LocalClient(worker))

The interfaces (Sender, TrainerWeights, Engines, the one EngineClient) and the records are in
rollout/sync_interface.py; the engine's side (its update object and states) in
rollout/sync_engine.py; docs/WEIGHT_SYNC.md describes the whole for users and maintainers.

Transports (`rollout.weight_sync`; `sender` is the one place a mode becomes an implementation):
- `ipc` (`IpcSender`, here): trainer rank and vLLM worker on the same GPU, through vLLM's CUDA IPC
  weight-transfer engine (`vllm.distributed.weight_transfer`, backend "ipc"). The trainer packs
  its tensors, cast to the sampler's dtype in the copy, into one GPU buffer it exported once
  (`IPCBuffer`) and hands vLLM's packed update info (names, shapes, dtypes, sizes, the buffer's
  IPC handle) to the engine, which reads the bytes in place; nothing leaves the GPU. The engine's
  plan picks the layout (records.weights.FORMATS): where no layer of the engine computes from its weights after
  loading (megamoe's experts, unquantized linears on CUDA, one GPU per engine), every tensor comes
  in kernel format, as the engine's own parameter (q/k/v packed into qkv_proj, the experts whole),
  and is copied in place, with no vLLM reload (rollout/kernel_format.py); else the routed experts
  so and the rest in checkpoint format through vLLM's update session (its layer-wise reload); else
  everything in checkpoint format. The version-specific calls are in rollout/adapter.py.
  `IpcSender.publish` packs a version whole into one of `depth` buffers (`PublishedSlots`) that
  stays untouched until `release`, for each engine to take later (RolloutWorker.take_weights):
  the pull model of docs/WEIGHT_SYNC.md.
- `nccl` (`NcclSender`, rollout/sync_nccl.py): trainer and sampler on different GPUs, through
  vLLM's NCCL weight-transfer engine. Not yet run on two GPUs: opt in with rollout.weight_sync=nccl
  (`auto` keeps files for separate GPUs until it has been).
- `files` (`FilesSender`, rollout/sync_files.py): rank 0's weights, shared once, into every engine's
  RolloutWorker.update_weights (safetensors buckets in /dev/shm, rollout/weights.py): the CPU transport.

Every update is checked whole before any byte is applied, on both sides, and ends applied whole,
aborted with nothing applied, or broken (the engine refuses to sample until a complete update):
the invariants, and why each is checked where it is, are written in rollout/sync_stream.py (the
trainer's, T1-T6) and rollout/sync_engine.py (the engine's, E1-E4).

This module imports nothing heavy at import time, so the config loader can call `resolve`.
"""

from __future__ import annotations

from collections.abc import Iterable

from records.weights import EngineAnswer, PackedChunk, Publication, SyncReport, ipc_chunk, published_ipc
from rollout.sync_interface import Engines, LocalClient, Sender, TrainerWeights
from rollout.sync_stream import (DEFAULT_IPC_BUCKET_BYTES, Clock, StreamDecision, abort_on_failure, agreed_format,
                                 checked_and_started, checkpoint_spec, finished_report, plan_buffer_bytes,
                                 rank0_decides, refuse_nonfinite)

# Names the transports' callers and tests import from here, though defined beside the code they serve.
__all__ = ["AUTO", "DEFAULT_IPC_BUCKET_BYTES", "MODES", "STREAMED", "Clock", "IPCBuffer", "IpcSender",
           "LocalClient", "PublishedSlots", "checked_and_started", "ipc_buffer", "push_ipc_local", "release",
           "resolve", "send_ipc", "sender"]

MODES = ("files", "ipc", "nccl")
STREAMED = ("ipc", "nccl")  # the transports of the streamed protocol (plan and start, chunks); files is a Sender too
AUTO = "auto"


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


def sender(mode: str, *, model_dir: str, dtype: str | None, bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES,
           address: str | None = None, depth: int = 1) -> Sender:
    """The trainer's sender for `mode` (MODES): the one place a mode string becomes a transport.
    address: trainer rank 0's address the engines reach (nccl's rendezvous; None: the node's
    address as Ray sees it, found in the trainer's process). depth: ipc's published versions not
    yet taken, at most (PublishedSlots; run.max_async_steps + 1)."""
    if mode == "ipc":
        return IpcSender(model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes, depth=depth)
    if mode == "nccl":
        from rollout.sync_nccl import NcclSender  # here, not at the top: sync_nccl needs nothing of this module

        return NcclSender(model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes, address=address)
    if mode == "files":
        from rollout.sync_files import FilesSender

        return FilesSender(model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes)
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


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
    (`agreed`: a barrier that also carries a failure to every rank, T5).
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

    def chunks(self, named_tensors: Iterable, dtype, limit: int | None = None,
               start: int | None = None) -> Iterable[PackedChunk]:
        """Pack (name, GPU tensor) pairs, cast to `dtype` (None: as they are), into chunks of at most
        `limit` bytes (default: the buffer); each chunk is yielded as a PackedChunk once its bytes
        are on the GPU. A pair may carry a list of tensors instead: one
        tensor, their concatenation along dim 0 (a kernel-format parameter such as qkv_proj), each
        part copied into its place (T4). start None: every chunk fills the buffer from byte 0 (a
        streamed sync: the consumer must be done with a chunk before the generator is resumed);
        start an offset: the chunks lie one after another from there, each at a multiple of
        `ALIGN` (`PackedChunk.offset`), so that all of them stay readable (a published version)."""
        import torch

        limit = self.nbytes if limit is None else limit
        if not 0 < limit <= self.nbytes:
            raise ValueError(f"limit: expected 0 < limit <= {self.nbytes} (the buffer), got {limit}")
        base = 0 if start is None else start

        chunk, used = PackedChunk(offset=base), 0
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
                if start is not None:
                    base = aligned(base + used)
                chunk, used = PackedChunk(offset=base), 0
            if base + used + size > self.nbytes:
                raise ValueError(f"tensor {name!r} would end at byte {base + used + size} of an IPC buffer of "
                                 f"{self.nbytes}")
            if used % out_dtype.itemsize:
                raise ValueError(f"tensor {name!r} ({out_dtype}) would start at byte {used} of the IPC buffer, "
                                 "which is not a multiple of its element size: one dtype per sync")
            at = base + used
            for p in parts:
                n = p.numel() * out_dtype.itemsize
                self.tensor[at:at + n].view(out_dtype).view(p.shape).copy_(p)
                at += n
            chunk.names.append(name)
            chunk.shapes.append(shape)
            chunk.dtype_names.append(str(out_dtype).removeprefix("torch."))
            chunk.tensor_sizes.append(size)
            used += size
        if used:
            self._synchronize()
            yield chunk

    def region_handles(self, regions: list[tuple[int, int]]) -> list[dict]:
        """The IPC handle of each (offset, nbytes) region of the buffer, as an engine maps it (a view:
        the rebuilt tensor starts at the region's first byte), {GPU uuid: rebuild arguments} with
        every trainer rank's copy (a collective with several ranks)."""
        import torch
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(self.tensor.device).uuid)
        mine = [{uuid: reduce_tensor(self.tensor[at:at + n])[1]} for at, n in regions]
        if not self.multi_rank:
            return mine
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return [{k: v for per_rank in gathered for k, v in per_rank[i].items()} for i in range(len(regions))]

    def _synchronize(self) -> None:
        """The chunk's bytes are in the buffer (the copies are queued on this process's stream)."""
        import torch

        if self.tensor.is_cuda:
            torch.cuda.current_stream(self.tensor.device).synchronize()


ALIGN = 256  # a published chunk's first byte: a multiple of every dtype's size (and of CUDA's allocation grain)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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


class PublishedSlots:
    """This trainer process's buffers of published versions (IpcSender.publish), kept for the run:
    `depth` slots, version v in slot v % depth, each as large as one whole update in the sampler's
    dtype. A slot is written only when the version it held was released (`release`: every engine
    took it), so an engine's take reads exactly the bytes of its version however far the trainer
    trained meanwhile. At run.max_async_steps k the driver needs depth k + 1: version v is taken
    before the generation of step v + k returns, which train step v + k needs before it publishes
    v + k + 1. The buffers are never dropped (see IPCBuffer: a dropped exported buffer is not
    reclaimed under vLLM 0.26), so they cost depth x the update's bytes of GPU memory for the run,
    on each trainer rank's GPU."""

    def __init__(self, depth: int):
        self.depth = depth
        self.buffers: list[IPCBuffer | None] = [None] * depth
        self.held: dict[int, int] = {}  # slot: the version in it that not every engine has taken
        self.decisions: dict = {}  # the update's description: rank 0's StreamDecision (the engines' plan)

    def free_slot(self, version: int) -> int:
        """The slot version `version` goes into; RuntimeError, before anything is read or written,
        while that slot holds a version not yet released."""
        slot = version % self.depth
        if slot in self.held:
            raise RuntimeError(f"weight sync: cannot publish version {version}: its buffer (slot {slot} of "
                               f"{self.depth}) still holds version {self.held[slot]}, which not every engine has "
                               "taken (release it once every engine's take_weights returned; at "
                               "run.max_async_steps k publish with depth k + 1)")
        return slot

    def buffer(self, slot: int, nbytes: int) -> IPCBuffer:
        buf = self.buffers[slot]
        if buf is None or buf.nbytes < nbytes:
            buf = self.buffers[slot] = new_ipc_buffer(nbytes)
        return buf

    def release(self, version: int) -> None:
        slot = version % self.depth
        if self.held.get(slot) != version:
            raise ValueError(f"version: {version} is not published and held here (held: "
                             f"{sorted(self.held.values())})")
        del self.held[slot]


def new_ipc_buffer(nbytes: int) -> IPCBuffer:
    return IPCBuffer(nbytes)


_PUBLISHED: dict[int, PublishedSlots] = {}  # this process's published versions, by CUDA device index


def published_slots(depth: int) -> PublishedSlots:
    """This process's PublishedSlots on the current CUDA device, made at the first publish; `depth`
    must stay what it was (versions are placed by it)."""
    import torch

    if not (isinstance(depth, int) and depth >= 1):
        raise ValueError(f"depth: expected an int >= 1 (run.max_async_steps + 1), got {depth!r}")
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    slots = _PUBLISHED.get(device)
    if slots is None:
        slots = _PUBLISHED[device] = PublishedSlots(depth)
    if slots.depth != depth:
        raise ValueError(f"depth: this trainer publishes with depth {slots.depth}, got {depth}")
    return slots


def release(publication: Publication, reports: list[dict | None]) -> None:
    """Every engine has taken `publication`: its buffer may be written again.
    `reports`: each engine's take_weights report (or None for an engine whose take failed: it no
    longer reads the buffer), one per engine the version was published for; a report of another
    version is refused (ValueError), nothing released. files keeps nothing: a no-op."""
    mode, version = publication.mode, publication.version
    if mode == "files":
        return
    if mode != "ipc":
        raise ValueError(f"publication: mode {mode!r} is not one that publishes (files, ipc)")
    want = publication.payload["engines"]
    if len(reports) != want:
        raise ValueError(f"reports: version {version} was published for {want} engine(s), got {len(reports)} "
                         "report(s); release once every engine's take returned")
    other = [r.get("version") for r in reports if r is not None and r.get("version") != version]
    if other:
        raise ValueError(f"reports: releasing version {version}, but engines reported taking {other}")
    slots = next((s for s in _PUBLISHED.values() if version % s.depth in s.held), None)
    if slots is None:
        raise ValueError(f"version: {version} is not published and held in this process")
    slots.release(version)


class IpcSender(Sender):
    """The CUDA IPC transport: trainer rank and engine on one GPU (see the module docstring).

    Nothing is applied before the whole update passed two checks: NaN/Inf in the sampler's dtype
    on every rank's GPU (T1), and the engines' plan of the update's names, shapes and dtypes
    (RolloutWorker.plan_weight_update, from metadata alone, E1); either raises ValueError, on every
    rank. The two run at once: rank 0 asks the engines to plan and start the update, then checks
    while they do, and aborts the started update if either check refuses it or the stream fails
    before its end. Then the stream, in the format the engines' plan names (`FORMATS`): "kernel",
    every engine parameter packed from its trainer tensors in the plan's layout; "experts", the
    routed experts first, fused, then the rest in checkpoint format through vLLM's reload;
    "checkpoint", everything through vLLM's reload. The engines end the update when its last
    tensor arrives.

    Phases (seconds): check (with the engines' plan and start under way), plan (waiting for them
    after the check), pack (gathering and casting into the buffer, on this rank), send (the
    engines' chunk calls, as this rank sees them), finish; and the engines' own time per phase as
    engine_* (RolloutWorker.finish_weight_update), so that send minus engine_kernel and
    engine_reload is the transport's overhead.
    """

    mode = "ipc"

    def __init__(self, *, model_dir: str, dtype: str | None, bucket_bytes: int, depth: int = 1):
        super().__init__(model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes)
        self.depth = depth  # PublishedSlots' depth: versions published and not yet taken, at most

    def decide(self, answers: list[EngineAnswer], metas: list, dtype: str | None) -> StreamDecision:
        fmt, layout = agreed_format(answers), answers[0].layout
        # the tensors as they travel: in kernel format the engine's (qkv_proj is larger than q_proj)
        sent = [(name, shape, dtype) for name, shape, dtype, _ in layout] if fmt == "kernel" else metas
        return StreamDecision(format=fmt, why=answers[0].why, bytes=answers[0].bytes, layout=layout,
                              buffer_bytes=plan_buffer_bytes(sent, self.bucket_bytes))

    def send(self, weights: TrainerWeights, engines: Engines | None) -> SyncReport:
        import torch

        rank = weights.rank
        clock = Clock()
        dtype = weights.sync_dtype(self.dtype)
        decision = checked_and_started(weights, engines, dtype, clock,
                                       lambda plans, metas: self.decide(plans, metas, dtype))
        out_dtype = getattr(torch, dtype) if dtype else None
        fmt = decision.format
        streams = self._streams(weights, decision)
        sent_bytes, sent_chunks, done = 0, 0, None
        with abort_on_failure(engines if rank == 0 else None, "the trainer's stream failed"):
            buf = ipc_buffer(decision.buffer_bytes)
            for stream in streams:
                chunks = buf.chunks(stream(), out_dtype, decision.buffer_bytes)
                # every rank's copy of the chunk is on its GPU (None: the stream's end, on every rank)
                while (chunk := buf.agreed(lambda: next(chunks, None), "packing a chunk")) is not None:
                    clock.lap("pack")
                    # the engines are done with the chunk once this returns: the buffer may be overwritten
                    done = buf.agreed(lambda: engines.update_weights(ipc_chunk(chunk, buf.handle))
                                      if rank == 0 else None, "handing a chunk to the engines")
                    clock.lap("send")
                    sent_bytes += chunk.nbytes
                    sent_chunks += 1
        return finished_report(rank, engines, clock, done, bytes=decision.bytes, sent_bytes=sent_bytes,
                               chunks=sent_chunks, format=fmt, why=decision.why)


    def _streams(self, weights: TrainerWeights, decision: StreamDecision) -> list:
        """The trainer's tensors in the decided format, as functions each starting one stream."""
        from rollout import weights as wts

        spec = checkpoint_spec(self.model_dir)
        if decision.format == "kernel":
            return [lambda: kernel_stream(weights, decision.layout)]
        if decision.format == "experts":  # the experts whole first, then the rest in checkpoint format
            return [lambda fused=fused: wts.to_checkpoint_names(
                        spec, weights.iter_device_weights(lambda n: wts.is_fused_experts(spec, n) == fused),
                        kernel_experts=True) for fused in (True, False)]
        return [lambda: wts.to_checkpoint_names(spec, weights.iter_device_weights())]

    def publish(self, weights: TrainerWeights, engines: Engines | None, version: int) -> Publication | None:
        """Version `version` packed whole into a buffer of this rank's that stays untouched until
        `release` (PublishedSlots), for each engine to take later (RolloutWorker.take_weights runs
        the whole update from it, the trainer not taking part). Checked first, on every rank: the
        slot is free (RuntimeError), no NaN/Inf in the sampler's dtype (T1, ValueError), the
        engines' plan (E1, asked once per update description and kept: it depends on nothing
        else; T2, T3); nothing is written before all pass. Rank 0 returns the Publication."""
        import torch

        if not (isinstance(version, int) and version >= 0):
            raise ValueError(f"version: expected an int >= 0, got {version!r}")
        rank = weights.rank
        slots = published_slots(self.depth)
        slot = slots.free_slot(version)
        dtype = weights.sync_dtype(self.dtype)
        metas = weights.weight_metadata(dtype)
        refuse_nonfinite(weights.nonfinite_weights(dtype), dtype)  # all-reduced: the same on every rank
        key = (tuple((n, tuple(s), d) for n, s, d in metas), self.bucket_bytes)
        decision = slots.decisions.get(key)
        if decision is None:
            decision = rank0_decides(rank, lambda c: self.decide(c.ask_plans(metas), metas, dtype), engines)
            slots.decisions[key] = decision
        tensors = len(decision.layout) if decision.format == "kernel" else len(metas)
        # The chunks lie one after another, each at most the planned chunk size (the bucket, or the whole
        # update rounded up to MiB when it is smaller): room for the bytes, their alignment and one chunk.
        buf = slots.buffer(slot, max(decision.buffer_bytes, decision.bytes + ALIGN * (tensors + 2)))
        out_dtype = getattr(torch, dtype) if dtype else None
        packed, at = [], 0
        for stream in self._streams(weights, decision):
            chunks = buf.chunks(stream(), out_dtype, decision.buffer_bytes, start=at)
            while (chunk := buf.agreed(lambda: next(chunks, None), "packing a published chunk")) is not None:
                packed.append(chunk)
                at = aligned(chunk.offset + chunk.nbytes)
        handles = buf.region_handles([(c.offset, c.nbytes) for c in packed])
        slots.held[slot] = version  # from here until release, nothing writes this buffer
        if rank != 0:
            return None
        payload = published_ipc(metas=metas, format=decision.format, layout=decision.layout, nbytes=decision.bytes,
                                chunks=[ipc_chunk(c, h) for c, h in zip(packed, handles, strict=True)],
                                engines=engines.engines)
        return Publication(version=version, mode=self.mode, payload=payload)


def send_ipc(trainer, client, *, model_dir: str, dtype: str | None,
             bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES) -> SyncReport:
    """IpcSender's sync and its report."""
    return IpcSender(model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes).send(trainer, client)


def kernel_stream(trainer: TrainerWeights, layout: list) -> Iterable[tuple[str, list]]:
    """(engine parameter, [its trainer tensors, in order]) per entry of a kernel-format plan's
    layout, the trainer's tensors read once each in the layout's order (the same on every rank;
    T4: each name checked)."""
    tensors = trainer.iter_device_weights(names=[n for *_, parts in layout for n in parts])
    for engine_name, _, _, parts in layout:
        got = [next(tensors) for _ in parts]
        if [n for n, _ in got] != list(parts):
            raise RuntimeError(f"kernel-format stream: expected {parts} for {engine_name!r}, the trainer gave "
                               f"{[n for n, _ in got]}")
        yield engine_name, [t for _, t in got]


def push_ipc_local(trainer, workers: list, *, model_dir: str, dtype: str | None,
                   bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES, client=None) -> SyncReport:
    """One CUDA IPC sync from a one-rank trainer into RolloutWorkers of this process (tests and
    benchmarks; rl/weight_sync.py runs the same IpcSender inside the trainer's Ray actors).
    `client` replaces LocalClient(*workers)."""
    return send_ipc(trainer, client or LocalClient(*workers), model_dir=model_dir, dtype=dtype,
                    bucket_bytes=bucket_bytes)


