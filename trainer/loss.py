"""Policy-gradient losses (GRPO, GSPO, CISPO, Dr. GRPO; docs/OBJECTIVES.md), an optional KL penalty
to a reference policy, and training-inference mismatch correction.

Pure functions on padded tensors: `[B, L]` per-token values of B sequences (completion tokens
only), with `mask_BL` (bool) marking real tokens. rl/metrics.py reuses the mismatch math.

Three logprobs per completion token:
  logp      the trainer's current policy (with gradient), log_softmax(logits / temperature)
  old_logp  the trainer's policy before this train_step's first update (no gradient): the PPO
            ratio's denominator; equal to logp.detach() in a single-update step
  sampler_logprobs  the sampler's (vLLM's) processed logprob of the token it sampled
and, with a KL penalty (kl_coef > 0), a fourth:
  ref_logp  the frozen reference policy's (the initial weights'), no gradient

Mismatch: r = exp(old_logp - sampler_logprobs) is the importance ratio between the policy the trainer
differentiates and the one that actually sampled; it would be 1 if both sides computed the same
function. Corrections (`is_correction`): "tis" weights each token by min(r, cap) (truncated IS);
"token_mask" drops tokens with r outside [low, high]; "seq_mask" drops whole sequences whose
geometric-mean ratio exp(mean_t log r) is outside [low, high] (a length-independent sequence
ratio, so long sequences are not masked just for being long); "metrics_only" and "none" leave
the loss alone. The metrics are computed in every mode. Whatever the objective, the correction
multiplies its per-token term by the weight and zeroes it where a token is dropped (policy_loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megamoe.contract import BITWISE, FAST
from trainer.config import IS_CORRECTIONS, KL_ESTIMATORS, LOSS_AGGS, OBJECTIVES


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def pad_lists(rows: Sequence[Sequence[float]], dtype=torch.float32, value: float = 0.0):
    """Ragged lists -> (values [B, L], mask [B, L] bool)."""
    B = len(rows)
    L = max((len(r) for r in rows), default=0)
    out = torch.full((B, L), value, dtype=dtype)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=dtype)
            mask[i, : len(r)] = True
    return out, mask


def token_logprobs(logits_BLV: torch.Tensor, targets_BL: torch.Tensor, temperature: float = 1.0,
                   numerics: str = FAST) -> torch.Tensor:
    """log_softmax(logits / temperature)[target], in fp32 whatever the logits' dtype.

    The sampler reports processed logprobs (after temperature), so the trainer divides by the same
    temperature; without it the two differ systematically (ANCHORS.md, "raw vs processed").
    numerics="bitwise": the log_softmax is the sampler's batch-invariant kernel (trainer/bitwise.py).
    """
    logits = logits_BLV.float()
    if temperature != 1.0:
        logits = logits / temperature
    if numerics == BITWISE:
        from trainer.bitwise import log_softmax

        lsm = log_softmax(logits)
    else:
        lsm = F.log_softmax(logits, dim=-1)
    return torch.gather(lsm, -1, targets_BL.long().unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# mismatch math (rl/metrics.py imports these)
# ---------------------------------------------------------------------------------------------
def log_ratio(trainer_logp: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log r = trainer - sampler per token; 0 on padding (so exp gives 1 there)."""
    return torch.where(mask, trainer_logp.float() - sampler_logprobs.float(), torch.zeros((), dtype=torch.float32))


