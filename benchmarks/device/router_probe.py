"""The router logits' Triton kernel against the ROWS-row BLAS blocks it replaced, on one GPU: time per call
eager and as a replayed CUDA graph, at decode and prefill/training row counts.

    python3 benchmarks/device/router_probe.py [--hidden 1024 --experts 64]
    python3 benchmarks/device/router_probe.py --hidden 7168 --experts 256 --sweep   # the kernel's row/expert/step
                                                                                     # blocks, graph replay only
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
    p.add_argument("--sweep", action="store_true", help="time other (BT, BE, BH) blocks of the Triton kernel")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.experts, args.hidden, generator=g).bfloat16().cuda()
    if args.sweep:
        return sweep(w, g)
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


def sweep(w, g):
    """Graph-replay time of the Triton kernel per (BT, BE, BH) block (the chunk of CH columns kept)."""
    from megamoe.router import BLOCKS, _logits_triton

    cands = [(16, 32, 64), (32, 32, 64), (32, 64, 64), (64, 64, 32), (64, 64, 64), (64, 128, 32), (128, 64, 32)]
    print(f"H={w.shape[1]} E={w.shape[0]}: us per call as a replayed graph; blocks BT,BE,BH "
          f"(chunks of {BLOCKS['CH']})")
    print("T | " + " | ".join(",".join(map(str, c)) for c in cands))
    for T in (1, 128, 1536, 16384):
        x = torch.randn(T, w.shape[1], generator=g).bfloat16().cuda()
        row = []
        for bt, be, bh in cands:
            blocks = dict(BLOCKS, BT=bt, BE=be, BH=bh)
            try:
                _logits_triton(x, w, blocks)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    _logits_triton(x, w, blocks)
                row.append(f"{timed(graph.replay, reps=50):.1f}")
            except Exception as e:  # a block that does not compile (shared memory, registers) reads as such
                row.append(type(e).__name__)
        print(f"{T} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
