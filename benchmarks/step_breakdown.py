"""A train run's step time breakdown and the weight sync's share, from its metrics.jsonl.

    python benchmarks/step_breakdown.py runs/h200-rl-megamoe/metrics.jsonl [more.jsonl ...]

Per step: step, rollout, train and sync seconds, the sync's share of the step, and the sync's
phases in ms (rollout.sync.send_ipc's, `time/weight_sync/*`); then, over the steps after the first
(the first compiles and warms up): the medians, and the sync's share of their summed time.
"""

from __future__ import annotations

import json
import statistics
import sys

PREFIX = "time/weight_sync/"


def breakdown(path: str) -> list[str]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for r in rows if "time/step_s" in r]
    if not rows:
        raise SystemExit(f"{path}: no step with time/step_s")
    phases = [k for k in rows[0] if k.startswith(PREFIX)]
    lines = [f"# {path}", "step | step s | rollout | train | sync ms | sync % | " +
             " ".join(k[len(PREFIX):-2] for k in phases) + " (ms)"]
    for r in rows:
        sync = r.get("time/weight_sync_s", 0.0)
        lines.append(f"{r['step']} | {r['time/step_s']:.3f} | {r['time/rollout_s']:.3f} | {r['time/train_s']:.3f} | "
                     f"{1e3 * sync:.1f} | {100 * sync / r['time/step_s']:.1f} | "
                     + " ".join(f"{1e3 * r.get(k, 0.0):.1f}" for k in phases))
    rest = rows[1:] or rows

    def med(key):
        return statistics.median(r.get(key, 0.0) for r in rest)

    other = statistics.median(r["time/step_s"] - r["time/rollout_s"] - r["time/train_s"] - r.get("time/weight_sync_s", 0.0)
                              for r in rest)
    share = sum(r.get("time/weight_sync_s", 0.0) for r in rest) / sum(r["time/step_s"] for r in rest)
    lines.append(f"median of steps {rest[0]['step']}-{rest[-1]['step']}: step {med('time/step_s'):.3f}, rollout "
                 f"{med('time/rollout_s'):.3f}, train {med('time/train_s'):.3f}, sync {med('time/weight_sync_s'):.3f}, "
                 f"other {other:.3f} s; sync {100 * share:.1f} % of their total; phases (ms) "
                 + ", ".join(f"{k[len(PREFIX):-2]} {1e3 * med(k):.1f}" for k in phases))
    return lines


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise SystemExit(__doc__)
    for p in paths:
        print("\n".join(breakdown(p)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
