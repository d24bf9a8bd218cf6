"""The public entry point: `fused_moe(..., impl=...)` (the contract is in megamoe/contract.py)."""

from __future__ import annotations

import torch

from megamoe.contract import SWIGLU, Activation, check_activation, check_biases, check_impl, check_moe_inputs


def fused_moe(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
              topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor,
              impl: str = "megamoe", *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              activation: Activation = SWIGLU, check_ids: bool = True) -> torch.Tensor:
    """y[t] = sum_j topk_weights[t,j] * (W2[e] act(G[e] x[t] + bg[e], U[e] x[t] + bu[e]) + b2[e]),
    e = topk_ids[t,j]; w13[e] = [G[e]; U[e]], b13[e] = [bg[e]; bu[e]] (both biases or neither);
    act: `activation` (megamoe.contract.SWIGLU, silu(gate) * up, or clamped_swiglu(alpha, limit)).

    Differentiable w.r.t. x, w13, w2, topk_weights and the biases. All inputs are checked before any
    compute; `check_ids=False` skips the one data-dependent check (ids in [-1, E)), e.g. under
    CUDA-graph capture where it would synchronise.
    """
    check_impl(impl)
    s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=check_ids)
    check_biases(b13, b2, s, x_TH)
    check_activation(activation)
    if impl == "reference":
        from megamoe.ref import moe_unfused
        return moe_unfused(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, b13_E2I=b13, b2_EH=b2,
                           activation=activation, check_ids=False)
    from megamoe.fused import megamoe_moe
    return megamoe_moe(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, b13=b13, b2=b2, activation=activation)


def dense_mlp(x_TH: torch.Tensor, w13_2IH: torch.Tensor, w2_HI: torch.Tensor, impl: str = "megamoe") -> torch.Tensor:
    """A dense SwiGLU MLP, y = w2 (silu(G x) * (U x)) with w13 = [G; U] rows (DeepSeek's shared
    experts), as `fused_moe` with one expert that every token takes with weight 1: the same op, and
    so the same bits, wherever it runs (the sampler's and the trainer's shared experts both call it)."""
    T = x_TH.shape[0]
    ones_T1 = torch.ones(T, 1, dtype=torch.float32, device=x_TH.device)
    ids_T1 = torch.zeros(T, 1, dtype=torch.int64, device=x_TH.device)
    return fused_moe(x_TH, w13_2IH[None], w2_HI[None], ones_T1, ids_T1, impl=impl, check_ids=False)
