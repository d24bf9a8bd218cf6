"""Rollout routing replay (R3), off and on, in fast mode (bf16), megamoe and stock samplers, one invocation.

    python benchmarks/bench_replay.py                                    # CPU, a random 4-layer Qwen3-MoE
    python benchmarks/bench_replay.py --layers 8 --hidden 256 --experts 32 --topk 4 --out r.md

For each sampler (rollout.moe_impl megamoe, stock) one vLLM engine in bf16 with return_routing=True
(megamoe compiled with torch.compile, vLLM's default on CUDA; stock eager, the only mode its capture runs
in) generates --prompts x --n completions of --max-tokens at temperature 1 (after a warm-up call), --reps
times each way, interleaved: through `llm.generate` with no capture session (the MoE ops still write their
buffers: the cost of the host side, rollout/capture.py, is what differs) and through RolloutWorker.generate,
which captures every prompt and completion token's routing while it generates (no extra forward). One
trainer model (trainer.model.load_model, megamoe, bf16) then computes the completions' logprobs with R3 off
(its own top-k, the sampler's routing only measured) and on (the sampler's experts), forward + backward in
micro-batches of --micro-batch. Reported per (sampler, R3): routing agreement (fraction of tokens whose
trainer top-k is the sampler's set, mean over layers; with R3 on it is measured against the trainer's own
choice, which replay overrides), end-to-end k3 KL(sampler || trainer) and max |dlogp| over completion tokens,
rollout completion tokens/s (best of --reps without the session and with it, and their ratio) and training
tokens/s (prompt + completion tokens per second of forward + backward, best of --reps). The header names
the machine's load average: on a shared machine the rollout timings move with it.

On a GPU (configs/h200_rl.yaml: vLLM compiled with CUDA graphs, one card, R3 off and on in the same call):

    megamoe-rl train --config configs/h200_rl.yaml run.steps=8 run.out_dir=runs/r3-off --overwrite && \
    megamoe-rl train --config configs/h200_rl.yaml run.steps=8 run.out_dir=runs/r3-on --overwrite \
        trainer.routing_replay=true && \
    python benchmarks/bench_replay.py --compare-runs runs/r3-off runs/r3-on

--compare-runs reads the two runs' metrics.jsonl: the median rollout tokens/s and seconds per step (steps 2..:
step 1 carries the engine's first-call costs) and their ratios, with the R3 run's routing agreement, k3 and
max |dlogp| where the run logged them.
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
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, load average {load}) | "
            f"torch {torch.__version__} | vLLM {vllm.__version__} | commit {commit} | "
            f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}")


def train_pass(model, seqs, micro_batch: int, replay: bool | None):
    """(seconds, trainer logprobs per sequence, routing metrics) of one forward + backward over `seqs`;
    replay None: no routing context at all (no metrics), the cost baseline of the metrics."""
    import contextlib

    import torch

    from trainer.batch import collate, micro_batches
    from trainer.loss import token_logprobs
    from trainer.replay import finish_routing, routing_replay, routing_sums

    sums: dict[str, float] = {}
    logps = {}
    t0 = time.perf_counter()
    for mb_seqs in micro_batches(seqs, len(seqs), micro_batch):
        mb = collate(mb_seqs, 0, torch.device("cpu"))
        ctx = contextlib.nullcontext([]) if replay is None else \
            routing_replay(model, mb.routed, mb.attention_mask.reshape(-1).bool(), replay=replay)
        with ctx as states:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            picked = torch.gather(logits, 1, mb.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            lp = token_logprobs(picked, mb.targets, 1.0)
            (lp * mb.mask).sum().backward()
        for k, v in (routing_sums(states) if states else {}).items():
            sums[k] = sums.get(k, 0.0) + v
        for r, s in enumerate(mb.seqs):
            logps[s.index] = lp[r, : len(s.completion)].detach()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds, [logps[s.index] for s in seqs], finish_routing(sums) if sums else {}


def compare_runs(off_dir: str, on_dir: str) -> str:
    """The rollout speed of two runs (R3 off, R3 on) from their metrics.jsonl, as a markdown table."""
    import json
    import statistics

    def steps(d):
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rows = [r for r in rows if "time/rollout_s" in r]
        if len(rows) < 2:
            raise SystemExit(f"{d}/metrics.jsonl: expected >= 2 steps with time/rollout_s, got {len(rows)}")
        return rows[1:]

    off, on = steps(off_dir), steps(on_dir)
    t_off = statistics.median(r["time/rollout_s"] for r in off)
    t_on = statistics.median(r["time/rollout_s"] for r in on)
    # The two runs train differently (R3 changes the gradients), so their completions' lengths drift apart:
    # the sampler's tokens per second is the like-for-like speed, the seconds per step the driver's view.
    v_off = statistics.median(r["throughput/rollout_tokens_per_s"] for r in off)
    v_on = statistics.median(r["throughput/rollout_tokens_per_s"] for r in on)
    keys = [k for k in ("routing/agree", "mismatch/k3_kl", "mismatch/abs_logp_diff_max") if k in on[-1] or k in off[-1]]
    lines = [header(), "", "| run | median rollout s (steps 2..) | median rollout tokens/s | " + " | ".join(keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for name, rows, t, v in ((off_dir, off, t_off, v_off), (on_dir, on, t_on, v_on)):
        vals = [f"{statistics.median(r[k] for r in rows if k in r):.4g}" if any(k in r for r in rows) else "-"
                for k in keys]
        lines.append(f"| {name} | {t:.3f} | {v:.0f} | " + " | ".join(vals) + " |")
    lines += ["", f"rollout with R3 / without: {v_on / v_off:.3f}x in tokens/s, {t_off / t_on:.3f}x in seconds per step"]
    return "\n".join(lines)


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
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--samplers", default="megamoe,stock")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="megamoe's engine eager too (no torch.compile: a quicker "
                   "start, the capture on the same op path as compiled on CPU)")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--compare-runs", nargs=2, metavar=("OFF_RUN", "ON_RUN"), default=None,
                   help="compare two megamoe-rl train runs' metrics.jsonl (R3 off, R3 on) instead of benchmarking")
    a = p.parse_args()
    if a.compare_runs:
        print(compare_runs(*a.compare_runs))
        return

    import torch

    from rl.make_model import make_model
    from rollout.worker import RolloutWorker
    from records import TrainBatch
    from trainer.batch import train_rows
    from trainer.loss import k3_kl
    from trainer.model import load_model
    from trainer.replay import routing_load

    tmp = tempfile.mkdtemp(prefix="bench_replay-")
    model_dir = make_model(os.path.join(tmp, "model"), arch="qwen3_moe", layers=a.layers, hidden=a.hidden,
                           experts=a.experts, topk=a.topk, intermediate=a.intermediate, seed=a.seed)
    prompts = [f"Question {i}: {3 * i + 1} + {i * i} = ? Answer:" for i in range(a.prompts)]
    sampling = {"temperature": 1.0, "max_tokens": a.max_tokens, "seed": a.seed}
    trainer = load_model(model_dir, "megamoe", dtype=torch.bfloat16).train()
    rows = []
    for impl in a.samplers.split(","):
        w = RolloutWorker(model_dir, impl, dtype="bfloat16", seed=a.seed, max_model_len=256,
                          kv_cache_memory_bytes=128 << 20, return_routing=True, enforce_eager=a.eager or impl == "stock")
        try:
            from vllm import SamplingParams

            w.generate(prompts, a.n, {**sampling, "seed": a.seed + 1})  # warm-up
            plain = [SamplingParams(n=a.n, seed=a.seed + i * a.n, logprobs=0, temperature=1.0,
                                    max_tokens=a.max_tokens) for i in range(len(prompts))]
            gen_s = route_s = None
            for _ in range(a.reps):
                t0 = time.perf_counter()
                w.llm.generate(prompts, plain, use_tqdm=False)
                sec = time.perf_counter() - t0
                gen_s = sec if gen_s is None else min(gen_s, sec)
                t0 = time.perf_counter()
                samples = w.generate(prompts, a.n, sampling)
                sec = time.perf_counter() - t0
                route_s = sec if route_s is None else min(route_s, sec)
            capture = dict(w.last_capture)
        finally:
            w.close()
        routed = [s.routed_experts for s in samples]
        comp = sum(len(s.completion_ids) for s in samples)
        batch = TrainBatch.from_samples(samples, [0.0] * len(samples))
        seqs, _ = train_rows(batch, vocab_size=trainer.config.vocab_size, max_seq_len=10**6, truncate=False)
        tokens = sum(len(s.prompt) + len(s.completion) for s in seqs)
        t0 = time.perf_counter()
        load = routing_load(routed, a.experts)
        load_ms = 1e3 * (time.perf_counter() - t0)
        assert load, "routing_load returned no metrics"
        train_pass(trainer, seqs, a.micro_batch, True)  # warm-up (the first pass of a process is slower)
        for replay in (None, False, True):
            best, logps, routing = None, None, None
            for _ in range(a.reps):
                sec, logps, routing = train_pass(trainer, seqs, a.micro_batch, replay)
                best = sec if best is None else min(best, sec)
            mask = torch.ones(1, dtype=torch.bool)
            k3 = [k3_kl(lp, torch.tensor(s.sampler_logprobs), mask.expand(len(lp))) for lp, s in zip(logps, samples)]
            dlogp = max(float((lp - torch.tensor(s.sampler_logprobs)).abs().max()) for lp, s in zip(logps, samples))
            rows.append((impl, {None: "no metrics", False: "off", True: "on"}[replay],
                         routing.get("routing/agree", float("nan")),
                         float(torch.cat(k3).mean()), dlogp, comp / gen_s, comp / route_s, gen_s / route_s,
                         1e3 * capture["read_s"] / max(capture["steps"], 1), tokens / best))
    lines = [header(),
             f"model: qwen3_moe layers={a.layers} H={a.hidden} E={a.experts} k={a.topk} I={a.intermediate}, bf16 both "
             f"sides (fast mode), trainer megamoe; {a.prompts} prompts x n={a.n}, max_tokens={a.max_tokens}",
             "",
             "| sampler | R3 | routing agreement | k3 | max abs dlogp | rollout tok/s | with capture tok/s | ratio "
             "| capture host ms/step | train tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.3e} | {r[4]:.3e} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.3f} "
              f"| {r[8]:.3f} | {r[9]:.1f} |" for r in rows]
    lines += ["", f"routing_load (load-balance metrics of the batch's sampler routing, host numpy): {load_ms:.2f} ms; "
              "R3 'no metrics' trains without the routing context (no agreement, entropy or replay)"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
