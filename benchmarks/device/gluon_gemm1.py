"""A warp-specialised gathered-row GEMM in Gluon for Hopper: the first step of the issue's
"warp specialization" route that Triton's `tl.range(..., warp_specialize=True)` cannot take here
(benchmarks/RESULTS.md: on sm_90 that flag is ignored at 8 warps and fails to compile for gathered
rows at 4). A PROTOTYPE beside the op, not used by it.

    out[m, n] = sum_k x[rows[m], k] * w[n, k]        x [T, K] bf16, rows int32 [M], w [N, K] bf16

which is GEMM1's shape in the persistent kernel (a row tile of one expert gathers its tokens' rows;
w is that expert's [2I, H] block). One output tile per program, three partitions sharing a ring of
STAGES shared-memory stages:

- gather loader (4 warps): the tile's BM token rows, BK columns at a time, by cp.async into the
  stage's A buffer (Hopper has no TMA gather); each thread arrives on the stage's `a_ready` barrier
  when its copies land (the no-increment arrive, so the barrier counts the partition's 128 threads);
- weight loader (1 warp): the [BN, BK] weight block by TMA into the stage's B buffer (`b_ready`);
- MMA (the default partition, `num_warps` warps): waits for both, wgmma from shared memory into a
  register accumulator, then frees the stage (`empty`) for both loaders.

The MMA partition also stores the tile (fp32 accumulator -> bf16).

    python3 benchmarks/device/gluon_gemm1.py                 # H200: check against torch, time vs tl.dot
    python benchmarks/device/gluon_gemm1.py --compile-only   # any machine: compile for sm_90, print resources

Status (2026-12-01): compiled for sm_90 on the CPU machine (`--compile-only`, also
tests/megamoe/test_kernel_compile.py) and run on the H200 (seventh session,
benchmarks/results/2026-12-01-h200-gluon-gemm1.log): the same largest error against torch as
`plain_gathered_gemm` (the same tile as a plain Triton kernel, software-pipelined by the compiler),
and 1.2-1.6x slower than it at Qwen3 / DeepSeek-V3 GEMM1 shapes, so the op keeps plain kernels
(benchmarks/RESULTS.md). Its MMA partition keeps at most one wgmma in flight (`warpgroup_mma_wait(0)`
per step); whether that is why is not measured.
"""

from __future__ import annotations

import argparse
import os
import sys

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

GATHER_WARPS = gl.constexpr(4)


@gluon.jit
def _mma_partition(a_bufs, b_bufs, a_ready, b_ready, empty, out_ptr, M, N, K, off_m, off_n, BM: gl.constexpr,
                   BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, acc_layout: gl.constexpr):
    acc = gl.zeros((BM, BN), gl.float32, acc_layout)
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(a_ready.index(s), phase)
        mbarrier.wait(b_ready.index(s), phase)
        # the A rows came through cp.async (the generic proxy); wgmma reads through the async proxy
        fence_async_shared()
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(s), count=1)
    # the epilogue here, not after the join: Triton 3.6 fails to compile a default partition that
    # returns its accumulator (flatten_values_to_ir raises outside a jit context)
    om = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    on = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    gl.store(out_ptr + om.to(gl.int64)[:, None] * N + on[None, :], acc.to(gl.bfloat16),
             mask=(om < M)[:, None] & (on < N)[None, :])


@gluon.jit
def _gather_partition(x_ptr, rows_ptr, w_desc, a_bufs, b_bufs, a_ready, b_ready, empty, M, K, off_m, off_n):
    # worker partitions take no constexpr arguments (Triton 3.6): the sizes come from the buffers
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    # 32 rows x BK columns per copy step: 8 contiguous bf16 (16 bytes) per thread and copy
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [GATHER_WARPS, 1], [1, 0])
    SUBM: gl.constexpr = 32
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    sub = gl.arange(0, SUBM, layout=gl.SliceLayout(1, layout))
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(empty.index(s), phase ^ 1)  # a fresh barrier counts as phase 1 completed
        k = i * BK + cols
        kmask = k < K
        for c in gl.static_range(BM // SUBM):
            r = off_m + c * SUBM + sub
            rmask = r < M
            src = gl.load(rows_ptr + r, mask=rmask, other=0).to(gl.int64)
            ptrs = x_ptr + src[:, None] * K + k[None, :]
            async_copy.async_copy_global_to_shared(a_bufs.index(s).slice(c * SUBM, SUBM), ptrs,
                                                   mask=rmask[:, None] & kmask[None, :])
        async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)


@gluon.jit
def _weight_partition(x_ptr, rows_ptr, w_desc, a_bufs, b_bufs, a_ready, b_ready, empty, M, K, off_m, off_n):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(empty.index(s), phase ^ 1)
        mbarrier.expect(b_ready.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [off_n, i * BK], b_ready.index(s), b_bufs.index(s))


