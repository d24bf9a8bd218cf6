"""The TrainerWorker's settings: one flat, typed dataclass built from the `cfg` dict rl/ hands over.

    cfg = TrainerWorkerConfig.from_dict({"lr": 1e-5, "is_correction": "tis", "temperature": 0.8})

Names match rl/config.py's `trainer` section where the two overlap, so rl/ can pass that section
(plus `temperature` and `dtype`, which live in its rollout/model sections) as it is. Keys that only
the orchestration reads (placement, checkpoint cadence) are accepted and ignored here; any other
unknown key is an error that names it. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

MOE_IMPLS = ("megamoe", "reference", "stock")
IS_CORRECTIONS = ("none", "tis", "token_mask", "seq_mask", "metrics_only")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean")
DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPES = ("auto",) + DTYPES
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("constant", "cosine")

# rl/config.py's trainer section carries these for the orchestration (placement groups, checkpoint
# cadence); the worker does not need them but accepts a dict that holds them.
ORCHESTRATION_KEYS = frozenset({"world_size", "checkpoint_every", "keep_checkpoints", "cpus_per_rank",
                                "gpus_per_rank", "extra", "moe_impl"})


class TrainerConfigError(ValueError):
    """A cfg entry that does not fit TrainerWorkerConfig; the message names the key."""


@dataclass(frozen=True)
class TrainerWorkerConfig:
    seed: int = 0
    """Seeds torch's RNG on every rank (same seed everywhere: the model is replicated math)."""
    dtype: str = "auto"
    """Compute dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32" or "bfloat16". Master
    weights, optimizer state and gradient reduction stay fp32; with "bfloat16" FSDP2 casts the
    parameters to bf16 for forward/backward (MixedPrecisionPolicy)."""
    device: str = "auto"
    """"auto": cuda when available (one GPU per rank, NCCL), else cpu (gloo)."""
    fsdp: bool = True
    """Shard with FSDP2 `fully_shard`. False is allowed only for world_size 1 (the plain, unsharded
    model: no process group at all; used as the ground truth FSDP is compared against)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (transformers' gradient checkpointing, non-reentrant)."""
    num_threads: int | None = None
    """torch intra-op threads per rank (CPU); None leaves torch's default."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    lr_schedule: str = "constant"
    """"constant" or "cosine" (to 0 at total_steps), both after linear warmup."""
    warmup_steps: int = 0
    total_steps: int = 0
    """Length of the cosine schedule in optimizer steps (required > 0 for "cosine")."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping (the norm is still measured and checked)."""

    temperature: float = 1.0
    """The sampler's temperature: trainer logprobs are log_softmax(logits / temperature)."""
    clip_eps: float = 0.2
    """PPO ratio clip, lower side 1 - clip_eps."""
    clip_eps_high: float | None = None
    """PPO ratio clip, upper side 1 + clip_eps_high; None = clip_eps."""
    loss_agg: str = "token_mean"
    """"token_mean": sum over all completion tokens / their number in the (mini)batch;
    "seq_mean_token_mean": mean over sequences of each sequence's token mean (GRPO's original)."""
    is_correction: str = "tis"
    """Training-inference mismatch correction against the sampler's logprobs (ratio
    r = pi_trainer_old / pi_sampler per token): "none"; "tis" (weight min(r, is_cap)); "token_mask"
    (drop tokens with r outside [is_low, is_high]); "seq_mask" (drop sequences whose geometric-mean
    ratio is outside); "metrics_only" (measure, do not correct). Metrics are logged in every mode."""
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    minibatches: int = 1
    """Optimizer steps per train_step: the batch is split into this many minibatches; with more
    than one, the old-policy logprobs of the PPO ratio are taken once before the first update."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank (gradient accumulation above it)."""
    max_seq_len: int = 512
    """Longest prompt + completion accepted, in tokens."""
    truncate: bool = False
    """Sequences longer than max_seq_len: cut the completion to fit (True) or reject the batch."""
    export_dtype: str | None = None
    """dtype of exported weights ("float32"/"bfloat16"); None = the master dtype (fp32)."""

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, expected: str) -> None:
            if not ok:
                raise TrainerConfigError(f"{key}: expected {expected}, got {getattr(self, key)!r}")

        def pos_int(key: str, allow_zero: bool = False) -> None:
            v = getattr(self, key)
            need(isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if allow_zero else v >= 1),
                 key, "an int >= 0" if allow_zero else "an int >= 1")

        def fin(key: str, lo: float | None = None, lo_open: bool = False) -> None:
            v = getattr(self, key)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if ok and lo is not None:
                ok = v > lo if lo_open else v >= lo
            need(ok, key, "a finite float" + ("" if lo is None else f" {'>' if lo_open else '>='} {lo}"))

        need(self.dtype in COMPUTE_DTYPES, "dtype", f"one of {COMPUTE_DTYPES}")
        need(self.device in DEVICES, "device", f"one of {DEVICES}")
        need(self.lr_schedule in LR_SCHEDULES, "lr_schedule", f"one of {LR_SCHEDULES}")
        need(self.loss_agg in LOSS_AGGS, "loss_agg", f"one of {LOSS_AGGS}")
        need(self.is_correction in IS_CORRECTIONS, "is_correction", f"one of {IS_CORRECTIONS}")
        need(self.export_dtype is None or self.export_dtype in DTYPES, "export_dtype", f"None or one of {DTYPES}")
        for key in ("fsdp", "activation_checkpointing", "truncate"):
            need(isinstance(getattr(self, key), bool), key, "a bool")
        pos_int("seed", allow_zero=True)
        pos_int("warmup_steps", allow_zero=True)
        pos_int("total_steps", allow_zero=True)
        pos_int("minibatches")
        pos_int("micro_batch_size")
        pos_int("max_seq_len")
        need(self.max_seq_len >= 2, "max_seq_len", "an int >= 2 (one prompt and one completion token)")
        need(self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1),
             "num_threads", "None or an int >= 1")
        fin("lr", 0.0, lo_open=True)
        fin("weight_decay", 0.0)
        fin("adam_eps", 0.0, lo_open=True)
        for key in ("adam_beta1", "adam_beta2"):
            need(isinstance(getattr(self, key), (int, float)) and 0 <= getattr(self, key) < 1, key, "a float in [0, 1)")
        fin("grad_clip", 0.0)
        fin("temperature", 0.0, lo_open=True)
        need(isinstance(self.clip_eps, (int, float)) and 0 < self.clip_eps < 1, "clip_eps", "a float in (0, 1)")
        need(self.clip_eps_high is None or (isinstance(self.clip_eps_high, (int, float)) and self.clip_eps_high > 0),
             "clip_eps_high", "None or a float > 0")
        fin("is_cap", 1.0)
        need(isinstance(self.is_low, (int, float)) and isinstance(self.is_high, (int, float))
             and 0 <= self.is_low < 1 < self.is_high, "is_low", f"0 <= is_low < 1 < is_high (is_high={self.is_high!r})")
        if self.lr_schedule == "cosine":
            need(self.total_steps > self.warmup_steps, "total_steps",
                 f"an int > warmup_steps ({self.warmup_steps}) for lr_schedule='cosine'")

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @classmethod
    def from_dict(cls, cfg: dict[str, Any] | None) -> "TrainerWorkerConfig":
        cfg = dict(cfg or {})
        extra = cfg.pop("extra", None) or {}
        if not isinstance(extra, dict):
            raise TrainerConfigError(f"extra: expected a mapping, got {extra!r}")
        cfg.update(extra)
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, value in cfg.items():
            if key in names:
                kwargs[key] = value
            elif key not in ORCHESTRATION_KEYS:
                close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
                hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
                raise TrainerConfigError(f"unknown trainer cfg key {key!r}{hint}; valid keys: {', '.join(names)}")
        return cls(**kwargs)
