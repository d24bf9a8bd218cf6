"""One megamoe training step (forward + backward, as bench_moe.py times it) under torch.profiler:
every device kernel with its time, the idle gaps between them, and the step's span, so the time
outside the three kernels (forward, backward persistent, weight gradients) can be attributed.

    python3 benchmarks/device/profile_step.py --shape qwen3 --tokens 4096 16384 [--impl reference]

On a GPU it lists CUDA kernels and memsets, then the host's side of the same step (the top-level
CPU ops on the same clock: when each kernel was asked for) and a cProfile of the step's Python
(--host-calls steps, functions by own time, no device sync inside the window); on a CPU machine
(torch backend, small shapes through --shape tiny) it lists CPU ops instead, which only checks that
the script runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
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
    ap.add_argument("--host-calls", type=int, default=20, help="steps under cProfile (0: none)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for T in args.tokens:
        step = step_fn(args.shape, T, args.impl, device)
        for _ in range(3):  # compile, allocator warm-up
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            step()
            if device == "cuda":
                torch.cuda.synchronize()
        every = sorted(prof.events(), key=lambda e: e.time_range.start)
        host = [e for e in every if e.device_type.name == "CPU" and e.cpu_parent is None]
        kernels = [e for e in every if e.device_type.name == "CUDA"] if device == "cuda" else host
        if not kernels:
            print(f"{args.shape} T={T}: no events recorded")
            continue
        t0 = min(e.time_range.start for e in (kernels + host))
        _timeline(f"{args.shape} T={T} {args.impl} on {device}", kernels, t0, args.top)
        if device == "cuda":
            _timeline(f"{args.shape} T={T} host (top-level CPU ops, same clock)", host, t0, args.top)
            if args.host_calls:
                _host_profile(step, args.host_calls)


def _timeline(title: str, events, t0: float, top: int) -> None:
    span = (events[-1].time_range.end - events[0].time_range.start) / 1e3
    busy = sum(e.time_range.elapsed_us() for e in events) / 1e3
    print(f"\n{title}: {len(events)} events, span {span:.3f} ms, busy {busy:.3f} ms, idle {span - busy:.3f} ms")
    print(f"{'start ms':>9} {'ms':>8} {'gap before':>10}  name")
    prev_end = events[0].time_range.start
    for e in events[:top]:
        gap = (e.time_range.start - prev_end) / 1e3
        print(f"{(e.time_range.start - t0) / 1e3:9.3f} {e.time_range.elapsed_us() / 1e3:8.3f} {gap:10.3f}  {e.name[:90]}")
        prev_end = max(prev_end, e.time_range.end)
    if len(events) > top:
        print(f"... {len(events) - top} more")


def _host_profile(step, n: int) -> None:
    """cProfile over n steps with no synchronisation inside (as a training loop issues them)."""
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(22)
    print(f"\ncProfile of {n} steps (times are totals over the {n}):")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])

if __name__ == "__main__":
    main()
