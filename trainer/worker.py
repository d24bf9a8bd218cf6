"""TrainerWorker: one rank of the FSDP2 trainer (a plain class; rl/ wraps it with ray.remote).

    Worker = ray.remote(num_cpus=1)(TrainerWorker)
    cfg = TrainerWorkerConfig.from_dict({"lr": 1e-5, "temperature": 0.8})  # or a mapping of its fields
    ranks = [Worker.remote(r, W, "127.0.0.1", port, model_dir, "megamoe", cfg) for r in range(W)]
    metrics = ray.get([w.train_step.remote(batch) for w in ranks])[0]   # every rank gets the whole batch
    named = ray.get([w.export_weights.remote() for w in ranks])[0]       # rank 0 returns the tensors

All ranks must receive every call (train_step, logprobs, export_*, save/load_checkpoint): each one
runs collectives. Every rank is handed the whole batch and works on its own contiguous shard.

A step: the batch's rows, checked against this model -> split into `minibatches` -> per minibatch, micro-batches of
forward/backward (gradients accumulate; FSDP2 reduce-scatters them in fp32) -> global gradient
norm and clipping -> if the loss and the norm are finite, AdamW steps; otherwise the step is
skipped (logged, counted in `skipped_total`) and the weights and optimizer state stay the last
good ones. With trainer.kl_coef > 0 every rank also holds its shard of a frozen reference policy
(the initial weights) and runs its forward on each micro-batch (docs/OBJECTIVES.md).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import checkpoint as ckpt
from megamoe.contract import HOST_IMPLS
from records import TrainBatch
from trainer.batch import BatchError, collate, micro_batches, score_rows, shard_bounds, split_even, train_rows
from trainer.config import ConfigError, TrainerWorkerConfig
from trainer.experts import MOE_CALLS
from trainer.fsdp import apply_fsdp, buckets, iter_full_weights, nonfinite_weights, weight_metadata
from trainer.loss import finish_stats, policy_loss, token_logprobs
from trainer import lora, packing
from trainer.model import load_model
from trainer.replay import finish_routing, replay_routers, routing_load, routing_replay, routing_sums

log = logging.getLogger("trainer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TrainerWorker:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_dir: str,
                 moe_impl: str, cfg: TrainerWorkerConfig | dict | None = None):
        """`cfg`: a TrainerWorkerConfig (rl/ builds it: rl.config.trainer_worker_config) or a mapping of
        its fields; moe_impl and world_size are this constructor's own arguments, never cfg entries."""
        if moe_impl not in HOST_IMPLS:
            raise ValueError(f"moe_impl: expected one of {HOST_IMPLS}, got {moe_impl!r}")
        if isinstance(cfg, TrainerWorkerConfig):
            cfg.validate()
        else:
            cfg = TrainerWorkerConfig.from_dict(cfg)
        self.cfg = c = cfg
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank, world_size: expected 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        if not c.fsdp and world_size != 1:
            raise ConfigError(f"fsdp: expected True for world_size={world_size} (False means one unsharded rank)")
        self.rank, self.world_size, self.moe_impl = rank, world_size, moe_impl
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        self.device = self._pick_device(c.device)
        dtype = c.dtype if c.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" and c.fsdp else "float32")
        self.compute_dtype = _DTYPES[dtype]
        if not c.fsdp and self.compute_dtype != torch.float32 and not c.lora.enabled:
            raise ConfigError(f"dtype: expected 'float32' or 'auto' with fsdp=False (bf16 compute over fp32 "
                              f"master weights is FSDP2's mixed precision; or trainer.lora, whose frozen base is "
                              f"held in the compute dtype), got {c.dtype!r}")
        torch.manual_seed(c.seed)

        self._owns_pg = False
        if c.fsdp:
            self._init_process_group(master_addr, master_port)
        # LoRA without FSDP2 holds the frozen base in the compute dtype (no master copy: it never changes).
        base_dtype = self.compute_dtype if c.lora.enabled and not c.fsdp else torch.float32
        self.model = load_model(model_dir, moe_impl, dtype=base_dtype, device=self.device, numerics=c.numerics)
        if c.lora.enabled:
            lora.install(self.model, c.lora, seed=c.seed, compute_dtype=self.compute_dtype)
        self.vocab_size = self.model.config.vocab_size
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None and 0 <= int(pad) < self.vocab_size else 0
        if c.activation_checkpointing:
            # transformers' own per-decoder-layer checkpointing: parameter names stay unchanged.
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        if c.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(self.device.type, (world_size,))
            apply_fsdp(self.model, mesh, self.compute_dtype)
        else:
            mesh = None
        self.reference = self._load_reference(model_dir, mesh) if c.kl_coef > 0 else None
        self.optimizer = self._make_optimizer()
        self.step = 0             # train_step calls
        self.optimizer_steps = 0  # AdamW updates taken (the LR schedule's clock)
        self.skipped_steps = 0    # updates skipped for a non-finite loss or gradient
        self.truncated_total = 0
        if rank == 0:
            log.info("TrainerWorker: world_size=%d device=%s moe_impl=%s compute dtype=%s (fp32 master weights) "
                     "fsdp=%s activation_checkpointing=%s", world_size, self.device, moe_impl, self.compute_dtype,
                     c.fsdp, c.activation_checkpointing)

    # -- setup -----------------------------------------------------------------------------------
    def _pick_device(self, want: str) -> torch.device:
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise RuntimeError("device: 'cuda' was asked for, but torch.cuda.is_available() is False")
            n = torch.cuda.device_count()
            index = int(os.environ.get("LOCAL_RANK", self.rank)) % n if n > 1 else 0
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def _init_process_group(self, addr: str, port: int) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise RuntimeError(f"process group: already initialised with rank {dist.get_rank()} of "
                                   f"{dist.get_world_size()}, expected rank {self.rank} of {self.world_size}")
            return
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{int(port)}", rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(minutes=10))
        self._owns_pg = True

    def _load_reference(self, model_dir: str, mesh) -> torch.nn.Module:
        """The KL penalty's reference policy: the initial weights (model_dir, also on a resumed run),
        frozen, in the compute dtype, sharded over the ranks as the policy is. Memory per rank:
        parameters x bytes of the compute dtype / world_size (bf16 on CUDA: 2 bytes, an eighth of the
        policy's 16: fp32 weights, fp32 gradients, two fp32 Adam moments; fp32 on CPU: 4), no gradients, no
        optimizer state, no activations kept (its forward runs under no_grad). In bf16 it holds the
        same rounding of the initial weights FSDP2's mixed precision computes the policy with."""
        ref = load_model(model_dir, self.moe_impl, dtype=self.compute_dtype, device=self.device,
                         numerics=self.cfg.numerics)
        ref.requires_grad_(False)
        ref.eval()
        if mesh is not None:
            apply_fsdp(ref, mesh, self.compute_dtype)
        if self.rank == 0:
            n = sum(p.numel() for p in ref.parameters())
            per_rank = n * torch.finfo(self.compute_dtype).bits // 8 / self.world_size
            log.info("reference policy for trainer.kl_coef=%g (%s): %d parameters, %.1f MiB per rank",
                     self.cfg.kl_coef, self.cfg.kl_estimator, n, per_rank / 2**20)
        return ref

    def _make_optimizer(self) -> torch.optim.Optimizer:
        c = self.cfg
        return torch.optim.AdamW(lora.trainable(self.model), lr=self._lr(0), betas=(c.adam_beta1, c.adam_beta2),
                                 eps=c.adam_eps, weight_decay=c.weight_decay)

    def _lr(self, update: int) -> float:
        """LR of optimizer update number `update` (0-based): linear warmup, then constant or cosine."""
        c = self.cfg
        if c.warmup_steps and update < c.warmup_steps:
            return c.lr * (update + 1) / c.warmup_steps
        if c.lr_schedule == "cosine":
            progress = min(1.0, (update - c.warmup_steps) / max(1, c.total_steps - c.warmup_steps))
            return c.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        return c.lr

    # -- collectives -----------------------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return dist.is_initialized() and self.cfg.fsdp

    def _reduce(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """All-reduce a stats dict: *_max by max, *_min by min, the rest by sum."""
        keys = sorted(sums)
        vals = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).reshape(()).cpu() for k in keys])
        if self._distributed:
            dev = self.device if self.device.type == "cuda" else torch.device("cpu")
            mx = torch.tensor([1.0 if k.endswith("_max") else 0.0 for k in keys], dtype=torch.bool)
            mn = torch.tensor([1.0 if k.endswith("_min") else 0.0 for k in keys], dtype=torch.bool)
            add = ~(mx | mn)
            t_sum = torch.where(add, vals, 0.0).to(dev)
            t_max = torch.where(mx, vals, torch.where(mn, -vals, -math.inf)).to(dev)
            dist.all_reduce(t_sum, op=dist.ReduceOp.SUM)
            dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
            t_sum, t_max = t_sum.cpu(), t_max.cpu()
            vals = torch.where(add, t_sum, torch.where(mx, t_max, -t_max))
        return {k: float(v) for k, v in zip(keys, vals)}

    # -- forward ---------------------------------------------------------------------------------
    def _completion_logprobs(self, mb, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Per-token logprobs of the micro-batch's completions under `model` (the policy by default)."""
        out = (model or self.model)(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                    position_ids=mb.position_ids, use_cache=False)
        logits = out.logits
        if mb.position_ids is not None:
            # packed (trainer/packing.py): each sequence's rows picked from the one row by index, whose backward
            # adds into a gradient of the row's size; a gather from the row expanded once per sequence would
            # allocate sequences x tokens x vocab there (71 GiB at Qwen3's vocabulary and 8192 tokens)
            picked = logits[0][mb.positions]
        else:
            V = logits.shape[-1]
            picked = torch.gather(logits, 1, mb.positions.unsqueeze(-1).expand(-1, -1, V))
        return token_logprobs(picked, mb.targets, self.cfg.temperature, self.cfg.numerics)

    # --- routing replay (docs/ROUTING_REPLAY.md) ---
    def _routing(self, mb):
        """The micro-batch's forward (and backward) with the sampler's routing replayed (trainer.routing_replay)
        or only measured against it; nothing when the batch carries none."""
        if mb.routed is None:
            return contextlib.nullcontext([])
        return routing_replay(self.model, mb.routed, mb.attention_mask.reshape(-1).bool(),
                              replay=self.cfg.routing_replay)

    def _routing_sums(self, states: list) -> dict[str, torch.Tensor]:
        # A rank's padding micro-batch carries no routing: zeros for every layer, so every rank reduces the same keys.
        sums = routing_sums(states) if states else {k: 0.0 for k in routing_sums(
            [_NoRouting()] * len(replay_routers(self.model)))}
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in sums.items()}
    # --- end routing replay ---

    def _local(self, seqs: list) -> tuple[list, int]:
        """This rank's shard of `seqs` and the largest shard any rank has."""
        start, end = shard_bounds(len(seqs), self.world_size, self.rank)
        return seqs[start:end], math.ceil(len(seqs) / self.world_size)

    def _micro_batches(self, seqs: list) -> Iterator:
        """This rank's micro-batches of `seqs` (a minibatch every rank holds): right-padded, micro_batch_size
        sequences each, or packed by trainer.token_budget (trainer/packing.py)."""
        c = self.cfg
        if c.packing:
            for group in packing.packed_groups(seqs, self.world_size, self.rank, c.token_budget):
                yield packing.collate_packed(group, self.pad_id, self.device)
            return
        local, nmax = self._local(seqs)
        for mb_seqs in micro_batches(local, nmax, c.micro_batch_size):
            yield collate(mb_seqs, self.pad_id, self.device)

    # -- public interface ------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict:
        """One optimizer update per minibatch of `batch` (a records.TrainBatch, checked where it was built;
        here against this model: trainer/batch.py); returns metrics (identical on every rank)."""
        c = self.cfg
        seqs, n_trunc = train_rows(batch, vocab_size=self.vocab_size, max_seq_len=c.max_seq_len, truncate=c.truncate)
        self.truncated_total += n_trunc
        minis = split_even(seqs, min(c.minibatches, len(seqs)))
        with_routing = seqs[0].routed is not None
        old_logp: dict[int, torch.Tensor] | None = None
        if seqs[0].old_logprobs is not None:
            old_logp = {s.index: torch.tensor(s.old_logprobs, dtype=torch.float32, device=self.device) for s in seqs}
        elif len(minis) > 1:
            # The PPO ratio's denominator: the policy before this step's first update.
            old_logp = {}
            with torch.no_grad():
                for mini in minis:
                    for mb in self._micro_batches(mini):
                        with self._routing(mb):
                            lp = self._completion_logprobs(mb)
                        for r, s in enumerate(mb.seqs):
                            old_logp[s.index] = lp[r, : len(s.completion)].detach()

        totals: dict[str, float] = {}
        losses, norms, skipped = [], [], 0
        for mini in minis:
            total_tokens = float(sum(s.loss_tokens for s in mini))
            self.optimizer.zero_grad(set_to_none=True)
            loss_local = torch.zeros((), dtype=torch.float64)
            stats_local: dict[str, torch.Tensor] = {}
            for mb in self._micro_batches(mini):
                # routing replay: the sampler's experts stay on the routers through the backward (activation
                # checkpointing recomputes the forward there); the frozen reference routes with its own router.
                with self._routing(mb) as routing_states:
                    logp = self._completion_logprobs(mb)
                    if old_logp is None:
                        old = logp.detach()
                    else:
                        old = torch.zeros_like(logp)
                        for r, s in enumerate(mb.seqs):
                            old[r, : len(s.completion)] = old_logp[s.index]
                    ref = None
                    if self.reference is not None:
                        with torch.no_grad():
                            ref = self._completion_logprobs(mb, self.reference)
                    loss, st = policy_loss(logp, old, mb.sampler_logprobs, mb.advantages, mb.mask, objective=c.loss,
                                           is_correction=c.is_correction, is_cap=c.is_cap, is_low=c.is_low,
                                           is_high=c.is_high, clip_low=c.clip_eps, clip_high=c.clip_high,
                                           agg=c.aggregation, total_tokens=total_tokens, total_seqs=float(len(mini)),
                                           max_tokens=c.max_tokens, ref_logp=ref, kl_coef=c.kl_coef,
                                           kl_estimator=c.kl_estimator)
                    # FSDP2 averages gradients over the ranks; each rank's loss is its share of the global
                    # (minibatch) loss, so scaling by world_size makes the reduced gradient the global one.
                    (loss * self.world_size).backward()
                if with_routing:
                    st = {**st, **self._routing_sums(routing_states)}
                loss_local += loss.detach().double().cpu()
                for k, v in st.items():
                    v = v.detach().cpu()
                    if k not in stats_local:
                        stats_local[k] = v
                    elif k.endswith("_max"):
                        stats_local[k] = torch.maximum(stats_local[k], v)
                    elif k.endswith("_min"):
                        stats_local[k] = torch.minimum(stats_local[k], v)
                    else:
                        stats_local[k] = stats_local[k] + v
            red = self._reduce({**stats_local, "loss_sum": loss_local})
            max_norm = c.grad_clip if c.grad_clip > 0 else math.inf
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            norm = float(norm)
            loss_value = red["loss_sum"]
            if math.isfinite(loss_value) and math.isfinite(norm):
                for group in self.optimizer.param_groups:
                    group["lr"] = self._lr(self.optimizer_steps)
                self.optimizer.step()
                self.optimizer_steps += 1
            else:
                skipped += 1
                self.skipped_steps += 1
                if self.rank == 0:
                    log.warning("train_step %d: skipped the update (loss=%s, grad_norm=%s); weights stay the last "
                                "good ones; %d skipped so far", self.step, loss_value, norm, self.skipped_steps)
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss_value)
            norms.append(norm)
            for k, v in red.items():
                if k.endswith("_max"):
                    totals[k] = max(totals.get(k, -math.inf), v)
                elif k.endswith("_min"):
                    totals[k] = min(totals.get(k, math.inf), v)
                else:
                    totals[k] = totals.get(k, 0.0) + v
        if self.device.type == "cuda":
            # The last optimizer step is still queued on the GPU: wait for it here, so that this step's
            # time is its own and not the next call's (a weight sync's first read waited for it).
            torch.cuda.synchronize(self.device)
        self.step += 1
        metrics = finish_stats(totals)
        if with_routing:  # routing metrics (docs/ROUTING_REPLAY.md); every rank holds the whole batch
            metrics.update(finish_routing(totals))
            metrics.update(routing_load([s.routed for s in seqs], replay_routers(self.model)[0].num_experts))
        metrics.update({
            "loss": sum(losses) / len(losses),
            "grad_norm": sum(norms) / len(norms),
            "lr": self._lr(max(self.optimizer_steps - 1, 0)),
            "step": self.step,
            "optimizer_steps": self.optimizer_steps,
            "skipped": skipped,
            "skipped_total": self.skipped_steps,
            "tokens": totals["tokens"],
            "sequences": len(seqs),
            "truncated": n_trunc,
        })
        return metrics

    def logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """The trainer's per-token logprobs of each completion (at the configured temperature), for
        every (prompt, completion) pair, on every rank."""
        c = self.cfg
        seqs = score_rows(prompt_ids, completion_ids, vocab_size=self.vocab_size, max_seq_len=c.max_seq_len,
                          truncate=c.truncate)
        out: dict[int, list[float]] = {}
        with torch.no_grad():
            for mb in self._micro_batches(seqs):
                with self._routing(mb):
                    lp = self._completion_logprobs(mb).cpu()
                for r, s in enumerate(mb.seqs):
                    out[s.index] = lp[r, : len(s.completion)].tolist()
        if self._distributed:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, out)
            for part in gathered:
                out.update(part)
        return [out[s.index] for s in seqs]

    def iter_weights(self, dtype: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full CPU tensor) one at a time on rank 0 (other ranks iterate, yielding nothing)."""
        name = dtype or self.cfg.export_dtype
        return iter_full_weights(self.model, dtype=_DTYPES[name] if name else None, rank=self.rank)

    def iter_device_weights(self, select=None, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor on this rank's device, in the trainer's dtype), one at a time, on every
        rank, for the names `select` accepts (all by default), or exactly `names` in that order: a
        CUDA IPC sync, where each rank's copy serves the engine on its GPU and is cast to the
        sampler's dtype as it is packed. A tensor may be the live parameter: copy it before the next
        optimizer step. Every rank must iterate it to the end."""
        return iter_full_weights(self.model, to_cpu=False, rank=self.rank, dst=None, select=select,
                                 names=names, may_alias=True)

    def sync_dtype(self, dtype: str | None = None) -> str | None:
        """The dtype name a weight sync sends in: `dtype`, else the trainer's export dtype (None: as held)."""
        return dtype or self.cfg.export_dtype

    def weight_metadata(self, dtype: str | None = None) -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype name) of every tensor `iter_weights(dtype)` yields; no data moves."""
        name = dtype or self.cfg.export_dtype
        return weight_metadata(self.model, _DTYPES[name] if name else None)

    def nonfinite_weights(self, dtype: str | None = None) -> list[str]:
        """Names of weights that hold NaN/Inf once cast to `dtype`, checked on the device (every rank)."""
        name = dtype or self.cfg.export_dtype
        return nonfinite_weights(self.model, _DTYPES[name] if name else None)

    def export_weights(self, dtype: str | None = None) -> list[tuple[str, torch.Tensor]]:
        """All weights as (transformers state_dict name, full tensor), on rank 0; [] on other ranks.

        This holds the whole model on rank 0; `export_weight_buckets` streams it instead."""
        return list(self.iter_weights(dtype))

    def export_weight_buckets(self, bucket_bytes: int = 64 << 20, dtype: str | None = None):
        """Generator of buckets (lists of (name, tensor), about bucket_bytes each) on rank 0.

        Through Ray: `w.export_weight_buckets.options(num_returns="streaming").remote()` on every
        rank; consume rank 0's stream bucket by bucket (e.g. into RolloutWorker.update_weights)."""
        yield from buckets(self.iter_weights(dtype), bucket_bytes)

    def save_checkpoint(self, path: str) -> str:
        trainer_state = {"step": self.step, "optimizer_steps": self.optimizer_steps,
                         "skipped_steps": self.skipped_steps, "truncated_total": self.truncated_total,
                         "moe_impl": self.moe_impl, "seed": self.cfg.seed}
        rank_state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rank_state["cuda"] = torch.cuda.get_rng_state(self.device)
        return str(ckpt.save(path, self.model, self.optimizer, trainer_state, rank_state))

    def load_checkpoint(self, path: str) -> dict:
        """Restore model, optimizer, LR-schedule clock, counters and RNG; returns the trainer state."""
        path = Path(path)
        if ckpt.is_complete(path):
            import json
            if not json.loads((path / ckpt.META).read_text()).get("has_optimizer_state", True):
                self.optimizer = self._make_optimizer()  # the checkpoint predates the first update
        trainer_state, rank_state, _ = ckpt.load(path, self.model, self.optimizer)
        self.step = int(trainer_state["step"])
        self.optimizer_steps = int(trainer_state["optimizer_steps"])
        self.skipped_steps = int(trainer_state["skipped_steps"])
        self.truncated_total = int(trainer_state.get("truncated_total", 0))
        if rank_state is not None:
            torch.set_rng_state(rank_state["torch"])
            random.setstate(rank_state["python"])
            if "cuda" in rank_state and self.device.type == "cuda":
                torch.cuda.set_rng_state(rank_state["cuda"], self.device)
        elif self.rank == 0:
            log.warning("checkpoint %s was written by another world size: RNG states not restored", path)
        return trainer_state

    def moe_calls(self) -> dict[str, int]:
        """Calls of megamoe's experts functions in this process (by impl)."""
        return dict(MOE_CALLS)

    def info(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                "moe_impl": self.moe_impl, "step": self.step, "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
                "experts_implementation": self.model.config._experts_implementation}

    def close(self) -> None:
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_pg = False


__all__ = ["BatchError", "TrainerWorker"]


class _NoRouting:
    """The counts of a forward that saw no routing (routing_sums of a padding micro-batch)."""
    tokens = agree = unrouted = replayed = 0
    entropy_sum = 0.0
