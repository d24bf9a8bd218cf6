"""The LoRA merge: a weight as the forward computes with it, W + (alpha / r) * delta(A, B) (trainer/lora.py
holds the rest: installing the factors, export, PEFT's format). Its own module because the experts'
forward (trainer/experts.py) calls it and trainer/lora.py reads the experts' classes: one direction each.
"""

from __future__ import annotations

import torch
from torch import nn

FACTORS = ("lora_A", "lora_B")
"""The child modules holding the factors: a state-dict name with one of these parts is an adapter tensor."""


def is_factor(name: str) -> bool:
    """Whether a state-dict name is a LoRA factor (not a base weight)."""
    parts = name.split(".")
    return any(p in FACTORS for p in parts)


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * delta(A, B), summed in fp32 and rounded once to W's dtype (2-D: B @ A; 3-D per expert:
    A[e]^T @ B[e]^T). The one merge of the trainer's forward and of every export."""
    if weight.dim() == 2:
        delta = b.float() @ a.float()
    else:
        delta = torch.bmm(a.float().transpose(1, 2), b.float().transpose(1, 2))
    return (weight.float() + scale * delta).to(weight.dtype)


def _factors(module: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if a is None or name not in a._parameters:
        return None
    return a._parameters[name], b._parameters[name]


def effective(module: nn.Module, name: str) -> torch.Tensor:
    """The weight `name` of `module` as the forward uses it: merged with its factors where it has some."""
    weight = getattr(module, name)
    f = _factors(module, name)
    if f is None:
        return weight
    a, b = f
    # The factors are fp32 masters; under FSDP2 mixed precision they arrive in the compute dtype already.
    dtype = weight.dtype
    return merge(weight, a.to(dtype), b.to(dtype), module.lora_scale)
