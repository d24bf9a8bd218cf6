"""megamoe: one fused, trainable Mixture-of-Experts operator (the Mega MoE).

The contract (every implementation computes this):

    fused_moe(x[T,H], w13[E,2I,H], w2[E,H,I], topk_weights[T,k], topk_ids[T,k], impl=...,
              b13[E,2I]=None, b2[E,H]=None, activation=SWIGLU) -> y[T,H]

    y[t] = sum_j topk_weights[t,j] * (W2[e] @ act(G[e] @ x[t] + bg[e], U[e] @ x[t] + bu[e]) + b2[e]),
           e = topk_ids[t,j]
    w13[e] = [G[e]; U[e]]   gate rows first, then up rows (vLLM's and transformers' layout); b13 alike
    act: SWIGLU, silu(gate) * up; or clamped_swiglu(alpha, limit), gpt-oss's (megamoe/contract.py)
    topk_ids[t,j] == -1  ->  that slot contributes nothing

Shape legend (suffixes in names): T tokens, H hidden, I expert intermediate, E experts, k top-k,
W expert-parallel world size; e.g. x_TH, w13_E2IH, w2_EHI, topk_ids_Tk.

Implementations (`impl=`):
  "megamoe"    the fused Triton kernel on CUDA; on CPU a torch implementation with the same
               semantics and the same fixed reduction order (megamoe/fused/)
  "reference"  the unfused path: permute -> grouped GEMM -> SwiGLU -> grouped GEMM -> weighted
               un-permute (megamoe/ref.py)
Routing (fp32 router logits -> softmax/sigmoid -> top-k -> optional renormalisation) is the
separate, differentiable `route` (megamoe/routing.py).
"""

from megamoe.contract import HOST_IMPLS, IMPLS, MEGAMOE, REFERENCE, STOCK, check_impl, check_moe_inputs

__all__ = ["HOST_IMPLS", "IMPLS", "MEGAMOE", "REFERENCE", "STOCK", "check_impl", "check_moe_inputs",
           "fused_moe", "route"]


def __getattr__(name: str):
    # The operator and the routing import torch (and Triton); they load when first used (PEP 562),
    # so that `from megamoe.contract import IMPLS` costs no torch import (the config loaders).
    if name == "fused_moe":
        from megamoe.moe import fused_moe

        return fused_moe
    if name == "route":
        from megamoe.routing import route

        return route
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
