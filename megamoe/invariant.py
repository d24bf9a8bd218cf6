"""Batch-invariant dense ops both sides of an RL run call in `numerics="bitwise"`: the linear layers
(attention projections, dense MLPs, the LM head) and causal attention, on CPU (fp32).

Each op fixes its reduction order by construction, so an output row's bits depend only on that row's
inputs, never on how many other rows (tokens, requests, padding) share the call:

- `linear`: x[M, K] @ w[N, K]^T as GEMMs of one fixed shape, [ROWS, K] @ [K, COLS] (rows and columns
  zero-padded to whole tiles, all tiles in one batched matmul). A BLAS picks its kernel, and so its
  rounding, by the problem's shape; with every call the same shape, an output element depends on its
  row of x and its column of w (and its column's place in the tile) only: a decode step (M = 1), a
  prefill (M = prompt length) and the trainer's batch give the same bits. A fused weight (vLLM's
  q/k/v or gate/up) goes through `linear_parts`, one `linear` per part, so that it gives the bits of
  the trainer's separate linears whatever the parts' sizes (a column's place in its tile changes its
  rounding: measured at K=2880).
- `causal_attention`: one sequence's queries against its keys 0..pos, in blocks of KEY_BLOCK keys
  from key 0 (online softmax: running max, running sum, rescaled accumulator), every reduction an
  explicit sum over the last, contiguous axis of one (query, head) row. A query's result does not
  depend on the other queries in the call, so vLLM's decode (one query against its KV cache), its
  chunked prefill and the trainer's whole-sequence forward agree.

Only the forward is shared; the trainer differentiates through plain matmuls (`InvariantLinearFn`,
attention through autograd of these torch ops). The tests (tests/megamoe/test_invariant.py) check the
invariances and the values against an fp64 ground truth.
"""

from __future__ import annotations

import math

import torch

from megamoe.blocked import ROWS

COLS = 64
"""Output columns per GEMM tile of `linear` (w's rows); fixed, for invariance to N."""
KEY_BLOCK = 32
"""Keys per block of `causal_attention`'s online softmax; fixed, for invariance to the query count."""


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def linear(x: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ w[N, K]^T (+ b[N]) in x's dtype, batch invariant (module docstring)."""
    K = x.shape[-1]
    if w_NK.dim() != 2 or w_NK.shape[1] != K:
        raise ValueError(f"w_NK: expected a 2-D [N, K={K}] weight, got {tuple(w_NK.shape)}")
    N = w_NK.shape[0]
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, K)
    M = x_MK.shape[0]
    if M == 0:
        out = x_MK.new_zeros(0, N)
    else:
        a = _pad_rows(x_MK, ROWS).view(-1, 1, ROWS, K)                       # [m, 1, ROWS, K]
        bt = _pad_rows(w_NK.to(x.dtype), COLS).view(1, -1, COLS, K).transpose(-1, -2)  # [1, n, K, COLS]
        out = torch.matmul(a, bt)                                            # [m, n, ROWS, COLS]
        out = out.permute(0, 2, 1, 3).reshape(-1, out.shape[1] * COLS)[:M, :N]
    if b_N is not None:
        out = out + b_N.to(out.dtype)
    return out.reshape(*lead, N)


