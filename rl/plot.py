"""A PNG of a run's reward (and eval reward / pass@1) and sampler-trainer mismatch over steps, from its metrics.jsonl.

    python -m rl.plot runs/demo            # writes runs/demo/plot.png
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from rl.metrics import read_jsonl


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Reward mean (± std) and mismatch (k3 KL, mean and max |Δlogp|) per step -> PNG path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")
    if not records:
        raise ValueError(f"plot: {run_dir / 'metrics.jsonl'} holds no metrics")
    out = Path(out) if out is not None else run_dir / "plot.png"

    fig, (ax_r, ax_m) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    xs, mean = _series(records, "reward/mean")
    _, std = _series(records, "reward/std")
    _, lo = _series(records, "reward/min")
    _, hi = _series(records, "reward/max")
    ax_r.plot(xs, mean, label="reward mean", color="tab:blue")
    if len(std) == len(lo) == len(hi) == len(mean):
        # ± std, kept inside the observed range (rewards are often bounded, e.g. 0..1).
        ax_r.fill_between(xs, [max(m - s, a) for m, s, a in zip(mean, std, lo)],
                          [min(m + s, b) for m, s, b in zip(mean, std, hi)],
                          alpha=0.2, color="tab:blue", label="± std (within min..max)")
    for key, label, color in (("eval/reward_mean", "eval reward mean", "tab:green"),
                              ("eval/pass@1", "eval pass@1", "tab:olive")):
        x, y = _series(records, key)  # the held-out evaluation (eval.every), where the run has one
        if y:
            ax_r.plot(x, y, marker="o", linestyle="--", label=label, color=color)
    ax_r.set_ylabel("reward")
    ax_r.set_title(f"{run_dir.name}: reward and sampler-trainer mismatch")
    ax_r.grid(alpha=0.3)
    ax_r.legend(loc="best")

    logscale = True
    for key, label in (("mismatch/k3_kl", "k3 KL"), ("mismatch/abs_logp_diff_mean", "mean |Δlogp|"),
                       ("mismatch/abs_logp_diff_max", "max |Δlogp|")):
        x, y = _series(records, key)
        if y:
            ax_m.plot(x, y, label=label)
            logscale &= all(v > 0 for v in y)
    if logscale:
        ax_m.set_yscale("log")
    ax_m.set_xlabel("step")
    ax_m.set_ylabel("mismatch")
    ax_m.grid(alpha=0.3)
    ax_m.legend(loc="best")
    fig.tight_layout()
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Plot reward and mismatch of an RL run")
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="PNG path (default <run_dir>/plot.png)")
    args = ap.parse_args(argv)
    print(plot_run(args.run_dir, args.out))


if __name__ == "__main__":
    main()
