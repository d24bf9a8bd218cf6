"""The trainer -> rollout weight sync over Ray actors (the transports are in rollout/sync.py; the
whole is described in docs/WEIGHT_SYNC.md).

    push_streamed("ipc", trainers, rollouts, dtype="bfloat16", model_dir=..., bucket_bytes=1 << 30)

ipc / nccl: one call into every trainer rank's actor, which runs the mode's rollout.sync.sender
there (its GPU tensors cannot leave the process as tensors): the NaN/Inf check on every rank's GPU,
the engines' plan of the whole update, then the stream through the rank's CUDA IPC buffer (or rank
0's NCCL broadcast) into vLLM's weight-transfer engine, rank 0 driving the engines through
`RayClient`. Nothing is applied before both checks passed for the whole update.
files: rank 0's weights through Ray's object store into RolloutWorker.update_weights (rl/pipeline.py).
"""

from __future__ import annotations

from rollout import sync
from rollout.sync_interface import EngineClient


ENGINE_METHODS = ("init_weight_transfer_engine", "plan_weight_update", "start_weight_update", "update_weight_chunk",
                  "finish_weight_update", "abort_weight_update")


class RayCalls:
    """rollout.sync_interface.Calls over RolloutWorker actors: `method` names one of RolloutHost's
    engine-side methods (ENGINE_METHODS; the Calls protocol names them), called as that typed actor
    method. `each` calls
    every engine at once and returns when all of them are done (a chunk's buffer is reused for the
    next chunk only after that). An actor runs one caller's calls in order, so an abort sent after
    a failed wait comes after every engine's plan-and-start call."""

    def __init__(self, hosts: list):
        self.hosts = list(hosts)
        self.count = len(self.hosts)

    def begin(self, method: str, args: list[tuple]) -> list:
        if method not in ENGINE_METHODS:
            raise ValueError(f"method: expected one of {ENGINE_METHODS} (RolloutHost's weight-sync methods), "
                             f"got {method!r}")
        return [getattr(h, method).remote(*a) for h, a in zip(self.hosts, args, strict=True)]

    def wait(self, pending: list) -> list:
        import ray

        return ray.get(pending)

    def each(self, method: str, *args) -> list:
        return self.wait(self.begin(method, [args] * self.count))


class RayClient(EngineClient):
    """The engine client (rollout.sync_interface.EngineClient) over RolloutWorker actors."""

    def __init__(self, hosts: list):
        super().__init__(RayCalls(hosts))


def send_from_trainer(trainer, mode: str, rollout_hosts: list, model_dir: str, dtype: str | None,
                      bucket_bytes: int) -> dict:
    """Runs in a TrainerWorker's actor (TrainerHost.send_weights): the mode's sender on this rank (nccl: the
    engines reach rank 0 at this node's address); its report as a dict."""
    import ray

    sender = sync.sender(mode, model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes,
                         address=ray.util.get_node_ip_address())
    return sender.send(trainer, RayClient(rollout_hosts)).to_wire()


def push_streamed(mode: str, trainers: list, rollouts: list, *, dtype: str | None, model_dir: str,
                  bucket_bytes: int) -> dict:
    """One streamed sync (`mode` ipc or nccl) into `rollouts`: rank 0's report (SyncReport's wire
    form: {"seconds": {phase: s}, "bytes", "sent_bytes", "chunks", "format", "why"}). Raises
    ValueError before anything is applied when a weight is non-finite or the update does not fit
    the checkpoint."""
    import ray

    return ray.get([t.send_weights.remote(mode, rollouts, model_dir, dtype, bucket_bytes) for t in trainers])[0]
