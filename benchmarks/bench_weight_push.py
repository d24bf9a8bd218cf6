"""Times RolloutWorker.update_weights (the RL loop's weight push) phase by phase, on this machine.

    python benchmarks/bench_weight_push.py                         # CPU: vLLM CPU engine, bf16
    python benchmarks/bench_weight_push.py --layers 8 --reps 3 --engine-kwargs '{"gpu_memory_utilization": 0.3}'

Builds a random Qwen3-MoE (default 4 layers, H=1024, E=64, k=8, I=512: 0.4 B parameters, 0.8 GB in
bf16), starts one engine, then pushes the full state dict --reps times (transformers' names, fused
experts, as the trainer exports them) and prints the median of each phase that update_weights
reports: plan (validate + translate names, driver side), pack, send (into the engine process),
commit (there: unpack + validate + load in place). The push is host work, so CPU numbers say how
the phases compare; absolute GPU-machine numbers come from `time/weight_sync/*` in an RL run's
metrics (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engine-kwargs", default="{}", help="JSON object passed to RolloutWorker")
    args = p.parse_args()
    if args.reps < 1:
        p.error(f"--reps: expected >= 1, got {args.reps}")

    import torch
    from transformers import AutoModelForCausalLM

    from rl.make_model import make_model
    from rollout.worker import RolloutWorker

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(os.path.join(tmp, "m"), arch="qwen3_moe", layers=args.layers, hidden=args.hidden,
                               experts=args.experts, topk=args.topk, intermediate=args.intermediate, seed=0)
        dtype = getattr(torch, args.dtype)
        state = {k: v.to(dtype) for k, v in
                 AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        w = RolloutWorker(model_dir, "megamoe", dtype=args.dtype, seed=0, max_model_len=64,
                          kv_cache_memory_bytes=64 << 20, **json.loads(args.engine_kwargs))
        try:
            runs = [w.update_weights(state) for _ in range(args.reps)]
        finally:
            w.close()
    import vllm

    print(f"# weight push, {datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, vllm {vllm.__version__}, cuda={torch.cuda.is_available()}")
    print(f"# model: qwen3_moe layers={args.layers} H={args.hidden} E={args.experts} k={args.topk} "
          f"I={args.intermediate} {args.dtype}: {len(state)} tensors, {nbytes / 1e9:.2f} GB; "
          f"{runs[0]['buckets']} buckets; median of {args.reps}")
    print("| phase | seconds | GB/s |")
    print("|---|---|---|")
    for key in [k for k in runs[0] if k.endswith("_s")] + ["seconds"]:
        s = statistics.median(r[key] for r in runs)
        print(f"| {key} | {s:.3f} | {nbytes / 1e9 / s:.2f} |")


if __name__ == "__main__":
    main()
