"""Routing: router logits -> (topk_weights, topk_ids), separate from expert compute.

    route(router_logits[T,E], top_k, scoring="softmax"|"sigmoid", renormalize=False, *,
          e_score_correction_bias=None [E], n_group=1, topk_group=1, routed_scaling_factor=1.0)
        -> topk_weights[T,k] (fp32, differentiable w.r.t. the logits), topk_ids[T,k] (int64)

The logits are cast to fp32 first, on both the sampler and the trainer side: a router computed in
bf16 on one side and fp32 on the other flips top-k choices (a pitfall seen in published MoE RL stacks).

The keyword-only arguments are DeepSeek-V3's router (and its relatives: Moonlight, Kimi, GLM-4.5;
DeepSeek-V2 without the bias): a score-correction bias that steers the *choice* only, group-limited
selection, and a routed scaling factor. Their semantics are transformers' DeepseekV3TopkRouter's and
vLLM's `grouped_topk` (vLLM 0.32), which agree (see `route`).
"""

from __future__ import annotations

import math

import torch

SCORINGS = ("softmax", "sigmoid")


def _int_in(name: str, value, lo: int, hi: int, hi_name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi_name}={hi}], got {value!r}")


def check_route_inputs(router_logits_TE: torch.Tensor, top_k: int, scoring: str,
                       *, check_finite: bool = True, e_score_correction_bias: torch.Tensor | None = None,
                       n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0) -> None:
    if not isinstance(router_logits_TE, torch.Tensor):
        raise TypeError(f"router_logits: expected a torch.Tensor, got {type(router_logits_TE).__name__}")
    if router_logits_TE.dim() != 2:
        raise ValueError(f"router_logits: expected shape [T, E], got {tuple(router_logits_TE.shape)}")
    if not router_logits_TE.dtype.is_floating_point:
        raise TypeError(f"router_logits: expected a floating dtype, got {router_logits_TE.dtype}")
    E = router_logits_TE.shape[1]
    _int_in("top_k", top_k, 1, E, "E")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    bias = e_score_correction_bias
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"e_score_correction_bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (E,):
            raise ValueError(f"e_score_correction_bias: expected shape [E={E}] (one per expert), got {tuple(bias.shape)}")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"e_score_correction_bias: expected a floating dtype, got {bias.dtype}")
        if bias.device != router_logits_TE.device:
            raise ValueError(f"e_score_correction_bias: expected the device of router_logits "
                             f"({router_logits_TE.device}), got {bias.device}")
    _int_in("n_group", n_group, 1, E, "E")
    if E % n_group:
        raise ValueError(f"n_group: expected a divisor of E={E} (experts split into equal groups), got {n_group}")
    _int_in("topk_group", topk_group, 1, n_group, "n_group")
    group_size = E // n_group
    if topk_group < n_group:
        # Only the kept groups' experts can be chosen.
        _int_in("top_k", top_k, 1, topk_group * group_size, f"topk_group*E/n_group={topk_group}*{group_size}")
        if bias is not None and group_size < 2:
            raise ValueError(f"n_group: expected E/n_group >= 2 with e_score_correction_bias (a group's score is "
                             f"the sum of its top-2 biased scores), got n_group={n_group} for E={E}")
    if (isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float))
            or not math.isfinite(routed_scaling_factor) or routed_scaling_factor <= 0):
        raise ValueError(f"routed_scaling_factor: expected a finite number > 0, got {routed_scaling_factor!r}")
    if check_finite and router_logits_TE.numel() and not bool(torch.isfinite(router_logits_TE).all()):
        bad = int((~torch.isfinite(router_logits_TE)).any(dim=1).sum())
        raise ValueError(f"router_logits: expected finite values, got NaN/Inf in {bad} token row(s)")
    if check_finite and bias is not None and not bool(torch.isfinite(bias).all()):
        raise ValueError("e_score_correction_bias: expected finite values, got NaN/Inf")


