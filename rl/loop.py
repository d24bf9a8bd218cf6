"""The RL loop on Ray: rollout and trainer actors in placement groups, one GRPO step at a time.

    megamoe-rl train --config configs/tiny.yaml [a.b=value ...] [--resume]
    rl.loop.train(cfg, resume=False) -> exit code

Per step k (1-based; the prompts of step k are a pure function of the seed and k, rl/data.py):
    prompts -> RolloutWorker.generate (G samples each, processed logprobs)
            -> rewards (rl/rewards.py) -> group advantages (trainer/loss.py)
            -> TrainerWorker.train_step on every rank (returns the loss and the sampler-trainer
               mismatch measured on the same forward)
            -> TrainerWorker.export_weights -> RolloutWorker.update_weights
            -> one line of metrics.jsonl (+ TensorBoard, progress bar); a checkpoint every
               trainer.checkpoint_every steps and at the end.

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
(the model made or checked before anything starts). This file stays over 500 lines for one reason:
`Loop` is one state machine (actors, steps, weight syncs, checkpoints, restarts) whose ~450 lines of
methods share its state; what does not need that state lives in the modules above.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import time
from pathlib import Path

from megamoe.contract import FAST
from rl.base_model import resolve_model
from rl.cluster import Placement, WorkerHost, node_ip_and_port, place, plan_bundles, start_ray, strategy
from rl.config import Config, to_yaml, trainer_worker_config
from rl.failures import ANSI, ActorError, RolloutFailed, TrainerDied, died, failure_paragraph
from rl.run_dir import (checkpoints_dir, holds_run, latest_checkpoint, log_config_changes, prepare_run_dir,
                        resume_checkpoint, write_atomic)
from rollout.sync import STREAMED

log = logging.getLogger("megamoe.rl")

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


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
        # -- issue 49 hook: evaluation, samples.jsonl, W&B; checked here, before anything starts --
        from rl.evaluation import Evaluator
        from rl.wandb_log import check_wandb

        check_wandb(cfg)
        self.evaluator = (Evaluator(cfg, tokenizer, None if cfg.eval.functions is not None else self.scorer.fns)
                          if cfg.eval.every else None)
        self.step_samples: list[dict] = []  # the last step's rows for samples.jsonl / W&B (rl/samples.py)
        self.wandb = None  # rl.wandb_log.WandbSink, opened by run()
        # -- end of the issue 49 hook --
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

    # -- actors ------------------------------------------------------------------------------
    def _host(self, num_cpus: float, num_gpus: float, pg, bundle: int):
        import ray

        # max_restarts=0: a dead worker is replaced by the loop, which knows the current weights.
        return ray.remote(WorkerHost).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
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
            host = self._host(t.cpus_per_rank, t.gpus_per_rank, pl.trainer_pg, pl.trainer_bundles[rank])
            self.trainers.append(host.remote(t.worker,
                                             (rank, t.world_size, addr, port, str(self.model_dir), t.moe_impl, cfg), {}))

    def _new_rollout(self, i: int):
        r = self.cfg.rollout
        pl = self.placement
        host = self._host(r.cpus_per_worker, r.gpus_per_worker, pl.rollout_pg, pl.rollout_bundles[i])
        kwargs = dict(dtype=self.cfg.model.dtype, seed=self.cfg.run.seed + i, max_model_len=r.max_model_len,
                      kv_cache_memory_bytes=r.kv_cache_bytes, weight_sync=self.weight_sync,
                      sleep_mode=r.sleep_level > 0, **r.engine_kwargs)
        if self.cfg.run.numerics != FAST:  # only then: a worker class of the interface without it still runs fast
            kwargs["numerics"] = self.cfg.run.numerics
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

    def _trainer_call(self, method: str, *args, put: bool = False):
        """Call `method` on every trainer rank (each runs collectives); rank 0's result (with put=True,
        [an ObjectRef to it] left in the object store by rank 0)."""
        refs = [(t.call_put if put else t.call).remote(method, *args) for t in self.trainers]
        return self._get(refs, self._trainer_names(), method)[0]

    def restart_rollout(self, i: int, why: BaseException, method: str) -> None:
        import ray

        self.restarts += 1
        if self.restarts > self.cfg.rollout.max_restarts:
            raise RolloutFailed(f"RolloutWorker {i}", method, self.where, why,
                                note=f" after rollout.max_restarts={self.cfg.rollout.max_restarts} restarts") from why
        log.warning("RolloutWorker %d died (%s); restarting it with the current weights (restart %d of %d)",
                    i, type(why).__name__, self.restarts, self.cfg.rollout.max_restarts)
        try:
            ray.kill(self.rollouts[i], no_restart=True)
        except Exception:  # noqa: BLE001 - it is dead already; kill only releases the handle
            pass
        self.rollouts[i] = self._new_rollout(i)
        self.pids["rollout"][i] = self._get([self.rollouts[i].pid.remote()], [f"RolloutWorker {i}"], "__init__")[0]
        self.write_pids()
        if self.weights_dirty:
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
        if self.weight_sync in STREAMED:
            what = f"the weight sync ({self.weight_sync})"
            try:
                info = weight_sync.push_streamed(self.weight_sync, self.trainers, [self.rollouts[i] for i in targets],
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
            times.update({k: v for k, v in info["seconds"].items() if k != "total"})  # rollout.sync.send_ipc's / send_nccl's phases
            times["total"] = time.perf_counter() - t0
            return times
        # A reference to rank 0's weights in the object store: the driver never holds them (fetching
        # them here and putting them back cost two more host copies of the whole model).
        named = self._trainer_call("export_weights", self._export_dtype(), put=True)[0]
        times["export"] = time.perf_counter() - t0
        for i in targets:
            try:
                info = ray.get(self.rollouts[i].call.remote("update_weights", named))
            except ray.exceptions.RayActorError as e:
                if e.actor_init_failed:
                    raise ActorError(f"RolloutWorker {i}", "__init__", self.where, e) from e
                self.restart_rollout(i, e, "update_weights")  # the new worker gets these weights
                continue
            except ray.exceptions.RayError as e:
                raise ActorError(f"RolloutWorker {i}", "update_weights", self.where, e) from e
            if i == targets[0] and isinstance(info, dict):
                times.update({k[:-2]: v for k, v in info.items() if k.endswith("_s")})
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
        mem = self._get([self.rollouts[0].call.remote("gpu_memory")], ["RolloutWorker 0"], "gpu_memory")[0]
        return mem["device_used_bytes"] / 2**30 if mem else None

    def generate(self, prompts: list[str], sampling: dict, n: int | None = None) -> list[dict]:
        """n (default rollout.n) samples per prompt over all rollout workers, ordered prompt-major;
        retried on worker death."""
        import ray

        n = self.cfg.rollout.n if n is None else n
        k = len(self.rollouts)
        bounds = [(len(prompts) * j // k, len(prompts) * (j + 1) // k) for j in range(k)]
        while True:
            refs = [w.call.remote("generate", prompts[a:b], n, sampling) for w, (a, b) in zip(self.rollouts, bounds)]
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
        samples = []
        for (a, _), out in zip(bounds, outs):
            for s in out:
                samples.append({**s, "prompt_index": a + s["prompt_index"]})
        samples.sort(key=lambda s: s["prompt_index"])  # stable: keeps each prompt's sample order
        counts = [0] * len(prompts)
        for s in samples:
            counts[s["prompt_index"]] += 1
        if any(c != n for c in counts):
            raise RuntimeError(f"RolloutWorker.generate returned {counts} samples per prompt, expected n={n} each")
        return samples

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
        self._trainer_call("save_checkpoint", str(root / name))
        # Older checkpoints go only once the new one reads back whole (run.keep_checkpoints).
        verify(root / name)
        write_atomic(root / "latest.json", json.dumps({"step": self.step, "path": name}) + "\n")
        keep = self.cfg.trainer.keep_checkpoints
        steps = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != name)
        import shutil
        for old in steps[: max(0, len(steps) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s written in %.1f s", root / name, time.perf_counter() - t0)
        return time.perf_counter() - t0

    # -- one step ----------------------------------------------------------------------------
    def run_step(self) -> dict:
        import ray
        from trainer.loss import group_advantages

        from rl.data import apply_chat_template
        from rl.rewards import TrainerState

        cfg = self.cfg
        self.where = f"step {self.step + 1}"
        t_step = time.perf_counter()
        batch = self.source.batch(self.step, cfg.run.prompts_per_step)
        prompts = batch.prompts
        if self.tokenizer is not None:  # message lists, and strings under data.chat_template
            prompts = apply_chat_template(self.tokenizer, prompts, strings=cfg.data.chat_template)
        sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "max_tokens": cfg.rollout.max_tokens, "seed": cfg.run.seed * 1_000_003 + self.step}

        t0 = time.perf_counter()
        samples = self.generate(prompts, sampling)
        t_rollout = time.perf_counter() - t0

        t0 = time.perf_counter()
        idx = [s["prompt_index"] for s in samples]
        texts = [s["text"] for s in samples]
        columns = {k: [v[i] for i in idx] for k, v in batch.columns.items()}
        rewards = self.scorer([batch.prompts[i] for i in idx], texts, columns,
                              completion_ids=[s["completion_ids"] for s in samples],
                              trainer_state=TrainerState(global_step=self.step, max_steps=cfg.run.steps))
        adv = group_advantages(rewards.total, cfg.rollout.n, scale_by_std=cfg.reward.scale_by_std,
                               eps=cfg.reward.eps).tolist()
        t_reward = time.perf_counter() - t0
        from rl.samples import sample_rows  # issue 49 hook: samples.jsonl / the W&B samples table

        self.step_samples = sample_rows(self.step + 1, prompts, texts, rewards, adv, idx)

        train_batch = {"prompt_ids": [s["prompt_ids"] for s in samples],
                       "completion_ids": [s["completion_ids"] for s in samples],
                       "sampler_logprobs": [s["logprobs"] for s in samples], "advantages": adv}
        memory = {}
        if self.on_gpu:
            memory["after_rollout"] = self.gpu_memory_gib()
        t_sleep = 0.0
        if cfg.rollout.sleep_level:
            # The KV cache (and with level 2 the weights) make room for the trainer; the sync wakes
            # the weights, the next generate the KV cache.
            t0 = time.perf_counter()
            self._get([w.call.remote("sleep", cfg.rollout.sleep_level) for w in self.rollouts],
                      [f"RolloutWorker {i}" for i in range(len(self.rollouts))], "sleep")
            t_sleep = time.perf_counter() - t0
        t0 = time.perf_counter()
        train_metrics = self._trainer_call("train_step", ray.put(train_batch))
        t_train = time.perf_counter() - t0
        if self.on_gpu:
            memory["after_train"] = self.gpu_memory_gib()
        self.weights_dirty = True
        self.step += 1

        sync = self.push_weights()
        if self.on_gpu:
            memory["after_sync"] = self.gpu_memory_gib()

        comp_tokens = sum(len(s["completion_ids"]) for s in samples)
        all_tokens = comp_tokens + sum(len(s["prompt_ids"]) for s in samples)
        m = rewards.metrics(cfg.rollout.n)
        m["reward/errors_total"] = sum(self.scorer.errors_total.values())
        m["data/dropped_prompts"] = self.source.dropped
        plens = [len(s["prompt_ids"]) for s in samples[::cfg.rollout.n]]
        m.update({"prompt/len_mean": sum(plens) / len(plens), "prompt/len_min": min(plens), "prompt/len_max": max(plens)})
        lens = [len(s["completion_ids"]) for s in samples]
        m["completion/len_mean"] = sum(lens) / len(lens)
        m["completion/len_max"] = max(lens)
        m["completion/at_max_tokens_frac"] = sum(n >= cfg.rollout.max_tokens for n in lens) / len(lens)
        for k, v in train_metrics.items():
            m[k if "/" in k else f"train/{k}"] = v
        m["throughput/rollout_tokens_per_s"] = comp_tokens / max(t_rollout, 1e-9)
        m["throughput/train_tokens_per_s"] = all_tokens / max(t_train, 1e-9)
        m["time/rollout_s"] = t_rollout
        m["time/reward_s"] = t_reward
        m["time/train_s"] = t_train
        m["time/sleep_s"] = t_sleep
        m["time/weight_sync_s"] = sync.pop("total")
        m.update({f"time/weight_sync/{k}_s": v for k, v in sync.items()})
        m.update({f"memory/gpu_used_gib/{k}": v for k, v in memory.items() if v is not None})
        m["rollout/restarts_total"] = self.restarts
        m["sample/prompt"] = prompts[0]  # as the sampler got it (chat template applied)
        m["sample/completion"] = texts[0]
        m["time/step_s"] = time.perf_counter() - t_step
        return m

    # -- the whole run -----------------------------------------------------------------------
    def run(self) -> int:
        from rl.metrics import truncate_jsonl

        cfg = self.cfg
        from rl.wandb_log import WandbSink  # issue 49 hook

        self.wandb = WandbSink.open(self.run_dir, cfg)
        self.placement = place(self.plan)
        self.start_trainers()
        self.start_rollouts()
        self.wait_for_actors()
        if self.step > 0:
            _, path = latest_checkpoint(self.run_dir)
            self._trainer_call("load_checkpoint", str(path))
            kept = truncate_jsonl(self.run_dir / "metrics.jsonl", self.step)
            for name in ("samples.jsonl", "eval_samples.jsonl"):  # issue 49 hook: as metrics.jsonl
                if (self.run_dir / name).exists():
                    truncate_jsonl(self.run_dir / name, self.step)
            log.info("resumed from %s (step %d; metrics.jsonl keeps %d lines)", path, self.step, kept)
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
            if self.evaluator is not None and self.step == 0:  # issue 49 hook: the base policy, before step 1
                sink.log(0, self.evaluate())
            while self.step < cfg.run.steps:
                if self.stop_requested:  # Ctrl-C before the first step: the last checkpoint stands
                    log.warning("stopped by Ctrl-C before step %d; continue with --resume", self.step + 1)
                    return EXIT_INTERRUPTED
                m = self.run_step()
                if self.evaluator is not None and self.evaluator.due(self.step):  # issue 49 hook
                    m.update(self.evaluate())
                sink.log_samples(self.step, self.step_samples)  # issue 49 hook
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

        m, rows = self.evaluator.run(lambda prompts, sampling, n: self.generate(prompts, sampling, n), self.step)
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
            if loop.wandb is not None:  # issue 49 hook
                loop.wandb.log_plot(plot)
        if code == EXIT_OK and cfg.run.export_final:
            log.info("final policy (Hugging Face checkpoint): %s", export_final(run_dir))
    except Exception as e:  # noqa: BLE001
        _report_failure(e, run_dir, command, "the end of the run (plot / export)")
        code = EXIT_FAILED
    if loop.wandb is not None:  # issue 49 hook
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
