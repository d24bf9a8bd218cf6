"""Weights & Biases beside metrics.jsonl and TensorBoard (run.wandb; the `wandb` extra).

    check_wandb(cfg)                       # at start: run.wandb.mode set but no wandb package -> ConfigError
    sink = WandbSink.open(run_dir, cfg)    # None when run.wandb.mode is disabled
    sink.log(step, metrics); sink.log_samples(step, rows); sink.log_plot(path); sink.close()

What goes there: the resolved config (W&B's run config), every metric of metrics.jsonl at its step
(numbers and the sample strings; NaN where the JSON line has null), the eval/* metrics (they are
metrics.jsonl's too), a table of sample completions (rl/samples.py's rows) every
run.wandb.samples_every steps (0: run.samples_every), and the final plot. offline writes the W&B
run into <run_dir>/wandb with no network (`wandb sync <run_dir>/wandb/offline-run-*` uploads it).
The W&B run's id is kept in <run_dir>/wandb_id.txt, so `--resume` continues the same W&B run; a
step W&B already holds (a resume redoes the steps after its checkpoint) is not logged again.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import uuid
from pathlib import Path

log = logging.getLogger("megamoe.rl.wandb")

ID_FILE = "wandb_id.txt"


def check_wandb(cfg) -> None:
    """run.wandb.mode other than disabled needs the wandb package; ConfigError naming the key and the extra."""
    if cfg.run.wandb.mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        from rl.config import ConfigError

        raise ConfigError(f"run.wandb.mode: {cfg.run.wandb.mode!r} needs the wandb package, which is not installed: "
                          "pip install 'megamoe-rl[wandb]' (or pip install wandb), or set run.wandb.mode=disabled")


class WandbSink:
    """One W&B run for one run folder (module docstring)."""

    def __init__(self, run, samples_every: int):
        self.run = run
        self.samples_every = samples_every
        self.last_step = int(run.step) - 1 if run.step else -1  # W&B's next step, minus one (a resumed run)

    @classmethod
    def open(cls, run_dir: Path, cfg) -> "WandbSink | None":
        w = cfg.run.wandb
        if w.mode == "disabled":
            return None
        check_wandb(cfg)
        import wandb

        from rl.config import to_dict

        id_file = Path(run_dir) / ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        run = wandb.init(project=w.project, entity=w.entity, name=w.name or Path(run_dir).name, group=w.group,
                         tags=list(w.tags) or None, mode=w.mode, dir=str(run_dir), id=run_id, resume="allow",
                         config=to_dict(cfg))
        log.info("W&B run %s (%s, %s)", run_id, w.mode, run.dir)
        return cls(run, w.samples_every or cfg.run.samples_every)

    def log(self, step: int, metrics: dict) -> None:
        if step <= self.last_step:  # a resumed run's redone step: W&B keeps the first one
            return
        data = {k: (float("nan") if v is None else v) for k, v in metrics.items()
                if v is None or isinstance(v, (int, float, str))}
        self.run.log(data, step=step)
        self.last_step = step

    def log_samples(self, step: int, rows: list[dict]) -> None:
        if not rows or not self.samples_every or step % self.samples_every or step < self.last_step:
            return
        import wandb

        columns = [k for k in rows[0] if k != "rewards"] + [f"reward/{k}" for k in rows[0]["rewards"]]
        data = [[r[k] for k in columns if not k.startswith("reward/")] +
                [_num(r["rewards"][k[len("reward/"):]]) for k in columns if k.startswith("reward/")] for r in rows]
        self.run.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)

    def log_plot(self, path: Path) -> None:
        import wandb

        self.run.summary["plot"] = wandb.Image(str(path))

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def _num(v):
    return float("nan") if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
