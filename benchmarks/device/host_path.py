"""Where the host's time goes on megamoe's GPU call path, layer by layer, and how much of it a
single call exposes (the gap between an eager call's latency and its device time).

    python3 benchmarks/device/host_path.py --shape qwen3 --tokens 64 4096

For each layer, from the raw launcher up to the public autograd op:
  host us   host time per call: 20 calls issued back to back with no synchronisation (the host
            never waits for the GPU: the queue holds far more launches), the best of 10 such batches
  eager ms  median (upper) over 30 calls of CUDA-event time around one call on an idle stream
            (what bench_moe.py measures: host latency before each launch shows up here)
The forward's device time alone is a CUDA graph of the public forward, replayed (no host work).
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.bench_moe import SHAPES, graph_ms, make_inputs, time_ms  # noqa: E402
from megamoe import fused  # noqa: E402
from megamoe.kernels import moe_kernels  # noqa: E402
from megamoe.moe import fused_moe  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_us(fn, n: int = 20, batches: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best / n * 1e6


def eager_ms(fn, n: int = 30) -> float:
    return time_ms(fn, n, warmup=1)


def rows_for(name: str, T: int):
    E, H, I, k = SHAPES[name]  # noqa: E741
    x, w13, w2, tw, ids = make_inputs(E, H, I, k, T, device="cuda", dtype=torch.bfloat16)
    ids = ids.contiguous()  # the raw launcher layers below (the public wrappers make it so themselves)
    args = (x, w13, w2, tw, ids)
    cfg = fused.config_for(x)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w13, w2, tw)]
    dy = torch.randn_like(x)
    _, gu = fused.fused_moe_fwd(*args, check=False, save_gu=True)

    def train_step():
        for t in leaves:
            t.grad = None
        fused_moe(*leaves, ids, check_ids=False).backward(dy)

    def public_nograd():
        with torch.no_grad():
            return fused_moe(*args, check_ids=False)

    def step_direct():  # the launchers alone, no autograd
        _, g = fused.fused_moe_fwd(*args, check=False, save_gu=True)
        fused.fused_moe_bwd(dy, *args, gu=g)

    launch = lambda: fused.launch_persistent(False, *args, None, T, H, I, E, k, cfg)  # noqa: E731
    layers = [
        ("launch_persistent, launch a no-op", launch, True),
        ("launch_persistent (forward)", launch, False),
        ("fused_moe_fwd(check=False)", lambda: fused.fused_moe_fwd(*args, check=False), False),
        ("torch.ops.megamoe.fused_moe", lambda: torch.ops.megamoe.fused_moe(*args), False),
        ("fused_moe, no grad (public)", public_nograd, False),
        ("fused_moe_bwd from gu (direct)", lambda: fused.fused_moe_bwd(dy, *args, gu=gu), False),
        ("step: public fused_moe + autograd", train_step, False),
        ("step: direct fwd + bwd, no autograd", step_direct, False),
    ]
    out = []
    for label, fn, mock in layers:
        if mock:
            real = moe_kernels._moe_persistent_kernel
            moe_kernels._moe_persistent_kernel = _NoLaunch()
            try:
                out.append((label, host_us(fn), float("nan")))
            finally:
                moe_kernels._moe_persistent_kernel = real
        else:
            out.append((label, host_us(fn), eager_ms(fn)))
    out.append(("CUDA graph of the no-grad forward", float("nan"), graph_ms(public_nograd, 30)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 4096])
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="KernelConfig fields to change, e.g. tma_weights=False (the launch then encodes no tensor maps)")
    args = ap.parse_args()
    from ab_config import config_fields
    changes = config_fields(args.set, "--set")
    if not torch.cuda.is_available():
        raise SystemExit("host_path.py needs a CUDA GPU")
    import dataclasses

    import triton
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    if changes:
        cfg = dataclasses.replace(fused.default_config(torch.bfloat16, torch.device("cuda")), **changes)
        fused.set_config(cfg)
        print(f"config: {cfg}")
    for T in args.tokens:
        print(f"\n{args.shape} T={T} bf16")
        print(f"{'layer':36s} {'host us':>8s} {'eager ms':>9s}")
        for label, h, e in rows_for(args.shape, T):
            print(f"{label:36s} {h:8.0f} {e:9.3f}")


if __name__ == "__main__":
    main()