@gluon.jit
def gathered_gemm_ws_kernel(x_ptr, rows_ptr, w_desc, out_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr,
                            BK: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(s), count=GATHER_WARPS * 32)
        mbarrier.init(b_ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    loader_args = (x_ptr, rows_ptr, w_desc, a_bufs, b_bufs, a_ready, b_ready, empty, M, K, off_m, off_n)
    gl.warp_specialize([
        (_mma_partition, (a_bufs, b_bufs, a_ready, b_ready, empty, out_ptr, M, N, K, off_m, off_n, BM, BN, BK, STAGES,
                          acc_layout)),
        (_gather_partition, loader_args),
        (_weight_partition, loader_args),
    ], [GATHER_WARPS, 1], [88, 24])


@triton.jit
def plain_gathered_gemm(x_ptr, rows_ptr, w_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
    """The same tile as a plain Triton kernel (pointer loads, the compiler's software pipeline)."""
    om = tl.program_id(0) * BM + tl.arange(0, BM)
    on = tl.program_id(1) * BN + tl.arange(0, BN)
    src = tl.load(rows_ptr + om, mask=om < M, other=0).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + src[:, None] * K + ks[None, :], mask=(om < M)[:, None] & (ks < K)[None, :], other=0.0)
        b = tl.load(w_ptr + on[None, :].to(tl.int64) * K + ks[:, None], mask=(ks < K)[:, None] & (on < N)[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + om.to(tl.int64)[:, None] * N + on[None, :], acc.to(tl.bfloat16),
             mask=(om < M)[:, None] & (on < N)[None, :])


def compile_only(BM=128, BN=128, BK=64, STAGES=4, num_warps=4) -> dict:
    """Compile the Gluon kernel for sm_90 on any machine; shared memory and registers."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gathered_gemm_ws_kernel
    consts = dict(BM=BM, BN=BN, BK=BK, STAGES=STAGES, num_warps=num_warps)
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    desc = f"tensordesc<bf16[{BN}, {BK}],{b_layout}>"
    sig = dict(x_ptr="*bf16", rows_ptr="*i32", w_desc=desc, out_ptr="*bf16", M="i32", N="i32", K="i32",
               **{k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr", "rows_ptr", "out_ptr", "N", "K")}
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compile_check import _resources
    ttgir = k.asm["ttgir"]
    return dict(shared=k.metadata.shared, warp_specialize=ttgir.count("ttg.warp_specialize"),
                async_copies=ttgir.count("async_copy_global_to_local"), wgmma=ttgir.count("ttng.warp_group_dot "),
                **_resources(k.asm["cubin"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if args.compile_only:
        import json
        print(json.dumps(compile_only()))
        return
    import torch

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from benchmarks.bench_moe import time_ms

    BM, BN, BK, STAGES = 128, 128, 64, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    print("case | M | N | K | max|ws - torch| | max|plain - torch| | ws ms | plain ms | ws TF/s | plain TF/s")
    for name, T, M, N, K in (("qwen3 GEMM1, one expert's 4096-token share", 4096, 256, 1536, 2048),
                             ("qwen3 GEMM1, all rows of T=4096", 4096, 32768, 1536, 2048),
                             ("dsv3 GEMM1, all rows of T=4096", 4096, 32768, 4096, 7168)):
        x = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
        rows = torch.randint(0, T, (M,), device="cuda", generator=g, dtype=torch.int32)
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
        ref = (x[rows.long()].float() @ w.float().T)
        out_ws = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        out_pl = torch.empty_like(out_ws)
        desc = TensorDescriptor.from_tensor(w, [BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16))
        grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))

        def ws():
            gathered_gemm_ws_kernel[grid](x, rows, desc, out_ws, M, N, K, BM, BN, BK, STAGES, num_warps=4)

        def plain():
            plain_gathered_gemm[grid](x, rows, w, out_pl, M, N, K, BM, BN, BK, num_warps=8, num_stages=3)

        ws()
        plain()
        torch.cuda.synchronize()
        e_ws = float((out_ws.float() - ref).abs().max())
        e_pl = float((out_pl.float() - ref).abs().max())
        t_ws, t_pl = time_ms(ws, args.reps), time_ms(plain, args.reps)
        fl = 2 * M * N * K
        print(f"{name} | {M} | {N} | {K} | {e_ws:.3e} | {e_pl:.3e} | {t_ws:.3f} | {t_pl:.3f} | "
              f"{fl / t_ws / 1e9:.0f} | {fl / t_pl / 1e9:.0f}", flush=True)


if __name__ == "__main__":
    main()
