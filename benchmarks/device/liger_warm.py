"""Compile Liger Kernel's autotune configurations for some MoE shapes in parallel worker processes,
so that bench_moe.py's own autotuning afterwards (one process, every configuration) finds each
compiled kernel in Triton's on-disk cache and only has to time them.

    python3 benchmarks/device/liger_warm.py --shapes dsv3 mixtral --tokens 4096 --workers 14
    python3 benchmarks/bench_moe.py --shapes dsv3 mixtral --tokens 4096 16384 64 ...

Why: Liger 0.8.5 autotunes, per (H, I), 32 configurations for each of its four GEMM kernels, 16 for
each weight-gradient kernel and 36 for the token gather. Compiled one after another in one process,
that outlasted a 540 s device call for the DeepSeek-V3 slice (benchmarks/RESULTS.md). Here worker i
of n keeps every i-th configuration of each of Liger's autotuners (at least one) and runs one forward
and backward at each shape; the worker's timings are thrown away. Which configuration Liger uses is
still decided by bench_moe.py's process, over all of them, with its own timings; the warm-up only
saves it the compiles (the cache key is the kernel source, constants, options and argument
specialisation, so run the warm-up with a token count that specialises like the benchmark's first,
e.g. any multiple of 16). Needs a CUDA GPU and Liger Kernel importable.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def keep_slice(module, i: int, n: int) -> dict:
    """Keep configurations i, i+n, ... (at least one) of every Triton autotuner in `module`;
    returns {kernel name: configurations kept}."""
    from triton.runtime.autotuner import Autotuner

    kept = {}
    for name in sorted(vars(module)):
        obj = getattr(module, name)
        if isinstance(obj, Autotuner):
            configs = list(obj.configs)
            obj.configs = configs[i::n] or [configs[i % len(configs)]]
            kept[name] = len(obj.configs)
    return kept


def worker(i: int, n: int, shapes: list[str], tokens: int) -> None:
    import torch
    from liger_kernel.ops import fused_moe_kernels
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    from benchmarks.bench_moe import SHAPES, make_inputs

    kept = keep_slice(fused_moe_kernels, i, n)
    for name in shapes:
        E, H, I, k = SHAPES[name]  # noqa: E741
        x, w13, w2, tw, ids = make_inputs(E, H, I, k, tokens)
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w13, w2)] + [tw.clone().requires_grad_(True)]
        lx, lw13, lw2, ltw = leaves
        ids32 = ids.to(torch.int32)
        with torch.no_grad():
            LigerFusedMoEFunction.apply(x, w13, w2, ids32, tw.to(x.dtype))  # the benchmark's forward call
        LigerFusedMoEFunction.apply(lx, lw13, lw2, ids32, ltw.to(lx.dtype)).backward(torch.randn_like(x))
        torch.cuda.synchronize()
        del x, w13, w2, tw, ids, leaves, lx, lw13, lw2, ltw
        torch.cuda.empty_cache()
    print(f"worker {i}/{n}: {sum(kept.values())} configurations over {len(kept)} autotuners, shapes {shapes}",
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from benchmarks.bench_moe import SHAPES

    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        raise SystemExit(f"--shapes: unknown {bad}; expected some of {sorted(SHAPES)}")
    if args.workers < 1:
        raise SystemExit(f"--workers: expected >= 1, got {args.workers}")
    if args.worker is not None:
        worker(args.worker, args.workers, args.shapes, args.tokens)
        return
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--shapes", *args.shapes, "--tokens", str(args.tokens),
                               "--workers", str(args.workers), "--worker", str(i)]) for i in range(args.workers)]
    rcs = [p.wait() for p in procs]
    print(f"liger_warm: {args.workers} workers, rc {rcs}, {time.time() - t0:.0f} s", flush=True)
    if any(rcs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