def _descending(scores: torch.Tensor) -> torch.Tensor:
    # Stable: equal scores go to the lower index, whatever the shape or backend (torch.topk leaves it open).
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim as five aten ops (max, subtract, exp, sum, divide), none of which vLLM's
    batch-invariant mode overrides (0.26 and 0.32; it overrides softmax itself, in 0.26 with this very
    sequence). A bitwise engine runs in that mode and the trainer's process does not (its Python overrides
    cost a trainer about half its speed on the H200): spelled out, both take the same kernels for the
    routing scores."""
    e = torch.exp(x - torch.amax(x, dim=-1, keepdim=True))
    return e / torch.sum(e, dim=-1, keepdim=True)


def route(router_logits_TE: torch.Tensor, top_k: int, scoring: str = "softmax",
          renormalize: bool = False, *, e_score_correction_bias: torch.Tensor | None = None,
          n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
          check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the top-k experts per token and their weights, in fp32.

    s = softmax(logits) or sigmoid(logits)                      (fp32)
    c = s + e_score_correction_bias                             (the choice scores; c = s without a bias)
    n_group > topk_group: experts are split into n_group equal groups of consecutive ids; a group's
        score is the sum of its top-2 c with a bias (DeepSeek-V3 "noaux_tc"), its max c without
        (DeepSeek-V2 "group_limited_greedy"); only the topk_group best groups' experts can be chosen.
    ids     = the top-k experts by c, in descending c
    weights = s at those ids (never the biased c), divided by their sum when `renormalize`, times
        routed_scaling_factor

    Ties (equal scores, common with bf16 logits) go to the lower expert (and group) index, by a stable
    descending sort: torch.topk leaves the choice among equal scores unspecified, and on CPU it
    depends on E and k (torch 2.13). Weights are in descending order when there is no bias. Every
    step is row-wise, so a token's result does not depend on the other rows (batch invariant).

    The bias steers the choice only: no gradient reaches it (transformers keeps it as a buffer, DeepSeek-V3
    updates it outside backprop). Gradients reach the logits through the weights.
    """
    check_route_inputs(router_logits_TE, top_k, scoring, check_finite=check_finite,
                       e_score_correction_bias=e_score_correction_bias, n_group=n_group, topk_group=topk_group,
                       routed_scaling_factor=routed_scaling_factor)
    scores = _scores(router_logits_TE, scoring)
    choice = scores.detach()
    if e_score_correction_bias is not None:
        choice = choice + e_score_correction_bias.detach().float()
    if topk_group < n_group:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)
        if e_score_correction_bias is not None:
            top2 = torch.sort(grouped, dim=-1, descending=True).values[..., :2]
            group_scores = top2[..., 0] + top2[..., 1]
        else:
            group_scores = grouped.max(dim=-1).values
        kept = torch.zeros(T, n_group, dtype=torch.bool, device=choice.device)
        kept.scatter_(1, _descending(group_scores)[:, :topk_group], True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // n_group, dim=1), float("-inf"))
    topk_ids_Tk = _descending(choice)[:, :top_k]
    return _combine_weights(scores, topk_ids_Tk, renormalize, routed_scaling_factor), topk_ids_Tk


def _scores(router_logits_TE: torch.Tensor, scoring: str) -> torch.Tensor:
    logits = router_logits_TE.float()
    return _softmax(logits) if scoring == "softmax" else torch.sigmoid(logits)


def _combine_weights(scores_TE: torch.Tensor, topk_ids_Tk: torch.Tensor, renormalize: bool,
                     routed_scaling_factor: float) -> torch.Tensor:
    topk_weights_Tk = scores_TE.gather(1, topk_ids_Tk)
    if renormalize:
        topk_weights_Tk = topk_weights_Tk / topk_weights_Tk.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights_Tk = topk_weights_Tk * routed_scaling_factor
    return topk_weights_Tk


def route_weights(router_logits_TE: torch.Tensor, topk_ids_Tk: torch.Tensor, scoring: str = "softmax",
                  renormalize: bool = False, *, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """The combine weights [T, k] (fp32, differentiable w.r.t. the logits) of given experts `topk_ids_Tk`
    (int, each in [0, E)), computed as `route` computes them for the experts it chooses: the scores
    (softmax or sigmoid of the fp32 logits) at those ids, divided by their sum when `renormalize`,
    times routed_scaling_factor. Routing replay (trainer/replay.py) uses the sampler's experts with
    the trainer's own router logits, so the router still gets gradients; for ids equal to `route`'s the
    result is bitwise `route`'s weights (the same ops). A score-correction bias and expert groups only
    steer the choice, so they play no part here."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    if topk_ids_Tk.dim() != 2 or topk_ids_Tk.shape[0] != router_logits_TE.shape[0]:
        raise ValueError(f"topk_ids: expected shape [T={router_logits_TE.shape[0]}, k], got {tuple(topk_ids_Tk.shape)}")
    return _combine_weights(_scores(router_logits_TE, scoring), topk_ids_Tk.long(), renormalize,
                            routed_scaling_factor)
