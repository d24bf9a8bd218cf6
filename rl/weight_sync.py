"""The trainer -> rollout weight sync over Ray actors (the transports are in rollout/sync.py).

    push_streamed("ipc", trainers, rollouts, dtype="bfloat16", model_dir=..., bucket_bytes=1 << 30)

ipc / nccl: one call into every trainer rank's actor, which runs rollout.sync.send_ipc (or
rollout.sync_nccl.send_nccl) there (its GPU tensors cannot leave the process as tensors): the NaN/Inf check on every
rank's GPU, the engines' plan of the whole update, then the stream through the rank's CUDA IPC
buffer (or rank 0's NCCL broadcast) into vLLM's weight-transfer engine, rank 0 driving the engines
through `RayClient`. Nothing is applied before both checks passed for the whole update.
files: rank 0's weights through Ray's object store into RolloutWorker.update_weights (rl/loop.py).
"""

from __future__ import annotations


class RayClient:
    """rollout.sync's client protocol over RolloutWorker actors: begin / wait (the plan-and-start
    call, NCCL's init handshake and receive), then update, finish or abort, each to every engine
    and returning when all of them are done (a chunk's buffer is reused for the next chunk only
    after that). An actor runs one caller's calls in order, so an abort sent after a failed wait
    comes after every engine's plan-and-start call."""

    def __init__(self, hosts: list):
        self.hosts = list(hosts)

    @property
    def engines(self) -> int:
        return len(self.hosts)

    def _all(self, method: str, *args) -> list:
        import ray

        return ray.get([h.call.remote(method, *args) for h in self.hosts])

    def begin(self, method: str, args: list[tuple]) -> list:
        """`method` on every engine (engine i with args[i]), not waited for (an NCCL collective needs
        the engines inside their call while the trainer makes its own); `wait` joins them."""
        return [h.call.remote(method, *a) for h, a in zip(self.hosts, args, strict=True)]

    def wait(self, pending: list) -> list:
        import ray

        return ray.get(pending)

    def abort_weight_update(self, why: str) -> None:
        self._all("abort_weight_update", why)

    def update_weights(self, update_info: dict) -> list:
        return self._all("update_weight_chunk", update_info)

    def finish_weight_update(self) -> dict:
        return self._all("finish_weight_update")[0]


def send_from_trainer(trainer, mode: str, rollout_hosts: list, model_dir: str, dtype: str | None,
                      bucket_bytes: int) -> dict:
    """Runs in a TrainerWorker's actor (WorkerHost.run): rollout.sync.send_ipc / send_nccl on this
    rank (nccl: the engines reach rank 0 at this node's address)."""
    from rollout import sync, sync_nccl

    client = RayClient(rollout_hosts)
    if mode == "ipc":
        return sync.send_ipc(trainer, client, model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes)
    if mode == "nccl":
        import ray

        return sync_nccl.send_nccl(trainer, client, model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes,
                              address=ray.util.get_node_ip_address())
    raise ValueError(f"mode: expected one of {sync.STREAMED}, got {mode!r}")


def push_streamed(mode: str, trainers: list, rollouts: list, *, dtype: str | None, model_dir: str,
                  bucket_bytes: int) -> dict:
    """One streamed sync (`mode` ipc or nccl) into `rollouts`: rank 0's {"seconds": {phase: s},
    "bytes", ...} (rollout.sync.send_ipc / send_nccl). Raises ValueError before anything is applied
    when a weight is non-finite or the update does not fit the checkpoint."""
    import ray

    return ray.get([t.run.remote("rl.weight_sync:send_from_trainer", mode, rollouts, model_dir, dtype,
                                 bucket_bytes) for t in trainers])[0]
