"""Fixed-lag async RL against the on-policy loop: the same config at run.max_async_steps = 0, 1, 2,
disaggregated (one RolloutWorker and one trainer rank, one CPU each), on the CPU demo.

    python benchmarks/bench_async.py [--steps 30] [--lags 0 1 2] [--config configs/tiny.yaml] [--out FILE]
    python benchmarks/bench_async.py --dry-run                 # each lag's resolved config, no run
    python benchmarks/bench_async.py --steps 2 --warmup 1 --lags 1 --set rollout.n=2 run.prompts_per_step=2

Each lag is one `megamoe-rl train` run (a subprocess) in a temporary folder. From its metrics.jsonl,
over the steps after the first `--warmup` (engine and trainer warm-up):
    steps/s       steps / the sum of their time/step_s (the driver's wall time per step)
    trainer idle  1 - sum(time/train_s) / sum(time/step_s)
    rollout idle  1 - sum(the sampler's seconds in generate) / sum(time/step_s); the sampler's
                  seconds are time/rollout_busy_s (async) or time/rollout_s (on-policy, where the
                  driver waits exactly for the generation)
    reward        reward/mean at the last step and the mean over the last 5 steps
On a shared machine every number moves with the load: compare lags of one invocation only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: Path, lag: int, steps: int, folder: Path, extra: list[str] = (), dry_run: bool = False):
    """The lag's `megamoe-rl train` run: its metrics.jsonl records, or with dry_run its resolved config (text)."""
    out = folder / f"k{lag}"
    argv = [sys.executable, "-m", "rl.cli", "train", "--config", str(config), f"run.out_dir={out}",
            f"run.steps={steps}", f"run.max_async_steps={lag}", "ray.placement=disaggregated",
            "rollout.cpus_per_worker=1", "trainer.cpus_per_rank=1", "run.progress=false", "run.plot=false",
            "run.tensorboard=false", "run.export_final=false", f"trainer.checkpoint_every={steps}", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(argv + (["--dry-run"] if dry_run else []), cwd=folder, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"k={lag}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    if dry_run:
        return proc.stdout
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(records: list[dict], warmup: int) -> dict:
    timed = records[warmup:]
    wall = sum(r["time/step_s"] for r in timed)
    busy = sum(r.get("time/rollout_busy_s", r["time/rollout_s"]) for r in timed)
    return {"steps_per_s": len(timed) / wall, "trainer_idle": 1 - sum(r["time/train_s"] for r in timed) / wall,
            "rollout_idle": 1 - busy / wall, "reward_last": records[-1]["reward/mean"],
            "reward_last5": sum(r["reward/mean"] for r in records[-5:]) / len(records[-5:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="further overrides for every run, e.g. rollout.n=2 run.prompts_per_step=2 (a smaller run)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print each lag's resolved config (megamoe-rl train --dry-run) and run nothing")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error(f"--steps: expected more than --warmup ({args.warmup}) steps, got {args.steps}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for lag in args.lags:
            if args.dry_run:
                print(f"# k={lag}\n{run(args.config, lag, args.steps, Path(tmp), args.set, dry_run=True)}")
                continue
            t0 = time.perf_counter()
            rows.append({"k": lag, **summarise(run(args.config, lag, args.steps, Path(tmp), args.set), args.warmup),
                         "run_s": time.perf_counter() - t0})
    if args.dry_run:
        return
    base = rows[0]["steps_per_s"]
    print(f"# bench_async {time.strftime('%Y-%m-%d %H:%M')} | {os.cpu_count()} CPUs | {args.config.name}, "
          f"{args.steps} steps, disaggregated, first {args.warmup} steps untimed")
    print("| k | steps/s | vs k=0 | trainer idle | rollout idle | reward last step | reward last 5 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['steps_per_s']:.2f} | {r['steps_per_s'] / base:.2f}x | {r['trainer_idle']:.0%} | "
              f"{r['rollout_idle']:.0%} | {r['reward_last']:.3f} | {r['reward_last5']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
