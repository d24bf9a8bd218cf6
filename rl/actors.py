"""The run's actors: placement, start, replacement of a dead RolloutWorker, the pids file, and the one
place where Ray's exceptions become the run's errors (rl/failures.py).

    actors = Actors(cfg, run_dir, model_dir, weight_sync)
    actors.start()                                                   # placement groups, every actor built
    actors.on_trainers(lambda t: t.train_step.remote(batch), "train_step")  # every rank; rank 0's result
    actors.rollout_fault(e, j, "generate")                          # raises the run's error unless j died
    actors.replace_rollout(j, e, "generate", what)                  # a new RolloutWorker j (model_dir's weights)

Calls are the typed methods of rl/cluster.py's TrainerHost / RolloutHost; `where` (the point of the
run, set by the driver) goes into every error. Placement (colocated / disaggregated) is rl/cluster.py's.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable

from megamoe.contract import FAST
from rl.cluster import Placement, RolloutHost, TrainerHost, node_ip_and_port, place, plan_bundles, strategy
from rl.config import Config, trainer_worker_config
from rl.failures import ANSI, ActorError, RolloutFailed, TrainerDied, died
from rl.run_dir import write_atomic

log = logging.getLogger("megamoe.rl")


class Actors:
    """The trainer ranks and the rollout workers of one run (module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, model_dir: Path, weight_sync: str):
        self.cfg = cfg
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.weight_sync = weight_sync
        self.plan = plan_bundles(cfg)
        self.placement: Placement | None = None
        self.trainers: list = []
        self.rollouts: list = []
        self.restarts = 0
        self.pids: dict[str, list[int]] = {"trainer": [], "rollout": []}
        self.where = "start"  # the point of the run, for failure reports (the driver sets it)

    # -- lifecycle -----------------------------------------------------------------------------
    def _options(self, cls, num_cpus: float, num_gpus: float, pg, bundle: int):
        import ray

        # max_restarts=0: a dead worker is replaced by the driver, which knows the weights it needs.
        return ray.remote(cls).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
                                       scheduling_strategy=strategy(pg, bundle))

    def start(self) -> None:
        """Placement groups, every trainer rank and rollout worker (their constructors run
        concurrently), then wait until all are built and write actors.json."""
        import ray

        self.placement = pl = place(self.plan)
        t = self.cfg.trainer
        addr, port = ray.get(ray.remote(node_ip_and_port).options(
            num_cpus=0, scheduling_strategy=strategy(pl.trainer_pg, pl.trainer_bundles[0])).remote())
        wcfg = trainer_worker_config(self.cfg)  # moe_impl and world_size travel as the arguments
        self.trainers = [self._options(TrainerHost, t.cpus_per_rank, t.gpus_per_rank, pl.trainer_pg,
                                       pl.trainer_bundles[rank]).remote(
                             t.worker, (rank, t.world_size, addr, port, str(self.model_dir), t.moe_impl, wcfg), {})
                         for rank in range(t.world_size)]
        self.rollouts = [self._new_rollout(i) for i in range(self.cfg.rollout.num_workers)]
        self.pids["trainer"] = self.get([a.pid.remote() for a in self.trainers], self.trainer_names(), "__init__")
        self.pids["rollout"] = self.get([a.pid.remote() for a in self.rollouts], self.rollout_names(), "__init__")
        self._write_pids()

    def _new_rollout(self, i: int):
        r = self.cfg.rollout
        pl = self.placement
        kwargs = dict(dtype=self.cfg.model.dtype, seed=self.cfg.run.seed + i, max_model_len=r.max_model_len,
                      kv_cache_memory_bytes=r.kv_cache_bytes, weight_sync=self.weight_sync,
                      sleep_mode=r.sleep_level > 0, **r.engine_kwargs)
        if self.cfg.run.numerics != FAST:  # only then: a worker class of the interface without it still runs fast
            kwargs["numerics"] = self.cfg.run.numerics
        # --- routing replay (docs/ROUTING_REPLAY.md) ---
        if self.cfg.trainer.routing_replay or self.cfg.trainer.routing_metrics:
            kwargs["return_routing"] = True
        # --- end routing replay ---
        host = self._options(RolloutHost, r.cpus_per_worker, r.gpus_per_worker, pl.rollout_pg, pl.rollout_bundles[i])
        return host.remote(r.worker, (str(self.model_dir), r.moe_impl), kwargs)

    def replace_rollout(self, i: int, why: BaseException, method: str, what: str) -> None:
        """Replace dead RolloutWorker i by a new one (holding model_dir's weights, version 0), up to
        rollout.max_restarts times per run; `what` says what it gets next, for the log."""
        import ray

        self.restarts += 1
        if self.restarts > self.cfg.rollout.max_restarts:
            raise RolloutFailed(f"RolloutWorker {i}", method, self.where, why,
                                note=f" after rollout.max_restarts={self.cfg.rollout.max_restarts} restarts") from why
        log.warning("RolloutWorker %d died (%s); restarting it with %s (restart %d of %d)", i, type(why).__name__,
                    what, self.restarts, self.cfg.rollout.max_restarts)
        try:
            ray.kill(self.rollouts[i], no_restart=True)
        except Exception:  # noqa: BLE001 - it is dead already; kill only releases the handle
            pass
        self.rollouts[i] = self._new_rollout(i)
        self.pids["rollout"][i] = self.get([self.rollouts[i].pid.remote()], [f"RolloutWorker {i}"], "__init__")[0]
        self._write_pids()

    def _write_pids(self) -> None:
        write_atomic(self.run_dir / "actors.json", json.dumps(self.pids) + "\n")

    def shutdown(self) -> None:
        import ray

        for a in self.rollouts + self.trainers:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group
            for pg in self.placement.groups:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001
                    pass

    # -- calls and their faults ----------------------------------------------------------------
    def trainer_names(self) -> list[str]:
        return [f"TrainerWorker rank {r}" for r in range(len(self.trainers))]

    def rollout_names(self) -> list[str]:
        return [f"RolloutWorker {i}" for i in range(len(self.rollouts))]

    def get(self, refs: list, actors: list[str], method: str) -> list:
        """ray.get of one call per actor (actors[i] made refs[i]), waiting in completion order: the
        first call that fails raises ActorError naming its actor (TrainerDied for a trainer rank
        whose process is gone), even while the other ranks still wait for it in a collective."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as e:
                actor = actors[refs.index(done[0])]
                kind = TrainerDied if actor.startswith("TrainerWorker") and died(e) else ActorError
                raise kind(actor, method, self.where, e) from e
        return ray.get(refs)

    def on_trainers(self, call: Callable, method: str):
        """`call(host) -> ObjectRef` on every trainer rank (each runs collectives); rank 0's result."""
        return self.get([call(t) for t in self.trainers], self.trainer_names(), method)[0]

    def on_rollouts(self, call: Callable, method: str) -> list:
        return self.get([call(w) for w in self.rollouts], self.rollout_names(), method)

    def rollout_fault(self, e: BaseException, j: int, method: str) -> None:
        """A Ray error of RolloutWorker j's call: returns when the worker's process died (the caller
        replaces it); raises the run's error otherwise (it raised, or its constructor failed)."""
        import ray

        if isinstance(e, ray.exceptions.RayActorError) and not e.actor_init_failed:
            return
        raise ActorError(f"RolloutWorker {j}", "__init__" if getattr(e, "actor_init_failed", False) else method,
                         self.where, e) from e

    def sync_fault(self, e: BaseException, targets: list[int], what: str) -> int:
        """A Ray error of a streamed weight sync (a call through several actors): the index of the
        dead RolloutWorker among `targets` to replace; raises the run's error otherwise."""
        import ray

        if isinstance(e, ray.exceptions.RayActorError):
            dead = self._dead_rollout(targets)
            if dead is not None:
                return dead
            raise TrainerDied(self._actor_of(e, "a TrainerWorker"), what, self.where, e) from e
        raise ActorError(self._actor_of(e, "an actor"), what, self.where, e) from e

    def _actor_of(self, e: BaseException, default: str) -> str:
        """The actor a Ray error came from, by the pid Ray's message names."""
        m = re.search(r"\bpid[=:] ?(\d+)", ANSI.sub("", str(e)))
        pid = int(m[1]) if m else None
        for kind, name in (("trainer", "TrainerWorker rank"), ("rollout", "RolloutWorker")):
            if pid in self.pids[kind]:
                return f"{name} {self.pids[kind].index(pid)}"
        return default

    def _dead_rollout(self, targets: list[int]) -> int | None:
        """The first of `targets` whose actor no longer answers."""
        import ray

        for i in targets:
            try:
                ray.get(self.rollouts[i].pid.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return i
        return None

    def gpu_memory_gib(self) -> float | None:
        """GPU memory in use on rollout worker 0's device (every process on it), GiB; None on CPU."""
        if self.cfg.rollout.gpus_per_worker <= 0:
            return None
        mem = self.get([self.rollouts[0].gpu_memory.remote()], ["RolloutWorker 0"], "gpu_memory")[0]
        return mem["device_used_bytes"] / 2**30 if mem else None
