"""The RL loop on Ray: rollout and trainer actors in placement groups, one GRPO step at a time.

    megamoe-rl train --config configs/tiny.yaml [a.b=value ...] [--resume]
    rl.loop.train(cfg, resume=False) -> exit code

Per step t (1-based; the prompts of step t are a pure function of the seed and t, rl/data.py):
    prompts -> RolloutHost.generate (G samples each, processed logprobs: rl.records.Sample)
            -> rewards (rl/rewards.py; + overlong shaping, rl/overlong.py; with data.dynamic_sampling,
               more prompts until every group has signal, rl/dynamic_sampling.py)
            -> group advantages (rl/advantages.py) -> rl.records.TrainBatch
            -> TrainerHost.train_step on every rank (returns the loss and the sampler-trainer
               mismatch measured on the same forward)
            -> TrainerHost.export_weights -> RolloutHost.update_weights
            -> one line of metrics.jsonl (+ TensorBoard, progress bar); a checkpoint every
               trainer.checkpoint_every steps and at the end.
With run.max_async_steps = k >= 1 (docs/ASYNC.md) the batch of step t was generated k steps earlier
by the policy after step max(0, t-1-k): each step queues on the rollout workers the current weights
and then the generation k steps ahead (Loop._next_batch), waits for its own batch and trains on it
while they generate; checkpoints hold the batches in flight (inflight.json), a dead rollout worker's
queue is replayed on its replacement (Loop._replay).

Run folder (run.out_dir): config.yaml (resolved), metrics.jsonl, train.log, vllm.log (vLLM's own
log, rl/logs.py), actors.json (pids of the actors, for operators and the fault tests), model/
(when made by model.make), plot.png, traceback.txt (after a failure),
checkpoints/step_NNNNNN/ (the trainer's atomic DCP checkpoint) and checkpoints/latest.json, the
pointer to the newest complete one, replaced atomically after the checkpoint is complete, and
final/ (the last step's policy as a Hugging Face checkpoint: run.export_final, rl/export.py),
samples.jsonl (run.samples_every) and eval_samples.jsonl (rl/samples.py), wandb/ and wandb_id.txt (run.wandb, rl/wandb_log.py).

Evaluation (eval.every, rl/evaluation.py): before step 1, every eval.every steps and after the last
step, between the weight push and the metrics line, on the rollout engines with seeds of its own;
its eval/* metrics join that step's metrics line (a line of step 0 for the base policy).

Before Ray starts, everything that can be refused is checked (train(): the model, the rewards, the
dataset, every prompt's length); a refused fresh start leaves nothing in run.out_dir.

Faults: a RolloutWorker that dies (its process is gone: RayActorError) is replaced in its bundle by
a new one that gets the trainer's current weights, and the step's generation is retried, up to
rollout.max_restarts times per run. Any other actor failure (a TrainerWorker that dies, an actor
that raises) ends the run (exit 1) with one paragraph in train.log and on the terminal: the actor,
the step, the root cause, the last complete checkpoint, which is intact, and the command that
continues the run; `--resume` continues from it, and metrics.jsonl drops the lines of steps after
it, which the resumed run writes again. `--resume` first verifies the latest checkpoint
(trainer.checkpoint.verify: every file its metadata lists, whole) and falls back to the newest
intact one with a warning naming both; older checkpoints are deleted (trainer.keep_checkpoints)
only after a new one verifies. Ctrl-C once: the current step finishes, a checkpoint is
written, every actor is stopped (exit 130); Ctrl-C twice: actors are stopped at once and the last
checkpoint stands.

Placement: colocated puts one bundle per trainer rank in one placement group and the rollout
workers into those bundles (round robin; each bundle reserves the sum of its actors' CPUs/GPUs);
disaggregated gives the trainer ranks and the rollout workers placement groups of their own
(rl/cluster.py).

Around it: rl/run_dir.py (the run folder, checkpoints' pointer, resume), rl/cluster.py (Ray, the
actor host, placement), rl/failures.py (an actor's failure as one paragraph), rl/base_model.py
(the model made or checked before anything starts), rl/records.py (Sample, TrainBatch). This file
stays over 500 lines for one reason: `Loop` is one state machine (actors, steps, weight syncs,
generations in flight, checkpoints, restarts) whose ~650 lines of methods share its state; what
does not need that state lives in the modules above.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
import shutil
import signal
import time
from pathlib import Path

from megamoe.contract import FAST
from rl.base_model import resolve_model
from rl.cluster import (Placement, RolloutHost, TrainerHost, WorkerHost, node_ip_and_port, place, plan_bundles,
                        start_ray, strategy)
from rl.config import Config, to_yaml, trainer_worker_config
from rl.failures import ANSI, ActorError, RolloutFailed, TrainerDied, died, failure_paragraph
from rl.records import Sample, TrainBatch
from rl.run_dir import (checkpoints_dir, holds_run, latest_checkpoint, log_config_changes, prepare_run_dir,
                        resume_checkpoint, write_atomic)

log = logging.getLogger("megamoe.rl")

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
INFLIGHT = "inflight.json"  # in a checkpoint of an async run: the batches generated, not yet trained on


@dataclasses.dataclass
class _InFlight:
    """One step's generation submitted to the rollout workers and not yet trained on (async mode).
    Worker j generates prompts[bounds[j][0]:bounds[j][1]]; syncs[j] are the weight updates queued on
    it before that generation, refs[j] the generation, outs[j] its (samples, seconds) once fetched."""
    step: int          # 0-based: the batch trained at metrics step `step + 1`
    version: int       # the policy version that generates it
    batch: object      # rl.data's batch (prompts as the data gave them, the reward columns)
    prompts: list      # as the sampler gets them (chat template applied)
    sampling: dict
    bounds: list
    syncs: list | None
    refs: list | None
    outs: list | None
    samples: list | None = None
    busy_s: float = 0.0  # the slowest worker's seconds in generate


# ---------------------------------------------------------------------------------------------
# The loop.


class Loop:
    """State of one `train` invocation; `run()` drives it (see the module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, start_step: int, model_dir: Path, rewards: list | None = None):
        from rl.data import PromptSource
        from rl.rewards import RewardScorer, load_rewards

        self.cfg = cfg
        self.run_dir = run_dir
        self.step = start_step
        self.model_dir = model_dir
        self.scorer = RewardScorer(load_rewards(cfg.reward) if rewards is None else rewards)
        if cfg.run.tensorboard:
            from rl.metrics import check_tensorboard

            check_tensorboard()  # before anything starts
        self.source = PromptSource.from_config(cfg.data, seed=cfg.run.seed)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer = tokenizer if cfg.data.chat_template or self.source.conversational else None
        self._check_prompt_lengths(tokenizer)
        # --- multi-turn episodes (rl/episode_step.py, docs/MULTITURN.md): built and checked before any actor ---
        self.episodes = None
        if cfg.env.enabled:
            from rl.episode_step import EpisodeStep

            self.episodes = EpisodeStep(cfg, tokenizer, model_dir)
        # --- end multi-turn episodes ---
        # Evaluation, samples.jsonl, W&B (docs/EVAL.md): checked here, before anything starts.
        from rl.evaluation import Evaluator
        from rl.wandb_log import check_wandb

        check_wandb(cfg)
        self.evaluator = (Evaluator(cfg, tokenizer, None if cfg.eval.functions is not None else self.scorer.fns)
                          if cfg.eval.every else None)
        self.step_samples: list[dict] = []  # the last step's rows for samples.jsonl / W&B (rl/samples.py)
        self.wandb = None  # rl.wandb_log.WandbSink, opened by run()
        self.plan = plan_bundles(cfg)
        from rl.config import resolve_weight_sync

        self.weight_sync = resolve_weight_sync(cfg)
        self._sync_format: str | None = None  # the format of the last streamed sync, logged when it changes
        self.on_gpu = cfg.rollout.gpus_per_worker > 0
        self.placement: Placement | None = None
        self.trainers: list = []
        self.rollouts: list = []
        self.restarts = 0
        self.weights_dirty = start_step > 0  # trainer weights differ from model_dir's
        self.stop_requested = False
        self.pids: dict[str, list[int]] = {"trainer": [], "rollout": []}
        self.where = f"start, before step {start_step + 1}"  # the point of the run, for failure reports
        # Async (run.max_async_steps >= 1): the generations in flight, oldest first; the version of the
        # weights last queued on the rollout workers (0: model_dir's, which a new worker loads); the
        # trainer's exported weights by version while a replay may need them; per worker, the weight
        # updates queued since its last generation.
        self.pending: collections.deque[_InFlight] = collections.deque()
        self.rollout_version = 0
        self.weight_refs: dict[int, object] = {}
        self.unchecked: list[list] = [[] for _ in range(cfg.rollout.num_workers)]

    # -- actors ------------------------------------------------------------------------------
    def _host(self, cls: type[WorkerHost], num_cpus: float, num_gpus: float, pg, bundle: int):
        import ray

        # max_restarts=0: a dead worker is replaced by the loop, which knows the current weights.
        return ray.remote(cls).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
                                              scheduling_strategy=strategy(pg, bundle))

    def start_trainers(self) -> None:
        import ray

        t = self.cfg.trainer
        pl = self.placement
        addr, port = ray.get(ray.remote(node_ip_and_port).options(
            num_cpus=0, scheduling_strategy=strategy(pl.trainer_pg, pl.trainer_bundles[0])).remote())
        cfg = trainer_worker_config(self.cfg)  # moe_impl and world_size travel as the arguments
        self.trainers = []
        for rank in range(t.world_size):
            host = self._host(TrainerHost, t.cpus_per_rank, t.gpus_per_rank, pl.trainer_pg, pl.trainer_bundles[rank])
            self.trainers.append(host.remote(t.worker,
                                             (rank, t.world_size, addr, port, str(self.model_dir), t.moe_impl, cfg), {}))

    def _new_rollout(self, i: int):
        r = self.cfg.rollout
        pl = self.placement
        host = self._host(RolloutHost, r.cpus_per_worker, r.gpus_per_worker, pl.rollout_pg, pl.rollout_bundles[i])
        kwargs = dict(dtype=self.cfg.model.dtype, seed=self.cfg.run.seed + i, max_model_len=r.max_model_len,
                      kv_cache_memory_bytes=r.kv_cache_bytes, weight_sync=self.weight_sync,
                      sleep_mode=r.sleep_level > 0, **r.engine_kwargs)
        if self.cfg.run.numerics != FAST:  # only then: a worker class of the interface without it still runs fast
            kwargs["numerics"] = self.cfg.run.numerics
        # --- routing replay (docs/ROUTING_REPLAY.md) ---
        if self.cfg.trainer.routing_replay or self.cfg.trainer.routing_metrics:
            kwargs["return_routing"] = True
        # --- end routing replay ---
        return host.remote(r.worker, (str(self.model_dir), r.moe_impl), kwargs)

    def start_rollouts(self) -> None:
        self.rollouts = [self._new_rollout(i) for i in range(self.cfg.rollout.num_workers)]

    def wait_for_actors(self) -> None:
        """Block until every actor is built (their constructors run concurrently); record the pids."""
        self.pids["trainer"] = self._get([a.pid.remote() for a in self.trainers], self._trainer_names(), "__init__")
        self.pids["rollout"] = self._get([a.pid.remote() for a in self.rollouts],
                                         [f"RolloutWorker {i}" for i in range(len(self.rollouts))], "__init__")
        self.write_pids()

    def write_pids(self) -> None:
        write_atomic(self.run_dir / "actors.json", json.dumps(self.pids) + "\n")

    def _trainer_names(self) -> list[str]:
        return [f"TrainerWorker rank {r}" for r in range(len(self.trainers))]

    def _get(self, refs: list, actors: list[str], method: str) -> list:
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

    def _on_trainers(self, method: str, *args):
        """Call TrainerHost.`method` on every trainer rank (each runs collectives); rank 0's result."""
        refs = [getattr(t, method).remote(*args) for t in self.trainers]
        return self._get(refs, self._trainer_names(), method)[0]

    def restart_rollout(self, i: int, why: BaseException, method: str, push: bool = True) -> None:
        """Replace dead RolloutWorker i; push=True gives it the trainer's current weights (the async
        loop instead replays the weights and generations it had queued: _replay)."""
        import ray

        self.restarts += 1
        if self.restarts > self.cfg.rollout.max_restarts:
            raise RolloutFailed(f"RolloutWorker {i}", method, self.where, why,
                                note=f" after rollout.max_restarts={self.cfg.rollout.max_restarts} restarts") from why
        log.warning("RolloutWorker %d died (%s); restarting it with %s (restart %d of %d)", i, type(why).__name__,
                    "the current weights" if push else "its queue of weights and generations", self.restarts,
                    self.cfg.rollout.max_restarts)
        try:
            ray.kill(self.rollouts[i], no_restart=True)
        except Exception:  # noqa: BLE001 - it is dead already; kill only releases the handle
            pass
        self.rollouts[i] = self._new_rollout(i)
        self.pids["rollout"][i] = self._get([self.rollouts[i].pid.remote()], [f"RolloutWorker {i}"], "__init__")[0]
        self.write_pids()
        if push and self.weights_dirty:
            self.push_weights([i])

    def _export_dtype(self) -> str | None:
        """The sampler's dtype when it is a 16-bit one: the engine would round the fp32 master weights
        to it anyway (the same round-to-nearest-even as the trainer's cast), and half the bytes travel."""
        return self.cfg.model.dtype if self.cfg.model.dtype in ("bfloat16", "float16") else None

    def push_weights(self, indices: list[int] | None = None) -> dict:
        """Trainer weights into the rollout workers (all, or `indices`) over rollout.weight_sync;
        {"total": s, phases...}. A worker that dies meanwhile is restarted and gets the weights."""
        import ray

        from rl import weight_sync

        t0 = time.perf_counter()
        targets = list(range(len(self.rollouts))) if indices is None else list(indices)
        times: dict[str, float] = {}
        what = f"the weight sync ({self.weight_sync})"
        try:
            info = weight_sync.push(self.weight_sync, self.trainers, [self.rollouts[i] for i in targets],
                                    dtype=self._export_dtype(), model_dir=str(self.model_dir),
                                    bucket_bytes=self.cfg.rollout.ipc_bucket_bytes)
        except ray.exceptions.RayActorError as e:
            dead = self._dead_rollout(targets)
            if dead is None:
                raise TrainerDied(self._actor_of(e, "a TrainerWorker"), what, self.where, e) from e
            self.restart_rollout(dead, e, what)  # the new worker gets the weights there
            rest = [i for i in targets if i != dead]
            return self.push_weights(rest) if rest else {"total": time.perf_counter() - t0}
        except ray.exceptions.RayError as e:
            raise ActorError(self._actor_of(e, "an actor"), what, self.where, e) from e
        if info.get("format") != self._sync_format:  # the layout the engines load (rollout.sync.FORMATS), once
            self._sync_format = info.get("format")
            why = "; ".join(f"not {k}: {v}" for k, v in (info.get("why") or {}).items())
            log.info("weight sync %s: format %s%s", self.weight_sync, self._sync_format, f" ({why})" if why else "")
        times.update({k: v for k, v in info["seconds"].items() if k != "total"})  # the sender's phases
        times["total"] = time.perf_counter() - t0
        return times

    def _actor_of(self, e: BaseException, default: str) -> str:
        """The actor a Ray error came from, by the pid Ray's message names (a call that went through
        several actors, as the IPC weight sync does)."""
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
        if not self.on_gpu:
            return None
        mem = self._get([self.rollouts[0].gpu_memory.remote()], ["RolloutWorker 0"], "gpu_memory")[0]
        return mem["device_used_bytes"] / 2**30 if mem else None

    def _bounds(self, num_prompts: int) -> list[tuple[int, int]]:
        """The slice of a step's prompts each rollout worker generates."""
        k = len(self.rollouts)
        return [(num_prompts * j // k, num_prompts * (j + 1) // k) for j in range(k)]

    def generate(self, prompts: list[str], sampling: dict, n: int | None = None) -> list[Sample]:
        """n (default rollout.n) samples per prompt over all rollout workers, ordered prompt-major;
        retried on worker death."""
        import ray

        n = self.cfg.rollout.n if n is None else n
        bounds = self._bounds(len(prompts))
        while True:
            refs = [w.generate.remote(prompts[a:b], n, sampling) for w, (a, b) in zip(self.rollouts, bounds)]
            outs, dead = [], None
            for j, ref in enumerate(refs):
                try:
                    outs.append(ray.get(ref))
                except ray.exceptions.RayActorError as e:
                    if e.actor_init_failed:
                        raise ActorError(f"RolloutWorker {j}", "__init__", self.where, e) from e
                    dead = dead or (j, e)
                except ray.exceptions.RayError as e:
                    raise ActorError(f"RolloutWorker {j}", "generate", self.where, e) from e
            if dead is None:
                break
            self.restart_rollout(*dead, "generate")  # another dead worker, if any, is found by the retry
        return self._samples(bounds, [o for o, _ in outs], len(prompts), self.step, n)

    def _samples(self, bounds: list[tuple[int, int]], outs: list[list[dict]], num_prompts: int,
                 version: int, n: int | None = None) -> list[Sample]:
        """The workers' outputs (worker j generated prompts bounds[j]) as Samples of policy `version`,
        prompt-major, each prompt's samples in the sampler's order; checks n (default rollout.n) per prompt."""
        n = self.cfg.rollout.n if n is None else n
        samples = [Sample.from_worker(s, offset=a, policy_version=version) for (a, _), out in zip(bounds, outs) for s in out]
        samples.sort(key=lambda s: s.prompt_index)  # stable: keeps each prompt's sample order
        counts = [0] * num_prompts
        for s in samples:
            counts[s.prompt_index] += 1
        if any(c != n for c in counts):
            raise RuntimeError(f"RolloutWorker.generate returned {counts} samples per prompt, expected n={n} each")
        return samples

    # -- async: generations in flight (run.max_async_steps >= 1; docs/ASYNC.md) -------------------
    # The rollout workers execute their calls in submission order (Ray: one caller, one actor), so
    # the loop queues, per step: the trainer's current weights, then the generation of the batch k
    # steps ahead. A weight update therefore always lands between two generate calls, and the batch
    # of step index s (0-based) is generated by version max(0, s - k), whatever the timing.
    def _submit(self, step: int) -> None:
        """Queue the generation of batch `step` (0-based) on every rollout worker, by the weights
        last queued (self.rollout_version)."""
        prompt_batch, prompts, sampling = self._prompts(step)
        bounds = self._bounds(len(prompts))
        flight = _InFlight(step, self.rollout_version, prompt_batch, prompts, sampling, bounds,
                           syncs=self.unchecked, refs=[None] * len(bounds), outs=[None] * len(bounds))
        self.unchecked = [[] for _ in self.rollouts]
        for j, w in enumerate(self.rollouts):
            a, b = bounds[j]
            flight.refs[j] = w.generate.remote(prompts[a:b], self.cfg.rollout.n, sampling)
        self.pending.append(flight)

    def _queue_weights(self) -> float:
        """Queue the trainer's current weights (version self.step) behind every worker's generations,
        keeping a reference to them while a generation in flight may need them again (_replay);
        returns the seconds the export took (the driver's part of the sync)."""
        if self.rollout_version == self.step:
            return 0.0
        t0 = time.perf_counter()
        ref = self._on_trainers("export_weights", self._export_dtype())[0]
        self.weight_refs[self.step] = ref
        self.rollout_version = self.step
        for j, w in enumerate(self.rollouts):
            self.unchecked[j].append(w.update_weights.remote(ref))
        return time.perf_counter() - t0

    def _collect(self, flight: _InFlight) -> None:
        """Wait for `flight`'s generations (and the weight updates queued before them); a worker that
        died is replaced and its queue replayed from the policy versions it needed (_replay)."""
        import ray

        if flight.samples is not None:
            return
        j = 0
        while j < len(flight.refs):
            if flight.outs[j] is None:
                try:
                    for ref in flight.syncs[j]:
                        ray.get(ref)
                    flight.outs[j] = ray.get(flight.refs[j])
                except ray.exceptions.RayActorError as e:
                    if e.actor_init_failed:
                        raise ActorError(f"RolloutWorker {j}", "__init__", self.where, e) from e
                    self._replay(j, e)
                    continue  # this worker again, on its replacement
                except ray.exceptions.RayError as e:
                    raise ActorError(f"RolloutWorker {j}", "generate or update_weights", self.where, e) from e
            j += 1
        flight.samples = self._samples(flight.bounds, [o for o, _ in flight.outs], len(flight.prompts),
                                       flight.version)
        flight.busy_s = max(sec for _, sec in flight.outs)
        flight.outs = flight.refs = flight.syncs = None  # the samples are all that is kept
        keep = min([f.version for f in self.pending if f.samples is None] + [self.rollout_version])
        self.weight_refs = {v: r for v, r in self.weight_refs.items() if v >= keep}

    def _replay(self, j: int, why: BaseException) -> None:
        """Replace dead RolloutWorker j and queue on the new one what the dead one had not returned:
        each unfinished generation behind the weights of its policy version, then the weights last
        queued; the samples are those the dead worker would have returned (same weights, same seeds)."""
        self.restart_rollout(j, why, "generate", push=False)
        w, version = self.rollouts[j], 0  # a new worker holds model_dir's weights: version 0
        for f in self.pending:
            if f.samples is not None or f.outs[j] is not None:
                continue
            f.syncs[j] = []
            if f.version != version:
                f.syncs[j].append(w.update_weights.remote(self.weight_refs[f.version]))
                version = f.version
            a, b = f.bounds[j]
            f.refs[j] = w.generate.remote(f.prompts[a:b], self.cfg.rollout.n, f.sampling)
        self.unchecked[j] = []
        if self.rollout_version != version:
            self.unchecked[j].append(w.update_weights.remote(self.weight_refs[self.rollout_version]))

    def _next_batch(self) -> tuple[_InFlight, float, float]:
        """The batch of this step, generated `run.max_async_steps` versions ago: queue the current
        weights and the generation k steps ahead, then wait for this step's. Returns (flight, seconds
        the driver waited for it, seconds the weight export took)."""
        k, steps = self.cfg.run.max_async_steps, self.cfg.run.steps
        t_sync = self._queue_weights()
        nxt = self.pending[-1].step + 1 if self.pending else self.step
        for step in range(nxt, min(self.step + k, steps - 1) + 1):
            self._submit(step)
        flight = self.pending[0]
        assert flight.step == self.step, (flight.step, self.step)
        t0 = time.perf_counter()
        self._collect(flight)
        self.pending.popleft()
        return flight, time.perf_counter() - t0, t_sync

    def _inflight_file(self, ckpt: Path) -> None:
        """The samples of the batches in flight into checkpoint `ckpt` (waiting for them): a resume
        trains on exactly these (docs/ASYNC.md, resume)."""
        for f in self.pending:
            self._collect(f)
        data = [{"step": f.step, "version": f.version, "busy_s": f.busy_s,
                 "samples": [smp.to_json() for smp in f.samples]} for f in self.pending]
        write_atomic(ckpt / INFLIGHT, json.dumps(data) + "\n")

    def _load_inflight(self, ckpt: Path) -> None:
        f = ckpt / INFLIGHT
        if not f.exists():
            return
        for d in json.loads(f.read_text()):
            prompt_batch, prompts, sampling = self._prompts(d["step"])
            flight = _InFlight(d["step"], d["version"], prompt_batch, prompts, sampling, self._bounds(len(prompts)),
                               syncs=None, refs=None, outs=None)
            flight.samples = [Sample.from_json(x) for x in d["samples"]]
            flight.busy_s = d["busy_s"]
            self.pending.append(flight)
        log.info("resume: %d batch(es) in flight at the checkpoint (steps %s), from %s", len(self.pending),
                 [f.step + 1 for f in self.pending], f)

    def _check_prompt_lengths(self, tokenizer) -> None:
        """Every prompt must leave room for rollout.max_tokens in the engine and the trainer; the
        longer ones are dropped or refused (data.long_prompts) here, before any actor starts."""
        from rl.data import check_prompt_lengths

        cfg = self.cfg
        room = min(cfg.rollout.max_model_len, cfg.trainer.max_seq_len)
        limit = room - cfg.rollout.max_tokens
        why = (f" (min(rollout.max_model_len={cfg.rollout.max_model_len}, trainer.max_seq_len="
               f"{cfg.trainer.max_seq_len}) - rollout.max_tokens={cfg.rollout.max_tokens})")
        dropped = check_prompt_lengths(self.source, tokenizer, limit, cfg.data.long_prompts,
                                       chat=cfg.data.chat_template, why=why)
        if dropped:
            log.warning("data: dropped %d of %d prompts longer than %d tokens%s, e.g. row %d "
                        "(data.long_prompts=refuse stops the run instead)", len(dropped),
                        len(dropped) + self.source.n, limit, why, dropped[0])

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self) -> float:
        from trainer.checkpoint import step_dir, verify

        t0 = time.perf_counter()
        root = checkpoints_dir(self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        name = step_dir(root, self.step).name
        self._on_trainers("save_checkpoint", str(root / name))
        # Older checkpoints go only once the new one reads back whole (run.keep_checkpoints).
        verify(root / name)
        if self.cfg.run.max_async_steps:
            self._inflight_file(root / name)
        write_atomic(root / "latest.json", json.dumps({"step": self.step, "path": name}) + "\n")
        keep = self.cfg.trainer.keep_checkpoints
        steps = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != name)
        import shutil
        for old in steps[: max(0, len(steps) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s written in %.1f s", root / name, time.perf_counter() - t0)
        return time.perf_counter() - t0

    # -- one step ----------------------------------------------------------------------------
    def _prompts(self, step: int, call: int = 0) -> tuple[object, list, dict]:
        """Batch `step` (0-based) of the data, its prompts as the sampler gets them, and its sampling
        parameters: pure functions of the config, the seed and the step. Call `call` >= 1 is dynamic
        sampling's extra generate call of that step: other prompts (rl.dynamic_sampling.extra_step) and
        seeds no step's own call uses."""
        from rl.data import apply_chat_template
        from rl.dynamic_sampling import extra_step

        cfg = self.cfg
        at = step if call == 0 else extra_step(step, call, cfg.run.steps)
        batch = self.source.batch(at, cfg.run.prompts_per_step)
        prompts = batch.prompts
        if self.tokenizer is not None:  # message lists, and strings under data.chat_template
            prompts = apply_chat_template(self.tokenizer, prompts, strings=cfg.data.chat_template)
        sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "max_tokens": cfg.rollout.max_tokens,
                    "seed": cfg.run.seed * 1_000_003 + step + call * 1_000_000_007}
        return batch, prompts, sampling

    def _rewards(self, batch, samples: list[Sample]):
        """The rewards of samples drawn from `batch` (rl/rewards.py), with overlong shaping (rl/overlong.py)."""
        from rl.rewards import TrainerState

        cfg = self.cfg
        idx = [s.prompt_index for s in samples]
        columns = {k: [v[i] for i in idx] for k, v in batch.columns.items()}
        rewards = self.scorer([batch.prompts[i] for i in idx], [s.text for s in samples], columns,
                              completion_ids=[s.completion_ids for s in samples],
                              trainer_state=TrainerState(global_step=self.step, max_steps=cfg.run.steps))
        if cfg.reward.overlong_buffer:
            from rl.overlong import shape

            rewards = shape(rewards, [len(s.completion_ids) for s in samples], max_tokens=cfg.rollout.max_tokens,
                            buffer=cfg.reward.overlong_buffer, penalty=cfg.reward.overlong_penalty)
        return rewards

    def draw(self, call: int):
        """Generate and score this step's generate call `call` (0: the step's own; >= 1: dynamic
        sampling's extra ones, rl/dynamic_sampling.py)."""
        from rl.dynamic_sampling import Draw

        batch, prompts, sampling = self._prompts(self.step, call)
        if self.episodes is not None:  # multi-turn episodes: the one hook (rl/episode_step.py, docs/MULTITURN.md)
            return self.episodes.draw(self, batch, prompts, sampling)
        t0 = time.perf_counter()
        samples = self.generate(prompts, sampling)
        t_rollout = time.perf_counter() - t0
        t0 = time.perf_counter()
        rewards = self._rewards(batch, samples)
        return Draw(prompts, samples, [s.text for s in samples], rewards,
                    {"rollout": t_rollout, "reward": time.perf_counter() - t0})

    def run_step(self) -> dict:
        import ray

        from rl.advantages import group_advantages
        from rl.config import scale_by_std
        from rl.dynamic_sampling import fill_batch

        cfg = self.cfg
        self.where = f"step {self.step + 1}"
        t_step = time.perf_counter()
        lag = cfg.run.max_async_steps
        ds_metrics = {}
        if lag:  # this step's batch was generated `lag` steps ago (docs/ASYNC.md)
            flight, t_rollout, t_export = self._next_batch()
            prompts, samples = flight.prompts, flight.samples
            t0 = time.perf_counter()
            rewards = self._rewards(flight.batch, samples)
            t_reward = time.perf_counter() - t0
        else:
            if cfg.data.dynamic_sampling:  # DAPO's: draw until the batch's groups have signal
                draw, ds_metrics = fill_batch(self.draw, cfg.run.prompts_per_step, cfg.rollout.n,
                                              cfg.data.max_extra_generates)
            else:
                draw = self.draw(0)
            prompts, samples, rewards = draw.prompts, draw.samples, draw.rewards
            t_rollout, t_reward = draw.seconds["rollout"], draw.seconds["reward"]
        adv = group_advantages(rewards.total, cfg.rollout.n, scale_by_std=scale_by_std(cfg),
                               eps=cfg.reward.eps).tolist()
        samples = [dataclasses.replace(s, reward=r) for s, r in zip(samples, rewards.total)]
        train_batch = TrainBatch.from_samples(samples, adv)
        from rl.samples import sample_rows  # samples.jsonl / the W&B samples table (docs/EVAL.md)

        extra = {"lag": [self.step - s.policy_version for s in samples]} if lag else {}
        self.step_samples = sample_rows(self.step + 1, prompts, [s.text for s in samples], rewards, adv,
                                        [s.prompt_index for s in samples], **extra)
        memory = {}
        # The probe is a call on rollout worker 0: async, it would wait behind the queued generation.
        probe = self.on_gpu and not lag
        if probe:
            memory["after_rollout"] = self.gpu_memory_gib()
        t_sleep = 0.0
        if cfg.rollout.sleep_level:
            # The KV cache (and with level 2 the weights) make room for the trainer; the sync wakes
            # the weights, the next generate the KV cache.
            t0 = time.perf_counter()
            self._get([w.sleep.remote(cfg.rollout.sleep_level) for w in self.rollouts],
                      [f"RolloutWorker {i}" for i in range(len(self.rollouts))], "sleep")
            t_sleep = time.perf_counter() - t0
        t0 = time.perf_counter()
        train_metrics = self._on_trainers("train_step", ray.put(train_batch.columns()))
        t_train = time.perf_counter() - t0
        if probe:
            memory["after_train"] = self.gpu_memory_gib()
        self.weights_dirty = True
        self.step += 1

        # On-policy: the new weights go to the sampler now; async: with the next step's generation.
        sync = {"total": t_export} if lag else self.push_weights()
        if probe:
            memory["after_sync"] = self.gpu_memory_gib()

        comp_tokens = sum(len(s.completion_ids) for s in samples)
        all_tokens = comp_tokens + sum(len(s.prompt_ids) for s in samples)
        m = rewards.metrics(cfg.rollout.n)
        m.update(ds_metrics)
        m["reward/errors_total"] = sum(self.scorer.errors_total.values())
        m["data/dropped_prompts"] = self.source.dropped
        plens = [len(s.prompt_ids) for s in samples[::cfg.rollout.n]]
        m.update({"prompt/len_mean": sum(plens) / len(plens), "prompt/len_min": min(plens), "prompt/len_max": max(plens)})
        lens = [len(s.completion_ids) for s in samples]
        m["completion/len_mean"] = sum(lens) / len(lens)
        m["completion/len_max"] = max(lens)
        m["completion/at_max_tokens_frac"] = sum(n >= cfg.rollout.max_tokens for n in lens) / len(lens)
        for k, v in train_metrics.items():
            m[k if "/" in k else f"train/{k}"] = v
        # The sampler's own seconds: async, the driver's wait (time/rollout_s) is only what was left of them.
        m["throughput/rollout_tokens_per_s"] = comp_tokens / max(flight.busy_s if lag else t_rollout, 1e-9)
        m["throughput/train_tokens_per_s"] = all_tokens / max(t_train, 1e-9)
        m["time/rollout_s"] = t_rollout
        m["time/reward_s"] = t_reward
        m["time/train_s"] = t_train
        m["time/sleep_s"] = t_sleep
        m["time/weight_sync_s"] = sync.pop("total")
        m.update({f"time/weight_sync/{k}_s": v for k, v in sync.items()})
        m.update({f"memory/gpu_used_gib/{k}": v for k, v in memory.items() if v is not None})
        m["rollout/restarts_total"] = self.restarts
        if lag:
            # time/rollout_s is what the driver waited for the batch; the sampler's own time is this.
            m["time/rollout_busy_s"] = flight.busy_s
            m["async/policy_version"] = flight.version
            m["async/lag"] = flight.step - flight.version
        m["sample/prompt"] = prompts[0]  # as the sampler got it (chat template applied)
        m["sample/completion"] = samples[0].text
        m["time/step_s"] = time.perf_counter() - t_step
        return m

    # -- the whole run -----------------------------------------------------------------------
    def run(self) -> int:
        from rl.metrics import truncate_jsonl

        cfg = self.cfg
        from rl.wandb_log import WandbSink

        self.wandb = WandbSink.open(self.run_dir, cfg)
        self.placement = place(self.plan)
        self.start_trainers()
        self.start_rollouts()
        self.wait_for_actors()
        if self.step > 0:
            _, path = latest_checkpoint(self.run_dir)
            self._on_trainers("load_checkpoint", str(path))
            kept = truncate_jsonl(self.run_dir / "metrics.jsonl", self.step)
            for name in ("samples.jsonl", "eval_samples.jsonl"):  # truncated as metrics.jsonl
                if (self.run_dir / name).exists():
                    truncate_jsonl(self.run_dir / name, self.step)
            log.info("resumed from %s (step %d; metrics.jsonl keeps %d lines)", path, self.step, kept)
            if cfg.run.max_async_steps:
                self._load_inflight(path)  # the weights go queued, with the next step's generation
            else:
                self.push_weights()

        bar = None
        if cfg.run.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.run.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        try:
            return self._steps(bar)
        finally:
            if bar is not None:
                bar.close()

    def _steps(self, bar) -> int:
        from rl.metrics import MetricsLogger

        cfg = self.cfg
        with MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard, wandb=self.wandb,
                           samples_every=cfg.run.samples_every) as sink:
            if self.evaluator is not None and self.step == 0:  # the base policy, before step 1
                sink.log(0, self.evaluate())
            while self.step < cfg.run.steps:
                if self.stop_requested:  # Ctrl-C before the first step: the last checkpoint stands
                    log.warning("stopped by Ctrl-C before step %d; continue with --resume", self.step + 1)
                    return EXIT_INTERRUPTED
                m = self.run_step()
                if self.evaluator is not None and self.evaluator.due(self.step):
                    m.update(self.evaluate())
                sink.log_samples(self.step, self.step_samples)
                # Metrics first, then the checkpoint: a crash in between leaves a metrics line that a
                # resume from the previous checkpoint drops and writes again, never a missing line.
                sink.log(self.step, m)
                every = cfg.trainer.checkpoint_every
                if (every and self.step % every == 0) or self.step == cfg.run.steps or self.stop_requested:
                    self.save_checkpoint()
                line = (f"step {self.step}/{cfg.run.steps} reward {m['reward/mean']:.3f} "
                        f"k3 {m.get('mismatch/k3_kl', float('nan')):.2e} "
                        f"|dlogp| {m.get('mismatch/abs_logp_diff_mean', float('nan')):.2e} "
                        f"rollout {m['throughput/rollout_tokens_per_s']:.0f} tok/s "
                        f"train {m['throughput/train_tokens_per_s']:.0f} tok/s sync {m['time/weight_sync_s']:.2f} s "
                        f"{m['time/step_s']:.1f} s")
                if bar is not None:
                    bar.set_postfix_str(line.split(" ", 2)[2], refresh=False)
                    bar.update(1)
                logging.getLogger("megamoe.rl.steps").info("%s", line)
                if self.stop_requested:
                    log.warning("stopped by Ctrl-C after step %d; continue with --resume", self.step)
                    return EXIT_INTERRUPTED
        return EXIT_OK

    def evaluate(self) -> dict:
        """eval/* metrics (rl/evaluation.py) of the policy the rollout engines hold after self.step:
        one version, since nothing trains or syncs meanwhile."""
        self.where = f"the evaluation after step {self.step}"
        from rl.samples import EVAL_SAMPLES_FILE, append_rows

        def generate(prompts, sampling, n):  # the Evaluator reads RolloutWorker.generate's dict fields
            return [{"prompt_index": x.prompt_index, "prompt_ids": x.prompt_ids, "completion_ids": x.completion_ids,
                     "logprobs": x.sampler_logprobs, "text": x.text} for x in self.generate(prompts, sampling, n)]

        m, rows = self.evaluator.run(generate, self.step)
        append_rows(self.run_dir, rows, EVAL_SAMPLES_FILE)
        return m

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


def _setup_logging(run_dir: Path) -> list[tuple[logging.Logger, logging.Handler]]:
    """train.log (and the terminal) for the megamoe loggers; returns what to remove at the end."""
    fmt = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    fh = logging.FileHandler(run_dir / "train.log")
    fh.setFormatter(fmt)
    root = logging.getLogger("megamoe")
    root.setLevel(logging.INFO)
    root.addHandler(fh)
    added = [(root, fh)]
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in root.handlers):
        sh = logging.StreamHandler()
        sh.setFormatter(fmt)
        root.addHandler(sh)
        added.append((root, sh))
    # The per-step line goes to the file; the progress bar shows it on the terminal.
    steps = logging.getLogger("megamoe.rl.steps")
    steps.propagate = False
    steps.addHandler(fh)
    added.append((steps, fh))
    return added


