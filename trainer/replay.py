"""Rollout routing replay (R3) and the sampler-vs-trainer routing metrics, on the trainer side.

    with routing_replay(model, routed_LTk, valid_T, replay=True) as states:
        logits = model(input_ids=...)          # every MoE block uses the sampler's experts
        loss.backward()                        # (inside: activation checkpointing recomputes with them)
    stats = routing_stats(states)              # agreement, tokens without routing, router entropy

routed_LTk [L, T, k] int: for each of the model's L MoE blocks (trainer.experts.moe_blocks order: the
model's layer order) and each of the T = batch * seq_len positions the blocks see (hidden states
flattened row-major, as transformers' MoE blocks flatten them), the k experts the sampler routed that
token to, or -1 in every slot for a token without routing (padding, a prefix-cached or preempted token);
valid_T [T] bool marks the real tokens (the attention mask).

replay=True: each Fp32Router uses the sampler's experts in place of its own top-k on the rows that have
them, with combine weights from its own router logits over those experts (`megamoe.routing.route_weights`:
softmax or sigmoid scores at the ids, renormalised as the family does; DeepSeek-V3's bias and groups only
steer the choice, so they play no part; its shared experts are not routed and stay as they are): the
experts are the sampler's, the router still learns. Rows without routing are routed by the trainer
itself, and counted. replay=False: the router routes itself and only measures (the metrics with R3 off).

The state stays on the routers for the whole `with` block, so a backward inside it that recomputes the
forward (activation checkpointing) routes the same way; the metrics are taken in the first forward only.
Routers must be `trainer.experts.Fp32Router` (trainer.moe_impl megamoe or reference): transformers' own
routers (moe_impl stock) have no seam for given experts, and are refused.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from megamoe.routing import route_weights
from trainer.experts import Fp32Router, block_router, moe_blocks

NO_ROUTING = -1
"""The id of every slot of a token the sampler returned no routing for."""


class ReplayState:
    """One router's replay input and its measurements for one forward (and its recomputation)."""

    def __init__(self, ids_Tk: torch.Tensor, valid_T: torch.Tensor, replay: bool):
        self.ids_Tk = ids_Tk
        self.valid_T = valid_T
        self.replay = replay
        self.measured = False
        self.tokens = 0        # real tokens that have sampler routing
        self.agree = 0         # ... whose trainer top-k is the sampler's set of experts
        self.unrouted = 0      # real tokens without sampler routing (the trainer routed them)
        self.replayed = 0      # tokens whose experts were the sampler's
        self.entropy_sum = 0.0  # sum over real tokens of the router's entropy (nats)

    def apply(self, router: Fp32Router, logits_TE: torch.Tensor, weights_Tk: torch.Tensor,
              ids_Tk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ids_Tk.shape[0] != logits_TE.shape[0]:
            raise ValueError(f"routing replay: the router saw {logits_TE.shape[0]} tokens, the replayed routing "
                             f"has {self.ids_Tk.shape[0]} rows")
        have_T = self.ids_Tk[:, 0] >= 0
        use_T = have_T & self.valid_T
        if not self.measured:
            self.measured = True
            with torch.no_grad():
                same = (torch.sort(ids_Tk, dim=1).values == torch.sort(self.ids_Tk, dim=1).values).all(dim=1)
                self.tokens = int(use_T.sum())
                self.agree = int((same & use_T).sum())
                self.unrouted = int((self.valid_T & ~have_T).sum())
                self.replayed = self.tokens if self.replay else 0
                scores = torch.softmax(logits_TE.float(), -1) if router.scoring == "softmax" \
                    else torch.sigmoid(logits_TE.float())
                p = scores / scores.sum(-1, keepdim=True)
                ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
                self.entropy_sum = float(ent[self.valid_T].sum())
        if not self.replay:
            return weights_Tk, ids_Tk
        ids = torch.where(use_T[:, None], self.ids_Tk, ids_Tk)
        weights = route_weights(logits_TE, ids, router.scoring, router.renormalize)
        return weights, ids


def replay_routers(model: nn.Module) -> list[Fp32Router]:
    """The router of every MoE block, in the model's layer order; a router that cannot replay is refused."""
    routers = []
    for name, block in moe_blocks(model):
        router = block_router(block)
        if not isinstance(router, Fp32Router):
            raise ValueError(f"{name}: router {type(router).__name__} cannot replay the sampler's routing; "
                             "trainer.routing_replay needs trainer.moe_impl 'megamoe' or 'reference' (Fp32Router)")
        routers.append(router)
    return routers


@contextlib.contextmanager
def routing_replay(model: nn.Module, routed_LTk: torch.Tensor, valid_T: torch.Tensor,
                   replay: bool) -> Iterator[list[ReplayState]]:
    """Route every MoE block of `model` by `routed_LTk` (replay=True) or measure against it (False); see
    the module docstring. Shapes are checked against the model's routers before anything runs."""
    routers = replay_routers(model)
    if routed_LTk.dim() != 3 or routed_LTk.shape[0] != len(routers):
        raise ValueError(f"routed experts: expected shape [L={len(routers)} MoE layers, T, k], got "
                         f"{tuple(routed_LTk.shape)}")
    if tuple(valid_T.shape) != (routed_LTk.shape[1],):
        raise ValueError(f"valid: expected shape [T={routed_LTk.shape[1]}], got {tuple(valid_T.shape)}")
    for layer, router in enumerate(routers):
        if routed_LTk.shape[2] != router.top_k:
            raise ValueError(f"routed experts: expected k={router.top_k} experts per token (layer {layer}), got "
                             f"{routed_LTk.shape[2]}")
        ids = routed_LTk[layer]
        bad = ((ids < NO_ROUTING) | (ids >= router.num_experts)).any() | ((ids[:, :1] < 0) != (ids < 0)).any()
        if bool(bad):
            raise ValueError(f"routed experts of MoE layer {layer}: expected ids in [0, {router.num_experts}) or "
                             f"{NO_ROUTING} in every slot of a token without routing")
    states = [ReplayState(routed_LTk[l].long(), valid_T.bool(), replay) for l in range(len(routers))]
    for router, state in zip(routers, states):
        router.replay = state
    try:
        yield states
    finally:
        for router in routers:
            router.replay = None


def routing_sums(states: list[ReplayState]) -> dict[str, float]:
    """Per-layer counts of one forward, as sums the trainer adds over micro-batches and ranks."""
    out: dict[str, float] = {}
    for l, s in enumerate(states):
        out[f"routing_tokens_l{l}"] = float(s.tokens)
        out[f"routing_agree_l{l}"] = float(s.agree)
        out[f"routing_entropy_sum_l{l}"] = s.entropy_sum
        out[f"routing_real_l{l}"] = float(s.tokens + s.unrouted)
    out["routing_unrouted"] = float(states[0].unrouted) if states else 0.0
    out["routing_replayed"] = float(states[0].replayed) if states else 0.0
    return out


def finish_routing(sums: dict[str, float]) -> dict[str, float]:
    """Summed routing counts -> metrics: `routing/agree_l{i}` (fraction of tokens with sampler routing whose
    trainer top-k is the same set), `routing/agree` (their mean over layers), `routing/entropy_l{i}` (the
    trainer router's mean entropy per token, nats), `routing/unrouted_tokens`, `routing/replayed_tokens`."""
    layers = sorted(int(k[len("routing_tokens_l"):]) for k in sums if k.startswith("routing_tokens_l"))
    out: dict[str, float] = {}
    agrees = []
    for l in layers:
        n = sums[f"routing_tokens_l{l}"]
        a = sums[f"routing_agree_l{l}"] / n if n else math.nan
        out[f"routing/agree_l{l}"] = a
        agrees.append(a)
        real = sums[f"routing_real_l{l}"]
        out[f"routing/entropy_l{l}"] = sums[f"routing_entropy_sum_l{l}"] / real if real else math.nan
    if agrees:
        out["routing/agree"] = sum(agrees) / len(agrees)
    out["routing/unrouted_tokens"] = sums.get("routing_unrouted", 0.0)
    out["routing/replayed_tokens"] = sums.get("routing_replayed", 0.0)
    return out


def routing_load(routed: list, num_experts: int) -> dict[str, float]:
    """Load-balance metrics per MoE layer from the sampler's routing of a batch (verl's MoE metrics):
    `routing/load_max_over_mean_l{i}` (tokens of the busiest expert / the mean per expert),
    `routing/load_cv_l{i}` (coefficient of variation of tokens per expert: population std / mean),
    `routing/idle_experts_l{i}` (experts that received no token). `routed`: per sequence an int array
    [tokens, L, k] (rows of NO_ROUTING ignored); each token counts once for each of its k experts."""
    import numpy as np

    rows = [np.asarray(r) for r in routed if r is not None and len(r)]
    if not rows:
        return {}
    ids = np.concatenate(rows)  # [N, L, k]
    ids = ids[ids[:, 0, 0] >= 0]
    out: dict[str, float] = {}
    for layer in range(ids.shape[1]):
        counts = np.bincount(ids[:, layer, :].reshape(-1).astype(np.int64), minlength=num_experts).astype(np.float64)
        mean = counts.mean()
        out[f"routing/load_max_over_mean_l{layer}"] = float(counts.max() / mean) if mean else math.nan
        out[f"routing/load_cv_l{layer}"] = float(counts.std() / mean) if mean else math.nan
        out[f"routing/idle_experts_l{layer}"] = float((counts == 0).sum())
    return out