def k3_kl(trainer_logp: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(sampler || trainer) from the sampler's own samples:
    r - 1 - log r with r = p_trainer / p_sampler; >= 0, unbiased, 0 on padding."""
    lr = log_ratio(trainer_logp, sampler_logprobs, mask)
    return torch.expm1(lr) - lr


def importance_ratio(trainer_logp: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token r = p_trainer / p_sampler; 1 on padding."""
    return torch.exp(log_ratio(trainer_logp, sampler_logprobs, mask))


def sequence_log_ratio(trainer_logp: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over its tokens of log r: the log of the geometric-mean ratio, [B]."""
    n = mask.sum(dim=1).clamp(min=1)
    return log_ratio(trainer_logp, sampler_logprobs, mask).sum(dim=1) / n


def masked_fraction(keep: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of real tokens that a correction dropped."""
    n = int(mask.sum())
    return float((mask & ~keep).sum()) / n if n else 0.0


LOGP_DIFF_TOL = 1e-3
"""A token counts as mismatched when |Δlogp| exceeds this (mismatch/logp_diff_gt_1e-3_frac)."""


def mismatch_sums(trainer_logp: torch.Tensor, sampler_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Additive / extremal statistics of the mismatch (fp64 scalars), so ranks can all-reduce them.

    Keys ending in _sum and `tokens` add; `_max` take the max; `_min` the min. The probability
    moments (prob_*_sum) are what a Pearson correlation of p_trainer and p_sampler needs, in sums.
    """
    lr = log_ratio(trainer_logp, sampler_logprobs, mask).double()
    m = mask
    r = torch.exp(lr)
    big = torch.tensor(float("inf"), dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    p_t = torch.where(m, trainer_logp.double().exp(), 0.0)
    p_s = torch.where(m, sampler_logprobs.double().exp(), 0.0)
    dp = (p_t - p_s).abs()
    return {
        "tokens": m.sum().double(),
        "k3_kl_sum": torch.where(m, torch.expm1(lr) - lr, 0.0).sum(),
        "abs_logp_diff_sum": torch.where(m, lr.abs(), 0.0).sum(),
        "abs_logp_diff_max": torch.where(m, lr.abs(), 0.0).max() if m.numel() else zero,
        "logp_diff_gt_tol_sum": (m & (lr.abs() > LOGP_DIFF_TOL)).sum().double(),
        "abs_prob_diff_sum": dp.sum(),
        "abs_prob_diff_max": dp.max() if m.numel() else zero,
        "prob_t_sum": p_t.sum(),
        "prob_s_sum": p_s.sum(),
        "prob_tt_sum": (p_t * p_t).sum(),
        "prob_ss_sum": (p_s * p_s).sum(),
        "prob_ts_sum": (p_t * p_s).sum(),
        "is_ratio_sum": torch.where(m, r, 0.0).sum(),
        "is_ratio_max": torch.where(m, r, -big).max() if m.numel() else -big,
        "is_ratio_min": torch.where(m, r, big).min() if m.numel() else big,
    }


def _pearson(sums: dict[str, torch.Tensor | float], n: float) -> float:
    """Pearson correlation of p_trainer and p_sampler from the moment sums; NaN when either side has
    (numerically) no variance, where the correlation is undefined."""
    st, ss = float(sums["prob_t_sum"]), float(sums["prob_s_sum"])
    var_t = float(sums["prob_tt_sum"]) - st * st / n
    var_s = float(sums["prob_ss_sum"]) - ss * ss / n
    cov = float(sums["prob_ts_sum"]) - st * ss / n
    # Below ~1e-12 of n the variance is fp64 rounding of E[p^2] - E[p]^2, not signal.
    if var_t <= 1e-12 * n or var_s <= 1e-12 * n:
        return float("nan")
    return cov / math.sqrt(var_t * var_s)


def finish_mismatch(sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """mismatch_sums (possibly all-reduced) -> means and extremes."""
    n = float(sums["tokens"])
    d = max(n, 1.0)
    out = {
        "mismatch/k3_kl": float(sums["k3_kl_sum"]) / d,
        "mismatch/abs_logp_diff_mean": float(sums["abs_logp_diff_sum"]) / d,
        "mismatch/abs_logp_diff_max": float(sums["abs_logp_diff_max"]) if n else 0.0,
        "mismatch/logp_diff_gt_1e-3_frac": float(sums["logp_diff_gt_tol_sum"]) / d,
        "mismatch/abs_prob_diff_mean": float(sums["abs_prob_diff_sum"]) / d,
        "mismatch/abs_prob_diff_max": float(sums["abs_prob_diff_max"]) if n else 0.0,
        "mismatch/prob_pearson": _pearson(sums, n) if n >= 2 else float("nan"),
        "mismatch/is_ratio_mean": float(sums["is_ratio_sum"]) / d if n else 1.0,
        "mismatch/is_ratio_max": float(sums["is_ratio_max"]) if n else 1.0,
        "mismatch/is_ratio_min": float(sums["is_ratio_min"]) if n else 1.0,
    }
    return out


def mismatch_metrics(trainer_logp: torch.Tensor, sampler_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """k3 KL, |Δlogp| mean/max and the fraction above LOGP_DIFF_TOL, |Δp| mean/max, the Pearson
    correlation of the token probabilities, importance ratio mean/min/max, over the real tokens."""
    return finish_mismatch(mismatch_sums(trainer_logp, sampler_logprobs, mask))


def mismatch_correction(old_logp: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, mode: str,
                        *, cap: float = 2.0, low: float = 0.5, high: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B,L] fp32, keep [B,L] bool) to multiply the per-token loss by; no gradient.

    keep is always a subset of mask; weights are 1 except under "tis".
    """
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"is_correction: expected one of {IS_CORRECTIONS}, got {mode!r}")
    with torch.no_grad():
        lr = log_ratio(old_logp.detach(), sampler_logprobs, mask)
        weights = torch.ones_like(lr)
        keep = mask.clone()
        if mode == "tis":
            weights = torch.exp(lr).clamp(max=cap)
        elif mode == "token_mask":
            r = torch.exp(lr)
            keep = mask & (r >= low) & (r <= high)
        elif mode == "seq_mask":
            seq_r = torch.exp(sequence_log_ratio(old_logp.detach(), sampler_logprobs, mask))
            keep = mask & ((seq_r >= low) & (seq_r <= high))[:, None]
    return weights, keep


# ---------------------------------------------------------------------------------------------
# the policy loss (docs/OBJECTIVES.md gives every formula)
# ---------------------------------------------------------------------------------------------
def objective_terms(objective: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages_B: torch.Tensor,
                    mask: torch.Tensor, *, clip_low: float, clip_high: float):
    """Per-token policy-gradient terms to minimise, [B, L], before the mismatch correction and the
    aggregation; the clip indicator; the ratio (detached). A = the token's sequence's advantage.

    grpo, dr_grpo  r_t = exp(logp_t - old_t);  loss_t = max(-A r_t, -A clip(r_t, 1 - lo, 1 + hi))
    gspo           s = exp(mean_t (logp_t - old_t)) over the sequence's real tokens (length-normalised);
                   r_t = s * exp(logp_t - sg(logp_t)) (value s, gradient s * grad logp_t: GSPO-token
                   with one advantage per sequence); loss_t as grpo's with r_t, so the clip decision is
                   the sequence's. Under seq_mean_token_mean the sequence's term is exactly GSPO's.
    cispo          w_t = sg(clip(r_t, 1 - lo, 1 + hi));  loss_t = -w_t A logp_t: every token keeps a gradient
    """
    adv = advantages_B.to(logp.dtype)[:, None]
    log_r = logp - old_logp.detach()
    if objective in ("grpo", "dr_grpo"):
        ratio = torch.exp(log_r)
    elif objective == "gspo":
        n = mask.sum(dim=1, keepdim=True).clamp(min=1)
        seq_log_r = torch.where(mask, log_r, torch.zeros((), dtype=log_r.dtype)).sum(dim=1, keepdim=True) / n
        ratio = torch.exp(seq_log_r.detach() + logp - logp.detach())
    elif objective == "cispo":
        ratio = torch.exp(log_r).detach()
        weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        return -weight * adv * logp, (weight != ratio) & mask, ratio
    else:
        raise ValueError(f"loss: expected one of {OBJECTIVES}, got {objective!r}")
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped) & mask, ratio.detach()


def reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) on the sampled tokens; d = ref_logp - logp:
    k1 = -d (unbiased, any sign), k3 = exp(d) - 1 - d (>= 0, unbiased, lower variance). Differentiable in logp."""
    d = ref_logp.detach() - logp
    if estimator == "k1":
        return -d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str, *, total_tokens: float, total_seqs: float,
              max_tokens: int | None = None) -> torch.Tensor:
    """Sum of this shard's contribution to the (mini)batch loss.

    token_mean: sum_t loss_t / total_tokens (all real tokens of the minibatch, every rank);
    seq_mean_token_mean: sum_b (sum_t loss_bt / n_b) / total_seqs;
    constant: sum_t loss_t / (total_seqs * max_tokens) (Dr. GRPO: no dependence on the lengths).
    Dropped tokens count in the denominators, so a correction removes their gradient without
    up-weighting the rest.
    """
    if agg == "token_mean":
        return per_token.sum() / max(total_tokens, 1.0)
    if agg == "seq_mean_token_mean":
        n = mask.sum(dim=1).clamp(min=1).to(per_token.dtype)
        return (per_token.sum(dim=1) / n).sum() / max(total_seqs, 1.0)
    if agg == "constant":
        if not max_tokens or max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1 with loss_agg 'constant', got {max_tokens!r}")
        return per_token.sum() / (max(total_seqs, 1.0) * max_tokens)
    raise ValueError(f"loss_agg: expected one of {LOSS_AGGS}, got {agg!r}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, sampler_logprobs: torch.Tensor, advantages_B: torch.Tensor,
                mask: torch.Tensor, *, objective: str = "grpo", is_correction: str = "tis", is_cap: float = 2.0,
                is_low: float = 0.5, is_high: float = 2.0, clip_low: float = 0.2, clip_high: float = 0.2,
                agg: str = "token_mean", total_tokens: float | None = None, total_seqs: float | None = None,
                max_tokens: int | None = None, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                kl_estimator: str = "k3"):
    """The full loss of one shard: (loss scalar, stats dict of fp64 sums for all-reduce).

        loss_t = objective_t * w_t + kl_coef * kl_t   on kept tokens, 0 elsewhere; then `agg`

    w_t and the kept tokens are the mismatch correction's (is_correction), applied to the objective's
    per-token term whatever the objective; the KL term is neither weighted nor kept where the
    correction drops a token (the sample is not trusted for either). total_tokens / total_seqs
    default to this shard's own (single-process use). ref_logp: the reference policy's logprobs of
    the same tokens (needed when kl_coef > 0; measured in the stats whenever given).
    """
    weights, keep = mismatch_correction(old_logp, sampler_logprobs, mask, is_correction, cap=is_cap, low=is_low,
                                        high=is_high)
    per_token, was_clipped, ratio = objective_terms(objective, logp, old_logp, advantages_B, mask,
                                                    clip_low=clip_low, clip_high=clip_high)
    per_token = per_token * weights
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"ref_logp: expected the reference policy's logprobs with kl_coef={kl_coef}, got None")
        per_token = per_token + kl_coef * reference_kl(logp, ref_logp, kl_estimator)
    # where, not multiply: a NaN/Inf on a dropped or padded token must not leak into the sum.
    per_token = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype))
    tt = float(mask.sum()) if total_tokens is None else total_tokens
    ts = float(mask.shape[0]) if total_seqs is None else total_seqs
    loss = aggregate(per_token, mask, agg, total_tokens=tt, total_seqs=ts, max_tokens=max_tokens)
    with torch.no_grad():
        stats = {
            "clipped_sum": was_clipped.sum().double(),
            "dropped_sum": (mask & ~keep).sum().double(),
            "is_weight_sum": torch.where(mask, weights, 0.0).sum().double(),
            "ppo_ratio_sum": torch.where(mask, ratio, 0.0).sum().double(),
        }
        if ref_logp is not None:
            for est in KL_ESTIMATORS:
                kl = reference_kl(logp.detach(), ref_logp, est).double()
                stats[f"ref_kl_{est}_sum"] = torch.where(mask, kl, 0.0).sum()
        stats.update(mismatch_sums(old_logp.detach(), sampler_logprobs, mask))
    return loss, stats


def finish_stats(sums: dict[str, float]) -> dict[str, float]:
    """All-reduced policy_loss stats -> metrics."""
    n = max(float(sums["tokens"]), 1.0)
    out = finish_mismatch(sums)
    out["loss/clip_frac"] = float(sums["clipped_sum"]) / n
    out["mismatch/masked_frac"] = float(sums["dropped_sum"]) / n
    out["mismatch/is_weight_mean"] = float(sums["is_weight_sum"]) / n
    out["loss/ppo_ratio_mean"] = float(sums["ppo_ratio_sum"]) / n
    for est in KL_ESTIMATORS:
        if f"ref_kl_{est}_sum" in sums:
            out[f"kl/ref_{est}"] = float(sums[f"ref_kl_{est}_sum"]) / n
    return out
