"""Times megamoe vs the unfused `reference` path vs Liger Kernel's fused_moe, in one process on a GPU.

    python benchmarks/bench_moe.py                       # every shape, T in {64, 512, 4096, 16384}
    python benchmarks/bench_moe.py --shapes qwen3 --tokens 4096 16384 --reps 50 --out results.md

Forward and forward+backward, median over --reps repetitions timed with CUDA events, bf16.
--rounds R (default 1) times every (implementation, forward / forward+backward) pair R times,
round-robin over the pairs, and keeps each pair's least median, also printing the spread of its R
medians: the implementations then share the machine's drifts (a peer's time alone has moved 10-15 %
between runs on the H200) instead of each meeting its own.
FLOPs: 6*T*k*H*I per forward (two GEMMs, gate+up counted as 2I), x3 for forward+backward.
Decode (T <= 512) is also compared with its weight-read floor: bytes of the experts touched / the
device copy bandwidth measured in the same process; there megamoe's forward is also timed as a
replayed CUDA graph (device time only, as vLLM runs decode steps). --graph times every implementation's
forward that way at every T (rows "graph"; one that cannot be captured says n/a and why), which
separates device time from the host time an eager call exposes. Liger comes from `liger-kernel`
(pure-Python Triton package); when it is not importable its columns say so. `--impls ... vllm` adds vLLM's
own Triton fused MoE (`fused_experts`, what vLLM's stock MoE layer runs; forward only, its output checked
against megamoe's first), the kernel the plugin replaces in the engine:
    python benchmarks/bench_moe.py --shapes qwen3 --tokens 64 256 512 2048 --impls megamoe vllm --graph --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megamoe.contract import clamped_swiglu  # noqa: E402
from megamoe.fused import fused_moe_fwd  # noqa: E402
from megamoe.moe import fused_moe  # noqa: E402
from megamoe.ref import moe_unfused  # noqa: E402
from megamoe.routing import route  # noqa: E402

SHAPES = {  # name: (E, H, I, k)
    "qwen3": (128, 2048, 768, 8),      # Qwen3-30B-A3B
    "olmoe": (64, 2048, 1024, 8),      # OLMoE-1B-7B
    "mixtral": (8, 4096, 14336, 2),    # Mixtral-8x7B
    "dsv3": (32, 7168, 2048, 8),       # DeepSeek-V3 slice
    "dsv2_lite": (64, 2048, 1408, 6),  # DeepSeek-V2-Lite's routed experts (Moonlight's are alike)
    "gpt_oss_20b": (32, 2880, 2880, 4),  # gpt-oss-20b: experts with biases and the clamped SwiGLU
}
# Shapes whose experts have biases and gpt-oss's clamped SwiGLU: megamoe and the reference run them
# with those; "megamoe_plain" is the bias-free silu kernel at the same shape (the options' cost) and
# Liger, which has neither option, runs that plain problem too.
GPT_OSS_SHAPES = ("gpt_oss_20b",)


def header() -> str:
    try:
        here = os.path.dirname(__file__)
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                         cwd=here, stderr=subprocess.DEVNULL).strip()
        if subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], text=True,
                                   cwd=here, stderr=subprocess.DEVNULL).strip():
            commit += "+uncommitted changes"
    except Exception:
        commit = "unknown"
    import triton
    return (f"GPU {torch.cuda.get_device_name()} | CUDA {torch.version.cuda} | torch {torch.__version__} | "
            f"Triton {triton.__version__} | commit {commit} | {datetime.date.today().isoformat()}")


def time_ms(fn, reps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn, reps: int) -> float:
    """time_ms of `fn` captured once in a CUDA graph and replayed: device time without host time
    (how vLLM runs decode steps)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, reps)


