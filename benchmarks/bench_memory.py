"""Backward activation memory per token: what autograd keeps alive between the forward and the
backward of one MoE layer, `megamoe` vs the unfused `reference` path (issue: the Mega MoE kernel,
target "backward activation memory <= the unfused path's").

    python benchmarks/bench_memory.py                    # every shape, T = 256, bf16, on this CPU
    python benchmarks/bench_memory.py --shapes qwen3 --tokens 64 256 --out results.md

Measured with saved-tensor hooks at storage level (megamoe.testing.saved_for_backward_bytes), not
with an allocator, so the numbers are the same on any device: storages that belong to the op's
inputs (x, the weights, the routing) are reported apart, since they stay alive without the op.
On CPU the megamoe op runs its torch backend, which saves the same tensors as the Triton path
(one op, `megamoe::fused_moe_train`, whose autograd saves its inputs and (gate, up)); the reference
path's grouped GEMMs run as per-expert matmuls on CPU and as torch._grouped_mm on a Hopper GPU,
both of which save their two operands.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_moe import SHAPES, make_inputs  # noqa: E402
from megamoe.moe import fused_moe  # noqa: E402
from megamoe.testing import saved_for_backward_bytes  # noqa: E402


def inputs(E, H, I, k, T, dtype):  # noqa: E741
    x, w13, w2, tw, ids = make_inputs(E, H, I, k, T, device="cpu", dtype=dtype)
    return [t.requires_grad_(True) for t in (x, w13, w2, tw)] + [ids]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[256])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    lines = [f"torch {torch.__version__} | {args.dtype} | {datetime.date.today().isoformat()} | device cpu",
             "", "| shape (E, H, I, k) | T | megamoe bytes/token | reference bytes/token | megamoe / reference | "
             "reference's largest saved storages (KiB per token) |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in args.shapes:
        E, H, I, k = SHAPES[name]  # noqa: E741
        for T in args.tokens:
            xs = inputs(E, H, I, k, T, dtype)
            got = {}
            for impl in ("megamoe", "reference"):
                detail: list = []
                got[impl] = saved_for_backward_bytes(lambda *a: fused_moe(*a, impl=impl), *xs, detail=detail)[0]
                if impl == "reference":
                    sizes = sorted(((n, str(dt).removeprefix("torch.")) for _, dt, n, is_input in detail
                                    if not is_input), reverse=True)
                    top = ", ".join(f"{n / T / 1024:.1f} {dt}" for n, dt in sizes[:6])
            line = (f"| {name} ({E}, {H}, {I}, {k}) | {T} | {got['megamoe'] / T / 1024:.1f} KiB | "
                    f"{got['reference'] / T / 1024:.1f} KiB | {got['megamoe'] / got['reference']:.2f} | {top} |")
            print(line, flush=True)
            lines.append(line)
            del xs
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