class _Created:
    """What a fresh run's start creates in run.out_dir, to remove when the start is refused: the
    folder itself (and any parents made for it) when it did not exist, else the entries it adds."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.top = None  # the outermost folder that did not exist
        for d in (run_dir, *run_dir.parents):
            if d.exists():
                break
            self.top = d
        self.before = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()

    def remove(self) -> None:
        if self.top is not None:
            shutil.rmtree(self.top, ignore_errors=True)
        elif self.run_dir.is_dir():
            for p in self.run_dir.iterdir():
                if p.name in self.before:
                    continue
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def train(cfg: Config, *, resume: bool = False, command: str | None = None, rewards: list | None = None) -> int:
    """Run (or resume) the RL loop described by `cfg`; returns the exit code (EXIT_*). `rewards`: the
    functions `rl.rewards.load_rewards(cfg.reward)` returned, where the caller loaded them already
    (the CLI does, to refuse a bad one first); None loads them here.

    Every check happens before Ray starts: the run folder, the checkpoint to resume, the model
    (check_model), the rewards, the dataset and every prompt's length (Loop). A refused start
    raises (ConfigError, DataError, RunDirError: exit 2 from the CLI) and a fresh run then removes
    what it created in run.out_dir. From then on a failure (an actor that raises or dies, Ray
    itself) ends the run with one paragraph in train.log and on the terminal (failure_paragraph):
    which actor, which step, the root cause, the last complete checkpoint and `command` + --resume,
    the way to continue (`command`: how the run was started, without --resume / --overwrite)."""
    run_dir = Path(cfg.run.out_dir).absolute()
    command = command or f"megamoe-rl train --config {run_dir / 'config.yaml'}"
    created = None if resume else _Created(run_dir)
    handlers: list = []
    try:
        run_dir, start_step = prepare_run_dir(cfg, resume)
        handlers = _setup_logging(run_dir)
        if resume:
            start_step = resume_checkpoint(run_dir)
            if start_step >= cfg.run.steps:  # finished: say so, change nothing (not even config.yaml)
                log.info("the run already has %d steps (run.steps=%d); nothing to do", start_step, cfg.run.steps)
                return EXIT_OK
        loop = Loop(cfg, run_dir, start_step, resolve_model(cfg, run_dir), rewards)
        if resume:
            log_config_changes(run_dir, cfg)
        write_atomic(run_dir / "config.yaml", to_yaml(cfg))
        from rl.logs import vllm_log_env

        vllm_env = vllm_log_env(run_dir)
        return _run(loop, cfg, run_dir, command, vllm_env)
    except BaseException:
        _close_logging(handlers)
        handlers = []
        if created is not None and not holds_run(run_dir):
            created.remove()
        raise
    finally:
        _close_logging(handlers)


def _close_logging(handlers: list[tuple[logging.Logger, logging.Handler]]) -> None:
    for logger, h in handlers:
        logger.removeHandler(h)
        h.close()


def _run(loop: Loop, cfg: Config, run_dir: Path, command: str, env: dict[str, str]) -> int:
    """Ray up, the loop, Ray down; every failure from here on is reported in one paragraph."""
    import ray

    def on_sigint(signum, frame):
        if loop.stop_requested:
            raise KeyboardInterrupt
        loop.stop_requested = True
        log.warning("Ctrl-C: finishing step %d, writing a checkpoint, then stopping (Ctrl-C again to stop now)",
                    loop.step + 1)

    previous = signal.signal(signal.SIGINT, on_sigint)
    started = False
    code = EXIT_FAILED
    try:
        started = start_ray(cfg, loop.plan, env=env)
        code = loop.run()
    except KeyboardInterrupt:
        last = latest_checkpoint(run_dir)
        log.warning("stopped at once by Ctrl-C; the last checkpoint is %s", last[1] if last else "none")
        code = EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - an actor's error or the driver's own: reported, not re-raised
        _report_failure(e, run_dir, command, loop.where)
        code = EXIT_FAILED
    finally:
        signal.signal(signal.SIGINT, previous)
        if started or ray.is_initialized():
            loop.shutdown()
        if started:
            ray.shutdown()
    try:
        if cfg.run.plot and (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size:
            from rl.plot import plot_run
            plot = plot_run(run_dir)
            log.info("plot: %s", plot)
            if loop.wandb is not None:
                loop.wandb.log_plot(plot)
        if code == EXIT_OK and cfg.run.export_final:
            log.info("final policy (Hugging Face checkpoint): %s", export_final(run_dir))
    except Exception as e:  # noqa: BLE001
        _report_failure(e, run_dir, command, "the end of the run (plot / export)")
        code = EXIT_FAILED
    if loop.wandb is not None:
        loop.wandb.close(code)
    return code


def _report_failure(e: BaseException, run_dir: Path, command: str, where: str) -> None:
    """The paragraph to train.log and the terminal; the traceback (the actor's, as Ray kept it, and
    the driver's) to <run_dir>/traceback.txt, which the paragraph names."""
    import traceback

    trace = run_dir / "traceback.txt"
    # The chain: ActorError <- Ray's exception, whose text holds the actor's own traceback.
    trace.write_text(ANSI.sub("", "".join(traceback.format_exception(e))))
    log.error("%s", failure_paragraph(e, run_dir, command, where, trace))


def export_final(run_dir: Path) -> Path:
    """The latest checkpoint's policy into run_dir/final (replacing an earlier export: a resumed run)."""
    from rl.export import export_policy

    final = run_dir / "final"
    if not final.exists():
        return export_policy(run_dir, final)
    new, old = run_dir / ".final.new", run_dir / ".final.old"
    for p in (new, old):
        if p.exists():
            shutil.rmtree(p)
    export_policy(run_dir, new)
    final.rename(old)
    new.rename(final)
    shutil.rmtree(old)
    return final
