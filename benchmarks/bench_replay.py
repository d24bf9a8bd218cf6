"""Rollout routing replay (R3), off and on, in fast mode (bf16), megamoe and stock samplers, one invocation.

    python benchmarks/bench_replay.py                                    # CPU, a random 4-layer Qwen3-MoE
    python benchmarks/bench_replay.py --layers 8 --hidden 256 --experts 32 --topk 4 --out r.md

For each sampler (rollout.moe_impl megamoe, stock) one vLLM engine in bf16 generates --prompts x --n
completions of --max-tokens at temperature 1 (after a warm-up call), then returns the routing of every
prompt and completion token (RolloutWorker.routed_experts: one prefill of the finished sequences). One
trainer model (trainer.model.load_model, megamoe, bf16) then computes the completions' logprobs with R3 off
(its own top-k, the sampler's routing only measured) and on (the sampler's experts), forward + backward in
micro-batches of --micro-batch. Reported per (sampler, R3): routing agreement (fraction of tokens whose
trainer top-k is the sampler's set, mean over layers; with R3 on it is measured against the trainer's own
choice, which replay overrides), end-to-end k3 KL(sampler || trainer) and max |dlogp| over completion tokens,
rollout completion tokens/s (generate alone, and generate + routing capture) and training tokens/s (prompt +
completion tokens per second of forward + backward, best of --reps).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def header() -> str:
    import torch
    import vllm

    here = os.path.dirname(__file__)
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=here).strip()
    except Exception:  # noqa: BLE001 - not a git checkout
        commit = "unknown"
    return (f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores) | torch {torch.__version__} | "
            f"vLLM {vllm.__version__} | commit {commit} | {datetime.date.today().isoformat()}")


def train_pass(model, seqs, micro_batch: int, replay: bool):
    """(seconds, trainer logprobs per sequence, routing metrics) of one forward + backward over `seqs`."""
    import torch

    from trainer.batch import collate, micro_batches
    from trainer.loss import token_logprobs
    from trainer.replay import finish_routing, routing_replay, routing_sums

    sums: dict[str, float] = {}
    logps = {}
    t0 = time.perf_counter()
    for mb_seqs in micro_batches(seqs, len(seqs), micro_batch):
        mb = collate(mb_seqs, 0, torch.device("cpu"))
        with routing_replay(model, mb.routed, mb.attention_mask.reshape(-1).bool(), replay=replay) as states:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            picked = torch.gather(logits, 1, mb.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            lp = token_logprobs(picked, mb.targets, 1.0)
            (lp * mb.mask).sum().backward()
        for k, v in routing_sums(states).items():
            sums[k] = sums.get(k, 0.0) + v
        for r, s in enumerate(mb.seqs):
            logps[s.index] = lp[r, : len(s.completion)].detach()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds, [logps[s.index] for s in seqs], finish_routing(sums)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--samplers", default="megamoe,stock")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    a = p.parse_args()

    import torch

    from rl.make_model import make_model
    from rollout.worker import RolloutWorker
    from trainer.batch import validate_batch
    from trainer.loss import k3_kl
    from trainer.model import load_model

    tmp = tempfile.mkdtemp(prefix="bench_replay-")
    model_dir = make_model(os.path.join(tmp, "model"), arch="qwen3_moe", layers=a.layers, hidden=a.hidden,
                           experts=a.experts, topk=a.topk, intermediate=a.intermediate, seed=a.seed)
    prompts = [f"Question {i}: {3 * i + 1} + {i * i} = ? Answer:" for i in range(a.prompts)]
    sampling = {"temperature": 1.0, "max_tokens": a.max_tokens, "seed": a.seed}
    trainer = load_model(model_dir, "megamoe", dtype=torch.bfloat16).train()
    rows = []
    for impl in a.samplers.split(","):
        w = RolloutWorker(model_dir, impl, dtype="bfloat16", seed=a.seed, max_model_len=256,
                          kv_cache_memory_bytes=128 << 20, return_routing=False)
        try:
            w.generate(prompts, a.n, {**sampling, "seed": a.seed + 1})  # warm-up
            t0 = time.perf_counter()
            samples = w.generate(prompts, a.n, sampling)
            gen_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            routed = w.routed_experts([s["prompt_ids"] for s in samples], [s["completion_ids"] for s in samples])
            route_s = time.perf_counter() - t0
        finally:
            w.close()
        comp = sum(len(s["completion_ids"]) for s in samples)
        batch = {"prompt_ids": [s["prompt_ids"] for s in samples], "completion_ids": [s["completion_ids"] for s in samples],
                 "routed_experts": routed}
        seqs, _ = validate_batch(batch, vocab_size=trainer.config.vocab_size, max_seq_len=10**6, truncate=False,
                                 need_training_fields=False)
        tokens = sum(len(s.prompt) + len(s.completion) for s in seqs)
        for replay in (False, True):
            best, logps, routing = None, None, None
            for _ in range(a.reps):
                sec, logps, routing = train_pass(trainer, seqs, a.micro_batch, replay)
                best = sec if best is None else min(best, sec)
            mask = torch.ones(1, dtype=torch.bool)
            k3 = [k3_kl(lp, torch.tensor(s["logprobs"]), mask.expand(len(lp))) for lp, s in zip(logps, samples)]
            dlogp = max(float((lp - torch.tensor(s["logprobs"])).abs().max()) for lp, s in zip(logps, samples))
            rows.append((impl, "on" if replay else "off", routing["routing/agree"],
                         float(torch.cat(k3).mean()), dlogp, comp / gen_s, comp / (gen_s + route_s), tokens / best))
    lines = [header(),
             f"model: qwen3_moe layers={a.layers} H={a.hidden} E={a.experts} k={a.topk} I={a.intermediate}, bf16 both "
             f"sides (fast mode), trainer megamoe; {a.prompts} prompts x n={a.n}, max_tokens={a.max_tokens}",
             "",
             "| sampler | R3 | routing agreement | k3 | max abs dlogp | rollout tok/s | rollout+routing tok/s | train tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.3e} | {r[4]:.3e} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.1f} |"
              for r in rows]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
