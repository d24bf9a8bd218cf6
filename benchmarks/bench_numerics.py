"""The cost of run.numerics=bitwise against fast, in one process: rollout tokens/s and training tokens/s.

    python benchmarks/bench_numerics.py                                   # CPU, the tiny model
    python benchmarks/bench_numerics.py --layers 4 --hidden 256 --experts 16 --intermediate 128 --out r.md

For each numerics (fast first, then bitwise, then fast again: the order effect shows): one vLLM engine
(moe_impl megamoe) generates --prompts x --n completions of --max-tokens at temperature 0.8 in one
`generate` call (wall time: completion tokens / s, engine start excluded), then the trainer
(trainer.model.load_model with that numerics, fp32) runs forward + backward of the GRPO loss's
logprobs over those sequences in micro-batches of --micro-batch (prompt + completion tokens / s, best
of --reps). Also checks that the bitwise trainer reproduces the bitwise sampler's logprobs.
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


def train_tokens_per_s(model_dir, numerics, prompts, completions, micro_batch: int, reps: int) -> float:
    import torch

    from trainer.batch import collate, micro_batches, validate_batch
    from trainer.loss import token_logprobs
    from trainer.model import load_model

    model = load_model(model_dir, "megamoe", numerics=numerics).train()
    seqs, _ = validate_batch({"prompt_ids": prompts, "completion_ids": completions}, vocab_size=model.config.vocab_size,
                             max_seq_len=max(len(p) + len(c) for p, c in zip(prompts, completions)), truncate=False,
                             need_training_fields=False)
    tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for mb_seqs in micro_batches(seqs, len(seqs), micro_batch):
            mb = collate(mb_seqs, 0, torch.device("cpu"))
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            picked = torch.gather(logits, 1, mb.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            (token_logprobs(picked, mb.targets, 0.8) * mb.mask).sum().backward()  # TrainerWorker's forward
        best = min(best, time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return tokens / best


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
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args()

    import torch
    import vllm

    from rl.make_model import make_model
    from rollout.worker import RolloutWorker

    tmp = tempfile.mkdtemp(prefix="bench_numerics_")
    model_dir = make_model(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden, experts=args.experts,
                           topk=args.topk, intermediate=args.intermediate)
    prompts = [f"digit {i % 10}: the red bird is number {i}" for i in range(args.prompts)]
    rows, sampled = [], {}
    for numerics in ORDER:
        w = RolloutWorker(model_dir, "megamoe", dtype="float32", seed=0, max_model_len=256,
                          kv_cache_memory_bytes=256 << 20, numerics=numerics)
        try:
            sampling = {"temperature": 0.8, "max_tokens": args.max_tokens, "seed": 1, "ignore_eos": True}
            w.generate(prompts[:2], 2, sampling)  # warm-up
            t0 = time.perf_counter()
            samples = w.generate(prompts, args.n, sampling)
            gen_s = time.perf_counter() - t0
        finally:
            w.close()
        P, C = [s["prompt_ids"] for s in samples], [s["completion_ids"] for s in samples]
        sampled[numerics] = samples
        rollout = sum(map(len, C)) / gen_s
        train = train_tokens_per_s(model_dir, numerics, P, C, args.micro_batch, args.reps)
        rows.append((numerics, rollout, train))
        print(f"{numerics}: rollout {rollout:.0f} tok/s, training {train:.0f} tok/s", flush=True)

    from trainer.model import load_model
    from trainer.probe import score

    s = sampled["bitwise"]
    got, _ = score(load_model(model_dir, "megamoe", numerics="bitwise").eval(), [x["prompt_ids"] for x in s],
                   [x["completion_ids"] for x in s], temperature=0.8, micro_batch_size=args.micro_batch)
    same = got == [x["logprobs"] for x in s]
    fast_r = [r for r in rows if r[0] == "fast"]
    bw = [r for r in rows if r[0] == "bitwise"][0]
    head = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores | torch {torch.__version__} | "
            f"vLLM {vllm.__version__} | {datetime.date.today()} | Qwen3-MoE layers={args.layers} H={args.hidden} "
            f"E={args.experts} k={args.topk} I={args.intermediate} fp32 | {args.prompts}x{args.n} completions of "
            f"{args.max_tokens} tokens")
    lines = [head, "", "| numerics | rollout tok/s | training tok/s |", "|---|---|---|"]
    lines += [f"| {n} | {r:.0f} | {t:.0f} |" for n, r, t in rows]
    lines.append(f"\nbitwise / fast (mean of the two fast runs): rollout "
                 f"{bw[1] / (sum(r[1] for r in fast_r) / 2):.2f}x, training {bw[2] / (sum(r[2] for r in fast_r) / 2):.2f}x; "
                 f"bitwise trainer reproduces the bitwise sampler's logprobs: {same}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
