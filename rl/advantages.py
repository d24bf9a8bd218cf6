"""GRPO advantages: the scoring stage computes them from the rewards (rl/pipeline.py) and hands them to the
trainer in the TrainBatch (records/samples.py); the trainer's loss takes them as an input.

    adv = group_advantages(rewards, group_size=rollout.n, scale_by_std=reward.scale_by_std, eps=reward.eps)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(rewards: Sequence[float | None] | torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: (r - mean of its group) / (std of its group + eps); groups are consecutive.

    std is the population std (unbiased=False): a group of identical rewards gets advantage 0. A
    reward of None (or NaN) marks a sample no reward function scored: it gets advantage 0 and its
    group's mean and std are over the scored samples only (rl/rewards.py says why).
    """
    r = torch.as_tensor([float("nan") if x is None else x for x in rewards] if not torch.is_tensor(rewards)
                        else rewards, dtype=torch.float64)
    if r.dim() != 1 or group_size < 1 or r.numel() % group_size:
        raise ValueError(f"rewards: expected a flat list whose length is a multiple of group_size={group_size}, "
                         f"got shape {tuple(r.shape)}")
    g = r.view(-1, group_size)
    scored = ~g.isnan()
    count = scored.sum(dim=1, keepdim=True).clamp(min=1)
    g0 = torch.where(scored, g, torch.zeros((), dtype=g.dtype))
    mean = g0.sum(dim=1, keepdim=True) / count
    adv = torch.where(scored, g - mean, torch.zeros((), dtype=g.dtype))
    if scale_by_std:
        std = (adv.square().sum(dim=1, keepdim=True) / count).sqrt()
        adv = adv / (std + eps)
    return adv.reshape(-1).float()
