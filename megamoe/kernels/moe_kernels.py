"""Triton kernels of the Mega MoE: pointer math only (launchers are in megamoe/fused.py).

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K = top-k, N = T*K slots,
R = number of row tiles (each tile: up to BM slots of one expert, in expert-sorted order).

The persistent kernel `_moe_persistent_kernel` runs three kinds of work item, handed out in a
fixed ticket order through an atomic counter (so an item is only taken by a program that is
running):
  phase 1  (tile r, column block of I)  forward: gather x rows, GEMM1 against w13[e], SwiGLU,
           store the activation h;  backward (IS_BWD): recompute GEMM1, dA = dy W2[e], store
           d(gate,up) and the weighted activation for dW2, and per-row partial dots for d(topk_weights)
  phase 2  (tile r, column block of H)  waits until all phase-1 items of tile r are done, then
           GEMM2 (forward: h @ W2[e]^T, times the routing weight; backward: dgu @ w13[e]) into a
           per-slot row buffer
  phase 3  (block of tokens)  waits until every phase-2 item is done, then sums each token's K
           slot rows in slot order, in fp32, into the output (no float atomics: deterministic and
           batch invariant)
Tickets: groups g = 0 .. R+LAG-1; group g holds the phase-1 items of tile g (g < R) followed by the
phase-2 items of tile g-LAG (g >= LAG); then the phase-3 items. A phase-2 item depends only on items
with smaller tickets, and every ticket below a waiting program's has been taken by a running program,
so no program waits on work that has not been handed out: no deadlock, whatever the residency.
The last program to leave resets the counters, so the workspace is left as it was found (CUDA-graph
replay needs no host-side clearing).
"""

import triton
import triton.language as tl


