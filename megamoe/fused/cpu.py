"""The torch implementation of megamoe (the CPU backend): the semantics and the reduction order of
the Triton kernels (megamoe/fused/__init__.py), with routing metadata from torch ops. Its
slot-order combine, `combine_slots`, is also the EP backward's on any device (megamoe/ep_fused.py)."""

from __future__ import annotations

import dataclasses

import torch

from megamoe.activation import act_backward, act_forward
from megamoe.blocked import ROWS, rows_mm
from megamoe.contract import SWIGLU, Activation


@dataclasses.dataclass
class RoutingMeta:
    sorted_slot: torch.Tensor   # int64 [N]   slot indices (t*K + j) sorted by id, stable: -1 slots first
    expert_start: torch.Tensor  # int32 [E]   first sorted row of each expert
    expert_count: torch.Tensor  # int32 [E]   rows of each expert


def routing_metadata(topk_ids_Tk: torch.Tensor, E: int) -> RoutingMeta:
    """Per-expert counts, offsets and the id-sorted slot permutation, in torch ops: the CPU
    backend's metadata and the exact reference for the Triton kernel's phase 0 (which computes the
    same permutation with a stable counting sort inside the persistent launch)."""
    ids = topk_ids_Tk.reshape(-1)
    _, sorted_slot = torch.sort(ids, stable=True)
    ids_m = torch.where(ids < 0, torch.full_like(ids, E), ids).long()
    counts = torch.zeros(E + 1, dtype=torch.int32, device=ids.device).scatter_add_(
        0, ids_m, torch.ones_like(ids_m, dtype=torch.int32))
    count_e = counts[:E]
    start_e = torch.cumsum(count_e, 0, dtype=torch.int32) - count_e + counts[E:]  # after the -1 slots
    return RoutingMeta(sorted_slot, start_e.contiguous(), count_e.contiguous())


_CPU_ROWS = ROWS  # fixed row block: a row's GEMM result never depends on how many rows share the call


_CPU_COLS = 512  # 32 x 512 elements stay under ATen's parallel grain (32768): one thread, fixed split


def _blockwise(fn, *ts: torch.Tensor) -> torch.Tensor:
    """fn applied elementwise in fixed [_CPU_ROWS, _CPU_COLS] blocks.

    On a whole [rows, I] tensor ATen splits elementwise ops across threads at points that depend on
    the row and thread counts, moving elements between its vectorised and scalar paths (exp differs
    in the last bit): a token's SwiGLU would then depend on its batch and on the process's thread
    count (vLLM's CPU worker runs 1 thread, the trainer 2). Fixed blocks keep every element's path a
    function of its column only.
    """
    M, N = ts[0].shape
    rows = []
    for r0 in range(0, M, _CPU_ROWS):
        rows.append(torch.cat([fn(*(t[r0:r0 + _CPU_ROWS, c0:c0 + _CPU_COLS] for t in ts))
                               for c0 in range(0, N, _CPU_COLS)], dim=1))
    return torch.cat(rows) if rows else fn(*ts)


