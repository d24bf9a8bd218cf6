"""The single-GPU Triton launchers: `launch_persistent` (routing metadata and the whole forward, or
the whole backward but the weight gradients, in one launch) and `launch_dw` (the row gather and the
weight-gradient kernel). `fused_moe_fwd` / `fused_moe_bwd` (megamoe/fused/op.py) call them; tests and
benchmark tools call them directly for the raw launch (no input checks beyond contiguity, the
kernel's internal outputs, the traced variant). Every kernel argument is passed by its name in the
kernel's signature (megamoe/kernels/moe_kernels.py)."""

from __future__ import annotations

import contextlib

import torch

from megamoe import alloc
from megamoe.contract import SILU, SWIGLU, Activation
from megamoe.fused.config import KernelConfig, persistent_stages
from megamoe.fused.kernel_args import (DW_OPERAND_ARGS, WEIGHT_ARGS, bias_grad_constexprs, dw_constexprs, dw_operand_args, dw_through_tma,
                                       next_pow2, persistent_setup, weight_args, weights_through_tma)
from megamoe.fused.workspace import METADATA_ARGS, KernelMeta


@contextlib.contextmanager
def launch_device(dev: torch.device):
    """Around every Triton launch of the op: on CUDA, the launch's device is `dev` and its context is
    bound to the calling thread. Triton launches on the thread's current device and encodes the TMA
    descriptors (tma_weights, dw_tma) through the driver before its launcher binds a context itself;
    autograd runs a backward on a thread of its own, which has no context until some CUDA runtime
    call binds one. So the op's backward as the first node of a backward pass failed with "Failed to
    create tensor map descriptor: invalid device context" (H200, 2026-12-02,
    results/2026-12-02-h200-host-path-tma.log; the same bug in pytorch/pytorch#124565).
    torch.cuda.device switches the device only where it differs; set_device (same device) binds the
    context. A no-op elsewhere (the interpreter on CPU)."""
    if dev.type != "cuda":
        yield
        return
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    with torch.cuda.device(idx):
        torch.cuda.set_device(idx)
        yield


def act_args(b13, act: Activation) -> dict:
    """The persistent kernel's bias and activation arguments: BIAS, ACT (0 silu, 1 clamped SwiGLU),
    ALPHA and LIMIT."""
    if act.name == SILU:
        return dict(BIAS=b13 is not None, ACT=0, ALPHA=0.0, LIMIT=0.0)
    return dict(BIAS=b13 is not None, ACT=1, ALPHA=act.alpha, LIMIT=act.limit)


