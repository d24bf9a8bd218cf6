"""A/B of megamoe kernel configurations in one process on a GPU (the working tree's kernels).

    python3 benchmarks/device/ab_config.py --variants ptr:tma_weights=False st4:num_stages=4 \
        --cases qwen3:4096 qwen3:16384 mixtral:4096

The first column is the default config; each variant is `label:field=value[,field=value]` over
megamoe.fused.KernelConfig. For every case and config: the inference forward (fused_moe_fwd), the
training forward's launch (saving (gate, up)), the backward reading it (fused_moe_bwd with gu) and the
whole step (both), fused_moe_fwd / fused_moe_bwd called directly (no autograd); `--pieces` picks
some of them, and `fwd graph` (the inference forward captured in a CUDA graph and replayed: device
time with no host time, how vLLM decodes). Interleaved rounds, the min of each config's medians. Also
says whether every output of a variant has the default's bits (only the forward's when no piece
needs the backward). Decode cases (T <= 512) also print the weight-read floor (bench_moe.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from benchmarks.bench_moe import (SHAPES, copy_bandwidth, expert_options, floor_ms, graph_ms, header, make_inputs,  # noqa: E402
                                  time_ms)
from megamoe import fused  # noqa: E402


PIECES = ("fwd", "fwd launch (gu)", "bwd (gu)", "step", "fwd graph")


def config_value(v: str):
    """A FIELD=VALUE tool argument's value: True/False/None, an integer, else the string."""
    return {"True": True, "False": False, "None": None}.get(v, int(v) if v.lstrip("-").isdigit() else v)


def config_fields(assignments: list[str], flag: str) -> dict:
    """`FIELD=VALUE` strings -> {field: value} over megamoe.fused.KernelConfig (True/False/None and
    integers converted); an unknown field or a malformed item exits naming `flag`. Shared by the
    device tools that take config changes (ab_config, compile_check, trace_items)."""
    fields = {f.name for f in dataclasses.fields(fused.KernelConfig)}
    out = {}
    for a in assignments:
        k, eq, v = a.partition("=")
        if not eq or k not in fields:
            raise SystemExit(f"{flag}: expected FIELD=VALUE with FIELD one of megamoe.fused.KernelConfig's "
                             f"{sorted(fields)}, got {a!r}")
        out[k] = config_value(v)
    return out


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, assigns = text.partition(":")
    out = config_fields([a for a in assigns.split(",") if a], "--variants")
    return label, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["ptr:tma_weights=False"])
    ap.add_argument("--cases", nargs="+", default=["qwen3:4096", "qwen3:16384", "olmoe:4096", "olmoe:16384",
                                                   "mixtral:4096", "dsv3:4096"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pieces", nargs="+", choices=PIECES, default=list(PIECES[:4]))
    args = ap.parse_args()
    print(header(), flush=True)
    base = fused.default_config(torch.bfloat16, torch.device("cuda"))
    configs = [("default", base)]
    configs += [(lbl, dataclasses.replace(base, **kw)) for lbl, kw in map(parse_variant, args.variants)]
    pieces = tuple(args.pieces)
    train = any(p in pieces for p in PIECES[1:4])
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    print("case | " + " | ".join(f"{p} {lbl}" for p in pieces for lbl, _ in configs) + " | same bits | floor ms",
          flush=True)
    for case in args.cases:
        name, T = case.split(":")
        T = int(T)
        E, H, I, k = SHAPES[name]  # noqa: E741
        x, w13, w2, tw, ids = make_inputs(E, H, I, k, T)
        ids = ids.contiguous()  # the direct launcher call below (the public wrappers make it so themselves)
        dy = torch.randn_like(x)
        o = expert_options(name, x)  # gpt-oss shapes: biases and the clamped SwiGLU

        def fns():
            fwd = lambda: fused.fused_moe_fwd(x, w13, w2, tw, ids, **o, check=False)  # noqa: E731
            launch = lambda: fused.launch_persistent(False, x, w13, w2, tw, ids, None, T, H, I, E, k,  # noqa: E731
                                                      fused.config_for(x), save_gu=True,
                                                      **o)
            gu = fused.fused_moe_fwd(x, w13, w2, tw, ids, **o, check=False, save_gu=True)[1] if train else None
            bwd = lambda: fused.fused_moe_bwd(dy, x, w13, w2, tw, ids, **o, gu=gu)  # noqa: E731
            step = lambda: fused.fused_moe_bwd(  # noqa: E731
                dy, x, w13, w2, tw, ids, **o, gu=fused.fused_moe_fwd(x, w13, w2, tw, ids, **o, check=False, save_gu=True)[1])
            return dict(zip(PIECES, (fwd, launch, bwd, step, fwd)))

        outs, t = {}, {}
        try:
            for lbl, cfg in configs:
                fused.set_config(cfg)
                if train:
                    y, gu = fused.fused_moe_fwd(x, w13, w2, tw, ids, **o, check=False, save_gu=True)
                    outs[lbl] = (y, gu, *fused.fused_moe_bwd(dy, x, w13, w2, tw, ids, **o, gu=gu))
                else:
                    outs[lbl] = (fused.fused_moe_fwd(x, w13, w2, tw, ids, **o, check=False),)
            for _ in range(args.rounds):
                for lbl, cfg in configs:
                    fused.set_config(cfg)
                    fn = fns()
                    for p in pieces:
                        timer = graph_ms if p == "fwd graph" else time_ms
                        t[p, lbl] = min(timer(fn[p], args.reps), t.get((p, lbl), 1e9))
        finally:
            fused.set_config(None)
        differ = [lbl for lbl, _ in configs if not all(torch.equal(a, b) for a, b in zip(outs[lbl], outs["default"]))]
        same = "True" if not differ else "differ: " + ",".join(differ)
        floor = floor_ms(ids, H, I, x.element_size(), bw) if T <= 512 else None
        print(f"{case} | " + " | ".join(f"{t[p, lbl]:.3f}" for p in pieces for lbl, _ in configs) + f" | {same} | "
              + (f"{floor:.3f}" if floor else "-"), flush=True)
        del x, w13, w2, tw, ids, dy, outs, o
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
