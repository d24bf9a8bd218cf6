"""The trainer -> rollout weight sync over Ray actors (the transports are in rollout/sync*.py; the
whole is described in docs/WEIGHT_SYNC.md).

    push("ipc", trainers, rollouts, dtype="bfloat16", model_dir=..., bucket_bytes=1 << 30)

Every mode (files, ipc, nccl) is one call into every trainer rank's actor
(`TrainerHost.send_weights(sender, engines)`), which runs the mode's rollout.sync.sender there: its
GPU tensors cannot leave the process as tensors, and every rank takes part in the gathers. Rank 0
drives the engines through `RayClient`, whose calls are the engines' typed endpoint
(rollout.sync_interface.EngineEndpoint, forwarded by rl.cluster.RolloutHost). The pull model (a
version published once, taken by each engine behind its generations, then released; files and ipc)
is driven by rl/pipeline.py's Publication through TrainerHost.publish_weights / release_weights and
RolloutHost.take_weights.
"""

from __future__ import annotations

from records.weights import Publication, SyncReport
from rollout import sync
from rollout.sync_interface import EngineClient


class RayEndpoint:
    """rollout.sync_interface.EngineEndpoint over one RolloutHost actor: each method starts the call
    and returns its ObjectRef (RayCalls.wait gets them)."""

    def __init__(self, host):
        self.host = host

    def plan_weight_update(self, metas: list, start: bool = False):
        return self.host.plan_weight_update.remote(metas, start)

    def update_weight_chunk(self, chunk: dict):
        return self.host.update_weight_chunk.remote(chunk)

    def finish_weight_update(self):
        return self.host.finish_weight_update.remote()

    def abort_weight_update(self, why: str):
        return self.host.abort_weight_update.remote(why)

    def init_weight_transfer_engine(self, join: dict):
        return self.host.init_weight_transfer_engine.remote(join)

    def update_weights(self, named_tensors):
        return self.host.update_weights.remote(named_tensors)

    def take_weights(self, publication: Publication):
        return self.host.take_weights.remote(publication)


class RayCalls:
    """rollout.sync_interface.Calls over RolloutHost actors. An actor runs one caller's calls in
    order, so an abort sent after a failed wait comes after every engine's plan-and-start call;
    `share` puts an object into Ray's object store once, for every engine to read."""

    def __init__(self, hosts: list):
        self.hosts = list(hosts)
        self.count = len(self.hosts)

    def begin(self, ops: list) -> list:
        return [op(RayEndpoint(h)) for h, op in zip(self.hosts, ops, strict=True)]

    def wait(self, pending: list) -> list:
        import ray

        return ray.get(pending)

    def share(self, obj):
        import ray

        return ray.put(obj)


class RayClient(EngineClient):
    """The engine client (rollout.sync_interface.EngineClient) over RolloutHost actors."""

    def __init__(self, hosts: list):
        super().__init__(RayCalls(hosts))


def push(mode: str, trainers: list, rollouts: list, *, dtype: str | None, model_dir: str,
         bucket_bytes: int) -> SyncReport:
    """One sync (`mode` in rollout.sync.MODES) into `rollouts`: rank 0's report. Raises
    ValueError before anything is applied when a weight is non-finite or the update does not fit
    the checkpoint."""
    import ray

    sender = sync.sender(mode, model_dir=model_dir, dtype=dtype, bucket_bytes=bucket_bytes)
    engines = RayClient(rollouts)
    return ray.get([t.send_weights.remote(sender, engines) for t in trainers])[0]