def combine_slots(slot_out_NH: torch.Tensor, ids_Tk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [T, H] in `dtype`: each token's K slot rows (slot_out [T*K, H]) summed in slot order in fp32,
    the -1 slots skipped; the Triton combine's order, on any device."""
    T, K = ids_Tk.shape
    rows = slot_out_NH.reshape(T, K, slot_out_NH.shape[-1])  # explicit H: T may be 0
    acc = torch.zeros(T, rows.shape[-1], dtype=torch.float32, device=rows.device)
    for j in range(K):  # slot order, fp32
        acc += torch.where((ids_Tk[:, j] >= 0)[:, None], rows[:, j].float(), 0.0)
    return acc.to(dtype)


def cpu_fwd(x, w13, w2, tw, ids, meta: RoutingMeta, T, H, I, K, save_gu: bool = False,  # noqa: E741
            b13=None, b2=None, act: Activation = SWIGLU):
    """y, and (gate, up) [N, 2I] in sorted rows rounded to x's dtype when save_gu (else None).
    Biases (both or neither) are added to the fp32 GEMM results, as the kernel adds them to its
    accumulators."""
    dtype = x.dtype
    slot_out = torch.zeros(T * K, H, dtype=dtype)
    gu_saved = torch.zeros(T * K, 2 * I, dtype=dtype, device=x.device) if save_gu else None  # -1 slots: 0
    sorted_slot = meta.sorted_slot.long()
    for e, (s, n) in enumerate(zip(meta.expert_start.tolist(), meta.expert_count.tolist())):
        if n == 0:
            continue
        slot = sorted_slot[s:s + n]
        gu = rows_mm(x[slot // K].float(), w13[e].float().t())
        if b13 is not None:
            gu = gu + b13[e].float()
        if gu_saved is not None:
            gu_saved[s:s + n] = gu.to(dtype)
        h = _blockwise(lambda g, u: act_forward(g, u, act), gu[:, :I], gu[:, I:]).to(dtype)
        o = rows_mm(h.float(), w2[e].float().t())
        if b2 is not None:
            o = o + b2[e].float()
        o = o * tw.reshape(-1)[slot].float()[:, None]
        slot_out[slot] = o.to(dtype)
    return combine_slots(slot_out, ids, dtype), gu_saved


def cpu_bwd(dy, x, w13, w2, tw, ids, meta: RoutingMeta, T, H, I, K, gu_saved=None,  # noqa: E741
            b13=None, b2=None, act: Activation = SWIGLU):
    """(dx [T,H], dw13, dw2, d(topk_weights) [T,K] fp32, db13, db2) (the bias gradients None without
    biases); gu_saved: the forward's (gate, up), else GEMM1 recomputed and rounded as the forward
    saves it. db13[e] sums d(gate, up) as rounded for dW13, db2[e] the weighted dy rows, in fp32."""
    dtype = x.dtype
    dx_slot = torch.zeros(T * K, H, dtype=dtype)
    dw13 = torch.zeros_like(w13)
    dw2 = torch.zeros_like(w2)
    dtw = torch.zeros(T * K, dtype=torch.float32)
    bias = b13 is not None
    db13 = torch.zeros_like(b13) if bias else None
    db2 = torch.zeros_like(b2) if bias else None
    sorted_slot = meta.sorted_slot.long()
    for e, (s, n) in enumerate(zip(meta.expert_start.tolist(), meta.expert_count.tolist())):
        if n == 0:
            continue
        slot = sorted_slot[s:s + n]
        tok = slot // K
        xe = x[tok].float()
        dye = dy[tok].float()
        w = tw.reshape(-1)[slot].float()[:, None]
        if gu_saved is not None:
            gu = gu_saved[s:s + n].float()
        else:  # recomputed and rounded as the forward saves it
            gu = rows_mm(xe, w13[e].float().t())
            gu = (gu + b13[e].float() if bias else gu).to(dtype).float()
        g, u = gu[:, :I], gu[:, I:]
        dA = rows_mm(dye, w2[e].float())
        da = dA * w
        h, dg, du = act_backward(g, u, da, act, sigmoid=lambda t: _blockwise(torch.sigmoid, t))
        h = h.to(dtype).float()
        dtw[slot] = (dA * h).sum(dim=1) + ((dye * b2[e].float()).sum(dim=1) if bias else 0.0)
        dgu = torch.cat([dg, du], dim=1).to(dtype)
        hw = (h * w).to(dtype)
        if bias:
            db13[e] = dgu.float().sum(dim=0).to(dtype)
            db2[e] = (dye * w).sum(dim=0).to(dtype)
        dx_slot[slot] = rows_mm(dgu.float(), w13[e].float()).to(dtype)
        dw13[e] = (dgu.float().t() @ xe).to(dtype)
        dw2[e] = (dye.t() @ hw.float()).to(dtype)
    dx = combine_slots(dx_slot, ids, dtype)
    dtw = torch.where(ids.reshape(-1) >= 0, dtw, 0.0)
    return dx, dw13, dw2, dtw.reshape(T, K), db13, db2