def interleaved_ms(timers: dict, rounds: int, report=None) -> dict:
    """{key: [median ms of each round]}: every timer of `timers` ({key: () -> ms}) once per round,
    in the dict's order, `rounds` rounds one after another (round-robin); report(key, round, ms),
    if given, after each timing."""
    if rounds < 1:
        raise ValueError(f"rounds: expected an int >= 1, got {rounds!r}")
    out = {key: [] for key in timers}
    for r in range(rounds):
        for key, timer in timers.items():
            out[key].append(timer())
            if report:
                report(key, r, out[key][-1])
    return out


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, counting bytes read + written."""
    a = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), 20)
    return 2 * a.numel() / (ms * 1e-3)


def make_inputs(E, H, I, k, T, seed=0, device="cuda", dtype=torch.bfloat16):  # noqa: E741
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, device=device, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device, generator=g) / I ** 0.5).to(dtype)
    logits = torch.randn(T, E, device=device, generator=g)
    tw, ids = route(logits, k, renormalize=True)
    return x, w13, w2, tw, ids


def expert_options(name: str, x: torch.Tensor) -> dict:
    """fused_moe's expert options for shape `name` on x's device and dtype: gpt-oss shapes get seeded
    biases (b13 [E, 2I], b2 [E, H], 0.1 * N(0, 1)) and the clamped SwiGLU; every other shape none."""
    if name not in GPT_OSS_SHAPES:
        return {}
    E, H, I, _ = SHAPES[name]  # noqa: E741
    g = torch.Generator(device=x.device).manual_seed(1)
    return dict(b13=(0.1 * torch.randn(E, 2 * I, device=x.device, generator=g)).to(x.dtype),
                b2=(0.1 * torch.randn(E, H, device=x.device, generator=g)).to(x.dtype),
                activation=clamped_swiglu())


def floor_ms(ids: torch.Tensor, H: int, I: int, elem_size: int, bw: float) -> float:  # noqa: E741
    """Decode's weight-read floor: the bytes of the experts `ids` touches (w13 and w2, 3·H·I
    elements each) at the copy bandwidth `bw` (bytes/s, copy_bandwidth())."""
    return int(torch.unique(ids[ids >= 0]).numel()) * 3 * H * I * elem_size / bw * 1e3


def liger_fn():
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception as exc:  # noqa: BLE001
        return None, f"not importable: {type(exc).__name__}: {exc}"
    return LigerFusedMoEFunction, None


VLLM_AGREE = 0.02
"""vLLM's output may differ from megamoe's by at most this fraction of max |y| to be timed: both compute in the
inputs' dtype with fp32 accumulation, so bf16 rounding of the intermediate (2^-8 relative) bounds the gap well
below it; a layout mismatch (e.g. gate and up swapped) gives differences of the order of |y| itself."""


def vllm_fn():
    """vLLM's Triton fused MoE (`fused_experts`, the kernel vLLM's stock MoE layer runs unquantized), forward
    only; (None, why) where vLLM is not importable."""
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except Exception as exc:  # noqa: BLE001
        return None, f"not importable: {type(exc).__name__}: {exc}"
    return fused_experts, None


def vllm_disagreement(vllm_experts, x, w13, w2, tw, ids) -> tuple[float, float, str | None]:
    """(max |dy|, max |y|, why not to time it or None): vLLM's output against megamoe's on the same inputs,
    refused beyond VLLM_AGREE of max |y|."""
    want = fused_moe_fwd(x, w13, w2, tw, ids, check=False).float()
    err = (vllm_experts(x, w13, w2, tw, ids.to(torch.int32)).float() - want).abs().max().item()
    scale = want.abs().max().item()
    why = None if err <= VLLM_AGREE * scale else \
        f"output disagrees with megamoe's: max |dy| {err:.3e} > {VLLM_AGREE} x max |y|"
    return err, scale, why


def bench_shape(name, T, reps, impls, bw, lines, records, rounds: int = 1, graph: bool = False):
    E, H, I, k = SHAPES[name]  # noqa: E741
    x, w13, w2, tw, ids = make_inputs(E, H, I, k, T)
    flops = 6.0 * T * k * H * I
    dy = torch.randn_like(x)
    liger, liger_err = liger_fn()
    ids32 = ids.to(torch.int32)
    tw_bf = tw.to(x.dtype)
    opts = expert_options(name, x)  # the experts' options of this shape (megamoe and the reference)
    if opts:
        impls = list(impls) + (["megamoe_plain"] if "megamoe" in impls else [])
    ref_opts = {"b13_E2I": opts["b13"], "b2_EH": opts["b2"], "activation": opts["activation"]} if opts else {}

    fwd = {
        "megamoe": lambda: fused_moe_fwd(x, w13, w2, tw, ids, check=False, **opts),
        "megamoe_plain": lambda: fused_moe_fwd(x, w13, w2, tw, ids, check=False),
        "reference": lambda: moe_unfused(x, w13, w2, tw, ids, check_ids=False, **ref_opts),
    }
    if liger is not None:
        fwd["liger"] = lambda: liger.apply(x, w13, w2, ids32, tw_bf)
    vllm_experts, vllm_err = vllm_fn() if "vllm" in impls else (None, None)
    if vllm_experts is not None and opts:
        vllm_experts, vllm_err = None, "runs bias-free silu only here (no gpt-oss options)"
    if vllm_experts is not None:
        fwd["vllm"] = lambda: vllm_experts(x, w13, w2, tw, ids32)

    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w13, w2)] + [tw.clone().requires_grad_(True)]
    bias_leaves = [opts[n].detach().clone().requires_grad_(True) for n in ("b13", "b2")] if opts else [None, None]

    def fb(impl):
        def run():
            for t in leaves + [b for b in bias_leaves if b is not None]:
                t.grad = None
            lx, lw13, lw2, ltw = leaves
            lb13, lb2 = bias_leaves
            if impl == "megamoe":
                y = fused_moe(lx, lw13, lw2, ltw, ids, impl="megamoe", check_ids=False, b13=lb13, b2=lb2,
                              **({"activation": opts["activation"]} if opts else {}))
            elif impl == "megamoe_plain":
                y = fused_moe(lx, lw13, lw2, ltw, ids, impl="megamoe", check_ids=False)
            elif impl == "reference":
                y = moe_unfused(lx, lw13, lw2, ltw, ids, check_ids=False,
                                **({"b13_E2I": lb13, "b2_EH": lb2, "activation": opts["activation"]} if opts else {}))
            else:
                y = liger.apply(lx, lw13, lw2, ids32, ltw.to(lx.dtype))
            y.backward(dy)
        return run

    row = {"shape": name, "T": T, "E": E, "H": H, "I": I, "k": k, "rounds": rounds,
           "options": "biases + clamped SwiGLU (megamoe, reference); megamoe_plain and liger: bias-free silu"
           if opts else "bias-free silu"}
    timers = {}
    uncapturable = {}  # impl: why its forward could not be captured in a CUDA graph

    def graph_timer(impl):
        def run():
            if impl in uncapturable:
                return float("nan")
            try:
                return graph_ms(fwd[impl], reps)
            except Exception as exc:  # noqa: BLE001  (a forward that waits on the host cannot be captured)
                uncapturable[impl] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                print(f"  {name} T={T} {impl}: forward not capturable: {uncapturable[impl]}", flush=True)
                return float("nan")
        return run

    for impl in impls:
        if (impl == "liger" and liger is None) or (impl == "vllm" and vllm_experts is None):
            row[f"{impl}_fwd_ms"] = row[f"{impl}_fb_ms"] = None
            row[f"{impl}_note"] = liger_err if impl == "liger" else vllm_err
            print(f"  {name} T={T} {impl}: {row[f'{impl}_note']}", flush=True)
            continue
        if impl == "vllm":  # the same problem as megamoe's: its output must agree before it is timed
            err, scale, why = vllm_disagreement(vllm_experts, x, w13, w2, tw, ids)
            row["vllm_max_abs_diff"] = err
            print(f"  {name} T={T} vllm vs megamoe: max |dy| {err:.3e} (max |y| {scale:.3e})", flush=True)
            if why:
                row["vllm_fwd_ms"] = row["vllm_fb_ms"] = None
                row["vllm_note"] = why
                print(f"  {name} T={T} vllm: not timed: {row['vllm_note']}", flush=True)
                continue
        timers[impl, "fwd"] = lambda f=fwd[impl]: time_ms(f, reps)
        if impl == "vllm":
            row["vllm_fb_ms"] = None  # vLLM's fused_experts has no backward
        else:
            timers[impl, "fb"] = lambda f=fb(impl): time_ms(f, reps)
        if graph:
            timers[impl, "graph"] = graph_timer(impl)
    # progress: a run cut by a time limit (Liger autotunes for minutes per new shape) keeps these
    meds = interleaved_ms(timers, rounds, report=lambda key, r, ms: print(
        f"  {name} T={T} {key[0]} {key[1]}: {ms:.3f} ms" + (f" (round {r + 1}/{rounds})" if rounds > 1 else ""),
        flush=True))
    for (impl, mode), ms in meds.items():
        measured = [m for m in ms if m == m]  # NaN: a forward that could not be captured
        row[f"{impl}_{mode}_ms"] = min(measured) if measured else None
        row[f"{impl}_{mode}_rounds_ms"] = ms
        if mode == "graph" and impl in uncapturable:
            row[f"{impl}_graph_note"] = uncapturable[impl]
            continue
        if rounds > 1:
            print(f"  {name} T={T} {impl} {mode}: rounds {' '.join(f'{m:.3f}' for m in ms)} ms, "
                  f"spread {max(ms) / min(ms):.3f}x", flush=True)
    if T <= 512:
        row["floor_ms"] = floor_ms(ids, H, I, x.element_size(), bw)
        if "megamoe" in impls:  # --graph has timed it already
            row["megamoe_graph_fwd_ms"] = row.get("megamoe_graph_ms") or graph_ms(fwd["megamoe"], reps)
    records.append(row)

    def tf(ms, mult):
        return f"{flops * mult / (ms * 1e-3) / 1e12:6.0f}" if ms else "   n/a"

    for mode, mult in (("fwd", 1), ("fb", 3)) + ((("graph", 1),) if graph else ()):
        m = row.get(f"megamoe_{mode}_ms")
        cells = []
        for impl in impls:
            ms = row.get(f"{impl}_{mode}_ms")
            cells.append(f"{impl} {ms:8.3f} ms {tf(ms, mult)} TF/s" if ms else f"{impl}      n/a")
        ratios = []
        for base in impls:
            if base != "megamoe" and row.get(f"{base}_{mode}_ms") and m:
                ratios.append(f"{row[f'{base}_{mode}_ms'] / m:5.2f}x vs {base}")
        floor = f" | floor {row['floor_ms']:.3f} ms ({m / row['floor_ms']:.2f}x)" if mode == "fwd" and "floor_ms" in row and m else ""
        if floor and "megamoe_graph_fwd_ms" in row:
            g = row["megamoe_graph_fwd_ms"]
            floor += f", megamoe as a replayed CUDA graph {g:.3f} ms ({g / row['floor_ms']:.2f}x)"
        line = f"{name:8s} T={T:6d} {mode:3s} | " + " | ".join(cells) + " | " + ", ".join(ratios) + floor
        print(line, flush=True)
        lines.append(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 512, 4096, 16384])
    ap.add_argument("--impls", nargs="+", default=["megamoe", "reference", "liger"],
                    choices=["megamoe", "reference", "liger", "vllm"],
                    help="vllm: vLLM's Triton fused_experts, forward only (default: megamoe reference liger)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the implementations round-robin this many times, keep each one's least median")
    ap.add_argument("--graph", action="store_true",
                    help="also time every implementation's forward captured once in a CUDA graph and replayed "
                         "(device time, no host time): rows 'graph'")
    ap.add_argument("--out", default=None, help="write the table (markdown) and records (json) here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds: expected an int >= 1, got {args.rounds}")
    head = header() + (f" | {args.rounds} interleaved rounds, least median" if args.rounds > 1 else "")
    print(head, flush=True)
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    lines, records = [], []
    for name in args.shapes:
        for T in args.tokens:
            bench_shape(name, T, args.reps, args.impls, bw, lines, records, rounds=args.rounds, graph=args.graph)
            torch.cuda.empty_cache()
            if args.out:  # after every row, so a run stopped by a time limit keeps what it measured
                with open(args.out, "w") as f:
                    f.write(head + "\n\n```\n" + "\n".join(lines) + "\n```\n")
                with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
                    json.dump({"header": head, "copy_bw": bw, "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()