@triton.jit
def _decode_ticket(t, R, LAG, n1, n2):
    """ticket -> (kind 1/2/3, tile or token block, sub-block), branch-free."""
    Lr = tl.minimum(LAG, R)
    endA = Lr * n1
    endB = endA + (R - Lr) * (n1 + n2)
    endC = R * (n1 + n2)
    inA = t < endA
    inB = (t >= endA) & (t < endB)
    inC = (t >= endB) & (t < endC)
    u = tl.maximum(t - endA, 0)
    g = Lr + u // (n1 + n2)
    s = u % (n1 + n2)
    v = tl.maximum(t - endB, 0)
    kind = tl.where(inA, 1, tl.where(inB, tl.where(s < n1, 1, 2), tl.where(inC, 2, 3)))
    tile = tl.where(inA, t // n1,
                    tl.where(inB, tl.where(s < n1, g, g - Lr),
                             tl.where(inC, (R - Lr) + v // n2, t - endC)))
    sub = tl.where(inA, t % n1, tl.where(inB, tl.where(s < n1, s, s - n1), tl.where(inC, v % n2, 0)))
    return kind, tile, sub


@triton.jit
def _wait_geq(ptr, target):
    c = tl.atomic_add(ptr, 0, sem="acquire")
    while c < target:
        c = tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _moe_persistent_kernel(
    # inputs
    x_ptr, w13_ptr, w2_ptr, tw_ptr, ids_ptr, dy_ptr,
    # routing metadata
    sorted_slot_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    # workspaces / outputs
    act_ptr,      # fwd: h [N, I] (sorted rows); bwd: dgu [N, 2I] (sorted rows)
    hw_ptr,       # bwd: w * h [N, I] (sorted rows), for dW2
    dtw_part_ptr,  # bwd: [N, n1] fp32 partial dots for d(topk_weights) (sorted rows)
    slot_out_ptr,  # [N, H] per-slot rows (indexed by slot)
    out_ptr,      # [T, H]
    ctr_ptr,      # int32 [3]: ticket, programs finished, phase-2 items finished
    tile_done_ptr,  # int32 [R_max]: phase-1 items finished per tile
    T, H, I, K, LAG,
    IS_BWD: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
    BN2: tl.constexpr, BK2: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    R = tl.load(num_tiles_ptr)
    n1 = tl.cdiv(I, BN1)
    n2 = tl.cdiv(H, BN2)
    total = R * (n1 + n2) + tl.cdiv(T, BT)
    # phase 2 contracts over I (forward) or 2I (backward: [dgate, dup] against [G; U])
    KA = I
    if IS_BWD:
        KA = 2 * I

    t = tl.atomic_add(ctr_ptr, 1)
    while t < total:
        kind, tile, sub = _decode_ticket(t, R, LAG, n1, n2)
        # tile metadata (read for every kind; a token block's index is clamped to a valid tile)
        mt = tl.where(kind < 3, tile, 0)
        e = tl.load(tile_expert_ptr + mt).to(tl.int64)
        row0 = tl.load(tile_start_ptr + mt)
        row1 = tl.load(tile_end_ptr + mt)
        rows32 = row0 + tl.arange(0, BM)
        rmask = rows32 < row1
        rows = rows32.to(tl.int64)
        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        tok = slot // K
        if kind == 1:
            cols = sub * BN1 + tl.arange(0, BN1)
            cmask = cols < I
            acc_g = tl.zeros((BM, BN1), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN1), dtype=tl.float32)
            acc_d = tl.zeros((BM, BN1), dtype=tl.float32)
            w13_e = w13_ptr + e * (2 * I * H)
            for k0 in range(0, H, BK1):
                ks = k0 + tl.arange(0, BK1)
                kmask = ks < H
                a = tl.load(x_ptr + tok[:, None] * H + ks[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                bmask = kmask[:, None] & cmask[None, :]
                bg = tl.load(w13_e + cols[None, :] * H + ks[:, None], mask=bmask, other=0.0)
                bu = tl.load(w13_e + (I + cols[None, :]) * H + ks[:, None], mask=bmask, other=0.0)
                acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
                if IS_BWD:
                    d = tl.load(dy_ptr + tok[:, None] * H + ks[None, :],
                                mask=rmask[:, None] & kmask[None, :], other=0.0)
                    bw = tl.load(w2_ptr + e * (H * I) + ks[:, None] * I + cols[None, :],
                                 mask=bmask, other=0.0)
                    acc_d = tl.dot(d, bw, acc_d, input_precision=DOT_PRECISION)
            sg = 1.0 / (1.0 + tl.exp(-acc_g))
            h = (acc_g * sg * acc_u).to(dtype)
            omask = rmask[:, None] & cmask[None, :]
            if IS_BWD:
                w = tl.load(tw_ptr + slot, mask=rmask, other=0.0).to(tl.float32)
                # d(topk_weight) = dy . (W2 h) = (W2^T dy) . h, with h rounded as in the forward
                part = tl.sum(acc_d * h.to(tl.float32), axis=1)
                tl.store(dtw_part_ptr + rows * n1 + sub, part, mask=rmask)
                da = acc_d * w[:, None]
                dgate = da * acc_u * sg * (1.0 + acc_g * (1.0 - sg))
                dup = da * acc_g * sg
                tl.store(act_ptr + rows[:, None] * (2 * I) + cols[None, :], dgate.to(dtype), mask=omask)
                tl.store(act_ptr + rows[:, None] * (2 * I) + I + cols[None, :], dup.to(dtype), mask=omask)
                tl.store(hw_ptr + rows[:, None] * I + cols[None, :],
                         (h.to(tl.float32) * w[:, None]).to(dtype), mask=omask)
            else:
                tl.store(act_ptr + rows[:, None] * I + cols[None, :], h, mask=omask)
            # every thread's stores happen before the release that publishes them
            tl.debug_barrier()
            tl.atomic_add(tile_done_ptr + tile, 1, sem="release")
        elif kind == 2:
            _wait_geq(tile_done_ptr + tile, n1)
            tl.debug_barrier()
            cols = sub * BN2 + tl.arange(0, BN2)
            cmask = cols < H
            acc = tl.zeros((BM, BN2), dtype=tl.float32)
            for k0 in range(0, KA, BK2):
                ks = k0 + tl.arange(0, BK2)
                kmask = ks < KA
                a = tl.load(act_ptr + rows[:, None] * KA + ks[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0, cache_modifier=".cg")
                bmask = kmask[:, None] & cmask[None, :]
                if IS_BWD:
                    b = tl.load(w13_ptr + e * (2 * I * H) + ks[:, None] * H + cols[None, :],
                                mask=bmask, other=0.0)
                else:
                    b = tl.load(w2_ptr + e * (H * I) + cols[None, :] * I + ks[:, None],
                                mask=bmask, other=0.0)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if not IS_BWD:
                w = tl.load(tw_ptr + slot, mask=rmask, other=0.0).to(tl.float32)
                acc = acc * w[:, None]
            tl.store(slot_out_ptr + slot[:, None] * H + cols[None, :], acc.to(dtype),
                     mask=rmask[:, None] & cmask[None, :])
            tl.debug_barrier()
            tl.atomic_add(ctr_ptr + 2, 1, sem="release")
        else:
            _wait_geq(ctr_ptr + 2, R * n2)
            tl.debug_barrier()
            toks = tile * BT + tl.arange(0, BT)
            tmask = toks < T
            for h0 in range(0, H, BH):
                hs = h0 + tl.arange(0, BH)
                m = tmask[:, None] & (hs < H)[None, :]
                acc = tl.zeros((BT, BH), dtype=tl.float32)
                for j in range(0, K):
                    sl = toks.to(tl.int64) * K + j
                    valid = tl.load(ids_ptr + sl, mask=tmask, other=-1) >= 0
                    v = tl.load(slot_out_ptr + sl[:, None] * H + hs[None, :],
                                mask=m & valid[:, None], other=0.0, cache_modifier=".cg")
                    acc += v.to(tl.float32)
                tl.store(out_ptr + toks[:, None] * H + hs[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)
        t = tl.atomic_add(ctr_ptr, 1)

    # leave the workspace as found: the last program out clears every counter
    n_out = tl.atomic_add(ctr_ptr + 1, 1, sem="acq_rel")
    if n_out == tl.num_programs(0) - 1:
        for r0 in range(0, R, 1024):
            rr = r0 + tl.arange(0, 1024)
            tl.store(tile_done_ptr + rr, tl.zeros((1024,), dtype=tl.int32), mask=rr < R)
        tl.atomic_xchg(ctr_ptr + 2, 0)
        tl.atomic_xchg(ctr_ptr + 1, 0)
        tl.atomic_xchg(ctr_ptr, 0)


@triton.jit
def _moe_bwd_dw_kernel(
    x_ptr, dy_ptr, dgu_ptr, hw_ptr, sorted_slot_ptr, expert_start_ptr, expert_count_ptr,
    dw13_ptr, dw2_ptr, H, I, K,
    BMW: tl.constexpr, BNW: tl.constexpr, BKR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Weight gradients, one output tile per program, summed over the expert's rows in order.

    dW13[e] [2I, H] = dgu_e^T @ x_e     dW2[e] [H, I] = dy_e^T @ (w * h)_e
    Programs [0, n13) of expert e do dW13 tiles, [n13, n13 + n2) dW2 tiles.
    """
    pid = tl.program_id(0)
    n13_m = tl.cdiv(2 * I, BMW)
    n13_n = tl.cdiv(H, BNW)
    n2_m = tl.cdiv(H, BMW)
    n2_n = tl.cdiv(I, BNW)
    per_e = n13_m * n13_n + n2_m * n2_n
    e = pid // per_e
    q = pid % per_e
    start = tl.load(expert_start_ptr + e)
    count = tl.load(expert_count_ptr + e)
    acc = tl.zeros((BMW, BNW), dtype=tl.float32)
    if q < n13_m * n13_n:
        om = (q // n13_n) * BMW + tl.arange(0, BMW)   # rows of dW13 (2I)
        on = (q % n13_n) * BNW + tl.arange(0, BNW)    # cols (H)
        mmask = om < 2 * I
        nmask = on < H
        for r0 in range(0, count, BKR):
            rs = start + r0 + tl.arange(0, BKR)
            rmask = (r0 + tl.arange(0, BKR)) < count
            tok = (tl.load(sorted_slot_ptr + rs, mask=rmask, other=0) // K).to(tl.int64)
            a = tl.load(dgu_ptr + rs[:, None].to(tl.int64) * (2 * I) + om[None, :],
                        mask=rmask[:, None] & mmask[None, :], other=0.0)
            b = tl.load(x_ptr + tok[:, None] * H + on[None, :],
                        mask=rmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
        dst = dw13_ptr + e.to(tl.int64) * (2 * I * H) + om[:, None] * H + on[None, :]
        tl.store(dst, acc.to(dw13_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
    else:
        q = q - n13_m * n13_n
        om = (q // n2_n) * BMW + tl.arange(0, BMW)    # rows of dW2 (H)
        on = (q % n2_n) * BNW + tl.arange(0, BNW)     # cols (I)
        mmask = om < H
        nmask = on < I
        for r0 in range(0, count, BKR):
            rs = start + r0 + tl.arange(0, BKR)
            rmask = (r0 + tl.arange(0, BKR)) < count
            tok = (tl.load(sorted_slot_ptr + rs, mask=rmask, other=0) // K).to(tl.int64)
            a = tl.load(dy_ptr + tok[:, None] * H + om[None, :],
                        mask=rmask[:, None] & mmask[None, :], other=0.0)
            b = tl.load(hw_ptr + rs[:, None].to(tl.int64) * I + on[None, :],
                        mask=rmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
        dst = dw2_ptr + e.to(tl.int64) * (H * I) + om[:, None] * I + on[None, :]
        tl.store(dst, acc.to(dw2_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _moe_metadata_kernel(
    sorted_ids_ptr, N, E, BM, R_MAX,
    expert_start_ptr, expert_count_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    E_PAD: tl.constexpr, RB: tl.constexpr,
):
    """Routing metadata in one program, from the stably sorted ids: per-expert starts and counts
    (a binary search per expert, log2(N) dependent loads instead of a pass over all N ids), and the
    row-tile table. The -1 slots sort first, so every expert's rows start after them."""
    bins = tl.arange(0, E_PAD)
    is_e = bins < E
    # lower_bound(sorted_ids, b) for b = 0..E (bin E gives the end of the last expert)
    lo = tl.zeros((E_PAD,), dtype=tl.int32)
    hi = tl.zeros((E_PAD,), dtype=tl.int32) + N
    while tl.max(hi - lo, axis=0) > 0:
        mid = (lo + hi) // 2
        v = tl.load(sorted_ids_ptr + mid, mask=mid < hi, other=0)
        go_right = (mid < hi) & (v < bins)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right | (mid >= hi), hi, mid)
    start = lo
    # count[e] = start[e+1] - start[e]: shift by one lane through a one-hot reduction
    nxt = tl.sum(tl.where(bins[None, :] == bins[:, None] + 1, start[None, :], 0), axis=1)
    cnt = tl.where(is_e, nxt - start, 0)
    tl.store(expert_start_ptr + bins, start, mask=is_e)
    tl.store(expert_count_ptr + bins, cnt, mask=is_e)
    tiles = (cnt + BM - 1) // BM
    tcum = tl.cumsum(tiles, axis=0)
    first = tcum - tiles
    tl.store(num_tiles_ptr, tl.sum(tiles, axis=0))
    for r0 in range(0, R_MAX, RB):
        r = r0 + tl.arange(0, RB)
        e = tl.sum(((tcum[None, :] <= r[:, None]) & is_e[None, :]).to(tl.int32), axis=1)
        sel = bins[None, :] == e[:, None]
        f = tl.sum(tl.where(sel, first[None, :], 0), axis=1)
        st = tl.sum(tl.where(sel, start[None, :], 0), axis=1)
        ce = tl.sum(tl.where(sel, cnt[None, :], 0), axis=1)
        ts = st + (r - f) * BM
        te = tl.minimum(ts + BM, st + ce)
        valid = e < E
        rm = r < R_MAX
        tl.store(tile_expert_ptr + r, e, mask=rm)
        tl.store(tile_start_ptr + r, tl.where(valid, ts, 0), mask=rm)
        tl.store(tile_end_ptr + r, tl.where(valid, te, 0), mask=rm)