def linear_parts(x: torch.Tensor, w_NK: torch.Tensor, sizes: list[int], b_N: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` of a weight that stacks parts of `sizes` rows (a fused projection), part by part,
    concatenated: bitwise the separate projections' `linear`s."""
    if sum(sizes) != w_NK.shape[0]:
        raise ValueError(f"sizes: expected part sizes summing to w_NK's {w_NK.shape[0]} rows, got {list(sizes)}")
    if len(sizes) == 1:
        return linear(x, w_NK, b_N)
    ws = w_NK.split(list(sizes))
    bs = b_N.split(list(sizes)) if b_N is not None else [None] * len(sizes)
    return torch.cat([linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)


class InvariantLinearFn(torch.autograd.Function):
    """`linear` forward; the gradients as plain matmuls (only the forward must match the sampler)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dx = (g2 @ w.to(g2.dtype)).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(w.dtype) if ctx.needs_input_grad[1] else None
        db = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def causal_attention(q_QhD: torch.Tensor, k_LgD: torch.Tensor, v_LgE: torch.Tensor, q_pos_Q: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(scale * q k^T) v for one sequence, query i attending keys 0..q_pos[i], batch invariant.

    q [Q, h, D], k [L, g, D], v [L, g, E] (g key/value heads, h a multiple of g: query head j reads
    key head j // (h // g)), q_pos [Q] int positions < L. Returns [Q, h, E] in q's dtype (computed in fp32).
    """
    Q, h, D = q_QhD.shape
    L, g = k_LgD.shape[:2]
    if h % g or tuple(k_LgD.shape) != (L, g, D) or tuple(v_LgE.shape[:2]) != (L, g):
        raise ValueError(f"causal_attention: expected q [Q, h, D], k [L, g, D], v [L, g, E] with h a multiple of g; "
                         f"got q {tuple(q_QhD.shape)}, k {tuple(k_LgD.shape)}, v {tuple(v_LgE.shape)}")
    if tuple(q_pos_Q.shape) != (Q,):
        raise ValueError(f"q_pos_Q: expected one position per query, shape [{Q}], got {tuple(q_pos_Q.shape)}")
    if Q and not (0 <= int(q_pos_Q.min()) and int(q_pos_Q.max()) < L):
        raise ValueError(f"q_pos_Q: expected positions in [0, L={L}), got [{int(q_pos_Q.min())}, {int(q_pos_Q.max())}]")
    E = v_LgE.shape[2]
    out_dtype = q_QhD.dtype
    q = q_QhD.float()
    k = _pad_rows(k_LgD.float().repeat_interleave(h // g, dim=1), KEY_BLOCK)     # [Lp, h, D]
    vt = _pad_rows(v_LgE.float().repeat_interleave(h // g, dim=1), KEY_BLOCK)    # [Lp, h, E]
    pos = q_pos_Q.to(device=q.device, dtype=torch.long)
    m = q.new_full((Q, h), -math.inf)
    s_sum = q.new_zeros(Q, h)
    acc = q.new_zeros(Q, h, E)
    offs = torch.arange(KEY_BLOCK, device=q.device)
    n_blocks = (int(pos.max()) // KEY_BLOCK + 1) if Q else 0
    for blk in range(n_blocks):
        start = blk * KEY_BLOCK
        rows = torch.nonzero(pos >= start).flatten()          # the queries that see this block
        kb = k[start:start + KEY_BLOCK].permute(1, 0, 2).contiguous()    # [h, KB, D]
        vb = vt[start:start + KEY_BLOCK].permute(1, 2, 0).contiguous()   # [h, E, KB]
        qr = q[rows]                                                     # [n, h, D]
        s = (qr[:, :, None, :] * kb[None]).sum(-1) * scale               # [n, h, KB]
        masked = (start + offs)[None, :] > pos[rows][:, None]            # [n, KB]
        s = s.masked_fill(masked[:, None, :], -math.inf)
        m_old = m[rows]
        m_new = torch.maximum(m_old, s.amax(-1))
        p = torch.exp(s - m_new[..., None])                              # masked keys: exactly 0
        alpha = torch.exp(m_old - m_new)                                 # first block: 0 (nothing yet)
        pv = (p[:, :, None, :] * vb[None]).masked_fill(masked[:, None, None, :], 0.0).sum(-1)  # [n, h, E]
        s_sum[rows] = s_sum[rows] * alpha + p.sum(-1)
        acc[rows] = acc[rows] * alpha[..., None] + pv
        m[rows] = m_new
    return (acc / s_sum[..., None]).to(out_dtype)
