"""Ray for the RL loop: the actor host Ray wraps for both worker kinds, the cluster, the placement
groups and their bundles (ray.placement colocated / disaggregated; described in docs/ARCHITECTURE.md)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket

from records import TrainBatch
from records.weights import EngineAnswer, Publication, SyncReport
from rl.config import Config

log = logging.getLogger("megamoe.rl")


# ---------------------------------------------------------------------------------------------
# Actor host: one class Ray wraps for both worker kinds, so the driver never imports the workers'
# heavy modules and every actor can report its pid before it is busy.


class WorkerHost:
    """Builds `module:cls(*args, **kwargs)` inside the actor process; the subclasses forward typed calls to it."""

    def __init__(self, target: str, args: tuple, kwargs: dict):
        import importlib

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from rl.logs import configure_vllm_logging

        configure_vllm_logging()  # vLLM's INFO into the run's vllm.log from its first import on
        module, _, name = target.partition(":")
        self.worker = getattr(importlib.import_module(module), name)(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()


class TrainerHost(WorkerHost):
    """The actor of one trainer rank: the calls the driver makes (trainer/worker.py's interface)."""

    def train_step(self, batch: TrainBatch) -> dict:
        return self.worker.train_step(batch)

    def save_checkpoint(self, path: str) -> str:
        return self.worker.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> dict:
        return self.worker.load_checkpoint(path)

    def export_weights(self, dtype: str | None = None) -> list:
        """[an ObjectRef to this rank's exported weights (rank 0's; other ranks: None)], put into Ray's
        object store from here, in a list so that Ray does not resolve it: the rollout workers take
        it without the driver holding the data."""
        import ray

        return [ray.put(self.worker.export_weights(dtype))]

    def publish_weights(self, sender, engines, version: int) -> Publication | None:
        """`sender.publish` on this rank, for the engines to take later: rank 0's Publication, None on
        the others."""
        return sender.publish(self.worker, engines, version)

    def release_weights(self, publication: Publication, reports: list[dict | None]) -> None:
        """Every engine took `publication` (their take_weights reports, None for one that failed):
        this rank may write its buffer again (rollout.sync.release)."""
        from rollout import sync

        sync.release(publication, reports)

    def send_weights(self, sender, engines) -> SyncReport:
        """One weight sync from this rank: `sender` (a rollout.sync_interface.Sender, built by the
        driver) runs here on this rank's weights, rank 0 driving `engines` (rl.weight_sync.RayClient)."""
        return sender.send(self.worker, engines)


class RolloutHost(WorkerHost):
    """The actor of one rollout worker: the calls the driver and the weight sync make (rollout/worker.py's interface)."""

    def generate(self, prompts: list, n: int, sampling: dict, *, offset: int, policy_version: int,
                 max_tokens: list[int] | None = None) -> tuple[list, float]:
        """RolloutWorker.generate's records.Sample list (prompt_index counted from `offset`, the position of
        this worker's slice in the step's prompts; stamped with `policy_version`, the version the driver
        queued last), and the seconds this actor spent in generate (its busy time); max_tokens (one per
        prompt: multi-turn episodes) is passed only when given."""
        import time

        t0 = time.perf_counter()
        extra = {} if max_tokens is None else {"max_tokens": max_tokens}
        samples = self.worker.generate(prompts, n, sampling, offset=offset, policy_version=policy_version, **extra)
        return samples, time.perf_counter() - t0

    def update_weights(self, named) -> dict:
        return self.worker.update_weights(named)

    # The engine's endpoint of the weight sync (rollout.sync_interface.EngineEndpoint), method for method.
    def take_weights(self, publication: Publication) -> dict:
        """RolloutWorker.take_weights, the publication's payload fetched from Ray's object store first
        (Ray resolves only top-level ObjectRef arguments, none inside a record)."""
        import ray

        if isinstance(publication.payload, ray.ObjectRef):
            publication = dataclasses.replace(publication, payload=ray.get(publication.payload))
        return self.worker.take_weights(publication)

    def plan_weight_update(self, metas: list, start: bool = False) -> EngineAnswer:
        return self.worker.plan_weight_update(metas, start)

    def update_weight_chunk(self, chunk: dict) -> dict | None:
        return self.worker.update_weight_chunk(chunk)

    def finish_weight_update(self) -> dict:
        return self.worker.finish_weight_update()

    def abort_weight_update(self, why: str) -> None:
        return self.worker.abort_weight_update(why)

    def init_weight_transfer_engine(self, join: dict) -> None:
        return self.worker.init_weight_transfer_engine(join)

    def sleep(self, level: int):
        return self.worker.sleep(level)

    def gpu_memory(self):
        return self.worker.gpu_memory()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip_and_port() -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), _free_port()


