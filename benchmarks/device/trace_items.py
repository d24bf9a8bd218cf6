"""Where one persistent launch (forward, or with --backward also the backward's) spends its time,
work item by work item, on a GPU.

    python3 benchmarks/device/trace_items.py --cases qwen3:64 qwen3:4096 dsv3:64 mixtral:64
    python3 benchmarks/device/trace_items.py --backward --cases qwen3:4096 mixtral:4096

Launches the forward's traced variant (fused.launch_persistent(trace=...): every ticket stores its
start, the end of its wait and its end from the GPU's %globaltimer, and which program ran it) and
reports, per kind of work item (routing metadata, GEMM1, GEMM2, combine, and tickets of row tiles
past the routed ones), how many ran, their mean time waiting (GEMM2: for its tile's GEMM1 items;
the first GEMM1 item of a program: for the routing metadata; combine: for every GEMM2 item) and
working, and how the launch's span divides between work, waits and the gaps between a program's
tickets (taking the next ticket). The traced variant is a separate compile with a few more stores per
ticket; its output is checked bitwise against the untraced launch, and both calls are timed (the
traced one including its record buffer's fill and the copy to the host), an upper bound on what
tracing changes. --backward also traces the training backward's persistent launch (reading the
forward's saved (gate, up); its items: phase 1 = d(gate, up) from dy, phase 2 = the dx rows, then
the per-token gather of dx and d(topk_weights)); the weight-gradient kernel is a separate launch and
not traced. Needs a CUDA GPU (the CPU test runs the same code under the interpreter, where "times"
are ticket numbers: tests/megamoe/test_trace.py).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

KINDS = {0: "metadata", 1: "GEMM1", 2: "GEMM2", 3: "combine", 5: "GEMM1 (no tile)", 6: "GEMM2 (no tile)"}
BWD_KINDS = {0: "metadata", 1: "d(gate, up)", 2: "dx rows", 3: "dx, dtw gather", 5: "d(gate, up) (no tile)",
             6: "dx rows (no tile)"}


def traced_launch(is_bwd, x, w13, w2, tw, ids, dy=None, gu=None, cfg=None, traced=True):
    """(outputs, ticks [tickets, 4] int64 on the CPU, layout) of one traced persistent launch: the
    forward (outputs = (y,)) or the backward reading the saved gu (outputs = (dx, d(topk_weights))).
    traced=False: the same launch untraced, (outputs, None, None)."""
    from megamoe import fused

    T, H = x.shape
    E, two_i, _ = w13.shape
    cfg = cfg or fused.config_for(x)
    trace: dict | None = {} if traced else None
    res = fused.launch_persistent(is_bwd, x, w13, w2, tw.contiguous(), ids.contiguous(), dy, T, H, two_i // 2, E,
                                   ids.shape[1], cfg, gu=gu, trace=trace)
    outs = (res[0], res[3]) if is_bwd else (res[0],)
    return (outs, trace["ticks"].cpu(), trace["layout"]) if traced else (outs, None, None)


def traced_forward(x, w13, w2, tw, ids, cfg=None):
    """(y, ticks [tickets, 4] int64 on the CPU, layout) of one traced forward launch."""
    outs, ticks, layout = traced_launch(False, x, w13, w2, tw, ids, cfg=cfg)
    return outs[0], ticks, layout


def summarize(ticks: torch.Tensor, P0: int | None = None, kinds: dict = KINDS) -> dict:
    """Per kind: count, mean wait and work; the span and its split; with P0 (the layout's), the
    routing metadata's three steps (0a block histograms, 0b prefixes, 0c scatters: the longest item
    of each) and when the last one ended. `ticks` as traced_forward gives (rows never written, -1,
    are tickets no program took: there are none in a finished launch)."""
    done = ticks[ticks[:, 3] >= 0]
    start, ready, end = done[:, 0].double(), done[:, 1].double(), done[:, 2].double()
    code = done[:, 3] % 16
    prog = done[:, 3] // 16
    t0 = float(start.min())
    span = float(end.max()) - t0
    out = {"tickets": int(done.shape[0]), "untaken": int(ticks.shape[0] - done.shape[0]), "span": span,
           "programs": int(prog.max()) + 1, "kinds": {}}
    for c, name in kinds.items():
        m = code == c
        if int(m.sum()):
            out["kinds"][name] = dict(n=int(m.sum()), wait=float((ready - start)[m].mean()),
                                      work=float((end - ready)[m].mean()), work_sum=float((end - ready)[m].sum()),
                                      wait_sum=float((ready - start)[m].sum()))
    gaps = 0.0
    first = []
    tail = []
    for p in prog.unique().tolist():
        sel = prog == p
        s, e = start[sel], end[sel]
        order = torch.argsort(s)
        s, e = s[order], e[order]
        gaps += float((s[1:] - e[:-1]).clamp(min=0).sum())
        first.append(float(s[0]) - t0)
        tail.append(t0 + span - float(e[-1]))
    total = span * out["programs"]
    work = sum(k["work_sum"] for k in out["kinds"].values())
    wait = sum(k["wait_sum"] for k in out["kinds"].values())
    out.update(work_frac=work / total, wait_frac=wait / total, gap_frac=gaps / total,
               lead_frac=sum(first) / total, tail_frac=sum(tail) / total)
    if P0:
        nb = (P0 - 1) // 2
        meta = ticks[:P0].double()
        work_m = meta[:, 2] - meta[:, 1]
        out["metadata_steps"] = dict(a=float(work_m[:nb].max()), b=float(work_m[nb]), c=float(work_m[nb + 1:].max()),
                                     done=float(meta[:, 2].max()) - t0)
    return out


def report(case: str, s: dict, unit: str, ms_plain: float | None, ms_traced: float | None) -> str:
    lines = [f"{case}: {s['tickets']} tickets on {s['programs']} programs, span {s['span'] / 1e3:.1f} {unit}"
             + (f"; launch alone {ms_plain:.3f} ms, traced {ms_traced:.3f} ms" if ms_plain else "")]
    lines.append(f"  of programs x span: work {s['work_frac']:.1%}, waits {s['wait_frac']:.1%}, between tickets "
                 f"{s['gap_frac']:.1%}, before the first ticket {s['lead_frac']:.1%}, after the last {s['tail_frac']:.1%}")
    if "metadata_steps" in s:
        m = s["metadata_steps"]
        lines.append(f"  metadata steps (longest item): 0a {m['a'] / 1e3:.2f}, 0b {m['b'] / 1e3:.2f}, 0c {m['c'] / 1e3:.2f} "
                     f"{unit}; all done {m['done'] / 1e3:.2f} {unit} after the first ticket")
    for name, k in s["kinds"].items():
        lines.append(f"  {name:16s} n={k['n']:6d}  wait {k['wait'] / 1e3:8.2f}  work {k['work'] / 1e3:8.2f} {unit} "
                     f"(mean)  work total {k['work_sum'] / s['span'] / s['programs']:6.1%} of programs x span")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["qwen3:64", "qwen3:4096", "dsv3:64", "mixtral:64"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="KernelConfig fields to change")
    ap.add_argument("--backward", action="store_true", help="also trace the backward's persistent launch")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("trace_items.py needs a CUDA GPU (tests/megamoe/test_trace.py runs the traced kernel on CPU)")
    from benchmarks.bench_moe import SHAPES, header, make_inputs, time_ms
    from megamoe import fused

    print(header(), flush=True)
    import dataclasses

    from ab_config import config_fields
    cfg = dataclasses.replace(fused.default_config(torch.bfloat16, torch.device("cuda")),
                              **config_fields(args.set, "--set"))
    print(f"config: {cfg}", flush=True)
    fused.set_config(cfg)
    for case in args.cases:
        name, T = case.split(":")
        E, H, I, k = SHAPES[name]  # noqa: E741
        x, w13, w2, tw, ids = make_inputs(E, H, I, k, int(T))
        y_plain = fused.fused_moe_fwd(x, w13, w2, tw, ids, check=False)
        y, ticks, layout = traced_forward(x, w13, w2, tw, ids)
        same = torch.equal(y, y_plain)
        ms_plain = time_ms(lambda: fused.fused_moe_fwd(x, w13, w2, tw, ids, check=False), args.reps)
        ms_traced = time_ms(lambda: traced_forward(x, w13, w2, tw, ids), args.reps)
        y, ticks, layout = traced_forward(x, w13, w2, tw, ids)  # a warm launch's timeline
        print(report(case, summarize(ticks, layout["P0"]), "us", ms_plain, ms_traced) + f"\n  layout {layout}, traced output "
              f"bitwise equal to the untraced: {same}", flush=True)
        if args.backward:
            dy = torch.randn_like(x)
            gu = fused.fused_moe_fwd(x, w13, w2, tw, ids, check=False, save_gu=True)[1]

            def plain():
                return traced_launch(True, x, w13, w2, tw, ids, dy, gu, cfg, traced=False)[0]

            outs, ticks, layout = traced_launch(True, x, w13, w2, tw, ids, dy, gu, cfg)
            same = all(torch.equal(a, b) for a, b in zip(outs, plain()))
            ms_plain = time_ms(plain, args.reps)
            ms_traced = time_ms(lambda: traced_launch(True, x, w13, w2, tw, ids, dy, gu, cfg), args.reps)
            outs, ticks, layout = traced_launch(True, x, w13, w2, tw, ids, dy, gu, cfg)
            print(report(case + " backward", summarize(ticks, layout["P0"], BWD_KINDS), "us", ms_plain, ms_traced)
                  + f"\n  layout {layout}, traced dx and d(topk_weights) bitwise equal to the untraced: {same}",
                  flush=True)


if __name__ == "__main__":
    main()
