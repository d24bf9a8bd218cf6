"""Host time the routing capture adds to each engine step (rollout/capture.py's after_step) and to a take.

    python benchmarks/bench_capture_host.py                         # CPU: 8 and 48 layers, 128 requests decoding
    python benchmarks/bench_capture_host.py --device cuda --layers 8 48 --requests 128 256

No engine: a stand-in for vLLM's model runner and scheduler output (the attributes the capture reads), the MoE
ops' writes done with moe_method.capture_routing, then `after_step` timed with a host clock, as vLLM's host
thread pays it; on CUDA the copies it queues are not waited for (that is the point), so the number is the
host time per step, not the device time. --steps decode steps of --requests requests (one row each), then one
take; the mean over the steps, the median over --reps. Compare numbers only within one invocation's machine and load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(layers: int, requests: int, steps: int, k: int, device: str) -> tuple[float, float]:
    """(mean host microseconds per after_step, milliseconds of the take) for one session. The mean, not the
    median: every capture.LAND_EVERY-th step files the landed ones, so the steps' costs differ."""
    import torch

    from rollout import capture, moe_method

    moe_method._STORE.clear()
    moe_method._SLOTS.clear()
    capture._SESSION.__init__()
    session = capture._SESSION
    session.on = True
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 64, (requests, k), generator=gen).to(device) for _ in range(layers)]
    reqs = [f"{i}_0-abcdefgh" for i in range(requests)]
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=reqs, num_reqs=requests), positions=None)
    out = types.SimpleNamespace(total_num_scheduled_tokens=requests, num_scheduled_tokens=dict.fromkeys(reqs, 1))
    per_step = []
    for step in range(steps):
        for layer in range(layers):
            moe_method.capture_routing(layer, ids[layer])
        runner.positions = torch.full((requests,), 16 + step, dtype=torch.long, device=device)
        t0 = time.perf_counter()
        session.after_step(runner, out)
        per_step.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    got = capture.routing_capture(None, "take", ())
    take = time.perf_counter() - t0
    assert len(got["requests"]) == requests and got["steps"] == steps
    return statistics.fmean(per_step) * 1e6, take * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 48])
    ap.add_argument("--requests", type=int, nargs="+", default=[128])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ["MEGAMOE_ROUTING_CAPTURE"] = "1"
    import torch

    print(f"bench_capture_host.py: {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, {args.steps} decode steps, top-{args.topk}, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| layers | requests | host us per step (mean over the steps, median of reps) | take ms |")
    print("|---|---|---|---|")
    for layers in args.layers:
        for requests in args.requests:
            runs = [measure(layers, requests, args.steps, args.topk, args.device) for _ in range(args.reps)]
            print(f"| {layers} | {requests} | {statistics.median(r[0] for r in runs):.1f} | "
                  f"{statistics.median(r[1] for r in runs):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
