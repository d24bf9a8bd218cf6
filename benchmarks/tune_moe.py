"""Tile-config sweep for the megamoe kernels on one GPU (bf16), with a per-stage time split.

    python benchmarks/tune_moe.py [--shape qwen3] [--reps 20]

Prints, per forward config: the persistent kernel's time at T = 64, 4096, 16384 (and the routing
metadata's time on its own); per backward config: the persistent backward launch and the weight-
gradient launch separately. Every config's output is checked against the default config's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_moe import SHAPES, make_inputs, time_ms  # noqa: E402
from megamoe import fused  # noqa: E402
from megamoe.fused import KernelConfig, routing_metadata  # noqa: E402

FWD = [
    KernelConfig(BN2=256),
    KernelConfig(BN1=128, BN2=256),
    KernelConfig(BN1=128),
    KernelConfig(programs=264),
    KernelConfig(BN1=128, BN2=256, num_stages=4),
    KernelConfig(BM=64, BN1=128, BN2=256, programs=264),
]
BWD = [
    KernelConfig(BNW=256),
    KernelConfig(BNW=256, BKR=32, dw_stages=4),
    KernelConfig(BMW=256, BNW=128),
    KernelConfig(BN2=256, BNW=256, dw_warps=8, dw_stages=4),
]


def short(c: KernelConfig) -> str:
    d = dataclasses.asdict(c)
    base = dataclasses.asdict(KernelConfig())
    return ",".join(f"{k}={v}" for k, v in d.items() if v != base[k]) or "default"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    E, H, I, k = SHAPES[args.shape]  # noqa: E741
    inputs = {T: make_inputs(E, H, I, k, T) for T in (64, 4096, 16384)}
    flops = {T: 6.0 * T * k * H * I for T in inputs}
    for T, (x, w13, w2, tw, ids) in inputs.items():
        ms = time_ms(lambda: routing_metadata(ids, E, 128), args.reps)
        ms_t = time_ms(lambda: routing_metadata(ids, E, 128, backend="triton"), args.reps)
        print(f"metadata T={T}: torch ops {ms:.3f} ms, triton {ms_t:.3f} ms", flush=True)
    ref_out = {}
    print("forward: persistent kernel (metadata excluded)")
    for c in FWD:
        cells = []
        for T, (x, w13, w2, tw, ids) in inputs.items():
            meta = routing_metadata(ids, E, c.BM, backend="triton")
            tw32 = tw.float()
            run = lambda: fused._launch_persistent(False, x, w13, w2, tw32, ids, None, meta, T, H, I, k, c)  # noqa: E731
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
            if T >= 4096:
                lags = {}
                for lag in (8, 16, 32):
                    cl = dataclasses.replace(c, lag=lag)
                    lags[lag] = time_ms(lambda: fused._launch_persistent(False, x, w13, w2, tw32, ids, None, meta, T, H, I, k, cl), args.reps)  # noqa: E731
                lag_best = " lags " + " ".join(f"{kk}:{v:.2f}" for kk, v in lags.items())
            cells.append(f"T={T} {ms:.3f} ms {flops[T] / ms / 1e9:.0f} TF/s err {err:.1e}{lag_best}")
        print(f"  [{short(c)}] " + " | ".join(cells), flush=True)
    # FLOPs: persistent = GEMM1 recompute 4TkHI + dA 2TkHI + dx 4TkHI = 10/6 of the forward's;
    # weight gradients = dW13 4TkHI + dW2 2TkHI = the forward's.
    print("backward: persistent (recompute, dgu, dx) | weight gradients")
    T = 16384
    x, w13, w2, tw, ids = inputs[T]
    dy = torch.randn_like(x)
    tw32 = tw.float()
    for c in BWD:
        meta = routing_metadata(ids, E, c.BM, backend="triton")
        try:
            outs = fused._launch_persistent(True, x, w13, w2, tw32, ids, dy, meta, T, H, I, k, c)
            ms_p = time_ms(lambda: fused._launch_persistent(True, x, w13, w2, tw32, ids, dy, meta, T, H, I, k, c), args.reps)
            ms_w = time_ms(lambda: fused._launch_dw(x, dy, outs[1], outs[2], meta, E, H, I, k, c), args.reps)
        except Exception as exc:  # noqa: BLE001
            print(f"  [{short(c)}] FAILED {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        print(f"  [{short(c)}] T={T} persistent {ms_p:.3f} ms ({10 / 6 * flops[T] / ms_p / 1e9:.0f} TF/s) | "
              f"dW {ms_w:.3f} ms ({flops[T] / ms_w / 1e9:.0f} TF/s)", flush=True)


if __name__ == "__main__":
    main()
