"""The built-in tool task on the CPU: why RL from the random tiny model has no signal, and what learns.

    python benchmarks/bench_tool_task.py [--out runs/bench_tool_task] [--seed 0] [--warm-steps N] [--rl-steps M]
                                         [--set KEY=VALUE ...]     (overrides of configs/tiny_tools_warm.yaml)

Four phases, each timed:
  1. base      `rl.make_model` writes the random tiny model (configs/tiny_tools_warm.yaml's shape), seed --seed.
  2. evidence  transformers scores, under that random model, the well-formed assistant turns of 8 tool_arith
               transcripts (rl.tool_task.transcript rendered by the chat template, teacher-forced): the
               log-probability of the calculator call (the first assistant turn, through its end-of-turn
               token) and of the answer turn. exp(that) is the chance that RL from the random model ever
               samples a call.
  3. warm      rl.warm_start: --warm-steps of supervised warm start on the task's transcripts (rows apart from
               the RL training set's).
  4. rl        `megamoe-rl train --config configs/tiny_tools_warm.yaml model.path=<warm>` for --rl-steps: the
               real calculator tool, multi-turn episodes on vLLM CPU, rewards tool_used + numeric.
Per RL step it prints the rate of well-formed tool calls (reward/tool_used/mean: episodes with a tool call that
parsed and returned a result), the answer's correctness (reward/numeric/mean: the last assistant message's last
number equals the answer), turns per episode and parse errors; step 1 is the warm-started model's own rate (its
rollout runs before any RL update). The summary (also <out>/summary.json) gives the means over the first and
the last --window steps. On a shared machine the seconds move with the load; the rates do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_tools_warm.yaml"
EVIDENCE_ROWS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_tool_task.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench_tool_task", help="a new or empty folder (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="model, warm start and RL seed (default %(default)s)")
    p.add_argument("--warm-steps", type=int, default=None, help="warm start steps (default: rl.warm_start's)")
    p.add_argument("--warm-lr", type=float, default=None, help="warm start learning rate (default: rl.warm_start's)")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps (default: the config's run.steps)")
    p.add_argument("--window", type=int, default=5,
                   help="steps averaged at the start and the end (default %(default)s)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the RL config")
    args = p.parse_args(argv)
    for name in ("warm_steps", "rl_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.warm_lr is not None and not 0 < args.warm_lr < 1:
        p.error(f"--warm-lr: expected a float in (0, 1), got {args.warm_lr}")
    if args.window < 1:
        p.error(f"--window: expected an int >= 1, got {args.window}")
    return args


def call_logprobs(model_dir: Path, n: int = EVIDENCE_ROWS, max_operand: int = 99) -> dict:
    """Teacher-forced log-probabilities of the transcripts' assistant turns under the model in `model_dir`
    (nats; the mean over n rows): the tool call turn and the answer turn, with their token counts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.envs import tool_schema
    from rl.episode_step import eos_ids
    from rl.episodes import ChatFormat
    from rl.tool_task import calculator, tool_arith, transcript
    from rl.warm_start import IGNORE, encode

    tok = AutoTokenizer.from_pretrained(model_dir)
    fmt = ChatFormat(tok, [tool_schema(calculator, "calculator")], eos_ids(tok, model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    turns: list[list[tuple[float, int]]] = [[], []]
    for row in tool_arith(n, random.Random("bench_tool_task:evidence"), max_operand=max_operand):
        ids, labels = encode(fmt, transcript(row))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        marked = [i - 1 for i, lab in enumerate(labels) if lab != IGNORE]
        # The two assistant turns are the two runs of consecutive labelled positions.
        split = next(j for j in range(1, len(marked)) if marked[j] != marked[j - 1] + 1)
        for t, span in enumerate((marked[:split], marked[split:])):
            turns[t].append((float(logp[span].sum()), len(span)))
    out = {}
    for name, rows in zip(("call", "answer"), turns):
        out[f"{name}_logprob"] = sum(lp for lp, _ in rows) / len(rows)
        out[f"{name}_tokens"] = sum(k for _, k in rows) / len(rows)
    return out


def rl_run(model_dir: Path, out: Path, seed: int, steps: int | None, overrides: list[str]) -> list[dict]:
    argv = [sys.executable, "-m", "rl.cli", "train", "--config", str(CONFIG), f"model.path={model_dir}",
            f"run.out_dir={out}", f"run.seed={seed}", "run.progress=false", "run.plot=false", "run.tensorboard=false",
            "run.export_final=false", "run.samples_every=1", *([f"run.steps={steps}"] if steps is not None else []),
            *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, start_new_session=True)
    if proc.returncode:
        raise RuntimeError(f"megamoe-rl train: exit {proc.returncode}\n{proc.stderr[-6000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_rates(r: dict) -> dict:
    return {"step": r["step"], "tool_call_rate": r["reward/tool_used/mean"], "correct": r["reward/numeric/mean"],
            "turns": r["env/turns_mean"], "parse_errors": r["env/parse_errors"], "tool_errors": r["env/tool_errors"],
            "step_s": r["time/step_s"]}


def bench(out: str | Path, *, seed: int = 0, warm_steps: int | None = None, warm_lr: float | None = None,
          rl_steps: int | None = None, window: int = 5, overrides: list[str] = (), log=print) -> dict:
    """The four phases (module docstring) into `out`; returns the summary (also written to out/summary.json)."""
    import torch
    import transformers
    import vllm

    from rl import config as C
    from rl.make_model import make_model
    from rl.warm_start import warm_start

    out = Path(out).absolute()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out: expected a new or empty folder, {out} is not")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    log(f"{platform.machine()}, {os.cpu_count()} CPUs | torch {torch.__version__}, transformers {transformers.__version__}, "
        f"vLLM {vllm.__version__} | commit {commit or 'unknown'} | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    cfg = C.load(CONFIG, [f"model.path={out / 'warm'}", *overrides])
    max_operand = cfg.data.task_kwargs.get("max_operand", 99)
    shape = dict(arch="qwen3_moe", layers=2, hidden=64, experts=8, topk=2, intermediate=32)
    seconds = {}
    t = time.monotonic()
    make_model(out / "base", seed=seed, **shape)
    seconds["base"] = time.monotonic() - t

    t = time.monotonic()
    evidence = call_logprobs(out / "base", max_operand=max_operand)
    seconds["evidence"] = time.monotonic() - t
    log(f"random model: log p(well-formed calculator call) = {evidence['call_logprob']:.1f} nats over "
        f"{evidence['call_tokens']:.0f} tokens, log p(answer turn) = {evidence['answer_logprob']:.1f} nats over "
        f"{evidence['answer_tokens']:.0f} tokens (mean of {EVIDENCE_ROWS} transcripts)")

    t = time.monotonic()
    kw = {k: v for k, v in (("steps", warm_steps), ("lr", warm_lr)) if v is not None}
    warm_start(out / "base", out / "warm", seed=seed, max_operand=max_operand, log=log, **kw)
    seconds["warm_start"] = time.monotonic() - t
    warm_info = json.loads((out / "warm" / "warm_start.json").read_text())

    t = time.monotonic()
    records = rl_run(out / "warm", out / "rl", seed, rl_steps, list(overrides))
    seconds["rl"] = time.monotonic() - t
    rates = [step_rates(r) for r in records]
    log("step  tool_call_rate  correct  turns  parse_errors  step_s")
    for r in rates:
        log(f"{r['step']:4d}  {r['tool_call_rate']:14.3f}  {r['correct']:7.3f}  {r['turns']:5.2f}  "
            f"{r['parse_errors']:12.0f}  {r['step_s']:6.1f}")

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    first, last = rates[:window], rates[-window:]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} cores", "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "vllm": vllm.__version__, "commit": commit, "seed": seed, "model": shape,
        "warm_start": {k: warm_info[k] for k in ("steps", "batch", "lr", "max_operand", "first_loss", "last_loss")},
        "rl": {"config": str(CONFIG.relative_to(ROOT)), "overrides": list(overrides), "steps": len(rates),
               "prompts_per_step": cfg.run.prompts_per_step, "n": cfg.rollout.n, "lr": cfg.trainer.lr},
        "random_model": evidence, "window": window,
        "tool_call_rate": {"first": mean("tool_call_rate", first), "last": mean("tool_call_rate", last)},
        "correct": {"first": mean("correct", first), "last": mean("correct", last)},
        "per_step": rates, "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    summary["seconds"]["total"] = round(sum(seconds.values()), 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"tool-call rate {summary['tool_call_rate']['first']:.3f} (first {window} steps) -> "
        f"{summary['tool_call_rate']['last']:.3f} (last {window}); correct {summary['correct']['first']:.3f} -> "
        f"{summary['correct']['last']:.3f}; seconds {summary['seconds']}")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"python benchmarks/bench_tool_task.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    bench(args.out, seed=args.seed, warm_steps=args.warm_steps, warm_lr=args.warm_lr, rl_steps=args.rl_steps,
          window=args.window, overrides=args.set)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
