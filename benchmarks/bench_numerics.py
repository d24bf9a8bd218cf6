"""The cost of run.numerics=bitwise against fast, in one process: rollout tokens/s and training tokens/s.

    python benchmarks/bench_numerics.py                                   # CPU, the tiny model
    python benchmarks/bench_numerics.py --layers 4 --hidden 256 --experts 16 --intermediate 128 --out r.md
    python benchmarks/bench_numerics.py --device cuda --layers 8 --hidden 1024 --experts 64 --topk 8 \
        --intermediate 512 --prompts 64 --n 8 --max-tokens 64 --micro-batch 64 --reps 5 --gen-reps 3
        # one GPU, bf16 (h200_rl.yaml's model); on the H200 a rollout of 16 x 8 completions of 32 tokens
        # (about 0.3 s per call) was too short to time: two fast engines differed by up to 43 %

Rollout: for each numerics in turn (fast, bitwise, fast again: the order effect shows) one vLLM engine
(moe_impl megamoe) generates --prompts x --n completions of --max-tokens at temperature 0.8, after a warm-up
call of the same size; completion tokens / s of the best of --gen-reps `generate` calls (engine start
excluded). Training: a fast and a bitwise trainer (trainer.model.load_model; fp32 on CPU, bf16 on CUDA),
both in this process, take turns: forward + backward of the GRPO loss's logprobs over the sampled sequences
in micro-batches of --micro-batch, --reps rounds (prompt + completion tokens / s, median and best: the
passes are host-bound on the H200, their times spread by tens of percent between passes). Also checks that
the bitwise trainer reproduces the bitwise sampler's logprobs. --profile adds, per numerics, the 12 kernels
with the most GPU time of one training pass and the 15 ops with the most host time (torch.profiler).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ORDER = ("fast", "bitwise", "fast")


def training_pass(model_dir, numerics, prompts, completions, micro_batch: int, device: str):
    """(one_pass, tokens): forward + backward of the GRPO loss's logprobs over the sequences, in micro-batches
    (TrainerWorker's forward), with a model loaded in `numerics`."""
    import torch

    from trainer.batch import collate, micro_batches, score_rows
    from trainer.loss import token_logprobs
    from trainer.model import load_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(model_dir, "megamoe", dtype=dtype, device=device, numerics=numerics).train()
    seqs = score_rows(prompts, completions, vocab_size=model.config.vocab_size,
                      max_seq_len=max(len(p) + len(c) for p, c in zip(prompts, completions)), truncate=False)
    tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))

    def one_pass():
        for mb_seqs in micro_batches(seqs, len(seqs), micro_batch):
            mb = collate(mb_seqs, 0, torch.device(device))
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            picked = torch.gather(logits, 1, mb.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            (token_logprobs(picked, mb.targets, 0.8, numerics) * mb.mask).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)

    return one_pass, tokens


