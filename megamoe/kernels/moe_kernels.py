"""Triton kernels of the Mega MoE: pointer math only (launchers are in megamoe/fused/launch.py).

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K = top-k, N = T*K slots,
R = number of row tiles (each tile: up to BM slots of one expert, in expert-sorted order),
NB = ceil(N / BLK) blocks of slots for the routing metadata.

The persistent kernel `_moe_persistent_kernel` is the whole forward (or the whole backward but the
weight gradients) in one launch. Its work items are handed out in a fixed ticket order through an
atomic counter, so an item is only ever taken by a program that is running:
  phase 0  routing metadata, a stable counting sort of the slots by expert (key = id + 1, so the
           -1 slots come first):
           0a (block b of slots)  histogram of the block's keys
           0b (one item)          per key: exclusive prefix of the block histograms, totals, start
                                  of each key's rows, tiles per expert (inclusive cumsum), R
           0c (block b of slots)  rank of each slot among the block's slots of its key (in slot
                                  order): its sorted row; writes the permutation and its inverse
  phase 1  (tile r, column block of I)  forward: gather x rows, GEMM1 against w13[e], SwiGLU,
           store the activation h (and, with GU, the GEMM1 result (gate, up) rounded to the input
           dtype, for the backward);  backward (IS_BWD): (gate, up) loaded (GU) or recomputed and
           rounded the same way, dA = dy W2[e], store d(gate,up) and the weighted activation for
           dW2, and per-row partial dots for d(topk_weights)
  phase 2  (tile r, column block of H)  waits until all phase-1 items of tile r are done, then
           GEMM2 (forward: h @ W2[e]^T, times the routing weight; backward: dgu @ w13[e]) into a
           per-slot row buffer
  phase 3  (block of tokens)  waits until every phase-2 item is done, then sums each token's K
           slot rows in slot order, in fp32, into the output (no float atomics: deterministic and
           batch invariant); the backward also sums each slot's partial dots, in block order, into
           d(topk_weights)
Each item is one helper (inlined but for the noinline ones, whose comments say why): _metadata_item
(phase 0), _gemm1_item (phase 1: _gemm1's loop, _act_fwd, the backward's _backward_da), _gemm2_item
(phase 2), _combine_tokens and the backward's _dtw_item (phase 3); with EP _ep_dispatch and
_ep_result_item. The kernel body hands out the tickets and finds each item's rows (_tile_rows).
Tickets: [0, NB) phase 0a, NB phase 0b, [NB+1, 2NB+1) phase 0c; then, from P0 = 2NB+1, units
q = 0 .. R_MAX/GT+LAG-1, unit q holding the phase-1 items of tiles [q*GT, (q+1)*GT) (q < R_MAX/GT)
followed by the phase-2 items of the tiles of unit q-LAG (q >= LAG), each part column block by column
block (_decode_ticket); then the phase-3 items. R_MAX, a multiple of GT at least ceil(N / BM) + E,
bounds R from the shapes alone; items of tiles >= R (known once phase 0 is done) are empty. Every
item waits only on items with smaller tickets, and every ticket below a waiting program's has been
taken by a running program, so no program waits on work that has not been handed out: no deadlock,
whatever the residency. The last program to leave resets the counters, so the workspace is left as it was found
(CUDA-graph replay needs no host-side clearing).

Data written in this launch and read by other programs is read with `.cg` (from L2, not a
possibly stale L1 line), after an acquire on the counter that publishes it.

EP (constexpr; megamoe/ep_fused.py): the expert-parallel forward of one rank. Tickets [0, ND) are
dispatch items (BT of the rank's own slots each: ids, weights and token rows stored into every
owner's receive buffers, addressed through an int64 table of every rank's buffers) and ticket ND
release-stores the call's epoch into every owner's dispatch pad (system scope); each program then
waits (bounded) for every source's epoch before phases 0-2, which run unchanged over the W*TMK
received rows (K = 1). Phase 3 becomes one item that stores the epoch into every source's combine
pad once all phase-2 items are done, then combine items that wait for every owner's epoch and sum
each of the rank's tokens' rows, read from the owners' result buffers, in slot order in fp32.
Without EP these branches compile away (compile_check: same registers and stack).

Over 500 lines, on purpose: it holds only the kernels (pointer math, no launch logic), and the
persistent kernel, the helpers it calls and the counter and address-table constants they share read
as one unit; the launchers and everything host-side are in megamoe/fused/.
"""

import triton
import triton.language as tl

# counter slots (int32) at the head of the workspace; tile_done follows at CTR_SLOTS
CTR_TICKET = tl.constexpr(0)   # next ticket
CTR_OUT = tl.constexpr(1)      # programs finished
CTR_P2 = tl.constexpr(2)       # phase-2 items finished
CTR_0A = tl.constexpr(3)       # phase-0a items finished
CTR_0B = tl.constexpr(4)       # phase-0b finished
CTR_0C = tl.constexpr(5)       # phase-0c items finished
CTR_D = tl.constexpr(6)        # EP: dispatch items finished
CTR_SLOTS = tl.constexpr(8)

# EP: rows of the address table (int64 [EP_ROWS, W], one column per rank)
EP_RECV_X = tl.constexpr(0)    # [W * TMK, H] token rows received by the rank (source-major)
EP_RECV_ID = tl.constexpr(1)   # int32 [W * TMK] local expert id of each received row, -1: none
EP_RECV_W = tl.constexpr(2)    # fp32 [W * TMK] routing weight of each received row
EP_OUT = tl.constexpr(3)       # [W * TMK, H] result of each received row (weighted), read by its source
EP_DSIG = tl.constexpr(4)      # int64 [W] dispatch signal pad: entry s = epoch of source s's rows
EP_CSIG = tl.constexpr(5)      # int64 [W] combine signal pad: entry d = epoch of owner d's results
EP_ROWS = tl.constexpr(6)


