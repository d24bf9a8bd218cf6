"""The router logits' Triton kernel against the ROWS-row BLAS blocks it replaced, on one GPU: time per call
eager and as a replayed CUDA graph, at decode and prefill/training row counts.

    python3 benchmarks/device/router_probe.py [--hidden 1024 --experts 64]
"""
import argparse

import torch

from megamoe.router import router_logits_fwd


def timed(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.experts, args.hidden, generator=g).bfloat16().cuda()
    print(f"H={args.hidden} E={args.experts} bf16 x, us per call")
    print("T | triton eager | torch eager | triton graph | torch graph | max |err| against fp64 (both)")
    for T in (1, 16, 128, 1536, 2600, 16384):
        x = torch.randn(T, args.hidden, generator=g).bfloat16().cuda()
        row = [T]
        for backend in ("triton", "torch"):
            row.append(timed(lambda: router_logits_fwd(x, w, backend=backend)))
        for backend in ("triton", "torch"):
            graph = torch.cuda.CUDAGraph()
            router_logits_fwd(x, w, backend=backend)
            with torch.cuda.graph(graph):
                router_logits_fwd(x, w, backend=backend)
            row.append(timed(graph.replay))
        ref = x.double() @ w.double().t()
        err = max(float((router_logits_fwd(x, w, backend=b).double() - ref).abs().max()) for b in ("triton", "torch"))
        print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row) + f" | {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
