"""Weight sync from the trainer to the rollout engines: one seam, three transports.

    mode = resolve("auto", colocated=True, on_gpu=True)            # -> "ipc"
    send_ipc(trainer.iter_device_weights("bfloat16"), model_dir, LocalClient(rollout_worker),
             bucket_bytes=1 << 30, rank=0)                          # in the trainer's process

Transports (`rollout.weight_sync`):
- `ipc`: trainer rank and vLLM worker on the same GPU. vLLM's own CUDA IPC weight-transfer engine
  (`vllm.distributed.weight_transfer`, backend "ipc"): the trainer packs tensors, already in the
  sampler's dtype and the checkpoint's on-disk names, into one reusable GPU buffer and hands its
  IPC handle to the engine, which reads the bytes in place and loads them through vLLM's
  layer-wise reload; nothing leaves the GPU. The version-specific calls are in rollout/adapter.py.
- `nccl`: trainer and sampler on different GPUs; vLLM's NCCL engine (not available in this
  release of the project: refused at config time, see `resolve`).
- `files`: safetensors buckets in /dev/shm (rollout/weights.py): the CPU transport.

Every update is checked before any byte is applied: names, shapes and dtypes of the whole update
against the checkpoint (`RolloutWorker.plan_weight_update`, from metadata alone) and NaN/Inf on
the trainer's GPU (`TrainerWorker.nonfinite_weights`). Each chunk is then checked against that
plan on arrival. A failure *while* chunks are being applied (a process dying, a CUDA error) cannot
be undone without a second copy of the weights: the engine then refuses to sample until a later
update completes (RolloutWorker's broken state), rather than serve a mix of old and new weights.

A client is vLLM's `VLLMWeightSyncClient` shape (init / start / update / finish); `LocalClient`
drives a RolloutWorker object in this process, rl/ has the Ray one.

This module imports nothing heavy at import time, so the config loader can call `resolve`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

MODES = ("files", "ipc", "nccl")
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
        # Separate GPUs: files, through host memory, until the NCCL engine is wired (then nccl).
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
    if mode == "nccl":
        if colocated and same_gpu:
            raise ValueError(f"{key}: 'nccl' needs the trainer and the sampler on different GPUs (NCCL "
                             f"cannot join two ranks on one device); this placement shares a GPU, where "
                             f"{key}=ipc works")
        raise ValueError(f"{key}: 'nccl' (vLLM's NCCL weight-transfer engine) is not provided by this "
                         f"release; use {key}=files for separate GPUs, or colocate them for ipc")
    return mode


class LocalClient:
    """vLLM's trainer-side client protocol over RolloutWorker objects in this process."""

    def __init__(self, *workers):
        self.workers = workers

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        for w in self.workers:
            w.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        for w in self.workers:
            w.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        for w in self.workers:
            w.update_weight_chunk(update_info)

    def finish_weight_update(self) -> None:
        for w in self.workers:
            w.finish_weight_update()


def refuse_nonfinite(bad: list[str], dtype: str | None) -> None:
    """The refusal of an update with NaN/Inf weights (the trainer's check), before anything moves."""
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"weight sync refused, nothing applied: tensor(s) {', '.join(map(repr, bad[:3]))}{more} "
                         f"hold NaN/Inf in {dtype or 'their dtype'}")


def send_ipc(named_tensors: Iterable, model_dir: str, client, *, bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES,
             rank: int = 0) -> dict:
    """Stream the trainer's (name, GPU tensor) pairs into the engines behind `client` by CUDA IPC.

    Runs in the trainer's process, on every trainer rank (each rank's tensors serve the engine on
    its GPU; rank 0 drives the client). The engines must have been given the update's plan first
    (`RolloutWorker.plan_weight_update`). Returns {"seconds", "bytes"} of this rank's stream.
    """
    from rollout import adapter, weights

    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: expected a positive int, got {bucket_bytes!r}")
    spec = weights.CheckpointSpec.from_dir(model_dir)
    sent = {"bytes": 0}

    def counted():
        for name, t in weights.to_checkpoint_names(spec, named_tensors):
            sent["bytes"] += t.numel() * t.element_size()
            yield name, t

    t0 = time.perf_counter()
    adapter.trainer_send_ipc(counted(), client, bucket_bytes=bucket_bytes, rank=rank)
    return {"seconds": time.perf_counter() - t0, "bytes": sent["bytes"]}


def push_ipc_local(trainer, workers: list, *, model_dir: str, dtype: str | None,
                   bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES, client=None) -> dict:
    """One CUDA IPC sync from a one-rank trainer into RolloutWorkers of this process (tests and
    benchmarks; rl/weight_sync.py is the same three steps over Ray actors): NaN/Inf check on the
    trainer's GPU, the engines' plan of the whole update, then the stream. Raises ValueError before
    anything is applied when the first two fail. `client` replaces LocalClient(*workers)."""
    t0 = time.perf_counter()
    refuse_nonfinite(trainer.nonfinite_weights(dtype), dtype)
    t_check = time.perf_counter()
    metas = trainer.weight_metadata(dtype)
    plans = [w.plan_weight_update(metas) for w in workers]
    t_plan = time.perf_counter()
    sent = send_ipc(trainer.iter_device_weights(dtype), model_dir, client or LocalClient(*workers),
                    bucket_bytes=bucket_bytes, rank=trainer.rank)
    t_end = time.perf_counter()
    return {"check_s": t_check - t0, "plan_s": t_plan - t_check, "transfer_s": t_end - t_plan,
            "seconds": t_end - t0, "bytes": plans[0]["bytes"], "sent_bytes": sent["bytes"]}