@triton.jit
def _decode_ticket(t, R, LAG, n1, n2, GT: tl.constexpr):
    """ticket (from P0) -> (kind 1/2/3, tile or token block, sub-block), branch-free.

    Tiles go in groups of GT (R, a multiple of GT): unit q holds the phase-1 items of tiles
    [q*GT, (q+1)*GT), then the phase-2 items of the tiles of unit q-LAG. Inside a unit the items go
    column block by column block, each block for the unit's GT tiles in turn, so programs running at
    the same time read the same weight columns (read once from memory for GT row tiles)."""
    Q = R // GT
    m1 = GT * n1
    m2 = GT * n2
    Lr = tl.minimum(LAG, Q)
    endA = Lr * m1
    endB = endA + (Q - Lr) * (m1 + m2)
    endC = Q * (m1 + m2)
    inA = t < endA
    inB = (t >= endA) & (t < endB)
    inC = (t >= endB) & (t < endC)
    u = tl.maximum(t - endA, 0)
    g = Lr + u // (m1 + m2)
    s = u % (m1 + m2)
    v = tl.maximum(t - endB, 0)
    kind = tl.where(inA, 1, tl.where(inB, tl.where(s < m1, 1, 2), tl.where(inC, 2, 3)))
    unit = tl.where(inA, t // m1, tl.where(inB, tl.where(s < m1, g, g - Lr), (Q - Lr) + v // m2))
    idx = tl.where(inA, t % m1, tl.where(inB, tl.where(s < m1, s, s - m1), v % m2))
    tile = tl.where(kind == 3, t - endC, unit * GT + idx % GT)
    sub = tl.where(kind == 3, 0, idx // GT)
    return kind, tile, sub


@triton.jit
def _wait_geq(ptr, target):
    c = tl.atomic_add(ptr, 0, sem="acquire")
    while c < target:
        c = tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _publish(ptr):
    # every thread's stores happen before the release that publishes them
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release")


@triton.jit
def _publish_sys(ptr):
    # as _publish, at system scope: the stores it publishes include stores to other GPUs (EP)
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="sys")


@triton.jit
def _ep_addr(ep_ptr, row, rank, W, ty: tl.constexpr):
    """Base pointer of buffer `row` of `rank` (rank may be a tensor of ranks)."""
    return tl.load(ep_ptr + row * W + rank).to(tl.pointer_type(ty))


@triton.jit
def _globaltimer():
    """The GPU's nanosecond clock (%globaltimer)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trace_time(t, CLOCK: tl.constexpr):
    if CLOCK:
        return _globaltimer()
    else:
        return t.to(tl.int64)


@triton.jit(noinline=True)  # inlined, it would spill the GEMM loops' registers
def _ep_wait_all(pad_ptr, W, epoch, spin_max, err_ptr, code, POLL_NS: tl.constexpr):
    """Wait (bounded, system-scope acquire) until every entry of a signal pad reaches `epoch`: at most
    spin_max polls per entry, at least POLL_NS ns apart (0: back to back, the interpreter, which has
    no clock; on a GPU the bound is then a time, at least spin_max * POLL_NS ns, whatever an atomic
    costs). On time-out: record (code, entry) in err_ptr [2] (first one wins) and go on; the host raises."""
    for s in range(0, W):
        c = tl.atomic_add(pad_ptr + s, 0, sem="acquire", scope="sys")
        n = 0
        while (c < epoch) & (n < spin_max):
            if POLL_NS > 0:
                t_next = _globaltimer() + POLL_NS
                while _globaltimer() < t_next:
                    pass
            c = tl.atomic_add(pad_ptr + s, 0, sem="acquire", scope="sys")
            n += 1
        if c < epoch:
            if tl.atomic_cas(err_ptr, 0, code) == 0:
                tl.atomic_xchg(err_ptr + 1, s)


@triton.jit
def _block_keys(ids_ptr, b, N, E, BLK: tl.constexpr):
    """Slots and keys (id + 1 in [0, E]; -1 past N or out of range) of block b."""
    offs = b * BLK + tl.arange(0, BLK)
    m = offs < N
    key = tl.load(ids_ptr + offs, mask=m, other=-2).to(tl.int32) + 1
    key = tl.where(m & (key >= 0) & (key <= E), key, -1)
    return offs, key


@triton.jit(noinline=True)  # inlined, it pushes the GEMM loops past 255 registers (a stack frame)
def _metadata_item(p0, ids_ptr, blk_ptr, key_start_ptr, key_count_ptr, tile_cum_ptr, num_tiles_ptr,
                   sorted_slot_ptr, inv_slot_ptr, ctr_ptr, N, E, NB, BM,
                   BLK: tl.constexpr, KB: tl.constexpr, CB: tl.constexpr):
    """Phase-0 ticket p0 (< 2NB+1). blk [NB, E+1] holds the block histograms (0a), which 0b turns
    into each block's exclusive prefix per key; 0c ranks the block's slots by one in-register sort of
    its (key, slot) pairs: a histogram and a sort, not one-hot sums, which took 5 to 20 times longer per
    block on the H200 at E=128 (benchmarks/RESULTS.md, "The metadata by histogram + sort")."""
    bins = tl.arange(0, KB)
    is_key = bins <= E
    if p0 < NB:  # 0a: histogram of block p0
        offs, key = _block_keys(ids_ptr, p0, N, E, BLK)
        cnt = tl.histogram(tl.where(key >= 0, key, 0), KB, mask=key >= 0)
        tl.store(blk_ptr + p0 * (E + 1) + bins, cnt, mask=is_key)
        _publish(ctr_ptr + CTR_0A)
    elif p0 == NB:  # 0b: prefixes over blocks, key starts, tiles per expert
        _wait_geq(ctr_ptr + CTR_0A, NB)
        tl.debug_barrier()
        run = tl.zeros((KB,), dtype=tl.int32)
        for b0 in range(0, NB, CB):
            bs = b0 + tl.arange(0, CB)
            m = (bs < NB)[:, None] & is_key[None, :]
            ptrs = blk_ptr + bs[:, None] * (E + 1) + bins[None, :]
            cnt = tl.load(ptrs, mask=m, other=0, cache_modifier=".cg")
            incl = tl.cumsum(cnt, axis=0)
            tl.store(ptrs, run[None, :] + incl - cnt, mask=m)
            run += tl.sum(cnt, axis=0)
        start = tl.cumsum(run, axis=0) - run  # key 0 (dropped slots) first
        tl.store(key_start_ptr + bins, start, mask=is_key)
        tl.store(key_count_ptr + bins, run, mask=is_key)
        # expert e = key e+1: tiles per expert, inclusive cumsum over experts
        tiles = tl.where((bins >= 1) & is_key, (run + BM - 1) // BM, 0)
        tcum = tl.cumsum(tiles, axis=0)
        tl.store(tile_cum_ptr + bins - 1, tcum, mask=(bins >= 1) & is_key)
        tl.store(num_tiles_ptr, tl.sum(tiles, axis=0))
        _publish(ctr_ptr + CTR_0B)
    else:  # 0c: sorted rows of block b's slots
        b = p0 - NB - 1
        _wait_geq(ctr_ptr + CTR_0B, 1)
        tl.debug_barrier()
        base = tl.load(blk_ptr + b * (E + 1) + bins, mask=is_key, other=0, cache_modifier=".cg") + \
            tl.load(key_start_ptr + bins, mask=is_key, other=0, cache_modifier=".cg")
        # sorted by (key, slot), the block's p-th pair goes to row base[key] + p - first[key],
        # first[key] = the pairs of smaller keys in the block. (base - first) per key goes through
        # the block's own blk row (read by this item only) so each pair can gather it.
        offs, key = _block_keys(ids_ptr, b, N, E, BLK)
        ok = key >= 0
        cnt = tl.histogram(tl.where(ok, key, 0), KB, mask=ok)
        tl.debug_barrier()  # every thread has read the row (base) before it is overwritten
        tl.store(blk_ptr + b * (E + 1) + bins, base - (tl.cumsum(cnt, axis=0) - cnt), mask=is_key)
        tl.debug_barrier()
        pairs = tl.sort(tl.where(ok, key * BLK + (offs - b * BLK), KB * BLK))
        skey = pairs // BLK
        sok = skey < KB
        sslot = b * BLK + pairs % BLK
        row = tl.load(blk_ptr + b * (E + 1) + skey, mask=sok, other=0, cache_modifier=".cg") + tl.arange(0, BLK)
        tl.store(sorted_slot_ptr + row, sslot, mask=sok)
        tl.store(inv_slot_ptr + sslot, row, mask=sok)
        _publish(ctr_ptr + CTR_0C)


@triton.jit(noinline=True)  # inlined, it would spill the GEMM loops' registers
def _ep_dispatch_item(b, ep_ptr, xs_ptr, ids_src_ptr, tw_src_ptr, ctr_ptr, RANK, W, L, H, TS, SK, TMK,
                      BT: tl.constexpr, BH: tl.constexpr):
    """EP dispatch of source slots [b*BT, (b+1)*BT): into every rank d's receive buffers at rows
    RANK*TMK + slot, the local expert id (-1 where d does not own the slot's expert, and for the
    slots past this call's TS*SK), and where d owns it the routing weight and the token row."""
    sl = b * BT + tl.arange(0, BT)
    smask = sl < TMK
    live = sl < TS * SK
    gid = tl.load(ids_src_ptr + sl, mask=live, other=-1).to(tl.int32)
    gid = tl.where((gid >= 0) & (gid < L * W), gid, -1)
    owner = tl.where(gid >= 0, gid // L, -1)
    w = tl.load(tw_src_ptr + sl, mask=live, other=0.0)
    tok = (sl // SK).to(tl.int64)
    row = (RANK * TMK + sl).to(tl.int64)
    for d in range(0, W):
        mine = smask & (owner == d)
        tl.store(_ep_addr(ep_ptr, EP_RECV_ID, d, W, tl.int32) + row, tl.where(owner == d, gid - d * L, -1), mask=smask)
        tl.store(_ep_addr(ep_ptr, EP_RECV_W, d, W, tl.float32) + row, w, mask=mine)
        xd = _ep_addr(ep_ptr, EP_RECV_X, d, W, xs_ptr.dtype.element_ty)
        for h0 in range(0, H, BH):
            hs = h0 + tl.arange(0, BH)
            m = mine[:, None] & (hs < H)[None, :]
            v = tl.load(xs_ptr + tok[:, None] * H + hs[None, :], mask=m, other=0.0)
            tl.store(xd + row[:, None] * H + hs[None, :], v, mask=m)
    _publish_sys(ctr_ptr + CTR_D)


@triton.jit
def _combine_tokens(blk, rows_ptr, ids_ptr, y_ptr, T, K, E_ALL, H, ep_ptr, RANK, W, TMK,
                    BT: tl.constexpr, BH: tl.constexpr, EP: tl.constexpr):
    """Phase 3 for tokens [blk*BT, (blk+1)*BT): each token's K slot rows (already weighted) summed in
    slot order in fp32 into y. The rows of slot sl: rows_ptr[sl]; with EP, row RANK*TMK + sl of the
    result buffer of the rank owning the slot's expert (E_ALL // W experts per rank)."""
    toks = blk * BT + tl.arange(0, BT)
    tmask = toks < T
    for h0 in range(0, H, BH):
        hs = h0 + tl.arange(0, BH)
        m = tmask[:, None] & (hs < H)[None, :]
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for j in range(0, K):
            sl = toks.to(tl.int64) * K + j
            idj = tl.load(ids_ptr + sl, mask=tmask, other=-1)
            valid = (idj >= 0) & (idj < E_ALL)
            if EP:
                owner = tl.where(valid, idj // (E_ALL // W), 0).to(tl.int32)
                src = _ep_addr(ep_ptr, EP_OUT, owner, W, y_ptr.dtype.element_ty)[:, None] + \
                    (RANK * TMK + sl)[:, None] * H + hs[None, :]
            else:
                src = rows_ptr + sl[:, None] * H + hs[None, :]
            v = tl.load(src, mask=m & valid[:, None], other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
        tl.store(y_ptr + toks[:, None] * H + hs[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit(noinline=True)  # inlined, it would spill the GEMM loops' registers
def _ep_combine_item(blk, ep_ptr, ids_src_ptr, y_ptr, RANK, W, L, TS, SK, TMK, H,
                     BT: tl.constexpr, BH: tl.constexpr):
    """EP combine of the rank's own tokens: their rows come from the owners' EP_OUT buffers."""
    _combine_tokens(blk, y_ptr, ids_src_ptr, y_ptr, TS, SK, L * W, H, ep_ptr, RANK, W, TMK, BT, BH, True)


@triton.jit
def _ep_dispatch(t, ND, PD, EPOCH, ep_ptr, xs_ptr, ids_src_ptr, tw_src_ptr, ctr_ptr, RANK, W, L, H, TS, SK, TMK,
                 BT: tl.constexpr, BH: tl.constexpr):
    """EP tickets [0, PD = ND + 1): dispatch items, then (ticket ND) the dispatch signal. Returns the
    first ticket past them this program takes."""
    while t < PD:
        if t < ND:
            _ep_dispatch_item(t, ep_ptr, xs_ptr, ids_src_ptr, tw_src_ptr, ctr_ptr, RANK, W, L, H, TS, SK, TMK, BT, BH)
        else:  # every block sent: tell each owner its rows from this rank are there
            _wait_geq(ctr_ptr + CTR_D, ND)
            for d in range(0, W):
                tl.atomic_xchg(_ep_addr(ep_ptr, EP_DSIG, d, W, tl.int64) + RANK, EPOCH, sem="release", scope="sys")
        t = tl.atomic_add(ctr_ptr + CTR_TICKET, 1)
    return t


@triton.jit
def _tile_rows(tile, bins, tile_cum_ptr, key_start_ptr, key_count_ptr, sorted_slot_ptr, E, K, BM: tl.constexpr):
    """Row tile `tile` (< R): its expert (int32 and int64), sorted rows, row mask, slots and tokens."""
    # the tile's expert, from the inclusive cumsum of tiles per expert
    tc = tl.load(tile_cum_ptr + bins, mask=bins < E, other=2147483647, cache_modifier=".cg")
    e32 = tl.sum((tc <= tile).to(tl.int32), axis=0)
    first = tl.sum(tl.where(bins == e32 - 1, tc, 0), axis=0)
    e = e32.to(tl.int64)
    est = tl.load(key_start_ptr + e32 + 1, cache_modifier=".cg")
    ecnt = tl.load(key_count_ptr + e32 + 1, cache_modifier=".cg")
    row0 = est + (tile - first) * BM
    rows32 = row0 + tl.arange(0, BM)
    rmask = rows32 < est + ecnt
    rows = rows32.to(tl.int64)
    slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0, cache_modifier=".cg").to(tl.int64)
    return e32, e, rows, rmask, slot, slot // K


@triton.jit
def _gemm1(acc_g, acc_u, acc_d, x_ptr, dy_ptr, w13_e, w2_ptr, w13_d1, w2_d1, e, e32, tok, rmask, cols, cmask, sub,
           H, I, BN1: tl.constexpr, BK1: tl.constexpr, IS_BWD: tl.constexpr, GU: tl.constexpr,
           TMA_W: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Phase 1's loop over H for one (tile, column block), accumulated in fp32: (gate, up) += x W13[e]^T
    (w13_e: expert e's rows), unless the backward reads them (GU); the backward's dA += dy W2[e] (before
    the routing weight)."""
    for k0 in range(0, H, BK1):
        ks = k0 + tl.arange(0, BK1)
        kmask = ks < H
        bmask = kmask[:, None] & cmask[None, :]
        if not (IS_BWD and GU):  # GEMM1 (the backward without GU recomputes it)
            a = tl.load(x_ptr + tok[:, None] * H + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            if TMA_W:
                bg = w13_d1.load([e32, 0, sub * BN1, k0]).reshape(BN1, BK1).T
                bu = w13_d1.load([e32, 1, sub * BN1, k0]).reshape(BN1, BK1).T
            else:
                bg = tl.load(w13_e + cols[None, :] * H + ks[:, None], mask=bmask, other=0.0)
                bu = tl.load(w13_e + (I + cols[None, :]) * H + ks[:, None], mask=bmask, other=0.0)
            acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
        if IS_BWD:
            d = tl.load(dy_ptr + tok[:, None] * H + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            if TMA_W:
                bw = w2_d1.load([e32, k0, sub * BN1]).reshape(BK1, BN1)
            else:
                bw = tl.load(w2_ptr + e * (H * I) + ks[:, None] * I + cols[None, :], mask=bmask, other=0.0)
            acc_d = tl.dot(d, bw, acc_d, input_precision=DOT_PRECISION)
    return acc_g, acc_u, acc_d


@triton.jit
def _act_fwd(g, u, ALPHA, LIMIT, ACT: tl.constexpr, dtype: tl.constexpr):
    """The activation of fp32 (gate, up) (megamoe/activation.py): (h rounded to dtype, the gate's
    sigmoid, the clamped gate and up; ACT 0: the unclamped ones)."""
    if ACT == 0:  # silu(gate) * up
        sg = 1.0 / (1.0 + tl.exp(-g))
        h = (g * sg * u).to(dtype)
        gc = g
        uc = u
    else:  # gpt-oss: g' = min(g, limit), u' = clamp(u, -limit, limit); NaN stays NaN (torch.clamp)
        gc = tl.minimum(g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
        uc = tl.minimum(tl.maximum(u, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                        propagate_nan=tl.PropagateNan.ALL)
        sg = 1.0 / (1.0 + tl.exp(-(ALPHA * gc)))
        h = ((uc + 1.0) * (gc * sg)).to(dtype)
    return h, sg, gc, uc


@triton.jit
def _act_bwd(da, g, u, sg, gc, uc, ALPHA, LIMIT, ACT: tl.constexpr):
    """d(gate), d(up) from dh = da, with _act_fwd's sigmoid and clamped values."""
    if ACT == 0:
        dgate = da * u * sg * (1.0 + g * (1.0 - sg))
        dup = da * g * sg
    else:  # torch's clamp gradient: passed where the input is within the bounds
        dgate = tl.where(g <= LIMIT, da * (uc + 1.0) * sg * (1.0 + ALPHA * gc * (1.0 - sg)), 0.0)
        dup = tl.where((u >= -LIMIT) & (u <= LIMIT), da * (gc * sg), 0.0)
    return dgate, dup


@triton.jit
def _backward_da(acc_g, acc_u, acc_d, h, sg, gc, uc, tw_ptr, dy_ptr, b2_ptr, dtw_part_ptr, act_ptr, hw_ptr,
                 e, tok, slot, rows, rmask, cols, omask, sub, H, I, n1, ALPHA, LIMIT,
                 BK1: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr):
    """The backward's phase-1 stores from dA = dy W2[e] (acc_d): the partial dot of d(topk_weight),
    d(gate, up) and the weighted activation w * h for dW2."""
    dtype = act_ptr.dtype.element_ty
    w = tl.load(tw_ptr + slot, mask=rmask, other=0.0).to(tl.float32)
    # d(topk_weight) = dy . (W2 h + b2) = (W2^T dy) . h + dy . b2, with h rounded as in the forward;
    # the bias dot belongs to column block 0
    part = tl.sum(acc_d * h.to(tl.float32), axis=1)
    if BIAS:
        if sub == 0:
            # its own loop over H, outside the pipelined GEMM loop (inside it, the saved-(gate, up)
            # TMA variant computed wrong d(gate, up) on the H200; the extra read is one pass over
            # the tile's dy rows)
            for kb in range(0, H, BK1):
                ksb = kb + tl.arange(0, BK1)
                db = tl.load(dy_ptr + tok[:, None] * H + ksb[None, :], mask=rmask[:, None] & (ksb < H)[None, :],
                             other=0.0)
                bb = tl.load(b2_ptr + e * H + ksb, mask=ksb < H, other=0.0)
                part += tl.sum(db.to(tl.float32) * bb.to(tl.float32)[None, :], axis=1)
    tl.store(dtw_part_ptr + rows * n1 + sub, part, mask=rmask)
    dgate, dup = _act_bwd(acc_d * w[:, None], acc_g, acc_u, sg, gc, uc, ALPHA, LIMIT, ACT)
    tl.store(act_ptr + rows[:, None] * (2 * I) + cols[None, :], dgate.to(dtype), mask=omask)
    tl.store(act_ptr + rows[:, None] * (2 * I) + I + cols[None, :], dup.to(dtype), mask=omask)
    tl.store(hw_ptr + rows[:, None] * I + cols[None, :], (h.to(tl.float32) * w[:, None]).to(dtype), mask=omask)


@triton.jit
def _gemm1_item(tile, sub, e, e32, rows, rmask, slot, tok, x_ptr, dy_ptr, w13_ptr, w2_ptr, w13_d1, w2_d1, tw_ptr,
                b13_ptr, b2_ptr, gu_ptr, act_ptr, hw_ptr, dtw_part_ptr, tile_done_ptr, H, I, n1, ALPHA, LIMIT,
                IS_BWD: tl.constexpr, GU: tl.constexpr, TMA_W: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr,
                BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Phase-1 item (tile, column block sub of I): GEMM1 and the activation; the forward stores h
    (and with GU the rounded (gate, up)), the backward d(gate, up) (_backward_da)."""
    dtype = x_ptr.dtype.element_ty
    cols = sub * BN1 + tl.arange(0, BN1)
    cmask = cols < I
    acc_g = tl.zeros((BM, BN1), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN1), dtype=tl.float32)
    acc_d = tl.zeros((BM, BN1), dtype=tl.float32)
    w13_e = w13_ptr + e * (2 * I * H)
    omask = rmask[:, None] & cmask[None, :]
    gu_rows = gu_ptr + rows[:, None] * (2 * I) + cols[None, :]
    acc_g, acc_u, acc_d = _gemm1(acc_g, acc_u, acc_d, x_ptr, dy_ptr, w13_e, w2_ptr, w13_d1, w2_d1, e, e32, tok, rmask,
                                 cols, cmask, sub, H, I, BN1, BK1, IS_BWD, GU, TMA_W, DOT_PRECISION)
    if BIAS and not (IS_BWD and GU):
        bg = tl.load(b13_ptr + e * (2 * I) + cols, mask=cmask, other=0.0).to(tl.float32)
        bu = tl.load(b13_ptr + e * (2 * I) + I + cols, mask=cmask, other=0.0).to(tl.float32)
        acc_g += bg[None, :]
        acc_u += bu[None, :]
    if IS_BWD:
        # the backward differentiates at (gate, up) rounded to the input dtype, whether saved by the
        # forward or recomputed: one semantics
        if GU:
            acc_g = tl.load(gu_rows, mask=omask, other=0.0).to(tl.float32)
            acc_u = tl.load(gu_rows + I, mask=omask, other=0.0).to(tl.float32)
        else:
            acc_g = acc_g.to(dtype).to(tl.float32)
            acc_u = acc_u.to(dtype).to(tl.float32)
    elif GU:
        tl.store(gu_rows, acc_g.to(dtype), mask=omask)
        tl.store(gu_rows + I, acc_u.to(dtype), mask=omask)
    h, sg, gc, uc = _act_fwd(acc_g, acc_u, ALPHA, LIMIT, ACT, dtype)
    if IS_BWD:
        _backward_da(acc_g, acc_u, acc_d, h, sg, gc, uc, tw_ptr, dy_ptr, b2_ptr, dtw_part_ptr, act_ptr, hw_ptr,
                     e, tok, slot, rows, rmask, cols, omask, sub, H, I, n1, ALPHA, LIMIT, BK1, BIAS, ACT)
    else:
        tl.store(act_ptr + rows[:, None] * I + cols[None, :], h, mask=omask)
    _publish(tile_done_ptr + tile)


@triton.jit
def _gemm2_item(sub, e, e32, rows, rmask, slot, act_ptr, w13_ptr, w2_ptr, w_d2, b2_ptr, tw_ptr, slot_out_ptr,
                ctr_ptr, H, I, KA, IS_BWD: tl.constexpr, TMA_W: tl.constexpr, BIAS: tl.constexpr, EP: tl.constexpr,
                BM: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Phase-2 item (tile, column block sub of H), once the tile's phase-1 items are done: the
    forward's h W2[e]^T (plus b2) times the routing weight, the backward's d(gate, up) [W1; W3][e],
    into the slots' rows. KA: the contraction, I (forward) or 2I (backward: [dgate, dup] against [G; U])."""
    cols2 = sub * BN2 + tl.arange(0, BN2)
    cmask2 = cols2 < H
    acc2 = tl.zeros((BM, BN2), dtype=tl.float32)
    for k02 in range(0, KA, BK2):
        ks2 = k02 + tl.arange(0, BK2)
        kmask2 = ks2 < KA
        a2 = tl.load(act_ptr + rows[:, None] * KA + ks2[None, :], mask=rmask[:, None] & kmask2[None, :], other=0.0,
                     cache_modifier=".cg")
        bmask2 = kmask2[:, None] & cmask2[None, :]
        if TMA_W:
            if IS_BWD:
                b2 = w_d2.load([e32, k02, sub * BN2]).reshape(BK2, BN2)
            else:
                b2 = w_d2.load([e32, sub * BN2, k02]).reshape(BN2, BK2).T
        elif IS_BWD:
            b2 = tl.load(w13_ptr + e * (2 * I * H) + ks2[:, None] * H + cols2[None, :], mask=bmask2, other=0.0)
        else:
            b2 = tl.load(w2_ptr + e * (H * I) + cols2[None, :] * I + ks2[:, None], mask=bmask2, other=0.0)
        acc2 = tl.dot(a2, b2, acc2, input_precision=DOT_PRECISION)
    if not IS_BWD:
        if BIAS:
            acc2 += tl.load(b2_ptr + e * H + cols2, mask=cmask2, other=0.0).to(tl.float32)[None, :]
        acc2 = acc2 * tl.load(tw_ptr + slot, mask=rmask, other=0.0).to(tl.float32)[:, None]
    # EP: slot_out is this rank's symmetric result buffer [W * TMK, H]; the sources read their rows
    # from it (a per-row remote base here would spill)
    tl.store(slot_out_ptr + slot[:, None] * H + cols2[None, :], acc2.to(slot_out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask2[None, :])
    if EP:
        _publish_sys(ctr_ptr + CTR_P2)
    else:
        _publish(ctr_ptr + CTR_P2)


@triton.jit
def _dtw_item(blk, ids_ptr, inv_slot_ptr, dtw_part_ptr, dtw_ptr, T, K, E, n1, BT: tl.constexpr):
    """The backward's phase 3, tokens [blk*BT, (blk+1)*BT): d(topk_weights), each slot's partial
    dots summed in column-block order."""
    toks = blk * BT + tl.arange(0, BT)
    tmask = toks < T
    for j in range(0, K):
        sl = toks.to(tl.int64) * K + j
        idj = tl.load(ids_ptr + sl, mask=tmask, other=-1)
        valid = tmask & (idj >= 0) & (idj < E)
        row = tl.load(inv_slot_ptr + sl, mask=valid, other=0, cache_modifier=".cg").to(tl.int64)
        d = tl.zeros((BT,), dtype=tl.float32)
        for c in range(0, n1):
            d += tl.load(dtw_part_ptr + row * n1 + c, mask=valid, other=0.0, cache_modifier=".cg")
        tl.store(dtw_ptr + sl, d, mask=tmask)


@triton.jit
def _ep_result_item(blk, R, n2, EPOCH, ep_ptr, ep_err_ptr, ids_src_ptr, y_ptr, ctr_ptr, RANK, W, L, TS, SK, TMK, H,
                    SPIN_MAX, BT: tl.constexpr, BH: tl.constexpr, POLL_NS: tl.constexpr):
    """EP phase 3: item 0 tells every source its result rows are stored, once every phase-2 item is
    done; item blk > 0 waits for every owner's signal, then combines the rank's tokens block blk - 1."""
    if blk == 0:
        _wait_geq(ctr_ptr + CTR_P2, R * n2)
        for s in range(0, W):
            tl.atomic_xchg(_ep_addr(ep_ptr, EP_CSIG, s, W, tl.int64) + RANK, EPOCH, sem="release", scope="sys")
    else:
        _ep_wait_all(_ep_addr(ep_ptr, EP_CSIG, RANK, W, tl.int64), W, EPOCH, SPIN_MAX, ep_err_ptr, 2, POLL_NS)
        tl.debug_barrier()
        _ep_combine_item(blk - 1, ep_ptr, ids_src_ptr, y_ptr, RANK, W, L, TS, SK, TMK, H, BT, BH)


@triton.jit
def _trace_store(trace_ptr, t, t_start, t_ready, code, CLOCK: tl.constexpr):
    rec = trace_ptr + t.to(tl.int64) * 4
    tl.store(rec, t_start)
    tl.store(rec + 1, t_ready)
    tl.store(rec + 2, _trace_time(t, CLOCK))
    tl.store(rec + 3, tl.program_id(0).to(tl.int64) * 16 + code)


@triton.jit
def _leave(ctr_ptr, tile_done_ptr, num_tiles_ptr, ep_epoch_ptr, EPOCH, EP: tl.constexpr):
    """Leave the workspace as found: the last program out clears every counter (and, EP, stores
    the call's epoch)."""
    n_out = tl.atomic_add(ctr_ptr + CTR_OUT, 1, sem="acq_rel")
    if n_out == tl.num_programs(0) - 1:
        R_last = tl.load(num_tiles_ptr, cache_modifier=".cg")
        for r0 in range(0, R_last, 1024):
            rr = r0 + tl.arange(0, 1024)
            tl.store(tile_done_ptr + rr, tl.zeros((1024,), dtype=tl.int32), mask=rr < R_last)
        for c in tl.static_range(1, CTR_SLOTS):
            tl.atomic_xchg(ctr_ptr + c, 0)
        if EP:
            tl.atomic_xchg(ep_epoch_ptr, EPOCH)
        tl.atomic_xchg(ctr_ptr + CTR_TICKET, 0)  # the ticket counter last


@triton.jit(do_not_specialize=["T", "N", "LAG", "R_MAX", "NB", "RANK", "W", "TS", "SK", "TMK", "SPIN_MAX"])
def _moe_persistent_kernel(
    # inputs
    x_ptr, w13_ptr, w2_ptr, tw_ptr, ids_ptr, dy_ptr,
    b13_ptr, b2_ptr,  # BIAS: the experts' biases [E, 2I] (gate, then up) and [E, H], else unused
    # TMA_W: host TMA descriptors of the weights (else unused): w13_d1 = w13 as [E, 2, I, H], block
    # [1, 1, BN1, BK1] (phase 1's gate and up); w2_d1 = w2 [E, H, I], block [1, BK1, BN1] (the
    # backward's phase 1); w_d2 = phase 2's weight: forward w2 [E, H, I], block [1, BN2, BK2];
    # backward w13 [E, 2I, H], block [1, BK2, BN2]. Per-expert bounds: out-of-range reads are zero.
    w13_d1, w2_d1, w_d2,
    # routing metadata, written by phase 0 (int32)
    sorted_slot_ptr, inv_slot_ptr, key_start_ptr, key_count_ptr, tile_cum_ptr, num_tiles_ptr, blk_ptr,
    # workspaces / outputs
    act_ptr,      # fwd: h [N, I] (sorted rows); bwd: dgu [N, 2I] (sorted rows)
    hw_ptr,       # bwd: w * h [N, I] (sorted rows), for dW2
    gu_ptr,       # GU: (gate, up) [N, 2I] (sorted rows): written by the forward, read by the backward
    dtw_part_ptr,  # bwd: [N, n1] fp32 partial dots for d(topk_weights) (sorted rows)
    dtw_ptr,      # bwd: [N] fp32 d(topk_weights) (slot order)
    slot_out_ptr,  # [N, H] per-slot rows (indexed by slot)
    out_ptr,      # [T, H]
    ctr_ptr,      # int32 [CTR_SLOTS]: counters (see CTR_*)
    tile_done_ptr,  # int32 [R_MAX]: phase-1 items finished per tile
    ep_ptr,       # EP: int64 [EP_ROWS, W] addresses of every rank's buffers (see EP_*)
    ep_err_ptr,   # EP: int32 [2] time-out record (signal code, pad entry), 0 = none
    ep_epoch_ptr,  # EP: int64 [1] the last call's epoch; this call's is one more (stored by the last program out)
    xs_ptr, ids_src_ptr, tw_src_ptr, y_ptr,  # EP: the rank's own tokens [TS, H], [TS, SK] routing, y [TS, H]
    trace_ptr,    # TRACE: int64 [tickets, 4] per ticket (see TRACE), else unused
    T, N, E, H, I, K, LAG, R_MAX, NB,
    RANK, W, TS, SK, TMK, SPIN_MAX,  # EP: rank, ranks, own tokens, top-k, rows per source, polls per wait
    ALPHA, LIMIT,  # ACT == 1: the clamped SwiGLU's alpha and limit (fp32), else unused
    IS_BWD: tl.constexpr, GU: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
    BN2: tl.constexpr, BK2: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    BLK: tl.constexpr, KB: tl.constexpr, CB: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EP: tl.constexpr = False, TMA_W: tl.constexpr = False, GT: tl.constexpr = 1,
    POLL_NS: tl.constexpr = 0,  # EP: least ns between two polls of a signal pad (_ep_wait_all)
    # a timeline for benchmarks (megamoe.fused.launch_persistent's `trace`): each ticket t (counted from the
    # first non-EP ticket) stores [start, after its wait, end, program * 16 + kind code] into
    # trace_ptr[t]; times from %globaltimer in ns with CLOCK, else (the interpreter, which has no
    # clock) the ticket's own number, so that tests can check the records' order and kinds
    TRACE: tl.constexpr = False, CLOCK: tl.constexpr = False,
    # the experts' biases added to both GEMMs' fp32 accumulators (megamoe.contract), and the
    # activation: 0 silu(gate) * up, 1 gpt-oss's clamped SwiGLU (_act_fwd)
    BIAS: tl.constexpr = False, ACT: tl.constexpr = 0,
):
    n1 = tl.cdiv(I, BN1)
    n2 = tl.cdiv(H, BN2)
    P0 = 2 * NB + 1
    if EP:
        # tickets [0, ND) dispatch blocks of BT source slots, ND the dispatch signal, then the rest
        ND = tl.cdiv(TMK, BT)
        PD = ND + 1
        # read by every program before any program can finish, so before the last one out stores it:
        # the epoch lives on the device, so a CUDA-graph replay advances it too
        EPOCH = tl.load(ep_epoch_ptr) + 1
        total = PD + P0 + R_MAX * (n1 + n2) + 1 + tl.cdiv(TS, BT)
    else:
        PD = 0
        EPOCH = 0
        total = P0 + R_MAX * (n1 + n2) + tl.cdiv(T, BT)
    KA = I
    if IS_BWD:
        KA = 2 * I
    bins = tl.arange(0, KB)

    R = tl.full([], -1, tl.int32)   # valid tiles; read once phase 0 is done
    t = tl.atomic_add(ctr_ptr + CTR_TICKET, 1)
    if EP:
        t = _ep_dispatch(t, ND, PD, EPOCH, ep_ptr, xs_ptr, ids_src_ptr, tw_src_ptr, ctr_ptr, RANK, W, E, H, TS, SK, TMK,
                         BT, BH)
        if t < total:  # every source's rows must have arrived before the routing metadata reads them
            _ep_wait_all(_ep_addr(ep_ptr, EP_DSIG, RANK, W, tl.int64), W, EPOCH, SPIN_MAX, ep_err_ptr, 1, POLL_NS)
    while t < total:
        t = t - PD
        if TRACE:
            t_start = _trace_time(t, CLOCK)
            t_ready = t_start
            code = tl.full([], 0, tl.int32)  # 0 phase 0, 1 GEMM1, 2 GEMM2, 3 combine; +4: a tile past R
        if t < P0:
            _metadata_item(t, ids_ptr, blk_ptr, key_start_ptr, key_count_ptr, tile_cum_ptr, num_tiles_ptr,
                           sorted_slot_ptr, inv_slot_ptr, ctr_ptr, N, E, NB, BM, BLK, KB, CB)
        else:
            if R < 0:
                _wait_geq(ctr_ptr + CTR_0C, NB)
                tl.debug_barrier()
                R = tl.load(num_tiles_ptr, cache_modifier=".cg")
                if TRACE:
                    t_ready = _trace_time(t, CLOCK)
            kind, tile, sub = _decode_ticket(t - P0, R_MAX, LAG, n1, n2, GT)
            if TRACE:
                code = kind + tl.where((kind < 3) & (tile >= R), 4, 0)
            if kind < 3:
                if tile < R:
                    e32, e, rows, rmask, slot, tok = _tile_rows(tile, bins, tile_cum_ptr, key_start_ptr, key_count_ptr,
                                                                sorted_slot_ptr, E, K, BM)
                    if kind == 1:
                        _gemm1_item(tile, sub, e, e32, rows, rmask, slot, tok, x_ptr, dy_ptr, w13_ptr, w2_ptr, w13_d1,
                                    w2_d1, tw_ptr, b13_ptr, b2_ptr, gu_ptr, act_ptr, hw_ptr, dtw_part_ptr,
                                    tile_done_ptr, H, I, n1, ALPHA, LIMIT, IS_BWD, GU, TMA_W, BIAS, ACT, BM, BN1, BK1,
                                    DOT_PRECISION)
                    else:
                        _wait_geq(tile_done_ptr + tile, n1)
                        tl.debug_barrier()
                        if TRACE:
                            t_ready = _trace_time(t, CLOCK)
                        _gemm2_item(sub, e, e32, rows, rmask, slot, act_ptr, w13_ptr, w2_ptr, w_d2, b2_ptr, tw_ptr,
                                    slot_out_ptr, ctr_ptr, H, I, KA, IS_BWD, TMA_W, BIAS, EP, BM, BN2, BK2,
                                    DOT_PRECISION)
            elif EP:
                _ep_result_item(tile, R, n2, EPOCH, ep_ptr, ep_err_ptr, ids_src_ptr, y_ptr, ctr_ptr, RANK, W, E, TS, SK,
                                TMK, H, SPIN_MAX, BT, BH, POLL_NS)
            else:
                _wait_geq(ctr_ptr + CTR_P2, R * n2)
                tl.debug_barrier()
                if TRACE:
                    t_ready = _trace_time(t, CLOCK)
                _combine_tokens(tile, slot_out_ptr, ids_ptr, out_ptr, T, K, E, H, ep_ptr, 0, 1, 0, BT, BH, False)
                if IS_BWD:
                    _dtw_item(tile, ids_ptr, inv_slot_ptr, dtw_part_ptr, dtw_ptr, T, K, E, n1, BT)
        if TRACE:
            _trace_store(trace_ptr, t, t_start, t_ready, code, CLOCK)
        t = tl.atomic_add(ctr_ptr + CTR_TICKET, 1)
    _leave(ctr_ptr, tile_done_ptr, num_tiles_ptr, ep_epoch_ptr, EPOCH, EP)


@triton.jit
def _gather_token_rows_kernel(x_ptr, dy_ptr, sorted_slot_ptr, xs_ptr, dys_ptr, N, H, K,
                              BR: tl.constexpr, BH: tl.constexpr):
    """xs[r] = x[t(r)], dys[r] = dy[t(r)] with t(r) = sorted_slot[r] // K: the weight gradients'
    token rows in the sorted order, so that every operand of _moe_bwd_dw_kernel is contiguous."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < N
    src = (tl.load(sorted_slot_ptr + r, mask=rmask, other=0) // K).to(tl.int64) * H
    dst = r.to(tl.int64) * H
    for h0 in range(0, H, BH):
        hs = h0 + tl.arange(0, BH)
        m = rmask[:, None] & (hs < H)[None, :]
        tl.store(xs_ptr + dst[:, None] + hs[None, :], tl.load(x_ptr + src[:, None] + hs[None, :], mask=m), mask=m)
        tl.store(dys_ptr + dst[:, None] + hs[None, :], tl.load(dy_ptr + src[:, None] + hs[None, :], mask=m), mask=m)


@triton.jit
def _dw_tile(I, H, expert_start_ptr, expert_count_ptr, BMW: tl.constexpr, BNW: tl.constexpr):
    """This program's weight-gradient tile: (expert e, its first sorted row, its row count, whether
    a dW13 tile, first row m0, first column n0). Per expert, tiles [0, n13) are dW13's [2I, H] tiles,
    then dW2's as [I, H] tiles (transposed), each kind row-major over [BMW, BNW] blocks."""
    tile = tl.program_id(0)
    n_n = tl.cdiv(H, BNW)
    n13 = tl.cdiv(2 * I, BMW) * n_n
    per_e = n13 + tl.cdiv(I, BMW) * n_n
    e = tile // per_e
    q = tile % per_e
    start = tl.load(expert_start_ptr + e)
    count = tl.load(expert_count_ptr + e)
    is13 = q < n13
    qq = tl.where(is13, q, q - n13)
    return e, start, count, is13, (qq // n_n) * BMW, (qq % n_n) * BNW


@triton.jit
def _dw_operands(is13, dgu_ptr, hw_ptr, b13_ptr, b2_ptr, I):
    """A weight-gradient tile's operands: (A base, B base, A's columns). A: the sorted rows of dgu
    [N, 2I] (dW13) or hw [N, I] (dW2); B: the [N, H] token rows (x / dy or their sorted copies).
    The bases may be pointers or TMA descriptors of those tensors."""
    a_cols = tl.where(is13, 2 * I, I)
    if is13:
        a_base = dgu_ptr
        b_base = b13_ptr
    else:
        a_base = hw_ptr
        b_base = b2_ptr
    return a_base, b_base, a_cols


@triton.jit
def _dw_store(acc, e, is13, om, on, omask, dw13_ptr, dw2_ptr, H, I):
    """A finished weight-gradient tile (rows om, columns on of its kind) into dW13[e] [2I, H], or
    as the [I, H] tile of dW2[e] [H, I] stored transposed."""
    if is13:
        tl.store(dw13_ptr + e.to(tl.int64) * (2 * I * H) + om[:, None] * H + on[None, :],
                 acc.to(dw13_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(dw2_ptr + e.to(tl.int64) * (H * I) + on[None, :] * I + om[:, None],
                 acc.to(dw2_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _dw_full_blocks(a_desc, b_desc, start, full, m0, n0, acc, BKR: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += A^T B over the expert's whole K blocks, rows [start, start + full), through TMA
    descriptors over all N sorted rows (made on the host once per launch)."""
    for r0 in range(0, full, BKR):
        a = a_desc.load([start + r0, m0])
        b = b_desc.load([start + r0, n0])
        acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["E"])
def _moe_bwd_dw_kernel(
    xs_ptr, dys_ptr, dgu_ptr, hw_ptr, xs_d, dys_d, dgu_d, hw_d, expert_start_ptr, expert_count_ptr,
    dw13_ptr, dw2_ptr, E, H, I,
    BMW: tl.constexpr, BNW: tl.constexpr, BKR: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Weight gradients, one output tile per program, each summed over its expert's rows in order.

    dW13[e] [2I, H] = dgu_e^T @ xs_e     dW2[e]^T [I, H] = hw_e^T @ dys_e
    with every operand in the sorted row order (xs, dys from _gather_token_rows_kernel), so both
    tile kinds have the same roles: A = [BKR, BMW] rows of dgu or hw, B = [BKR, BNW] rows of xs or
    dys; dW2's [I, H] tiles are stored transposed. Tiles q = [0, n13) of expert e are dW13 tiles,
    [n13, per_e) dW2 tiles. TMA: the expert's whole K blocks through the host's descriptors over
    all N rows (*_d; else those arguments are the tensors and unused), then its last partial block
    (or, without TMA, every block) by masked pointer loads: a descriptor block past the expert's
    end would read the next expert's rows. The same values reach the same dots in the same order
    either way, so the same bits. (Descriptors made on the device per program, over the expert's
    rows only, cost 0.13-0.29 ms per backward at T <= 512 and Qwen3 4096; a persistent variant,
    TMA stores, and larger tiles measured no faster on the H200; gathering x / dy rows through the
    token index in the K loop instead of reading sorted copies cost 1.16-1.32x: benchmarks/RESULTS.md.)
    """
    e, start, count, is13, m0, n0 = _dw_tile(I, H, expert_start_ptr, expert_count_ptr, BMW, BNW)
    om = m0 + tl.arange(0, BMW)
    on = n0 + tl.arange(0, BNW)
    a_base, b_base, a_cols = _dw_operands(is13, dgu_ptr, hw_ptr, xs_ptr, dys_ptr, I)
    mmask = om < a_cols
    nmask = on < H
    a_stride = a_cols.to(tl.int64)
    acc = tl.zeros((BMW, BNW), dtype=tl.float32)
    full = 0
    if TMA:
        full = count - count % BKR
        a_d, b_d, _ = _dw_operands(is13, dgu_d, hw_d, xs_d, dys_d, I)  # the same choice, as descriptors
        acc = _dw_full_blocks(a_d, b_d, start, full, m0, n0, acc, BKR, DOT_PRECISION)
    for r0 in range(full, count, BKR):
        rs = (start + r0 + tl.arange(0, BKR)).to(tl.int64)
        rmask = (r0 + tl.arange(0, BKR)) < count
        a = tl.load(a_base + rs[:, None] * a_stride + om[None, :], mask=rmask[:, None] & mmask[None, :], other=0.0)
        b = tl.load(b_base + rs[:, None] * H + on[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
    _dw_store(acc, e, is13, om, on, mmask[:, None] & nmask[None, :], dw13_ptr, dw2_ptr, H, I)


@triton.jit(do_not_specialize=["E"])
def _moe_bwd_bias_kernel(dgu_ptr, dys_ptr, tw_ptr, sorted_slot_ptr, expert_start_ptr, expert_count_ptr,
                         db13_ptr, db2_ptr, E, H, I, BR: tl.constexpr, BC: tl.constexpr):
    """The experts' bias gradients, one [BC] column block of one expert per program, each summed
    over the expert's sorted rows in order, in fp32 (no atomics):

        db13[e] [2I] = sum_r dgu[r]        db2[e] [H] = sum_r w[slot(r)] * dys[r]

    Programs [0, n13) of expert e are db13's column blocks, then db2's."""
    n13 = tl.cdiv(2 * I, BC)
    per_e = n13 + tl.cdiv(H, BC)
    e = tl.program_id(0) // per_e
    q = tl.program_id(0) % per_e
    start = tl.load(expert_start_ptr + e)
    count = tl.load(expert_count_ptr + e)
    is13 = q < n13
    c0 = tl.where(is13, q, q - n13) * BC
    ncols = tl.where(is13, 2 * I, H)
    cols = c0 + tl.arange(0, BC)
    cmask = cols < ncols
    acc = tl.zeros((BC,), dtype=tl.float32)
    for r0 in range(0, count, BR):
        rs = (start + r0 + tl.arange(0, BR)).to(tl.int64)
        rmask = (r0 + tl.arange(0, BR)) < count
        m = rmask[:, None] & cmask[None, :]
        if is13:
            v = tl.load(dgu_ptr + rs[:, None] * (2 * I) + cols[None, :], mask=m, other=0.0).to(tl.float32)
        else:
            slot = tl.load(sorted_slot_ptr + rs, mask=rmask, other=0)
            w = tl.load(tw_ptr + slot, mask=rmask, other=0.0).to(tl.float32)
            v = tl.load(dys_ptr + rs[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32) * w[:, None]
        acc += tl.sum(v, axis=0)
    if is13:
        tl.store(db13_ptr + e.to(tl.int64) * (2 * I) + cols, acc.to(db13_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(db2_ptr + e.to(tl.int64) * H + cols, acc.to(db2_ptr.dtype.element_ty), mask=cmask)
