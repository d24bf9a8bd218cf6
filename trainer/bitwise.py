"""The trainer's side of `numerics="bitwise"`: the model's dense linears and attention forward through
megamoe.invariant's batch-invariant kernels, the functions vLLM's side calls (rollout/bitwise.py).

    model = load_model(dir, "megamoe", numerics="bitwise")    # trainer/model.py calls install()

- every `nn.Linear` (attention projections, dense MLPs, the LM head) is replaced by `InvariantLinear`, a
  subclass holding the same Parameter objects (state-dict names, FSDP2 sharding and checkpoints
  unchanged); its forward is `megamoe.invariant.linear`, its backward plain matmuls.
- attention is the function registered in transformers' attention registry as ATTENTION
  (`megamoe.invariant.batched_causal_attention` on CPU, vLLM's unified attention over pages on CUDA:
  rollout/invariant_kernels.py, reached through megamoe.invariant.gpu_kernels; the backward is the gradient of the same softmax attention recomputed by
  autograd: torch's fused causal attention for whole sequences, plain fp32 attention otherwise). The
  trainer's batches are right-padded (trainer/batch.py): a real token's queries only reach real keys, so
  the padding needs no mask; a left-padded or packed mask is refused.
- every RMSNorm (a module with `weight` and `variance_epsilon`, class name ending in RMSNorm) becomes
  `InvariantRMSNorm` (same weight): `megamoe.invariant.rms_norm` forward, the one vLLM's norm layers call
  (rollout/bitwise.py); the residual adds stay transformers' own (`residual + x` in the model's dtype).
- the model's rotary embedding (`model.model.rotary_emb`) becomes `InvariantRotary`: cos and sin rows of
  `megamoe.invariant.rope_cache`, vLLM's table in this mode; transformers applies them as usual.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megamoe import invariant

ATTENTION = "megamoe_invariant"
"""The attention implementation's name in transformers' AttentionInterface."""


class InvariantLinear(nn.Linear):
    """nn.Linear whose forward is megamoe.invariant.linear (bitwise vLLM's linear in numerics=bitwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.InvariantLinearFn.apply(x, self.weight, self.bias)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return invariant.rms_norm(x, w, eps)

    @staticmethod
    def backward(ctx, g):
        # The gradient of y = x r w, r = (mean(x^2) + eps)^-1/2, in fp32, written out: a handful of kernels
        # (recomputing the norm through autograd took ~0.9 ms of host time per call on the H200) and sums,
        # not means (a bitwise trainer's process routes aten's mean through vLLM's Triton kernel).
        x, w = ctx.saved_tensors
        xf, gw = x.float(), g.float() * w.float()
        inv_h = 1.0 / x.shape[-1]
        r = torch.rsqrt(xf.square().sum(-1, keepdim=True) * inv_h + ctx.eps)
        dx = r * gw - xf * (r.pow(3) * (gw * xf).sum(-1, keepdim=True) * inv_h)
        dw = (g.float() * xf * r).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype), None


class InvariantRMSNorm(nn.Module):
    """An RMSNorm module (the same weight Parameter) whose forward is megamoe.invariant.rms_norm."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.variance_epsilon)


class InvariantRotary(nn.Module):
    """transformers' rotary-embedding module interface, (cos, sin) [B, T, dim] in x's dtype, from the rows of
    megamoe.invariant.rope_cache (the table a bitwise vLLM engine's rotary layers hold)."""

    def __init__(self, base: float, dim: int, max_positions: int):
        super().__init__()
        self.base, self.dim, self.max_positions = base, dim, max_positions
        self._tables: dict = {}

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        table = self._tables.get(x.device)
        if table is None:
            table = self._tables[x.device] = invariant.rope_cache(self.base, self.dim, self.max_positions).to(x.device)
        if int(position_ids.max()) >= self.max_positions:
            raise ValueError(f"position_ids: expected positions < max_position_embeddings={self.max_positions}, got "
                             f"{int(position_ids.max())}")
        c, s = table[position_ids.long()].chunk(2, dim=-1)
        return torch.cat([c, c], -1).to(x.dtype), torch.cat([s, s], -1).to(x.dtype)


def _rotary(module: nn.Module, config) -> InvariantRotary:
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default" or float(getattr(module, "attention_scaling", 1.0)) != 1.0:
        raise NotImplementedError(f"numerics=bitwise: rope_type {rope_type!r} (attention scaling "
                                  f"{getattr(module, 'attention_scaling', 1.0)}): the shared rotary table is the "
                                  "default rope's")
    dim = 2 * module.inv_freq.shape[0]
    return InvariantRotary(float(params["rope_theta"]), dim, int(config.max_position_embeddings))


class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):  # q [B, T, h, D], k [B, L, g, D], v [B, L, g, E]: the last T of L positions
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        if q.is_cuda:
            return invariant.gpu_kernels().paged_attention(q, k, v, scale)
        B, T = q.shape[:2]
        seq = torch.arange(B, device=q.device).repeat_interleave(T)
        pos = _positions(q, k).repeat(B)
        o = invariant.batched_causal_attention(q.reshape(B * T, *q.shape[2:]), k, v, seq, pos, scale)
        return o.view(B, T, *o.shape[1:])

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            if q.shape[1] == k.shape[1] and q.shape[-1] == v.shape[-1]:
                # a whole sequence (every training forward): torch's fused causal attention, in q's dtype
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True,
                                                   scale=ctx.scale, enable_gqa=True).transpose(1, 2)
                grads = torch.autograd.grad(o, leaves, g.to(o.dtype))
            else:
                leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
                o = _plain_attention(*leaves, ctx.scale)
                grads = torch.autograd.grad(o, leaves, g.float())
        return tuple(d.to(t.dtype) for d, t in zip(grads, (q, k, v))) + (None,)