def profile_pass(one_pass, device: str) -> str:
    """The 12 kernels (CUDA) or ops (CPU) with the most time, and on CUDA the 15 ops with the most host time,
    of one pass under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        one_pass()
    wall_ms = (time.perf_counter() - t0) * 1e3
    averages = prof.key_averages()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    table = averages.table(sort_by=key, row_limit=12)
    if device == "cuda":
        # Kernel time against the pass's wall time: far below it, the pass waits on the host (launches).
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = sum(e.device_time for e in kernels) / 1e3
        table = (f"{len(kernels)} kernels, {busy_ms:.1f} ms of GPU time in a {wall_ms:.1f} ms pass (under the "
                 f"profiler)\n" + table + "\nby host time:\n" + averages.table(sort_by="cpu_time_total", row_limit=15))
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=5, help="training passes per numerics, in turns")
    p.add_argument("--gen-reps", type=int, default=2, help="timed generate calls per engine (the best counts)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--profile", action="store_true", help="one training pass per numerics under torch.profiler")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args()

    import torch
    import vllm

    from rl.make_model import make_model
    from rollout.worker import RolloutWorker

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = {}
    if device == "cuda":
        from rollout.testing import gpu_engine_kwargs

        engine = dict(**gpu_engine_kwargs(), kv_cache_memory_bytes=2 << 30)

    tmp = tempfile.mkdtemp(prefix="bench_numerics_")
    model_dir = make_model(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden, experts=args.experts,
                           topk=args.topk, intermediate=args.intermediate)
    prompts = [f"digit {i % 10}: the red bird is number {i}" for i in range(args.prompts)]
    rollout, sampled = [], {}
    for numerics in ORDER:
        w = RolloutWorker(model_dir, "megamoe", dtype=dtype, seed=0, max_model_len=256,
                          **{"kv_cache_memory_bytes": 256 << 20, **engine}, numerics=numerics)
        try:
            sampling = {"temperature": 0.8, "max_tokens": args.max_tokens, "seed": 1, "ignore_eos": True}
            # warm-up at the timed call's sizes, so that nothing is compiled or allocated for the first time
            # inside the timing (with a 2-prompt warm-up the first fast engine on a fresh H200 read 3.8k
            # tokens/s, the same settings later in the process 9.2k; the cause was not isolated)
            w.generate(prompts, args.n, {**sampling, "seed": 2})
            best = float("inf")
            for _ in range(args.gen_reps):
                t0 = time.perf_counter()
                samples = w.generate(prompts, args.n, sampling)
                best = min(best, time.perf_counter() - t0)
        finally:
            w.close()
        sampled[numerics] = samples
        rollout.append((numerics, sum(len(x.completion_ids) for x in samples) / best))
        print(f"{numerics}: rollout {rollout[-1][1]:.0f} tok/s", flush=True)

    passes, tokens, times, profiles = {}, {}, {}, []
    for numerics in ("fast", "bitwise"):
        s = sampled[numerics]
        passes[numerics], tokens[numerics] = training_pass(model_dir, numerics, [x.prompt_ids for x in s],
                                                 [x.completion_ids for x in s], args.micro_batch, device)
        passes[numerics]()  # compiles the Triton kernels (CUDA) and warms the allocator
        times[numerics] = []
    for _ in range(args.reps):  # in turns, so that a drift of the machine reaches both alike
        for numerics, one_pass in passes.items():
            t0 = time.perf_counter()
            one_pass()
            times[numerics].append(time.perf_counter() - t0)
    training = {n: (tokens[n] / statistics.median(t), tokens[n] / min(t)) for n, t in times.items()}
    for numerics, (median, best) in training.items():
        print(f"{numerics}: training {median:.0f} tok/s median, {best:.0f} best of {args.reps}", flush=True)
        if args.profile:
            profiles.append((numerics, profile_pass(passes[numerics], device)))

    from trainer.model import load_model
    from trainer.probe import score

    s = sampled["bitwise"]
    model = load_model(model_dir, "megamoe", dtype=getattr(torch, dtype), device=device, numerics="bitwise").eval()
    got, _ = score(model, [x.prompt_ids for x in s], [x.completion_ids for x in s], temperature=0.8,
                   micro_batch_size=args.micro_batch, numerics="bitwise")
    same = got == [x.sampler_logprobs for x in s]
    fast_rollout = statistics.mean(r for n, r in rollout if n == "fast")
    bw_rollout = [r for n, r in rollout if n == "bitwise"][0]
    machine = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or platform.machine()}"
    head = (f"{machine}, {os.cpu_count()} cores | torch {torch.__version__} | "
            f"vLLM {vllm.__version__} | {datetime.date.today()} | Qwen3-MoE layers={args.layers} H={args.hidden} "
            f"E={args.experts} k={args.topk} I={args.intermediate} {dtype} | {args.prompts}x{args.n} completions of "
            f"{args.max_tokens} tokens, {tokens['bitwise']} tokens per training pass")
    lines = [head, "", f"| numerics | rollout tok/s (best of {args.gen_reps}) |", "|---|---|"]
    lines += [f"| {n} | {r:.0f} |" for n, r in rollout]
    lines += ["", f"| numerics | training tok/s, median of {args.reps} | best |", "|---|---|---|"]
    lines += [f"| {n} | {m:.0f} | {b:.0f} |" for n, (m, b) in training.items()]
    lines.append(f"\nbitwise / fast: rollout {bw_rollout / fast_rollout:.2f}x (against the mean of the two fast "
                 f"engines), training {training['bitwise'][0] / training['fast'][0]:.2f}x (medians); bitwise trainer "
                 f"reproduces the bitwise sampler's logprobs: {same}")
    for numerics, table in profiles:
        lines += ["", f"training pass, {numerics}:", "```", table, "```"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
