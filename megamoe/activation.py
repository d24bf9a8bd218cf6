"""The experts' activations in torch (megamoe.contract.Activation): the formulas the reference paths
and the CPU backend compute, and their derivative for the CPU backend's explicit backward. The
Triton kernels compute the same formulas in fp32 (megamoe/kernels/moe_kernels.py, `_act_fwd` and
`_act_bwd`).

    silu            h = silu(g) * u
    clamped_swiglu  g' = min(g, limit), u' = clamp(u, -limit, limit),
                    h = (u' + 1) * g' * sigmoid(alpha * g')

The CPU backend evaluates both in fixed blocks (cpu._blockwise): `act_backward` takes the sigmoid
it applies to the (scaled, clamped) gate for that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megamoe.contract import SILU, Activation

Sigmoid = Callable[[torch.Tensor], torch.Tensor]


def act_forward(g: torch.Tensor, u: torch.Tensor, act: Activation) -> torch.Tensor:
    """h = act(gate, up), differentiable by torch's autograd (the ground truth differentiates this)."""
    if act.name == SILU:
        return F.silu(g) * u
    gc = g.clamp(max=act.limit)
    uc = u.clamp(min=-act.limit, max=act.limit)
    return (uc + 1) * gc * torch.sigmoid(act.alpha * gc)


def act_backward(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, act: Activation,
                 sigmoid: Sigmoid = torch.sigmoid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, d gate, d up) for upstream dh: torch autograd's derivative of `act_forward`, written out
    (clamp passes the gradient where its input lies inside the bounds, bounds included)."""
    if act.name == SILU:
        s = sigmoid(g)
        return g * s * u, dh * u * s * (1 + g * (1 - s)), dh * g * s
    gc = g.clamp(max=act.limit)
    uc = u.clamp(min=-act.limit, max=act.limit)
    s = sigmoid(act.alpha * gc)
    glu = gc * s
    dg = dh * (uc + 1) * s * (1 + act.alpha * gc * (1 - s))
    du = dh * glu
    return ((uc + 1) * glu, torch.where(g <= act.limit, dg, 0.0),
            torch.where((u >= -act.limit) & (u <= act.limit), du, 0.0))
