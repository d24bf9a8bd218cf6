"""DAPO's dynamic sampling: a step trains only on groups whose rewards differ.

    data.dynamic_sampling: true          # in a config
    data.max_extra_generates: 4          # at most this many more generate calls per step

A group (the rollout.n samples of one prompt) whose scored rewards are all equal (or that has fewer
than two scored samples) has advantage 0 on every sample under every objective: it costs a forward
and backward and teaches nothing, and it shrinks the batch's effective size as the policy masters
(or gives up on) prompts. With dynamic sampling the loop drops such groups and generates for new
prompts, a whole run.prompts_per_step at a time as the step's own call, until the batch holds
run.prompts_per_step groups with signal, then keeps the first that many in the order they were
generated. After data.max_extra_generates extra calls it stops: the shortfall is filled with the
dropped groups, earliest first (advantage 0: they add tokens to the loss's normalisers and nothing
else, as they would without dynamic sampling), logged and counted. The metrics, every step:

    dynamic_sampling/generate_calls   generate calls this step (1 = the step's own prompts sufficed)
    dynamic_sampling/dropped_groups   groups without signal, over every call
    dynamic_sampling/kept_groups      groups with signal in the batch
    dynamic_sampling/surplus_groups   groups with signal the last call made beyond the batch (unused)
    dynamic_sampling/filled_groups    groups without signal that filled the batch after the cap

The prompts of extra call k of step s are those the data stream (rl/data.py) holds at step
s + k * run.steps, positions no step of the run reads, so a step's prompts stay a function of the
seed, the step and run.steps, and a resumed run draws the same ones. The loop's part is one
callable, `draw(k) -> Draw`, that generates and scores call k.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from records import Sample
from rl.rewards import RewardResult

log = logging.getLogger("megamoe.rl.dynamic_sampling")


@dataclass
class Draw:
    """One generate call's results, prompt-major: group g is samples[g * n:(g + 1) * n]."""
    prompts: list           # as the sampler got them (chat template applied), one per group
    samples: list[Sample]   # prompt_index: the group's position in `prompts`
    texts: list[str]        # each sample's completion text
    rewards: RewardResult   # scored and shaped
    seconds: dict[str, float] = field(default_factory=dict)  # time/<phase>_s of this call


def has_signal(rewards: list[float | None]) -> bool:
    """True when the group's scored rewards hold at least two different values (exact comparison:
    the advantage is r - mean, zero for every sample exactly when they are all equal)."""
    scored = [r for r in rewards if r is not None]
    return len(scored) >= 2 and min(scored) != max(scored)


def extra_step(step: int, call: int, total_steps: int) -> int:
    """The data-stream step whose prompts extra call `call` (>= 1) of step `step` (0-based) uses."""
    return step + call * total_steps


def fill_batch(draw: Callable[[int], Draw], groups: int, n: int, max_extra: int) -> tuple[Draw, dict[str, Any]]:
    """Call draw(0), draw(1), ... until `groups` groups with signal are found or draw(max_extra) is
    done; returns the batch as one Draw of exactly `groups` groups (kept in generation order, then
    filled with dropped ones, earliest first) and the dynamic_sampling/* metrics."""
    if max_extra < 1:
        raise ValueError(f"data.max_extra_generates: expected an int >= 1, got {max_extra!r}")
    draws: list[Draw] = []
    kept: list[tuple[int, int]] = []     # (draw, group)
    dropped: list[tuple[int, int]] = []
    for call in range(max_extra + 1):
        d = draw(call)
        if len(d.samples) != len(d.prompts) * n or len(d.rewards.total) != len(d.samples):
            raise RuntimeError(f"dynamic sampling: call {call} returned {len(d.samples)} samples and "
                               f"{len(d.rewards.total)} rewards for {len(d.prompts)} prompts, expected n={n} each")
        draws.append(d)
        for g in range(len(d.prompts)):
            (kept if has_signal(d.rewards.total[g * n:(g + 1) * n]) else dropped).append((call, g))
        if len(kept) >= groups:
            break
    picks = kept[:groups]
    filled = dropped[:groups - len(picks)]
    if filled:
        log.warning("dynamic sampling: %d of %d groups had differing rewards after %d generate calls "
                    "(data.max_extra_generates=%d); %d groups without signal fill the batch",
                    len(picks), groups, len(draws), max_extra, len(filled))
    metrics = {"dynamic_sampling/generate_calls": len(draws), "dynamic_sampling/dropped_groups": len(dropped),
               "dynamic_sampling/kept_groups": len(picks), "dynamic_sampling/surplus_groups": len(kept) - len(picks),
               "dynamic_sampling/filled_groups": len(filled)}
    return merge(draws, picks + filled, n), metrics


def merge(draws: list[Draw], picks: list[tuple[int, int]], n: int) -> Draw:
    """One Draw of the picked (draw, group) pairs, in that order. Rewards' errors add over every
    call (each was a failed scoring); `logged` values (log_metric means, log_extra's first sample)
    are the first call's; the seconds add."""
    samples, texts, prompts = [], [], []
    total: list[float | None] = []
    per_fn: dict[str, list[float | None]] = {name: [] for name in draws[0].rewards.per_fn}
    for d_i, g in picks:
        d, sl = draws[d_i], slice(g * n, (g + 1) * n)
        prompts.append(d.prompts[g])
        samples.extend(dataclasses.replace(s, prompt_index=len(prompts) - 1) for s in d.samples[sl])
        texts.extend(d.texts[sl])
        total.extend(d.rewards.total[sl])
        for name in per_fn:
            per_fn[name].extend(d.rewards.per_fn[name][sl])
    errors = {name: sum(d.rewards.errors.get(name, 0) for d in draws) for name in draws[0].rewards.errors}
    seconds: dict[str, float] = {}
    for d in draws:
        for k, v in d.seconds.items():
            seconds[k] = seconds.get(k, 0.0) + v
    return Draw(prompts, samples, texts, RewardResult(total, per_fn, errors, dict(draws[0].rewards.logged)), seconds)