def launch_persistent(is_bwd: bool, x, w13, w2, tw, ids, dy, T, H, I, E, K, cfg: KernelConfig,  # noqa: E741
                      gu: torch.Tensor | None = None, save_gu: bool = False, trace: dict | None = None,
                      b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      activation: Activation = SWIGLU):
    """One persistent launch: routing metadata, then the forward (or the backward but dW).
    b13 [E, 2I], b2 [E, H]: the experts' biases (both or neither); activation: the contract's.

    Returns (out, act, hw, dtw, meta, gu): out is y [T, H] (forward) or dx [T, H] (backward); act is
    the activation h [N, I] (forward) or d(gate, up) [N, 2I] (backward), hw the weighted activation
    [N, I] (backward; the forward returns act again), dtw d(topk_weights) [N] fp32 (backward; the
    forward returns tw), all in sorted rows; meta the routing metadata (`KernelMeta`); gu, for a
    forward with save_gu, the (gate, up) [N, 2I] in sorted rows (else None). A backward with gu reads
    it instead of recomputing GEMM1. Every input must be contiguous (the kernel indexes them as dense
    row-major arrays); `fused_moe_fwd` / `fused_moe_bwd` are the checked entries.

    trace (benchmarks only; a separately compiled variant): a dict the launch fills with "ticks",
    int64 [tickets, 4] = per ticket [start, after its wait, end, program * 16 + kind] (ns of the GPU's
    clock on CUDA, the ticket number under the interpreter; kind 0 routing metadata, 1 GEMM1,
    2 GEMM2, 3 combine, +4 a row tile past the routed ones), and "layout", the launch's ticket
    layout. The outputs are the untraced launch's."""
    from megamoe.kernels.moe_kernels import CTR_SLOTS, _moe_persistent_kernel

    # the kernel indexes every input as a dense row-major array; the public wrappers pass them
    # through their prep, a direct caller (the benchmark tools) might not (topk ids are often a slice)
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", tw), ("topk_ids", ids), ("dy", dy),
                    ("gu", gu), ("b13", b13), ("b2", b2)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"launch_persistent: {name} must be contiguous, got strides {tuple(t.stride())}")
    N = T * K
    dev, dtype = x.device, x.dtype
    use_gu = gu is not None if is_bwd else save_gu
    tma_w = weights_through_tma(cfg, w13, w2)
    setup = persistent_setup(N, E, H, I, dtype, dev, cfg, is_bwd, gu=use_gu, tma_w=tma_w)
    n1 = setup.n1
    act = alloc.empty(N, (2 * I) if is_bwd else I, dtype=dtype, device=dev)
    hw = alloc.empty(N, I, dtype=dtype, device=dev) if is_bwd else act
    dtw_part = alloc.empty(N, n1, dtype=torch.float32, device=dev) if is_bwd else tw
    dtw = alloc.empty(N, dtype=torch.float32, device=dev) if is_bwd else tw
    slot_out = alloc.empty(N, H, dtype=dtype, device=dev)
    out = alloc.empty(T, H, dtype=dtype, device=dev)
    if not is_bwd and save_gu:
        # zeros: the rows of dropped (-1) slots are never written, and an op output must not hold
        # whatever memory held before (opcheck compares two runs)
        gu = torch.zeros(N, 2 * I, dtype=dtype, device=dev)
    ctr = setup.ctr
    trace_args = {}
    if trace is not None:
        p0 = 2 * setup.nb + 1
        tickets = p0 + setup.r_max * (n1 + setup.n2) + -(-T // cfg.BT)  # the kernel's `total`
        trace["ticks"] = torch.full((tickets, 4), -1, dtype=torch.int64, device=dev)
        trace["layout"] = dict(P0=p0, R_MAX=setup.r_max, n1=n1, n2=setup.n2, lag=setup.lag, GT=cfg.group_tiles,
                               programs=setup.programs, T=T, BT=cfg.BT)
        trace_args = dict(TRACE=True, CLOCK=dev.type == "cuda")
    # Arguments a launch does not read (the backward's without IS_BWD, the EP ones without EP, the
    # trace pointer without TRACE) still need a tensor of the pointer type the kernel's signature
    # expects: they get one of the launch's own tensors.
    with launch_device(dev):
        _moe_persistent_kernel[(setup.programs,)](
            x_ptr=x, w13_ptr=w13, w2_ptr=w2, tw_ptr=tw, ids_ptr=ids, dy_ptr=dy if dy is not None else x,
            b13_ptr=b13 if b13 is not None else x, b2_ptr=b2 if b2 is not None else x,
            **dict(zip(WEIGHT_ARGS, weight_args(w13, w2, setup.consts, is_bwd, use_gu))),
            **dict(zip(METADATA_ARGS, setup.meta)),
            act_ptr=act, hw_ptr=hw, gu_ptr=gu if use_gu else act, dtw_part_ptr=dtw_part, dtw_ptr=dtw,
            slot_out_ptr=slot_out, out_ptr=out, ctr_ptr=ctr, tile_done_ptr=ctr[CTR_SLOTS.value:],
            ep_ptr=ctr, ep_err_ptr=ctr, ep_epoch_ptr=ctr, xs_ptr=x, ids_src_ptr=ids, tw_src_ptr=tw, y_ptr=out,
            trace_ptr=trace["ticks"] if trace is not None else ids,
            T=T, N=N, E=E, H=H, I=I, K=K, LAG=setup.lag, R_MAX=setup.r_max, NB=setup.nb,
            RANK=0, W=1, TS=0, SK=0, TMK=0, SPIN_MAX=0,
            **{**setup.consts, **trace_args, **act_args(b13, activation)}, num_warps=cfg.num_warps,
            num_stages=persistent_stages(cfg, is_bwd, T, recompute=is_bwd and not use_gu))
    sorted_slot, inv_slot, key_start, key_count, tile_cum, num_tiles, _ = setup.meta
    meta = KernelMeta(sorted_slot, inv_slot, key_start[1:], key_count[1:], tile_cum, num_tiles)
    return out, act, hw, dtw, meta, (gu if use_gu and not is_bwd else None)


def launch_dw(x, dy, dgu, hw, meta: KernelMeta, E, H, I, K, cfg: KernelConfig,  # noqa: E741
              tw: torch.Tensor | None = None):
    """(dW13 [E, 2I, H], dW2 [E, H, I]) from a backward `launch_persistent`'s d(gate, up) and
    weighted activation (its act, hw and meta): the token rows gathered into the sorted order (one
    launch), then the weight-gradient kernel (one launch). With tw (the routing weights [T*K] in slot
    order: the experts have biases) one more launch sums the bias gradients, and the result is
    (dW13, dW2, db13 [E, 2I], db2 [E, H]). The gathered copies (2·T·k·H elements) live only for
    this call."""
    from megamoe.kernels.moe_kernels import _gather_token_rows_kernel, _moe_bwd_bias_kernel, _moe_bwd_dw_kernel

    N = meta.sorted_slot.numel()
    xs = alloc.empty(N, H, dtype=x.dtype, device=x.device)
    dys = alloc.empty(N, H, dtype=x.dtype, device=x.device)
    dw13 = alloc.empty(E, 2 * I, H, dtype=x.dtype, device=x.device)
    dw2 = alloc.empty(E, H, I, dtype=x.dtype, device=x.device)
    tma = dw_through_tma(cfg, (dgu, hw, xs, dys))
    per_e = (-(-2 * I // cfg.BMW) + -(-I // cfg.BMW)) * (-(-H // cfg.BNW))
    with launch_device(x.device):
        _gather_token_rows_kernel[(-(-N // cfg.BR),)](
            x_ptr=x, dy_ptr=dy, sorted_slot_ptr=meta.sorted_slot, xs_ptr=xs, dys_ptr=dys, N=N, H=H, K=K,
            BR=cfg.BR, BH=min(256, next_pow2(H)), num_warps=4)
        _moe_bwd_dw_kernel[(E * per_e,)](
            xs_ptr=xs, dys_ptr=dys, dgu_ptr=dgu, hw_ptr=hw,
            **dict(zip(DW_OPERAND_ARGS, dw_operand_args(xs, dys, dgu, hw, cfg, tma))),
            expert_start_ptr=meta.expert_start, expert_count_ptr=meta.expert_count, dw13_ptr=dw13, dw2_ptr=dw2,
            E=E, H=H, I=I, **dw_constexprs(cfg, x.dtype, tma), num_warps=cfg.dw_warps, num_stages=cfg.dw_stages)
        if tw is None:
            return dw13, dw2
        db13 = alloc.empty(E, 2 * I, dtype=x.dtype, device=x.device)
        db2 = alloc.empty(E, H, dtype=x.dtype, device=x.device)
        consts = bias_grad_constexprs()
        per_e = -(-2 * I // consts["BC"]) + -(-H // consts["BC"])
        _moe_bwd_bias_kernel[(E * per_e,)](
            dgu_ptr=dgu, dys_ptr=dys, tw_ptr=tw, sorted_slot_ptr=meta.sorted_slot,
            expert_start_ptr=meta.expert_start, expert_count_ptr=meta.expert_count, db13_ptr=db13, db2_ptr=db2,
            E=E, H=H, I=I, **consts, num_warps=4)
    return dw13, dw2, db13, db2
