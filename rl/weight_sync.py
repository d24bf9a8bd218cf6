"""The trainer -> rollout weight sync over Ray actors (the transports are in rollout/sync.py).

    push(trainers, rollouts, mode="ipc", dtype="bfloat16", model_dir=..., bucket_bytes=1 << 30)

ipc: (1) every trainer rank checks its shards for NaN/Inf in the sampler's dtype, on its GPU;
(2) every engine checks the update's names, shapes and dtypes (from the trainer's metadata) against
its checkpoint; (3) every trainer rank streams its full tensors through its CUDA IPC buffer into vLLM's
weight-transfer engine (`send_from_trainer`, run inside the trainer's actor; rollout/sync.py), rank
0 driving the engines through `RayClient`. Nothing is applied before (1) and (2) passed for the whole update.
files: rank 0's weights through Ray's object store into RolloutWorker.update_weights.
"""

from __future__ import annotations

import time


class RayClient:
    """vLLM's trainer-side client protocol (init / start / update / finish) over RolloutWorker actors:
    each call goes to every engine and returns when all of them are done (a chunk's buffer is
    reused for the next chunk only after that)."""

    def __init__(self, hosts: list):
        self.hosts = list(hosts)

    def _all(self, method: str, *args):
        import ray

        return ray.get([h.call.remote(method, *args) for h in self.hosts])

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weight_chunk", update_info)

    def finish_weight_update(self) -> None:
        self._all("finish_weight_update")


def send_from_trainer(trainer, rollout_hosts: list, model_dir: str, dtype: str | None, buffer_bytes: int,
                      kernel_experts: bool) -> dict:
    """Runs in a TrainerWorker's actor (WorkerHost.run): its full GPU tensors into the engines."""
    from rollout.sync import send_ipc

    return send_ipc(trainer.iter_device_weights, model_dir, RayClient(rollout_hosts), dtype=dtype,
                    buffer_bytes=buffer_bytes, kernel_experts=kernel_experts, rank=trainer.rank)


def push_ipc(trainers: list, rollouts: list, *, dtype: str | None, model_dir: str, bucket_bytes: int) -> dict:
    """One CUDA IPC sync into `rollouts`; {phase: seconds, "bytes": ...}. Raises ValueError before
    anything is applied when a weight is non-finite or the update does not fit the checkpoint."""
    import ray

    from rollout.sync import agreed_kernel_experts, plan_buffer_bytes, refuse_nonfinite

    t0 = time.perf_counter()
    dtype = ray.get(trainers[0].call.remote("sync_dtype", dtype))
    refuse_nonfinite(ray.get([t.call.remote("nonfinite_weights", dtype) for t in trainers])[0], dtype)
    t_check = time.perf_counter()
    metas = ray.get(trainers[0].call.remote("weight_metadata", dtype))
    buffer_bytes = plan_buffer_bytes(metas, bucket_bytes)
    plans = ray.get([r.call.remote("plan_weight_update", metas) for r in rollouts])
    kernel = agreed_kernel_experts(plans)
    t_plan = time.perf_counter()
    sent = ray.get([t.run.remote("rl.weight_sync:send_from_trainer", rollouts, model_dir, dtype, buffer_bytes,
                                 kernel) for t in trainers])[0]
    t_end = time.perf_counter()
    return {"check": t_check - t0, "plan": t_plan - t_check, "transfer": t_end - t_plan,
            "bytes": plans[0]["bytes"], "sent_bytes": sent["bytes"], "chunks": sent["chunks"]}
