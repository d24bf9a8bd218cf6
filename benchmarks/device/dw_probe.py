"""Where the weight-gradient kernel's time goes, and variants of it, in one process on a GPU.

The op's `_moe_bwd_dw_kernel` (megamoe/kernels/moe_kernels.py) is the backward's weakest piece
(245-330 TF/s on the H200). Per expert e with rows r of its sorted slots (token t(r)):

    dW13[e] [2I, H] = sum_r dgu[r]^T x[t(r)]         dW2[e] [H, I] = sum_r dy[t(r)]^T hw[r]

so one operand of each is contiguous in the sorted order (dgu, hw) and the other gathered by
token (x, dy). This script times, against the op's kernel on the same inputs (CUDA-graph replay:
device time only), a probe kernel with the op kernel's tiles and K order and switches:

- `gather`: read x / dy rows through the token index (as the op does), or from copies already in
  the sorted order (`xs = x[t(r)]`, `dys = dy[t(r)]`: what it would cost to build them is timed too);
- `tma`: the contiguous operand(s) through per-expert TMA descriptors made on the device
  (`tl.make_tensor_descriptor` over the expert's rows only, so the last partial K block reads zeros,
  never the next expert's rows) instead of pointer loads;
- `store`: write the tiles, or only each tile's first row (what the epilogue's writes cost);
- tile sizes, warps, stages, and Triton's `warp_specialize` on the K loop.

Every variant's dW13 / dW2 must equal the op kernel's bitwise (same products, same K order, zero
rows past an expert's end), except `store=row0`. Prints one table per case, ms, TF/s (2·N·3·H·I
FLOPs), and the ratio to the op kernel.

    python3 benchmarks/device/dw_probe.py [--cases qwen3:4096 ...] [--reps 20]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.bench_moe import SHAPES, graph_ms, time_ms  # noqa: E402
from megamoe import fused  # noqa: E402
from megamoe.kernels.moe_kernels import _dw_operands, _dw_store, _dw_tile  # noqa: E402


@triton.jit(do_not_specialize=["E"])
def dw_probe_kernel(
    x_ptr, dy_ptr, dgu_ptr, hw_ptr, sorted_slot_ptr, expert_start_ptr, expert_count_ptr,
    dw13_ptr, dw2_ptr, E, H, I, K,
    BMW: tl.constexpr, BNW: tl.constexpr, BKR: tl.constexpr, GATHER: tl.constexpr, TMA: tl.constexpr,
    STORE_ALL: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
):
    """The op kernel's K order with one operand role for both tile kinds: A = the sorted operand's
    rows (dgu for dW13, hw for dW2), B = the token rows (x for dW13, dy for dW2), so dW2 is computed
    transposed ([I, H] tiles, stored to dW2[e] [H, I]). GATHER: B through the token index, else
    x_ptr / dy_ptr hold copies in the sorted order. TMA: 0 pointer loads, 1 A through a per-expert
    device descriptor, 2 A and B (needs GATHER=False)."""
    e, start, count, is13, m0, n0 = _dw_tile(I, H, expert_start_ptr, expert_count_ptr, BMW, BNW)
    om = m0 + tl.arange(0, BMW)
    on = n0 + tl.arange(0, BNW)
    a_base, b_base, a_cols = _dw_operands(is13, dgu_ptr, hw_ptr, x_ptr, dy_ptr, I)
    mmask = om < a_cols
    nmask = on < H
    a_stride = a_cols.to(tl.int64)
    if TMA > 0:
        rows = tl.maximum(count, 1)
        a_desc = tl.make_tensor_descriptor(a_base + start.to(tl.int64) * a_stride, shape=[rows, a_cols],
                                           strides=[a_stride, 1], block_shape=[BKR, BMW])
    if TMA > 1:
        b_desc = tl.make_tensor_descriptor(b_base + start.to(tl.int64) * H, shape=[rows, H],
                                           strides=[H, 1], block_shape=[BKR, BNW])
    acc = tl.zeros((BMW, BNW), dtype=tl.float32)
    for r0 in tl.range(0, count, BKR, num_stages=STAGES, warp_specialize=WS):
        rs = start + r0 + tl.arange(0, BKR)
        rmask = (r0 + tl.arange(0, BKR)) < count
        if TMA > 0:
            a = a_desc.load([r0, m0])
        else:
            a = tl.load(a_base + rs.to(tl.int64)[:, None] * a_stride + om[None, :],
                        mask=rmask[:, None] & mmask[None, :], other=0.0)
        if TMA > 1:
            b = b_desc.load([r0, n0])
        else:
            if GATHER:
                b_row = tl.load(sorted_slot_ptr + rs, mask=rmask, other=0) // K
            else:
                b_row = rs
            b = tl.load(b_base + b_row.to(tl.int64)[:, None] * H + on[None, :],
                        mask=rmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    omask = mmask[:, None] & nmask[None, :]
    if not STORE_ALL:
        omask = omask & (om == m0)[:, None]
    _dw_store(acc, e, is13, om, on, omask, dw13_ptr, dw2_ptr, H, I)


# label: (BMW, BNW, BKR, GATHER, TMA, STORE_ALL, STAGES, WS, warps)
VARIANTS = {
    "transposed dW2": (128, 128, 64, True, 0, True, 2, False, 8),
    "no stores": (128, 128, 64, True, 0, False, 2, False, 8),
    "sorted copies": (128, 128, 64, False, 0, True, 2, False, 8),
    "tma A": (128, 128, 64, True, 1, True, 2, False, 8),
    "tma A st3": (128, 128, 64, True, 1, True, 3, False, 8),
    "tma A 128x256 st3": (128, 256, 64, True, 1, True, 3, False, 8),
    "sorted+tma": (128, 128, 64, False, 2, True, 2, False, 8),
    "sorted+tma st3": (128, 128, 64, False, 2, True, 3, False, 8),
    "sorted+tma st4 4w": (128, 128, 64, False, 2, True, 4, False, 4),
    "sorted+tma ws 4w": (128, 128, 64, False, 2, True, 3, True, 4),
    "sorted+tma 128x256 st3": (128, 256, 64, False, 2, True, 3, False, 8),
    "sorted+tma 256x128 st3": (256, 128, 64, False, 2, True, 3, False, 8),
    "sorted+tma 128x256 st4 BK32": (128, 256, 32, False, 2, True, 4, False, 8),
}


def inputs(shape: str, T: int, seed: int = 0):
    E, H, I, K = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    N = T * K
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    dy = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    dgu = torch.randn(N, 2 * I, device=dev, dtype=dt, generator=g)
    hw = torch.randn(N, I, device=dev, dtype=dt, generator=g)
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices.to(torch.int32)
    sorted_slot = torch.sort(ids.flatten(), stable=True).indices.to(torch.int32)
    count = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    start = (torch.cumsum(count, 0) - count).to(torch.int32)
    return x, dy, dgu, hw, sorted_slot, start, count, (E, H, I, K)


def compile_only(labels) -> None:
    """Compile every variant for sm_90 on any machine (ptxas included): registers, shared memory,
    spills, or the compiler's error."""
    from benchmarks.device.compile_check import _compile, _local_ops, _resources

    types = {n: "*bf16" for n in ("x_ptr", "dy_ptr", "dgu_ptr", "hw_ptr", "dw13_ptr", "dw2_ptr")}
    for label in labels:
        BMW, BNW, BKR, GATHER, TMA, STORE_ALL, STAGES, WS, warps = VARIANTS[label]
        consts = dict(BMW=BMW, BNW=BNW, BKR=BKR, GATHER=GATHER, TMA=TMA, STORE_ALL=STORE_ALL, STAGES=STAGES, WS=WS)
        try:
            k = _compile(dw_probe_kernel, types, consts, ("H", "I"), warps, STAGES)
            ttgir = k.asm["ttgir"]
            print(f"{label}: {_resources(k.asm['cubin'])}, {_local_ops(k.asm['cubin'])}, shared {k.metadata.shared} B, "
                  f"tma loads {ttgir.count('async_tma_copy_global_to_local')}, cp.async "
                  f"{ttgir.count('async_copy_global_to_local')}, warp-specialised {ttgir.count('ttg.warp_specialize')}")
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            print(f"{label}: failed: {type(exc).__name__}: {msg[0][:200] if msg else ''}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="compile the variants for sm_90 and stop")
    ap.add_argument("--cases", nargs="+", default=["qwen3:4096", "qwen3:16384", "olmoe:4096", "dsv3:4096",
                                                     "mixtral:4096"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args.variants)
    # device-made descriptors live in a scratch buffer the launcher asks this allocator for
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    try:  # the op's previous version, where carried (benchmarks/device/ab_kernel.py says how to make abold/)
        from abold import fused as old
    except ImportError:
        old = None
    summary = []
    for case in args.cases:
        shape, T = case.split(":")
        x, dy, dgu, hw, slot, start, count, (E, H, I, K) = inputs(shape, int(T))
        tok = (slot // K).long()
        flops = 2 * slot.numel() * 3 * H * I
        meta = fused.KernelMeta(slot, slot, start, count, count, count[:1])
        cfg = fused.default_config(torch.bfloat16, x.device)

        def op():
            return fused.launch_dw(x, dy, dgu, hw, meta, E, H, I, K, cfg)

        ref13, ref2 = op()
        base = graph_ms(op, args.reps)
        if old is not None:  # the op's weight gradients before and now (gather launch + dW launch)
            prev = lambda: old._launch_dw(x, dy, dgu, hw, meta, E, H, I, K, old.default_config(x.dtype, x.device))  # noqa: E731
            o13, o2 = prev()
            print(f"\n{case}: the op's weight gradients, previous (abold) vs now (same bits: "
                  f"{torch.equal(o13, ref13) and torch.equal(o2, ref2)})")
            for label, fn in [("previous", prev), ("now", op)] + [
                    (f"now, {f}={v}", lambda c=dataclasses.replace(cfg, **{f: v}): fused.launch_dw(
                        x, dy, dgu, hw, meta, E, H, I, K, c)) for f, v in (("dw_warps", 4), ("dw_stages", 4))]:
                ms = graph_ms(fn, args.reps)
                print(f"  {label:22s} {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s (graph), eager {time_ms(fn, args.reps):.3f} ms")
                summary.append((case, "op: " + label, ms, 0.0, "-"))
        xs, dys = x.index_select(0, tok), dy.index_select(0, tok)
        copies = graph_ms(lambda: (x.index_select(0, tok), dy.index_select(0, tok)), args.reps)
        print(f"\n{case}: E={E} H={H} I={I} k={K} rows={slot.numel()}  op kernel {base:.3f} ms "
              f"{flops / base / 1e9:.0f} TF/s; building xs and dys (index_select) {copies:.3f} ms")
        print("variant | ms | TF/s | x op | same bits")
        for label in args.variants:
            BMW, BNW, BKR, GATHER, TMA, STORE_ALL, STAGES, WS, warps = VARIANTS[label]
            a, b = (x, dy) if GATHER else (xs, dys)
            out13, out2 = torch.empty_like(ref13), torch.empty_like(ref2)
            per_e = (triton.cdiv(2 * I, BMW) + triton.cdiv(I, BMW)) * triton.cdiv(H, BNW)

            def run():
                dw_probe_kernel[(E * per_e,)](a, b, dgu, hw, slot, start, count, out13, out2, E, H, I, K,
                                              BMW=BMW, BNW=BNW, BKR=BKR, GATHER=GATHER, TMA=TMA,
                                              STORE_ALL=STORE_ALL, STAGES=STAGES, WS=WS, num_warps=warps)
            try:
                run()
                torch.cuda.synchronize()
                same = (torch.equal(out13, ref13) and torch.equal(out2, ref2)) if STORE_ALL else "-"
                ms = graph_ms(run, args.reps)
                print(f"{label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {base / ms:.2f} | {same}")
                summary.append((case, label, ms, base / ms, same))
            except Exception as exc:  # a variant that does not compile or launch: say so, go on
                msg = str(exc).strip().splitlines()
                print(f"{label} | failed: {type(exc).__name__}: {msg[0][:160] if msg else ''}")
                summary.append((case, label, float("nan"), float("nan"), "failed"))
    print("\nsummary (x the op's kernel as of the run; same bits)")
    for case, label, ms, r, same in summary:
        print(f"{case:14s} {label:34s} {ms:8.3f} ms {r:5.2f}x {same}")


if __name__ == "__main__":
    main()
