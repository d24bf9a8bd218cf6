"""Per-step metrics of the RL loop: sampler-trainer mismatch, rewards, throughput, and their sinks.

    m = mismatch_metrics(trainer_logprobs, sampler_logprobs, mode="tis", is_low=0.5, is_high=2.0, is_cap=2.0)
    with MetricsLogger(run_dir, tensorboard=True) as sink:
        sink.log(step, {"reward/mean": 0.4, **m})

The mismatch math has one home, trainer/loss.py (the trainer computes it inside train_step from the
same forward it trains with, and the loop logs what it returns); `mismatch_metrics` here applies the
same functions to ragged per-sequence lists, for callers that hold logprobs outside a trainer (the
`consistency` command, tests). For each completion token the sampler drew:
    d   = logp_trainer - logp_sampler      (Δlogp; the sampler's logprobs are processed ones)
    r   = exp(d)                           (importance ratio)
    k3  = r - 1 - d >= 0                   (k3 estimator of KL(sampler || trainer))
    p   = exp(logp)                        (token probability; |Δp| = |p_trainer - p_sampler|)
Keys: mismatch/k3_kl, mismatch/abs_logp_diff_mean, mismatch/abs_logp_diff_max,
mismatch/logp_diff_gt_1e-3_frac (tokens with |Δlogp| > 1e-3), mismatch/abs_prob_diff_mean / _max,
mismatch/prob_pearson (Pearson correlation of p_trainer and p_sampler over the tokens; NaN without
variance), mismatch/is_ratio_mean / _min / _max, mismatch/masked_frac (tokens the configured
correction drops).

Per MoE layer (`moe_layer_metrics`, the consistency command; both sides fed the same hidden states):
moe/routing_agreement (fraction of tokens whose top-k expert *set* is identical on both sides),
moe/out_rel_diff (||y_sampler - y_trainer|| / ||y_trainer||, Frobenius, fp64), moe/out_max_abs_diff,
moe/out_bitwise_equal, moe/router_logits_max_abs_diff.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Iterable

log = logging.getLogger("megamoe.rl.metrics")

# What the end-of-run plot and the progress bar read; train_step reports them (trainer/loss.py).
MISMATCH_KEYS = ("mismatch/k3_kl", "mismatch/abs_logp_diff_mean", "mismatch/abs_logp_diff_max",
                 "mismatch/logp_diff_gt_1e-3_frac", "mismatch/abs_prob_diff_mean", "mismatch/abs_prob_diff_max",
                 "mismatch/prob_pearson", "mismatch/is_ratio_mean", "mismatch/is_ratio_min", "mismatch/is_ratio_max",
                 "mismatch/masked_frac")
MOE_LAYER_KEYS = ("moe/routing_agreement", "moe/out_rel_diff", "moe/out_max_abs_diff", "moe/out_bitwise_equal",
                  "moe/router_logits_max_abs_diff")


def mismatch_metrics(trainer_logprobs: Iterable[Iterable[float]], sampler_logprobs: Iterable[Iterable[float]], *,
                     mode: str = "metrics_only", is_low: float = 0.5, is_high: float = 2.0,
                     is_cap: float = 2.0) -> dict[str, float]:
    """MISMATCH_KEYS over ragged per-sequence logprob lists (trainer/loss.py's definitions)."""
    import torch

    from trainer import loss

    t_seqs, s_seqs = [list(x) for x in trainer_logprobs], [list(x) for x in sampler_logprobs]
    if len(t_seqs) != len(s_seqs):
        raise ValueError(f"mismatch_metrics: {len(t_seqs)} trainer sequences vs {len(s_seqs)} sampler sequences")
    for i, (a, b) in enumerate(zip(t_seqs, s_seqs)):
        if len(a) != len(b):
            raise ValueError(f"mismatch_metrics: sequence {i} has {len(a)} trainer logprobs and {len(b)} "
                             f"sampler logprobs; they must cover the same completion tokens")
    t, mask = loss.pad_lists(t_seqs, dtype=torch.float64)
    s, _ = loss.pad_lists(s_seqs, dtype=torch.float64)
    out = loss.mismatch_metrics(t, s, mask)
    _, keep = loss.mismatch_correction(t, s, mask, mode, cap=is_cap, low=is_low, high=is_high)
    out["mismatch/masked_frac"] = loss.masked_fraction(keep, mask)
    return out


def routing_agreement(ids_a_Tk, ids_b_Tk) -> float:
    """Fraction of tokens whose top-k expert set is identical (slot order ignored: vLLM's top-k is unsorted)."""
    if tuple(ids_a_Tk.shape) != tuple(ids_b_Tk.shape):
        raise ValueError(f"routing_agreement: top-k ids of shape {tuple(ids_a_Tk.shape)} vs {tuple(ids_b_Tk.shape)}")
    if ids_a_Tk.shape[0] == 0:
        raise ValueError("routing_agreement: no tokens to compare")
    a = ids_a_Tk.long().sort(dim=1).values
    b = ids_b_Tk.long().sort(dim=1).values
    return float((a == b).all(dim=1).double().mean())


def relative_difference(a, b_ref) -> float:
    """||a - b|| / ||b|| (Frobenius, fp64). Raises on an all-zero reference, where it means nothing."""
    if tuple(a.shape) != tuple(b_ref.shape):
        raise ValueError(f"relative_difference: shapes {tuple(a.shape)} vs {tuple(b_ref.shape)}")
    ref = float(b_ref.double().norm())
    if ref == 0.0:
        raise ValueError("relative_difference: the reference is all zeros (a relative error is undefined)")
    return float((a.double() - b_ref.double()).norm()) / ref


def bitwise_equal(a, b) -> bool:
    """Same dtype, shape and bits (unlike ==, tells -0.0 from 0.0 and compares NaNs by payload)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def moe_layer_metrics(sampler: dict, trainer: dict) -> dict[str, float]:
    """MOE_LAYER_KEYS of one MoE layer, from each side's {"logits" [T,E], "ids" [T,k], "out" [T,H]}."""
    s_out, t_out = sampler["out"], trainer["out"]
    return {
        "moe/routing_agreement": routing_agreement(sampler["ids"], trainer["ids"]),
        "moe/out_rel_diff": relative_difference(s_out, t_out),
        "moe/out_max_abs_diff": float((s_out.double() - t_out.double()).abs().max()),
        "moe/out_bitwise_equal": float(bitwise_equal(s_out, t_out)),
        "moe/router_logits_max_abs_diff": float((sampler["logits"].double() - trainer["logits"].double()).abs().max()),
    }


def summarize(values: list[float], prefix: str) -> dict[str, float]:
    """mean / std (population) / min / max of a list under `prefix/`."""
    if not values:
        return {f"{prefix}/mean": float("nan")}
    n = len(values)
    mean = sum(values) / n
    return {f"{prefix}/mean": mean, f"{prefix}/std": math.sqrt(sum((v - mean) ** 2 for v in values) / n),
            f"{prefix}/min": min(values), f"{prefix}/max": max(values)}


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: str | os.PathLike, last_step: int) -> int:
    """Keep the records with step <= last_step (a resumed run redoes the later ones); atomic."""
    path = Path(path)
    records = [r for r in read_jsonl(path) if r["step"] <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
    return len(records)


def _json_value(v):
    # JSON has no NaN/inf; write them as null so every line stays parseable by strict readers.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def check_tensorboard() -> None:
    """run.tensorboard needs the tensorboard package (a dependency of the project); raises
    ConfigError naming the key when it does not import."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        from rl.config import ConfigError

        raise ConfigError("run.tensorboard: true, but the tensorboard package is not installed (pip install "
                          "tensorboard, a dependency of megamoe-rl); or set run.tensorboard=false")


class MetricsLogger:
    """Appends one JSON line per step to <run_dir>/metrics.jsonl; mirrors to TensorBoard (<run_dir>/tensorboard)
    when `tensorboard` and to W&B when given `wandb` (rl/wandb_log.py's WandbSink, closed by its owner).
    `log_samples` appends a step's samples to samples.jsonl every `samples_every` steps (rl/samples.py)
    and hands them to W&B's samples table."""

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, wandb=None, samples_every: int = 0):
        if tensorboard:
            check_tensorboard()
        self.run_dir = Path(run_dir)
        self.samples_every = samples_every
        self._wandb = wandb
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, metrics)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        from rl import samples

        if samples.due(step, self.samples_every):
            samples.append_rows(self.run_dir, rows)
        if self._wandb is not None:
            self._wandb.log_samples(step, rows)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
