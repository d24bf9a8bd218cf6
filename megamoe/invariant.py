"""Batch-invariant dense ops both sides of an RL run call in `numerics="bitwise"`: the linear layers
(attention projections, dense MLPs, the LM head), causal attention, RMSNorm, the rotary tables and the
log-softmax. On CPU (fp32) the kernels below; on CUDA `linear`, `rms_norm` and `log_softmax` run the
batch-invariant kernels registered with `register_gpu_kernels` (or named by the GPU_KERNELS_GROUP entry
point: the project's are vLLM's, which a bitwise engine runs, rollout/invariant_kernels.py; they also
hold the CUDA attention). megamoe imports no vLLM: the kernels reach it through this registration.

Each op fixes its reduction order by construction, so an output row's bits depend only on that row's
inputs, never on how many other rows (tokens, requests, padding) share the call:

- `linear`: x[M, K] @ w[N, K]^T as GEMMs of one fixed shape per weight, [ROWS, K] @ [K, N] (rows
  zero-padded to whole tiles: megamoe.blocked.rows_mm). A BLAS picks its kernel, and so its
  rounding, by the problem's shape; with every call the same shape, an output element depends on its
  row of x and on w only: a decode step (M = 1), a prefill (M = prompt length) and the trainer's batch
  give the same bits. A column's place among the N changes its rounding (measured at K=2880), so both
  sides must multiply by the same [N, K]: a fused weight (vLLM's q/k/v or gate/up) goes through
  `linear_parts`, one `linear` per part (the trainer's separate projections), and vLLM's LM head drops
  its vocabulary padding first.
- `causal_attention` / `batched_causal_attention`: each query against its sequence's keys 0..pos, in
  blocks of KEY_BLOCK keys from key 0 (online softmax: running max, running sum, rescaled accumulator).
  Queries go in tiles of QUERY_TILE rows of one sequence, so the two products are GEMMs of one fixed
  shape ([rep·QT, D] @ [D, KB], [rep·QT, KB] @ [KB, E], rep query heads per key head) and every other step is elementwise or a sum over one
  row; a block a query does not reach leaves its row exactly unchanged (alpha = 1, p = 0). So a query's
  result does not depend on the other queries, their number or its place in a tile: vLLM's decode (one
  query against its KV cache), its chunked prefill and the trainer's whole-sequence forward agree.

- `rms_norm`: one row at a time by construction (a mean over the row, elementwise otherwise).
- `rope_cache`: the rotary cos/sin table, computed in float64 on the CPU and rounded once to fp32, so
  that it does not depend on the device or the process computing it.

Only the forward is shared; the trainer differentiates through plain matmuls (`InvariantLinearFn`; the
attention's backward is trainer/bitwise.py's). The tests (tests/megamoe/test_invariant.py) check the
invariances and the values against an fp64 ground truth.
"""

from __future__ import annotations

import math

import torch

from megamoe.blocked import rows_mm

KEY_BLOCK = 32
"""Keys per block of `causal_attention`'s online softmax; fixed, for invariance to the query count."""
QUERY_TILE = 16
"""Query rows per GEMM tile of `causal_attention` (one sequence's; a short tile repeats its first row)."""

GPU_KERNELS_GROUP = "megamoe.invariant_kernels"
"""Entry-point group naming the CUDA batch-invariant kernels when none was registered in the process:
an object (a module) with linear(x_MK, w_NK, b_N), rms_norm(x, w, eps), log_softmax(x) and
paged_attention(q_BThD, k_BLgD, v_BLgD, scale) (pyproject.toml: rollout.invariant_kernels)."""
_GPU_KERNELS: list = []


def register_gpu_kernels(kernels) -> None:
    """Make `kernels` (see GPU_KERNELS_GROUP) this process's CUDA batch-invariant kernels."""
    ops = ("linear", "rms_norm", "log_softmax", "paged_attention")
    missing = [n for n in ops if not callable(getattr(kernels, n, None))]
    if missing:
        raise TypeError(f"register_gpu_kernels: {kernels!r} lacks {missing} (expected linear, rms_norm, log_softmax, "
                        "paged_attention)")
    _GPU_KERNELS[:] = [kernels]


