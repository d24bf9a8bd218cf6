"""One megamoe training step (forward + backward, as bench_moe.py times it) under torch.profiler:
every device kernel with its time, the idle gaps between them, and the step's span, so the time
outside the three kernels (forward, backward persistent, weight gradients) can be attributed.

    python3 benchmarks/device/profile_step.py --shape qwen3 --tokens 4096 16384 [--impl reference]

On a GPU it lists CUDA kernels and memsets; on a CPU machine (torch backend, small shapes through
--shape tiny) it lists CPU ops instead, which only checks that the script runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.bench_moe import SHAPES, make_inputs  # noqa: E402
from megamoe.moe import fused_moe  # noqa: E402

SHAPES = dict(SHAPES, tiny=(8, 64, 32, 2))


def step_fn(name: str, T: int, impl: str, device: str):
    E, H, I, k = SHAPES[name]  # noqa: E741
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, w13, w2, tw, ids = make_inputs(E, H, I, k, T, device=device, dtype=dtype)
    for t in (x, w13, w2, tw):
        t.requires_grad_(True)
    dy = torch.randn_like(x)

    def step():
        for t in (x, w13, w2, tw):
            t.grad = None
        fused_moe(x, w13, w2, tw, ids, impl=impl, check_ids=False).backward(dy)
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--impl", default="megamoe", choices=["megamoe", "reference"])
    ap.add_argument("--top", type=int, default=25, help="rows of the per-kernel table")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    for T in args.tokens:
        step = step_fn(args.shape, T, args.impl, device)
        for _ in range(3):  # compile, allocator warm-up
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=[activity]) as prof:
            step()
            if device == "cuda":
                torch.cuda.synchronize()
        # device events in time order (on CPU: the top-level ops)
        events = [e for e in prof.events() if (e.device_type.name == "CUDA") == (device == "cuda")]
        if device == "cpu":
            events = [e for e in events if e.cpu_parent is None]
        events.sort(key=lambda e: e.time_range.start)
        if not events:
            print(f"{args.shape} T={T}: no events recorded")
            continue
        span = (events[-1].time_range.end - events[0].time_range.start) / 1e3
        busy = sum(e.time_range.elapsed_us() for e in events) / 1e3
        print(f"\n{args.shape} T={T} {args.impl} on {device}: {len(events)} events, span {span:.3f} ms, "
              f"busy {busy:.3f} ms, idle {span - busy:.3f} ms")
        print(f"{'start ms':>9} {'ms':>8} {'gap before':>10}  name")
        prev_end = events[0].time_range.start
        for e in events[: args.top]:
            gap = (e.time_range.start - prev_end) / 1e3
            print(f"{(e.time_range.start - events[0].time_range.start) / 1e3:9.3f} "
                  f"{e.time_range.elapsed_us() / 1e3:8.3f} {gap:10.3f}  {e.name[:90]}")
            prev_end = max(prev_end, e.time_range.end)
        if len(events) > args.top:
            print(f"... {len(events) - args.top} more")


if __name__ == "__main__":
    main()