def _positions(q, k):
    """The queries' positions: the last T of the L keys' (a whole sequence when T = L)."""
    return torch.arange(k.shape[1] - q.shape[1], k.shape[1], device=q.device)


def _plain_attention(q, k, v, scale):
    """Causal softmax attention by plain torch ops (the backward's formula), [B, T, h, E]."""
    h, g = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // g, dim=2), v.repeat_interleave(h // g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    future = torch.arange(k.shape[1], device=q.device)[None, :] > _positions(q, k)[:, None]
    s = s.masked_fill(future, -math.inf)
    return torch.einsum("bhqk,bkhe->bqhe", s.softmax(-1), v)


def invariant_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        sliding_window=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query [B, h, T, D], key/value [B, g, L, D|E] (L >= T:
    the queries are the last T positions, L = T in a training forward); returns ([B, T, h, E], None)."""
    name = type(module).__name__
    if dropout:
        raise NotImplementedError(f"numerics=bitwise: {name} with attention dropout {dropout}")
    if sliding_window is not None or s_aux is not None:
        raise NotImplementedError(f"numerics=bitwise: {name} with a sliding window or attention sinks "
                                  "(the batch-invariant attention is plain causal)")
    B, _, T, _ = query.shape
    if key.shape[2] < T:
        raise ValueError(f"numerics=bitwise: {name} with {key.shape[2]} keys for {T} queries: expected the "
                         "queries to be the last of the keys' positions")
    if attention_mask is not None:
        m = attention_mask.bool()
        if m.dim() != 2 or bool((m[:, 1:] & ~m[:, :-1]).any()):
            raise ValueError("attention_mask: expected right padding (each row's ones first), the layout of "
                             "trainer/batch.py; the batch-invariant attention does not mask")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return _AttentionFn.apply(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale), None


def register_attention() -> None:
    """ATTENTION in transformers' attention registry, with the 2-D padding mask passed through (or None)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, invariant_attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


class _LogSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = invariant.log_softmax(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g - y.exp() * g.sum(-1, keepdim=True)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """megamoe.invariant.log_softmax over the last dim (the sampler's kernel for its processed logprobs), with
    log_softmax's gradient."""
    return _LogSoftmaxFn.apply(logits)


def _is_rms_norm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and isinstance(
        getattr(m, "weight", None), nn.Parameter)


def install(model: nn.Module) -> int:
    """Every nn.Linear of `model` -> InvariantLinear (same parameters), every RMSNorm -> InvariantRMSNorm,
    the rotary embedding -> InvariantRotary, attention -> ATTENTION; returns the number of linears replaced."""
    register_attention()
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if _is_rms_norm(child):
                setattr(parent, child_name, InvariantRMSNorm(child.weight, float(child.variance_epsilon)))
            elif child_name == "rotary_emb" and hasattr(child, "inv_freq"):
                setattr(parent, child_name, _rotary(child, model.config))
            elif type(child) is nn.Linear:
                new = InvariantLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                      device="meta")
                new.weight = child.weight
                new.bias = child.bias
                setattr(parent, child_name, new)
                replaced += 1
    model.set_attn_implementation(ATTENTION)
    return replaced