def gpu_kernels():
    """This process's CUDA batch-invariant kernels: the registered ones, else the one entry point of
    GPU_KERNELS_GROUP (loaded and registered); ImportError when there is none or more than one."""
    if not _GPU_KERNELS:
        from importlib.metadata import entry_points

        found = list(entry_points(group=GPU_KERNELS_GROUP))
        if len(found) != 1:
            raise ImportError(f"numerics='bitwise' on CUDA: expected one entry point in group {GPU_KERNELS_GROUP!r} "
                              f"naming the batch-invariant kernels (pyproject.toml; reinstall the project), got "
                              f"{[e.value for e in found]}; or call megamoe.invariant.register_gpu_kernels")
        register_gpu_kernels(found[0].load())
    return _GPU_KERNELS[0]


def linear(x: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ w[N, K]^T (+ b[N]) in x's dtype, batch invariant (module docstring)."""
    K = x.shape[-1]
    if w_NK.dim() != 2 or w_NK.shape[1] != K:
        raise ValueError(f"w_NK: expected a 2-D [N, K={K}] weight, got {tuple(w_NK.shape)}")
    N = w_NK.shape[0]
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, K)
    M = x_MK.shape[0]
    if x.is_cuda:
        return gpu_kernels().linear(x_MK, w_NK, b_N).reshape(*lead, N)
    if M == 0:
        out = x_MK.new_zeros(0, N)
    else:
        # one GEMM call per tile of ROWS rows (a batched call of a stride-0 weight is not invariant to the
        # number of tiles: measured), on the same [K, N] view of w on both sides
        out = rows_mm(x_MK, w_NK.to(x.dtype).contiguous().t())
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


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dim, in fp32, rounded once to x's dtype; batch invariant."""
    if w is not None and tuple(w.shape) != (x.shape[-1],):
        raise ValueError(f"w: expected a [{x.shape[-1]}] weight, got {tuple(w.shape)}")
    if x.is_cuda:
        return gpu_kernels().rms_norm(x, w, eps)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, batch invariant (on CUDA the registered kernel: vLLM's, the sampler's in this mode)."""
    if x.is_cuda:
        return gpu_kernels().log_softmax(x)
    return torch.log_softmax(x, dim=-1)


def rope_cache(base: float, rotary_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32 on the CPU: cos(p * f_i) then sin(p * f_i), f_i = base^(-2i/rotary_dim)
    for i < rotary_dim / 2 (vLLM's cos_sin_cache layout; transformers' cos/sin are [cos, cos], [sin, sin])."""
    if rotary_dim <= 0 or rotary_dim % 2 or max_positions <= 0:
        raise ValueError(f"rope_cache: expected an even rotary_dim > 0 and max_positions > 0, got "
                         f"{rotary_dim}, {max_positions}")
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], -1).float()


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
    if k_LgD.dim() != 3:
        raise ValueError(f"k_LgD: expected [L, g, D] (one sequence), got {tuple(k_LgD.shape)}")
    seq = torch.zeros(q_QhD.shape[0], dtype=torch.long, device=q_QhD.device)
    return batched_causal_attention(q_QhD, k_LgD[None], v_LgE[None], seq, q_pos_Q, scale,
                                    lengths_R=torch.tensor([k_LgD.shape[0]]))


