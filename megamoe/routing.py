"""Routing: router logits -> (topk_weights, topk_ids), separate from expert compute.

    route(router_logits[T,E], top_k, scoring="softmax"|"sigmoid", renormalize=False)
        -> topk_weights[T,k] (fp32, differentiable w.r.t. the logits), topk_ids[T,k] (int64)

The logits are cast to fp32 first, on both the sampler and the trainer side: a router computed in
bf16 on one side and fp32 on the other flips top-k choices (ANCHORS.md, "Pitfalls seen").
"""

from __future__ import annotations

import torch

SCORINGS = ("softmax", "sigmoid")


def check_route_inputs(router_logits_TE: torch.Tensor, top_k: int, scoring: str,
                       *, check_finite: bool = True) -> None:
    if not isinstance(router_logits_TE, torch.Tensor):
        raise TypeError(f"router_logits: expected a torch.Tensor, got {type(router_logits_TE).__name__}")
    if router_logits_TE.dim() != 2:
        raise ValueError(f"router_logits: expected shape [T, E], got {tuple(router_logits_TE.shape)}")
    if not router_logits_TE.dtype.is_floating_point:
        raise TypeError(f"router_logits: expected a floating dtype, got {router_logits_TE.dtype}")
    E = router_logits_TE.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected an int in [1, E={E}], got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    if check_finite and router_logits_TE.numel() and not bool(torch.isfinite(router_logits_TE).all()):
        bad = int((~torch.isfinite(router_logits_TE)).any(dim=1).sum())
        raise ValueError(f"router_logits: expected finite values, got NaN/Inf in {bad} token row(s)")


def route(router_logits_TE: torch.Tensor, top_k: int, scoring: str = "softmax",
          renormalize: bool = False, *, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the top-k experts per token and their weights, in fp32.

    softmax: p = softmax(logits); weights = top-k of p (renormalised to sum 1 when asked).
    sigmoid: s = sigmoid(logits); weights = top-k of s (renormalised when asked; DeepSeek-V3 style).
    Weights come in descending order. Ties (equal scores, common with bf16 logits) go to the lower
    expert index, by a stable descending sort: torch.topk leaves the choice among equal scores
    unspecified, and on CPU it depends on E and k (torch 2.13). (vLLM's own router, which the
    rollout uses, is not this function: its order and ties follow its own kernels.)
    """
    check_route_inputs(router_logits_TE, top_k, scoring, check_finite=check_finite)
    logits = router_logits_TE.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    topk_ids_Tk = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    topk_weights_Tk = scores.gather(1, topk_ids_Tk)
    if renormalize:
        topk_weights_Tk = topk_weights_Tk / topk_weights_Tk.sum(dim=-1, keepdim=True)
    return topk_weights_Tk, topk_ids_Tk
