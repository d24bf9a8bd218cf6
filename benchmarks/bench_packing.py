"""Packed vs right-padded micro-batches in the trainer (trainer/packing.py): padding fraction and train tokens/s.

    PYTHONPATH=. python benchmarks/bench_packing.py [--seqs 32] [--steps 3] [--out benchmarks/results/packing_cpu.log]

A tiny random Qwen3-MoE (make-model, 2 layers, H=64), one unsharded TrainerWorker (fp32, CPU), a seeded batch
whose lengths spread like RL rollouts (prompts 8-48 tokens, completions 4-160), trained with micro-batches of
`--micro-batch-size` sequences right-padded to their longest, then packed with each of `--token-budgets` tokens
per micro-batch. Tokens/s counts real tokens (prompt + completion) over the wall time of train_step, best of
`--steps` (the first call is a warm-up).

On the CPU, attention over a packed row is sdpa with transformers' dense block-diagonal mask: its cost grows
with the square of the row's length, whatever the sequences in it, so a large budget pays for the masked-out
blocks (at this tiny model's H=64 attention dominates a layer); on a GPU flash-attention's varlen kernels
take the same position ids and compute each sequence's block only.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--token-budgets", default="256,512,1024", help="packed runs, one per budget (comma-separated)")
    ap.add_argument("--out", default=None, help="also write the report here")
    args = ap.parse_args()

    import torch

    from rl.make_model import make_model
    from trainer import packing
    from trainer.batch import micro_batches, train_rows
    from trainer.testing import make_batch
    from trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    batch = make_batch(args.seqs, seed=0, prompt_len=(8, 48), completion_len=(4, 160))
    lines = [f"# bench_packing: {args.seqs} sequences, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
             f"1 thread, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "m", arch="qwen3_moe", seed=0)
        runs = [("padded", {"micro_batch_size": args.micro_batch_size})]
        runs += [(f"packed {b}", {"packing": True, "token_budget": int(b)}) for b in args.token_budgets.split(",")]
        workers, times = {}, {}
        for name, extra in runs:
            workers[name] = TrainerWorker(0, 1, "127.0.0.1", 0, str(model_dir), "megamoe",
                                          {"fsdp": False, "lr": 1e-4, "max_seq_len": 512, **extra})
            workers[name].train_step(batch)  # warm-up
            times[name] = []
        # interleaved, so that a change in the machine's load falls on every variant alike
        for _ in range(args.steps):
            for name, w in workers.items():
                t0 = time.perf_counter()
                w.train_step(batch)
                times[name].append(time.perf_counter() - t0)
        for name, extra in runs:
            w = workers[name]
            seqs, _ = train_rows(batch, vocab_size=w.vocab_size, max_seq_len=512, truncate=False)
            if name == "padded":
                groups = micro_batches(seqs, len(seqs), args.micro_batch_size)
            else:
                groups = packing.packed_groups(seqs, 1, 0, extra["token_budget"])
            frac = packing.padding_fraction(groups, packed=name != "padded")
            real = sum(len(s.prompt) + len(s.completion) for s in seqs)
            slots = sum(len(g) * max((len(s.prompt) + len(s.completion) for s in g), default=0) for g in groups) \
                if name == "padded" else real
            w.close()
            best = min(times[name])
            lines.append(f"{name}: {len(groups)} micro-batches, {slots} token slots, padding {100 * frac:.1f}%, "
                         f"train_step {best * 1e3:.0f} ms (best of {args.steps}, interleaved), "
                         f"{real / best:.0f} train tokens/s ({real} real tokens)")
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