def batched_causal_attention(q_QhD: torch.Tensor, k_RLgD: torch.Tensor, v_RLgE: torch.Tensor, q_seq_Q: torch.Tensor,
                             q_pos_Q: torch.Tensor, scale: float, lengths_R: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_attention` of many sequences in one call, bitwise the same per query: query i belongs to
    sequence q_seq[i] and attends its keys 0..q_pos[i] of k [R, L, g, D], v [R, L, g, E]. lengths_R: each
    sequence's valid keys (default L); keys past them may hold anything, even NaN."""
    R, L = k_RLgD.shape[:2]
    if k_RLgD.dim() != 4 or v_RLgE.dim() != 4 or tuple(v_RLgE.shape[:2]) != (R, L):
        raise ValueError(f"causal_attention: expected k [R, L, g, D], v [R, L, g, E]; got k {tuple(k_RLgD.shape)}, "
                         f"v {tuple(v_RLgE.shape)}")
    lengths = lengths_R if lengths_R is not None else torch.full((R,), L)
    table = torch.arange(R, device=q_QhD.device)[:, None]
    return paged_causal_attention(q_QhD, k_RLgD.transpose(1, 2), v_RLgE.transpose(1, 2), table, lengths, q_seq_Q,
                                  q_pos_Q, scale)


def _key_block(k_NgBD: torch.Tensor, v_NgBE: torch.Tensor, table_RM: torch.Tensor, start: int):
    """Keys and values start .. start + KEY_BLOCK of each row's sequence, [R, g, KB, D|E] in fp32: page j of
    a row is k[table[row, j]] (a page past the table's width reads its last page: masked by the caller)."""
    bs, width = k_NgBD.shape[2], table_RM.shape[1]
    R, g = table_RM.shape[0], k_NgBD.shape[1]
    if KEY_BLOCK % bs == 0:  # whole pages
        cols = (start // bs + torch.arange(KEY_BLOCK // bs, device=table_RM.device)).clamp(max=width - 1)
        pages = table_RM[:, cols]                                                    # [R, KB / bs]
        return tuple(c[pages].transpose(1, 2).reshape(R, g, KEY_BLOCK, c.shape[3]).float() for c in (k_NgBD, v_NgBE))
    if bs % KEY_BLOCK == 0:  # part of one page
        page = table_RM[:, min(start // bs, width - 1)]
        off = start % bs
        return tuple(c[:, :, off:off + KEY_BLOCK][page].float() for c in (k_NgBD, v_NgBE))
    idx = start + torch.arange(KEY_BLOCK, device=table_RM.device)[None, :].expand(R, -1)
    page = table_RM[torch.arange(R, device=table_RM.device)[:, None], (idx // bs).clamp(max=width - 1)][:, None, :]
    heads = torch.arange(g, device=table_RM.device)[None, :, None]
    return tuple(c[page, heads, (idx % bs)[:, None, :]].float() for c in (k_NgBD, v_NgBE))


def paged_causal_attention(q_QhD: torch.Tensor, k_NgBD: torch.Tensor, v_NgBE: torch.Tensor, block_table_RM: torch.Tensor,
                           lengths_R: torch.Tensor, q_seq_Q: torch.Tensor, q_pos_Q: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The attention over a paged KV cache (vLLM's layout): key j of sequence r is k[block_table[r, j // B],
    :, j % B], for j < lengths[r]; query i belongs to sequence q_seq[i] at position q_pos[i]. Bitwise the
    same per query as `causal_attention` of that sequence alone (module docstring)."""
    Q, h, D = q_QhD.shape
    g = k_NgBD.shape[1]
    R = block_table_RM.shape[0]
    if h % g or k_NgBD.dim() != 4 or k_NgBD.shape[3] != D or tuple(v_NgBE.shape[:3]) != tuple(k_NgBD.shape[:3]):
        raise ValueError(f"causal_attention: expected q [Q, h, D], k [L, g, D], v [L, g, E] with h a multiple of g; "
                         f"got q {tuple(q_QhD.shape)}, keys {tuple(k_NgBD.shape)}, values {tuple(v_NgBE.shape)} "
                         "([blocks, g, block size, D])")
    if tuple(q_pos_Q.shape) != (Q,) or tuple(q_seq_Q.shape) != (Q,):
        raise ValueError(f"q_pos_Q: expected one position per query, shape [{Q}], got {tuple(q_pos_Q.shape)} "
                         f"(q_seq_Q {tuple(q_seq_Q.shape)})")
    dev = q_QhD.device
    pos = q_pos_Q.to(device=dev, dtype=torch.long)
    seq = q_seq_Q.to(device=dev, dtype=torch.long)
    lengths = lengths_R.to(device=dev, dtype=torch.long)
    table = block_table_RM.to(device=dev, dtype=torch.long)
    if Q and not (0 <= int(seq.min()) and int(seq.max()) < R):
        raise ValueError(f"q_seq_Q: expected sequence indices in [0, {R}), got [{int(seq.min())}, {int(seq.max())}]")
    if Q and not (int(pos.min()) >= 0 and bool((pos < lengths[seq]).all())):
        raise ValueError(f"q_pos_Q: expected positions in [0, L={int(lengths[seq].max())}), got "
                         f"[{int(pos.min())}, {int(pos.max())}]")
    E = v_NgBE.shape[3]
    out_dtype = q_QhD.dtype
    rep = h // g
    if Q == 0:
        return q_QhD.new_zeros(0, h, E)
    # Query tiles: each sequence's queries in order, QUERY_TILE rows at a time; a sequence's last tile is
    # filled up with copies of its first row (computed, never returned).
    order = torch.argsort(seq * (int(pos.max()) + 1) + pos)                # by sequence, then position
    counts = torch.bincount(seq, minlength=R)
    rank = torch.arange(Q, device=dev) - (torch.cumsum(counts, 0) - counts)[seq[order]]
    per_seq = (counts + QUERY_TILE - 1) // QUERY_TILE
    tile_id = (torch.cumsum(per_seq, 0) - per_seq)[seq[order]] + rank // QUERY_TILE
    tile_rows = torch.full((int(per_seq.sum()), QUERY_TILE), -1, dtype=torch.long, device=dev)
    tile_rows[tile_id, rank % QUERY_TILE] = order
    real = tile_rows >= 0
    tile_rows = torch.where(real, tile_rows, tile_rows[:, :1])           # [nt, QT]
    tile_seq = seq[tile_rows[:, 0]]                                       # [nt]
    nt = tile_rows.shape[0]
    # [nt, g, rep * QT, D]: a tile's queries of the query heads that read key head j, stacked, so that one
    # GEMM per (tile, key head) covers them; query head j * rep + i reads key head j
    qt = q_QhD.float()[tile_rows].view(nt, QUERY_TILE, g, rep, D).permute(0, 2, 3, 1, 4)
    qt = qt.reshape(nt, g, rep * QUERY_TILE, D)
    # The softmax state is kept per query (its own rows of its tile's GEMMs): the elementwise steps run on
    # the real queries only, the GEMMs on whole tiles (a row's result does not depend on the other rows'
    # values, only on the GEMM's shape; the tile's filler rows of p are zeros).
    q_tile = torch.empty(Q, dtype=torch.long, device=dev)
    q_slot = torch.empty(Q, dtype=torch.long, device=dev)
    q_tile[order] = tile_id
    q_slot[order] = rank % QUERY_TILE
    m = qt.new_full((Q, g, rep), -math.inf)
    s_sum = qt.new_zeros(Q, g, rep)
    acc = qt.new_zeros(Q, g, rep, E)
    offs = torch.arange(KEY_BLOCK, device=dev)
    tile_max = pos.new_full((nt,), -1).scatter_reduce_(0, q_tile, pos, "amax")
    local = torch.full((nt,), -1, dtype=torch.long, device=dev)             # a tile's place among the active
    for blk in range(int(tile_max.max()) // KEY_BLOCK + 1):
        start = blk * KEY_BLOCK
        act = torch.nonzero(tile_max >= start).flatten()                 # the tiles that see this block
        na = act.numel()
        local[act] = torch.arange(na, device=dev)
        qa = torch.nonzero(tile_max[q_tile] >= start).flatten()          # their queries
        t_a, i_a = local[q_tile[qa]], q_slot[qa]
        r_n = tile_seq[act]
        idx = start + offs[None, :].expand(na, -1)                       # [na, KB] key positions
        kb, vb = _key_block(k_NgBD, v_NgBE, table[r_n], start)           # [na, g, KB, D|E], from the pages
        # a key past its sequence's length holds anything (a cache's stale or unwritten slots): its score
        # is masked below, its value zeroed here, so that p = 0 times it is exactly 0
        vb = vb.masked_fill(~(idx < lengths[r_n][:, None])[:, None, :, None], 0.0)
        # one GEMM shape for every tile and block: [rep * QT, D] @ [D, KB], then [rep * QT, KB] @ [KB, E]
        s = torch.matmul(qt if na == nt else qt[act], kb.transpose(-1, -2)) * scale  # [na, g, rep * QT, KB]
        s = s.view(na, g, rep, QUERY_TILE, KEY_BLOCK)[t_a, :, :, i_a]     # [qa, g, rep, KB]: the real rows
        s = s.masked_fill((start + offs[None, :] > pos[qa][:, None])[:, None, None, :], -math.inf)
        m_old = m[qa]
        m_new = torch.maximum(m_old, s.amax(-1))
        p = torch.exp(s - m_new[..., None])                              # masked keys: exactly 0
        alpha = torch.exp(m_old - m_new)                                 # first block: 0; a row it skips: 1
        s_sum[qa] = s_sum[qa] * alpha + p.sum(-1)
        p_tiles = p.new_zeros(na, g, rep, QUERY_TILE, KEY_BLOCK)
        p_tiles[t_a, :, :, i_a] = p
        pv = torch.matmul(p_tiles.view(na, g, rep * QUERY_TILE, KEY_BLOCK), vb)
        acc[qa] = acc[qa] * alpha[..., None] + pv.view(na, g, rep, QUERY_TILE, E)[t_a, :, :, i_a]
        m[qa] = m_new
        local[act] = -1
    out = (acc / s_sum[..., None]).reshape(Q, h, E)
    return out.to(out_dtype)
