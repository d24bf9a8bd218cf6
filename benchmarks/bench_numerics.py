"""The cost of run.numerics=bitwise against fast, in one process: rollout tokens/s and training tokens/s.

    python benchmarks/bench_numerics.py                                   # CPU, the tiny model
    python benchmarks/bench_numerics.py --layers 4 --hidden 256 --experts 16 --intermediate 128 --out r.md
    python benchmarks/bench_numerics.py --device cuda --layers 8 --hidden 1024 --experts 64 --topk 8 \
        --intermediate 512 --prompts 16 --n 8 --micro-batch 64 --profile      # one GPU, bf16 (h200_rl.yaml's model)

For each numerics (fast first, then bitwise, then fast again: the order effect shows): one vLLM engine
(moe_impl megamoe) generates --prompts x --n completions of --max-tokens at temperature 0.8 in one
`generate` call (wall time: completion tokens / s, engine start excluded), then the trainer
(trainer.model.load_model with that numerics; fp32 on CPU, bf16 on CUDA) runs forward + backward of the
GRPO loss's logprobs over those sequences in micro-batches of --micro-batch (prompt + completion tokens / s,
best of --reps). Also checks that the bitwise trainer reproduces the bitwise sampler's logprobs.
On CUDA a bitwise trainer leaves its process in vLLM's batch-invariant mode (megamoe.invariant_gpu): the
second fast run's training measures what that mode alone costs. --profile adds, per run, the 12 kernels
with the most GPU time of one training pass (torch.profiler).
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

ORDER = ("fast", "bitwise", "fast")


def train_tokens_per_s(model_dir, numerics, prompts, completions, micro_batch: int, reps: int, device: str,
                       profile: bool = False) -> tuple[float, str]:
    import torch

    from trainer.batch import collate, micro_batches, validate_batch
    from trainer.loss import token_logprobs
    from trainer.model import load_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(model_dir, "megamoe", dtype=dtype, device=device, numerics=numerics).train()
    seqs, _ = validate_batch({"prompt_ids": prompts, "completion_ids": completions}, vocab_size=model.config.vocab_size,
                             max_seq_len=max(len(p) + len(c) for p, c in zip(prompts, completions)), truncate=False,
                             need_training_fields=False)
    tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))

    def one_pass():
        for mb_seqs in micro_batches(seqs, len(seqs), micro_batch):
            mb = collate(mb_seqs, 0, torch.device(device))
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            picked = torch.gather(logits, 1, mb.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            # TrainerWorker's forward
            (token_logprobs(picked, mb.targets, 0.8, numerics) * mb.mask).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    best = float("inf")
    for _ in range(reps + (device == "cuda")):  # on CUDA a first pass compiles the Triton kernels
        t0 = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    table = ""
    if profile:
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
                     f"profiler)\n" + table + "\nby host time:\n"
                     + averages.table(sort_by="cpu_time_total", row_limit=15))
        model.zero_grad(set_to_none=True)
    return tokens / best, table


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
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--profile", action="store_true", help="the 12 busiest kernels of one training pass per run")
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
    rows, sampled, profiles = [], {}, []
    for numerics in ORDER:
        w = RolloutWorker(model_dir, "megamoe", dtype=dtype, seed=0, max_model_len=256,
                          **{"kv_cache_memory_bytes": 256 << 20, **engine}, numerics=numerics)
        try:
            sampling = {"temperature": 0.8, "max_tokens": args.max_tokens, "seed": 1, "ignore_eos": True}
            # warm-up at the timed call's sizes, so that nothing is compiled or allocated for the first time
            # inside the timing (with a 2-prompt warm-up the first fast engine on a fresh H200 read 3.8k
            # tokens/s, the same settings later in the process 9.2k; the cause was not isolated)
            w.generate(prompts, args.n, {**sampling, "seed": 2})
            t0 = time.perf_counter()
            samples = w.generate(prompts, args.n, sampling)
            gen_s = time.perf_counter() - t0
        finally:
            w.close()
        P, C = [s["prompt_ids"] for s in samples], [s["completion_ids"] for s in samples]
        sampled[numerics] = samples
        rollout = sum(map(len, C)) / gen_s
        train, table = train_tokens_per_s(model_dir, numerics, P, C, args.micro_batch, args.reps, device, args.profile)
        rows.append((numerics, rollout, train))
        profiles.append((numerics, table))
        print(f"{numerics}: rollout {rollout:.0f} tok/s, training {train:.0f} tok/s", flush=True)

    from trainer.model import load_model
    from trainer.probe import score

    s = sampled["bitwise"]
    model = load_model(model_dir, "megamoe", dtype=getattr(torch, dtype), device=device, numerics="bitwise").eval()
    got, _ = score(model, [x["prompt_ids"] for x in s], [x["completion_ids"] for x in s], temperature=0.8,
                   micro_batch_size=args.micro_batch, numerics="bitwise")
    same = got == [x["logprobs"] for x in s]
    fast_r = [r for r in rows if r[0] == "fast"]
    bw = [r for r in rows if r[0] == "bitwise"][0]
    machine = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or platform.machine()}"
    head = (f"{machine}, {os.cpu_count()} cores | torch {torch.__version__} | "
            f"vLLM {vllm.__version__} | {datetime.date.today()} | Qwen3-MoE layers={args.layers} H={args.hidden} "
            f"E={args.experts} k={args.topk} I={args.intermediate} {dtype} | {args.prompts}x{args.n} completions of "
            f"{args.max_tokens} tokens")
    lines = [head, "", "| numerics | rollout tok/s | training tok/s |", "|---|---|---|"]
    lines += [f"| {n} | {r:.0f} | {t:.0f} |" for n, r, t in rows]
    lines.append(f"\nbitwise / fast (mean of the two fast runs): rollout "
                 f"{bw[1] / (sum(r[1] for r in fast_r) / 2):.2f}x, training {bw[2] / (sum(r[2] for r in fast_r) / 2):.2f}x; "
                 f"bitwise trainer reproduces the bitwise sampler's logprobs: {same}")
    for numerics, table in profiles:
        if table:
            lines += ["", f"training pass, {numerics}:", "```", table, "```"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
