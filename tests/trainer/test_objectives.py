"""The policy objectives and the KL penalty of trainer/loss.py against float64 hand computations.

    .venv/bin/python -m pytest -q tests/trainer/test_objectives.py

Pure tests: seeded random logprobs on a ragged [B, L] batch, no model. The hand computations below
are written from the formulas of docs/OBJECTIVES.md with Python floats (float64), loss value and
gradient in closed form, one sequence and one token at a time; GSPO's from its sequence-level
definition (the gradient of max(-A s, -A clip(s)) with s the length-normalised sequence ratio),
so the test also checks that the per-token form policy_loss computes is GSPO.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import OBJECTIVE_AGG, ConfigError, TrainerWorkerConfig
from trainer.loss import finish_stats, policy_loss

# policy_loss computes in the logprobs' dtype (float64 here), except the mismatch correction's
# weights, which are fp32 by design (mismatch_correction's log_ratio): measured max relative error
# of loss and gradient against the float64 hand computation 1.0e-7 (tis cases; 2e-16 without a
# correction), 2-core x86, 2026-12-06; bound 1e-6, a 10x margin.
REL_TOL = 1e-6

LENGTHS = (5, 2, 4)       # ragged, non-power-of-two
MAX_TOKENS = 7            # the constant normaliser's rollout.max_tokens (> every length)
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def _inputs(seed: int):
    """logp (policy), old, sampler, ref logprobs and advantages; logp - old spread over +-0.5 per token
    plus +-0.5 per sequence, so that both sides of every clip range (GSPO's: of the sequences') are hit."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = True
    old = -0.5 - 2.0 * torch.rand(B, L, generator=g, dtype=torch.float64)
    logp = old + (torch.rand(B, L, generator=g, dtype=torch.float64) - 0.5) + (
        torch.rand(B, 1, generator=g, dtype=torch.float64) - 0.5)
    samp = old + 0.6 * (torch.rand(B, L, generator=g, dtype=torch.float64) - 0.5)
    ref = old + 0.8 * (torch.rand(B, L, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    # padding holds garbage: it must never reach the loss
    for t in (logp, old, samp, ref):
        t.masked_fill_(~mask, float("nan"))
    return logp, old, samp, ref, adv, mask


def _clip(x: float) -> float:
    return min(max(x, 1 - CLIP_LOW), 1 + CLIP_HIGH)


def _hand(objective: str, logp, old, samp, ref, adv, *, is_correction: str, kl_coef: float, kl_estimator: str,
          agg: str):
    """(loss, d loss / d logp as nested lists, tokens clipped) in float64 from the formulas."""
    B = len(LENGTHS)
    T = sum(LENGTHS)
    grad = [[0.0] * max(LENGTHS) for _ in range(B)]
    loss, clipped = 0.0, 0
    for b, n in enumerate(LENGTHS):
        lp = [float(logp[b, t]) for t in range(n)]
        od = [float(old[b, t]) for t in range(n)]
        sp = [float(samp[b, t]) for t in range(n)]
        rf = [float(ref[b, t]) for t in range(n)]
        A = float(adv[b])
        # the correction: weight and kept tokens from r_is = exp(old - sampler)
        r_is = [math.exp(o - s) for o, s in zip(od, sp)]
        w = [min(r, 2.0) if is_correction == "tis" else 1.0 for r in r_is]
        keep = [True] * n
        if is_correction == "token_mask":
            keep = [0.5 <= r <= 2.0 for r in r_is]
        elif is_correction == "seq_mask":
            seq = math.exp(sum(math.log(r) for r in r_is) / n)
            keep = [0.5 <= seq <= 2.0] * n
        norm = {"token_mean": 1.0 / T, "seq_mean_token_mean": 1.0 / (n * B),
                "constant": 1.0 / (B * MAX_TOKENS)}[agg]
        s = math.exp(sum(l - o for l, o in zip(lp, od)) / n)  # GSPO's sequence ratio
        for t in range(n):
            if not keep[t]:
                continue
            r = math.exp(lp[t] - od[t])
            if objective in ("grpo", "dr_grpo", "gspo"):
                x = s if objective == "gspo" else r
                un, cl = -A * x, -A * _clip(x)
                val = max(un, cl)
                is_clipped = cl > un
                # d/dlogp_t: grpo d(-A r)/dlogp_t = -A r; gspo: the sequence's -A s / n per token under
                # seq_mean_token_mean, i.e. -A s per token before the 1/n of the aggregation
                g = 0.0 if is_clipped else -A * x
            else:  # cispo
                wc = _clip(r)
                val = -wc * A * lp[t]
                is_clipped = wc != r
                g = -wc * A
            clipped += is_clipped
            val, g = val * w[t], g * w[t]
            if kl_coef:
                d = rf[t] - lp[t]
                if kl_estimator == "k1":
                    val, g = val + kl_coef * -d, g + kl_coef * 1.0
                else:
                    val, g = val + kl_coef * (math.exp(d) - 1 - d), g + kl_coef * (1 - math.exp(d))
            loss += norm * val
            grad[b][t] = norm * g
    return loss, grad, clipped


CASES = [
    pytest.param("grpo", "none", 0.0, "k3", id="grpo"),
    pytest.param("grpo", "tis", 0.05, "k3", id="grpo-tis-k3"),
    pytest.param("gspo", "none", 0.0, "k3", id="gspo"),
    pytest.param("gspo", "tis", 0.1, "k1", id="gspo-tis-k1"),
    pytest.param("gspo", "seq_mask", 0.0, "k3", id="gspo-seq_mask"),
    pytest.param("cispo", "none", 0.0, "k3", id="cispo"),
    pytest.param("cispo", "token_mask", 0.1, "k3", id="cispo-token_mask-k3"),
    pytest.param("dr_grpo", "none", 0.0, "k3", id="dr_grpo"),
    pytest.param("dr_grpo", "tis", 0.2, "k1", id="dr_grpo-tis-k1"),
]


@pytest.mark.parametrize("objective, is_correction, kl_coef, kl_estimator", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_match_the_float64_hand_computation(objective, is_correction, kl_coef, kl_estimator,
                                                              seed):
    logp, old, samp, ref, adv, mask = _inputs(seed)
    agg = OBJECTIVE_AGG[objective]
    want_loss, want_grad, want_clipped = _hand(objective, logp, old, samp, ref, adv, is_correction=is_correction,
                                               kl_coef=kl_coef, kl_estimator=kl_estimator, agg=agg)
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, old, samp, adv, mask, objective=objective, is_correction=is_correction,
                              clip_low=CLIP_LOW, clip_high=CLIP_HIGH, agg=agg, max_tokens=MAX_TOKENS,
                              ref_logp=ref, kl_coef=kl_coef, kl_estimator=kl_estimator)
    loss.backward()
    got_grad = torch.where(mask, x.grad, 0.0)
    want = torch.tensor(want_grad, dtype=torch.float64)
    assert want.abs().max() > 0 and want_loss != 0.0  # never against an all-zero reference
    loss_err = abs(float(loss.detach()) - want_loss) / abs(want_loss)
    grad_err = float((got_grad - want).norm() / want.norm())
    print(f"{objective}/{is_correction}/kl={kl_coef}: loss rel err {loss_err:.1e}, grad rel err {grad_err:.1e} "
          f"(tol {REL_TOL:.0e})")
    assert not torch.isnan(x.grad[mask]).any()
    assert loss_err <= REL_TOL and grad_err <= REL_TOL
    assert float(stats["clipped_sum"]) == want_clipped


def test_the_seeds_reach_both_sides_of_every_clip():
    """The hand computation above is only worth something if clipping happens and also does not."""
    for objective in ("grpo", "gspo", "cispo"):
        clipped = [_hand(objective, *_inputs(seed)[:5], is_correction="none", kl_coef=0.0, kl_estimator="k3",
                         agg="token_mean")[2] for seed in (0, 1)]
        total = 2 * sum(LENGTHS)
        assert 0 < sum(clipped) < total, (objective, clipped)


def test_kl_metrics_and_zero_kl_at_the_reference():
    logp, old, samp, ref, adv, mask = _inputs(3)
    _, stats = policy_loss(logp, old, samp, adv, mask, ref_logp=ref, kl_coef=0.1)
    m = finish_stats({k: float(v) for k, v in stats.items()})
    T = sum(LENGTHS)
    d = [float(ref[b, t] - logp[b, t]) for b, n in enumerate(LENGTHS) for t in range(n)]
    assert m["kl/ref_k1"] == pytest.approx(sum(-x for x in d) / T, rel=1e-12)
    assert m["kl/ref_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / T, rel=1e-12)
    # at the reference itself both estimators are exactly 0, and the penalty adds no gradient
    x = logp.clone().requires_grad_(True)
    loss_kl, st = policy_loss(x, old, samp, adv, mask, ref_logp=logp, kl_coef=1.0)
    loss_kl.backward()
    y = logp.clone().requires_grad_(True)
    loss_plain, _ = policy_loss(y, old, samp, adv, mask)
    loss_plain.backward()
    assert float(st["ref_kl_k3_sum"]) == 0.0 and float(st["ref_kl_k1_sum"]) == 0.0
    assert torch.equal(torch.where(mask, x.grad, 0.0), torch.where(mask, y.grad, 0.0))


def test_kl_without_reference_logprobs_is_refused():
    logp, old, samp, _, adv, mask = _inputs(0)
    with pytest.raises(ValueError, match="ref_logp: expected the reference policy's logprobs with kl_coef=0.1"):
        policy_loss(logp, old, samp, adv, mask, kl_coef=0.1)


def test_constant_normaliser_needs_max_tokens():
    logp, old, samp, _, adv, mask = _inputs(0)
    with pytest.raises(ValueError, match="max_tokens: expected an int >= 1 with loss_agg 'constant'"):
        policy_loss(logp, old, samp, adv, mask, objective="dr_grpo", agg="constant")


@pytest.mark.parametrize("cfg, match", [
    ({"kl_coef": -0.1}, "kl_coef: expected a float >= 0"),
    ({"loss": "ppo"}, "loss: expected one of 'grpo', 'gspo', 'cispo', 'dr_grpo', got 'ppo'"),
    ({"kl_estimator": "k2"}, "kl_estimator: expected one of 'k1', 'k3', got 'k2'"),
    ({"loss": "dr_grpo", "loss_agg": "token_mean", "max_tokens": 8}, "loss_agg: expected null or 'constant' with loss 'dr_grpo'"),
    ({"loss": "dr_grpo"}, "max_tokens: expected an int >= 1 with loss_agg 'constant'"),
])
def test_bad_objective_settings_are_refused_naming_the_key(cfg, match):
    with pytest.raises(ConfigError, match=match):
        TrainerWorkerConfig.from_dict(cfg)


def test_each_objective_has_its_aggregation_unless_one_is_named():
    assert TrainerWorkerConfig.from_dict({}).aggregation == "token_mean"
    assert TrainerWorkerConfig.from_dict({"loss": "gspo"}).aggregation == "seq_mean_token_mean"
    assert TrainerWorkerConfig.from_dict({"loss": "dr_grpo", "max_tokens": 8}).aggregation == "constant"
    assert TrainerWorkerConfig.from_dict({"loss": "gspo", "loss_agg": "token_mean"}).aggregation == "token_mean"

