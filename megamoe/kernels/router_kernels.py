"""Triton kernels of the router logits (pointer math only; the launcher is megamoe/router.py).

    logits[T, E] (fp32) = x[T, H] @ w[E, H]^T, both operands upcast to fp32 in registers

H is cut into S = ceil(H / CH) chunks of CH columns. `_router_logits_chunk_kernel` runs one program per
(block of BT rows, block of BE experts, chunk s) and accumulates that chunk from its first column with an
fp32 `tl.dot` in IEEE precision (fused multiply-adds, no TF32); `_router_logits_sum_kernel` adds the S
partial sums of each logit in chunk order (with S = 1 the chunk kernel writes the logits itself). So the
rounding of logits[t, e] depends on x[t], w[e] and the fixed block sizes alone: not on T, and not on which
program or which row of its block computed it. Rows past T, experts past E and columns past H load zeros
and are not stored.

Why chunks: one program walking all of H serially took 1.3 us per BH=32 block of columns whatever T was
(42 us at H=1024, 83 us at H=2048 for a decode step's rows; H200, benchmarks/device/router_probe.py), a
latency that cuBLAS beat at decode. Chunks bound the serial walk to CH columns and spread H over programs.
"""

from __future__ import annotations

import triton
import triton.language as tl


# T and the partials' stride (T * E) are not specialised on: one compiled kernel for every T (decode,
# prefill, training), never a compile in the middle of a rollout.
@triton.jit(do_not_specialize=["T", "stride_os"])
def _router_logits_chunk_kernel(x_ptr, w_ptr, out_ptr, T, E, H, stride_xt, stride_we, stride_os, stride_ot,
                                BT: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    experts = tl.program_id(1) * BE + tl.arange(0, BE)
    chunk = tl.program_id(2)
    cols = tl.arange(0, BH)
    row_ok = rows < T
    expert_ok = experts < E
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    for h0 in range(0, CH, BH):
        h = chunk * CH + h0 + cols
        h_ok = h < H
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + h[None, :],
                    mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[None, :].to(tl.int64) * stride_we + h[:, None],
                    mask=expert_ok[None, :] & h_ok[:, None], other=0.0).to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(out_ptr + chunk.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_ot + experts[None, :], acc,
             mask=row_ok[:, None] & expert_ok[None, :])


@triton.jit(do_not_specialize=["T", "stride_ps"])
def _router_logits_sum_kernel(part_ptr, out_ptr, T, E, stride_ps, stride_pt, stride_ot,
                              BT: tl.constexpr, BE: tl.constexpr, S: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    experts = tl.program_id(1) * BE + tl.arange(0, BE)
    ok = (rows < T)[:, None] & (experts < E)[None, :]
    at = rows[:, None].to(tl.int64) * stride_pt + experts[None, :]
    acc = tl.load(part_ptr + at, mask=ok, other=0.0)
    for s in tl.static_range(1, S):  # chunk order, unrolled: every partial's load is issued at once
        acc += tl.load(part_ptr + s * stride_ps + at, mask=ok, other=0.0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + experts[None, :], acc, mask=ok)
