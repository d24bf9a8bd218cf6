"""The public entry point: `fused_moe(..., impl=...)` (the contract is in megamoe/__init__.py)."""

from __future__ import annotations

import torch

from megamoe.contract import check_impl, check_moe_inputs


def fused_moe(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
              topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor,
              impl: str = "megamoe", *, check_ids: bool = True) -> torch.Tensor:
    """y[T,H] = sum_j topk_weights[t,j] * W2[e] (silu(G[e] x[t]) * U[e] x[t]), e = topk_ids[t,j].

    Differentiable w.r.t. x, w13, w2 and topk_weights. All inputs are checked before any compute;
    `check_ids=False` skips the one data-dependent check (ids in [-1, E)), e.g. under CUDA-graph
    capture where it would synchronise.
    """
    check_impl(impl)
    check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=check_ids)
    if impl == "reference":
        from megamoe.ref import moe_unfused
        return moe_unfused(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=False)
    from megamoe.fused import megamoe_moe
    return megamoe_moe(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk)
