"""What the policy writes, for a person to read: one JSON line per sample of a step in
<run_dir>/samples.jsonl every run.samples_every steps (and the rows of W&B's samples table).

    rows = sample_rows(step, prompts, completions, rewards, advantages)
    {"step": 4, "prompt_index": 0, "sample_index": 1, "prompt": "...", "completion": "...",
     "reward": 0.5, "rewards": {"format": 1.0, "exact_match": 0.0}, "advantage": 0.87}

`prompt` is the text the sampler got (chat template applied); `reward` the weighted sum (null: no
function scored the sample), `rewards` each function's unweighted value (null: not scored). A
resumed run drops the lines of steps after its checkpoint, as metrics.jsonl does (rl/loop.py).
"""

from __future__ import annotations

import json
from pathlib import Path

SAMPLES_FILE = "samples.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
"""Every completion of the run's evaluations (rl/evaluation.py's rows: step, prompt, completion, reward,
rewards, correct), the same rows `megamoe-rl eval --samples-out` writes."""


def sample_rows(step: int, prompts: list[str], completions: list[str], rewards, advantages: list[float],
                prompt_index: list[int], **extra: list) -> list[dict]:
    """One row per sample; `rewards` a RewardResult, `extra` further per-sample columns (e.g. lag)."""
    n = len(completions)
    seen: dict[int, int] = {}
    rows = []
    for j in range(n):
        i = prompt_index[j]
        seen[i] = seen.get(i, -1) + 1
        rows.append({"step": step, "prompt_index": i, "sample_index": seen[i], "prompt": prompts[i],
                     "completion": completions[j], "reward": rewards.total[j],
                     "rewards": {name: v[j] for name, v in rewards.per_fn.items()},
                     "advantage": advantages[j], **{k: v[j] for k, v in extra.items()}})
    return rows


def due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def append_rows(run_dir: Path, rows: list[dict], name: str = SAMPLES_FILE) -> None:
    with open(Path(run_dir) / name, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