# ---------------------------------------------------------------------------------------------
# Ray: cluster, placement groups, actors.


@dataclasses.dataclass
class Placement:
    trainer_pg: object
    trainer_bundles: list[int]
    rollout_pg: object
    rollout_bundles: list[int]
    groups: list


def _bundle(cpus: float, gpus: float) -> dict:
    b = {}
    if cpus > 0:
        b["CPU"] = cpus
    if gpus > 0:
        b["GPU"] = gpus
    return b


def plan_bundles(cfg: Config) -> dict:
    """The placement groups as plain data: {"trainer": [bundles], "rollout": [bundles] or None,
    "trainer_bundles": [index per rank], "rollout_bundles": [index per worker]} (tested directly)."""
    t, r = cfg.trainer, cfg.rollout
    if cfg.ray.placement == "colocated":
        bundles = [{"CPU": t.cpus_per_rank, "GPU": t.gpus_per_rank} for _ in range(t.world_size)]
        where = [i % t.world_size for i in range(r.num_workers)]
        for b in where:
            bundles[b]["CPU"] += r.cpus_per_worker
            bundles[b]["GPU"] += r.gpus_per_worker
        return {"trainer": [_bundle(b["CPU"], b["GPU"]) for b in bundles], "rollout": None,
                "trainer_bundles": list(range(t.world_size)), "rollout_bundles": where}
    return {"trainer": [_bundle(t.cpus_per_rank, t.gpus_per_rank) for _ in range(t.world_size)],
            "rollout": [_bundle(r.cpus_per_worker, r.gpus_per_worker) for _ in range(r.num_workers)],
            "trainer_bundles": list(range(t.world_size)), "rollout_bundles": list(range(r.num_workers))}


def _needed_cpus(plan: dict) -> float:
    return sum(b.get("CPU", 0) for b in plan["trainer"] + (plan["rollout"] or []))


def ray_address(cfg: Config) -> str | None:
    """The Ray cluster a run joins: ray.address, else $RAY_ADDRESS; None: it starts a local instance."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or None


def start_ray(cfg: Config, plan: dict, env: dict[str, str] | None = None) -> bool:
    """Join cfg.ray.address / $RAY_ADDRESS, or start a local instance; True if we started it. Every
    actor gets `env` (vLLM's logging: rl.logs) and then ray.env in its environment."""
    import ray

    address = ray_address(cfg)
    runtime_env = {"env_vars": {**(env or {}), **cfg.ray.env}}
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return False
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(_needed_cpus(plan)))
    log.info("starting a local Ray instance with %d logical CPUs", num_cpus)
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env, log_to_driver=True)
    return True


def place(plan: dict, timeout_s: float = 120.0) -> Placement:
    import ray
    from ray.util.placement_group import placement_group

    groups = [placement_group(plan["trainer"], strategy="PACK", name="megamoe-trainer")]
    if plan["rollout"] is not None:
        groups.append(placement_group(plan["rollout"], strategy="PACK", name="megamoe-rollout"))
    for pg, what in zip(groups, ("trainer", "rollout")):
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"placement group for the {what} ({plan[what] or plan['trainer']}) was not placed "
                               f"within {timeout_s:.0f}s; the cluster has {ray.available_resources()} available "
                               f"(lower trainer.cpus_per_rank / rollout.cpus_per_worker / *gpus*, or add nodes)") from None
    return Placement(trainer_pg=groups[0], trainer_bundles=plan["trainer_bundles"],
                     rollout_pg=groups[-1], rollout_bundles=plan["rollout_bundles"], groups=groups)


def strategy(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)
