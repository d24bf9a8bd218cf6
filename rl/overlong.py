"""DAPO's overlong reward shaping (soft overlong punishment), added to the summed reward.

    reward.overlong_buffer: 64       # tokens; 0 (the default) = off
    reward.overlong_penalty: 1.0     # the penalty at rollout.max_tokens

With L = rollout.max_tokens (the sampler's completion limit, so no completion is longer) and
B = overlong_buffer, a completion of |y| tokens gets

    penalty(|y|) = 0                                 if |y| <= L - B
                 = -overlong_penalty * (|y| - (L - B)) / B    if L - B < |y| <= L

a linear ramp from 0 to -overlong_penalty over the last B tokens: a completion the limit cut off
is told so gradually, instead of being scored as if it had ended there. The penalty is added to the
reward of every sample some reward function scored; a sample none scored (reward None) stays
unscored (rl/rewards.py says why: "could not judge" is not a score). It appears among the reward
functions' metrics as reward/overlong/mean (over every sample).
"""

from __future__ import annotations

from rl.rewards import RewardResult

NAME = "overlong"
"""Its name among the reward functions (reward/overlong/* metrics)."""


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """The shaping term of one completion of `length` tokens (the module docstring's formula)."""
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"reward.overlong_buffer: expected an int in (0, {max_tokens}], got {buffer!r}")
    over = length - (max_tokens - buffer)
    return -penalty * min(over, buffer) / buffer if over > 0 else 0.0


def shape(rewards: RewardResult, lengths: list[int], *, max_tokens: int, buffer: int,
          penalty: float) -> RewardResult:
    """`rewards` with the overlong penalty added to each scored total and listed as function NAME."""
    if len(lengths) != len(rewards.total):
        raise ValueError(f"lengths: expected {len(rewards.total)} (one per sample), got {len(lengths)}")
    if NAME in rewards.per_fn:
        raise ValueError(f"reward.functions: a function is named {NAME!r}, the name of the overlong shaping "
                         "(reward.overlong_buffer); rename it (its `name` key)")
    pen = [overlong_penalty(n, max_tokens, buffer, penalty) for n in lengths]
    total = [None if r is None else r + p for r, p in zip(rewards.total, pen)]
    return RewardResult(total, {**rewards.per_fn, NAME: pen}, {**rewards.errors, NAME: 0}, dict(rewards.logged))
