"""vLLM's default compilation against eager mode, megamoe against vLLM's own MoE: engine start seconds and
rollout tokens/s, one engine at a time in one process.

    python benchmarks/bench_compile.py                                    # CPU, the tiny model
    python benchmarks/bench_compile.py --device cuda --layers 8 --hidden 1024 --experts 64 --topk 8 \
        --intermediate 512 --prompts 256 --n 1 --max-tokens 256 --out r.md  # one GPU, bf16

For each (moe_impl, enforce_eager) of --cases (default: megamoe eager, megamoe compiled, stock compiled, stock
eager), a RolloutWorker on a random-initialised model (rl.make_model) starts (timed: vLLM's compilation and,
on CUDA, its CUDA-graph capture are part of it), makes one warm-up call, then --gen-reps timed `generate`
calls of --prompts x --n completions of exactly --max-tokens tokens (ignore_eos); completion tokens / s of
the best call. The first case's completions are the reference: the table gives each case's share of
completions equal to it and the max |dlogp| over the tokens where they agree.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CASES = ("megamoe:eager", "megamoe:compiled", "stock:compiled", "stock:eager")


def parse_case(case: str) -> tuple[str, bool]:
    impl, _, mode = case.partition(":")
    if impl not in ("megamoe", "reference", "stock") or mode not in ("eager", "compiled"):
        raise SystemExit(f"--cases: expected items moe_impl:eager|compiled (moe_impl megamoe, reference or stock), "
                         f"got {case!r}")
    return impl, mode == "eager"


def run_case(model_dir: str, impl: str, eager: bool, args, prompts: list[str], dtype: str, engine_kwargs: dict):
    from rollout.worker import RolloutWorker

    t0 = time.perf_counter()
    w = RolloutWorker(model_dir, impl, dtype=dtype, seed=0, max_model_len=args.max_model_len,
                      kv_cache_memory_bytes=args.kv_cache_bytes, enforce_eager=eager, **engine_kwargs)
    start_s = time.perf_counter() - t0
    try:
        sampling = {"temperature": 0.8, "max_tokens": args.max_tokens, "ignore_eos": True, "seed": 1}
        w.generate(prompts, args.n, sampling)  # warm-up
        best, samples = float("inf"), None
        for _ in range(args.gen_reps):
            t = time.perf_counter()
            samples = w.generate(prompts, args.n, sampling)
            best = min(best, time.perf_counter() - t)
        status = w.status()[0]
    finally:
        w.close()
    tokens = sum(len(s.completion_ids) for s in samples)
    return {"start_s": start_s, "tok_s": tokens / best, "samples": samples, "compilation": status["compilation"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated moe_impl:eager|compiled")
    p.add_argument("--arch", default="qwen3_moe")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--gen-reps", type=int, default=2, help="timed generate calls per engine (the best counts)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    cases = [parse_case(c.strip()) for c in args.cases.split(",") if c.strip()]

    import torch

    from rl.make_model import make_model

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dtype = "bfloat16" if cuda else "float32"
    engine_kwargs = {}
    if cuda:
        from rollout.testing import gpu_engine_kwargs

        engine_kwargs = gpu_engine_kwargs()
    prompts = [f"Problem {i}: add {i} and {2 * i + 1}, then" for i in range(args.prompts)]
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(os.path.join(tmp, "model"), arch=args.arch, layers=args.layers, hidden=args.hidden,
                                   experts=args.experts, topk=args.topk, intermediate=args.intermediate, seed=0,
                                   dtype=dtype))  # bf16 on CUDA: half the host memory and disk of fp32
        for impl, eager in cases:
            r = run_case(model_dir, impl, eager, args, prompts, dtype, engine_kwargs)
            same, worst = 0, 0.0
            if ref is None:
                ref = r["samples"]
            for a, b in zip(ref, r["samples"]):
                if a.completion_ids == b.completion_ids:
                    same += 1
                    worst = max([worst] + [abs(x - y) for x, y in zip(a.sampler_logprobs, b.sampler_logprobs)])
            rows.append((impl, "eager" if eager else "compiled", r["start_s"], r["tok_s"],
                         same / len(ref), worst, r["compilation"]))
            print(f"{impl:9s} {rows[-1][1]:9s} start {r['start_s']:7.1f} s  {r['tok_s']:10.1f} tok/s  "
                  f"same completions {same}/{len(ref)}  max |dlogp| {worst:.2e}  {r['compilation']}", flush=True)
    head = (f"bench_compile.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.node()}, {'cuda ' + torch.cuda.get_device_name() if cuda else 'cpu'}, {dtype}; "
            f"{args.arch} layers={args.layers} H={args.hidden} E={args.experts} k={args.topk} I={args.intermediate}; "
            f"{args.prompts} prompts x {args.n} x {args.max_tokens} tokens, best of {args.gen_reps}\n\n")
    table = "| moe_impl | mode | engine start (s) | tokens/s | same completions as row 1 | max \\|dlogp\\| there | compilation |\n"
    table += "|---|---|---|---|---|---|---|\n" + "".join(
        f"| {i} | {m} | {s:.1f} | {t:.1f} | {f:.0%} | {w:.2e} | {c} |\n" for i, m, s, t, f, w, c in rows)
    print(head + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(head + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
