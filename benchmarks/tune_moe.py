"""Tile-config sweep for the megamoe kernels on one GPU (bf16), with a per-stage time split.

    python benchmarks/tune_moe.py [--shape qwen3] [--tokens 4096 16384] [--reps 20]
    python benchmarks/tune_moe.py --decode [--shape qwen3] [--tokens 64 256]

--decode: the forward at decode sizes as the engine runs it (fused_moe_fwd replayed as a CUDA graph), the
bf16 CUDA default and variants of it (DECODE), beside vLLM's Triton fused_experts in the same process where
vLLM imports; per variant the time, the ratio to vLLM's and whether its output is bitwise the default's (a
decode-only tile must keep every bit for batch invariance: the defaults' tiles never depend on T).

Prints, per forward config: the persistent launch's time (routing metadata included: it is the
launch's phase 0) and, for T >= 4096, the best ticket lag; per backward config: the persistent
backward launch and the weight-gradient launch separately. Every config's output is checked
against the default config's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_moe import (SHAPES, expert_options, graph_ms, make_inputs, time_ms,  # noqa: E402
                                  vllm_disagreement, vllm_fn)
from megamoe import fused  # noqa: E402
from megamoe.fused import KernelConfig  # noqa: E402

FWD = [
    KernelConfig(BLK=2048),
    KernelConfig(BLK=512),
    # GEMM2's block of H: 256 leaves a partial last tile where H is no multiple of it (gpt-oss: 2880)
    KernelConfig(BN2=128),
    KernelConfig(BN2=64),
]
BWD = [
    KernelConfig(BMW=256, BNW=128),
    KernelConfig(dw_stages=3),
    KernelConfig(BMW=128, BNW=256, dw_stages=3),
    KernelConfig(BKR=32),
]

# the training path: the forward saves (gate, up), the backward's persistent launch reads it
GU = [
    KernelConfig(BN1=64),
    KernelConfig(bwd_BN1=32),   # (bwd_BN1=128 needs 245760 bytes of shared memory: over the limit)
]


# the forward at decode sizes: changes to the bf16 CUDA default (default_config), one or two fields each
DECODE = [
    dict(BM=64),
    dict(BM=64, num_warps=4),
    dict(BN1=64),
    dict(BN2=128),
    dict(BK1=128),
    dict(small_stages=3),
    dict(small_stages=5),
    dict(group_tiles=1),
    dict(BLK=256),
]


def decode_sweep(shape: str, tokens: list[int], reps: int, variants=DECODE, timer=graph_ms, device="cuda"):
    """The --decode table, yielded one T at a time (a list of rows, so a run cut short keeps the sizes it
    finished): one row per config, the default first and vLLM's fused_experts last (where it
    imports and its output agrees with megamoe's: bench_moe.vllm_disagreement), each {"T", "config", "ms",
    "vs_vllm", "bitwise"} (bitwise: the output equals the default config's bit for bit; None for vLLM and where
    the default failed) or {"T", "config", "error"} for a variant that fails to run."""
    from megamoe.fused import default_config, fused_moe_fwd, set_config

    E, H, I, k = SHAPES[shape]  # noqa: E741
    vllm_experts, vllm_err = vllm_fn()
    for T in tokens:
        rows = []
        x, w13, w2, tw, ids = make_inputs(E, H, I, k, T, device=device)
        base = default_config(x.dtype, x.device)
        default_out = None
        for change in [{}] + list(variants):
            name = ",".join(f"{a}={b}" for a, b in change.items()) or "default"
            try:
                cfg = dataclasses.replace(base, **change)
                set_config(cfg)
                out = fused_moe_fwd(x, w13, w2, tw, ids, check=False)
                ms = timer(lambda: fused_moe_fwd(x, w13, w2, tw, ids, check=False), reps)
            except Exception as exc:  # noqa: BLE001  (a tile the kernel or the card cannot take)
                rows.append({"T": T, "config": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
                continue
            finally:
                set_config(None)
            if not change:
                default_out = out
            rows.append({"T": T, "config": name, "ms": ms,
                         "bitwise": None if default_out is None else torch.equal(out, default_out)})
        why = vllm_err if vllm_experts is None else vllm_disagreement(vllm_experts, x, w13, w2, tw, ids)[2]
        if why is None:
            ids32 = ids.to(torch.int32)
            ms = timer(lambda: vllm_experts(x, w13, w2, tw, ids32), reps)
            rows.append({"T": T, "config": "vllm fused_experts", "ms": ms, "bitwise": None})
            for r in rows:
                if r["T"] == T and "ms" in r:
                    r["vs_vllm"] = ms / r["ms"]
        else:
            rows.append({"T": T, "config": "vllm fused_experts", "error": why})
        yield rows


def short(c: KernelConfig) -> str:
    d = dataclasses.asdict(c)
    base = dataclasses.asdict(KernelConfig())
    return ",".join(f"{k}={v}" for k, v in d.items() if v != base[k]) or "default"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 4096, 16384])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--lags", nargs="*", type=int, default=[1, 2, 4],
                    help="phase-2 lags to try, in units of group_tiles row tiles (KernelConfig.lag)")
    ap.add_argument("--decode", action="store_true",
                    help="the forward at decode sizes as CUDA graphs, DECODE's variants beside vLLM's fused_experts "
                         "(default --tokens then: 64 256)")
    args = ap.parse_args()
    if args.decode:
        tokens = args.tokens if args.tokens != ap.get_default("tokens") else [64, 256]
        print(f"forward at decode sizes, {args.shape}, bf16, replayed CUDA graphs, median of {args.reps}; "
              "vs_vllm > 1: faster than vLLM's fused_experts; bitwise: the same output bits as the default")
        for r in (r for rows in decode_sweep(args.shape, tokens, args.reps) for r in rows):
            if "error" in r:
                print(f"  T={r['T']:5d} [{r['config']}] {r['error']}", flush=True)
            else:
                vs = f" {r['vs_vllm']:.2f}x vs vllm" if "vs_vllm" in r else ""
                bits = "" if r["bitwise"] is None else f" bitwise {r['bitwise']}"
                print(f"  T={r['T']:5d} [{r['config']}] {r['ms']:.3f} ms{vs}{bits}", flush=True)
        return
    E, H, I, k = SHAPES[args.shape]  # noqa: E741
    # topk ids made contiguous: the raw launchers below index them as a dense array (the public
    # wrappers do this themselves; before 2026-12-01 this script passed the strided slice, so the
    # kernels read a balanced routing, each token's ids from one row of the full sort)
    inputs = {T: tuple(t.contiguous() for t in make_inputs(E, H, I, k, T)) for T in args.tokens}
    flops = {T: 6.0 * T * k * H * I for T in inputs}
    # the forward's expert options (gpt-oss shapes: biases and the clamped SwiGLU, as in bench_moe)
    opts = expert_options(args.shape, next(iter(inputs.values()))[0])
    if opts:
        print("forward with the experts' biases and the clamped SwiGLU; the backward sections without them")
    ref_out = {}
    print("forward: one persistent launch (routing metadata included)")
    for c in [KernelConfig()] + FWD:
        cells = []
        for T, (x, w13, w2, tw, ids) in inputs.items():
            def run(cfg=c):
                return fused.launch_persistent(False, x, w13, w2, tw, ids, None, T, H, I, E, k, cfg, **opts)
            try:
                out = run()[0]
            except Exception as exc:  # noqa: BLE001
                cells.append(f"T={T} FAILED {type(exc).__name__}: {str(exc)[:80]}")
                continue
            if T not in ref_out:
                ref_out[T] = out
            err = float((out.float() - ref_out[T].float()).norm() / ref_out[T].float().norm())
            ms = time_ms(run, args.reps)
            lag_best = ""
            if T >= 4096 and args.lags:
                lags = {lag: time_ms(lambda lag=lag: run(dataclasses.replace(c, lag=lag)), args.reps)
                        for lag in args.lags}
                lag_best = " lags " + " ".join(f"{kk}:{v:.2f}" for kk, v in lags.items())
            cells.append(f"T={T} {ms:.3f} ms {flops[T] / ms / 1e9:.0f} TF/s err {err:.1e}{lag_best}")
        print(f"  [{short(c)}] " + " | ".join(cells), flush=True)
    # FLOPs: persistent = GEMM1 recompute 4TkHI + dA 2TkHI + dx 4TkHI = 10/6 of the forward's;
    # weight gradients = dW13 4TkHI + dW2 2TkHI = the forward's.
    print("backward: persistent (metadata, recompute, dgu, dx, d(topk_weights)) | weight gradients")
    for T, (x, w13, w2, tw, ids) in inputs.items():
        if T < 4096:
            continue
        dy = torch.randn_like(x)
        ref_dw = None
        for c in [KernelConfig()] + BWD:
            try:
                outs = fused.launch_persistent(True, x, w13, w2, tw, ids, dy, T, H, I, E, k, c)
                ms_p = time_ms(lambda: fused.launch_persistent(True, x, w13, w2, tw, ids, dy, T, H, I, E, k, c),
                               args.reps)
                dw = fused.launch_dw(x, dy, outs[1], outs[2], outs[4], E, H, I, k, c)
                ms_w = time_ms(lambda: fused.launch_dw(x, dy, outs[1], outs[2], outs[4], E, H, I, k, c), args.reps)
            except Exception as exc:  # noqa: BLE001
                print(f"  [{short(c)}] FAILED {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            ref_dw = ref_dw or dw
            err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(dw, ref_dw))
            print(f"  [{short(c)}] T={T} persistent {ms_p:.3f} ms ({10 / 6 * flops[T] / ms_p / 1e9:.0f} TF/s) | "
                  f"dW {ms_w:.3f} ms ({flops[T] / ms_w / 1e9:.0f} TF/s) err {err:.1e}", flush=True)
    # FLOPs: the backward persistent launch reading (gate, up): dA 2TkHI + dx 4TkHI = the forward's
    print("training path: forward writing (gate, up) | backward persistent reading it (vs recomputing: err = max rel diff of dx)")
    for T, (x, w13, w2, tw, ids) in inputs.items():
        if T < 4096:
            continue
        dy = torch.randn_like(x)
        for c in [KernelConfig()] + GU:
            try:
                fw = fused.launch_persistent(False, x, w13, w2, tw, ids, None, T, H, I, E, k, c, save_gu=True)
                ms_f = time_ms(lambda: fused.launch_persistent(False, x, w13, w2, tw, ids, None, T, H, I, E, k, c,
                                                                save_gu=True), args.reps)
                gu = fw[-1]
                bw = fused.launch_persistent(True, x, w13, w2, tw, ids, dy, T, H, I, E, k, c, gu=gu)
                ms_b = time_ms(lambda: fused.launch_persistent(True, x, w13, w2, tw, ids, dy, T, H, I, E, k, c, gu=gu),
                               args.reps)
                rc = fused.launch_persistent(True, x, w13, w2, tw, ids, dy, T, H, I, E, k, c)
            except Exception as exc:  # noqa: BLE001
                print(f"  [{short(c)}] FAILED {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            err = float((bw[0].float() - rc[0].float()).abs().max() / rc[0].float().abs().max())
            same = torch.equal(bw[0], rc[0]) and torch.equal(bw[1], rc[1])
            print(f"  [{short(c)}] T={T} fwd+gu {ms_f:.3f} ms ({flops[T] / ms_f / 1e9:.0f} TF/s) | bwd persistent "
                  f"from gu {ms_b:.3f} ms ({flops[T] / ms_b / 1e9:.0f} TF/s) | bitwise = recompute: {same} err {err:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
