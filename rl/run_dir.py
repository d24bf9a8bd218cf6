"""A run's folder (run.out_dir): what it holds, whether it holds a run, its checkpoints' pointer,
fresh / resumed / overwritten starts (the layout is described in rl/loop.py). No Ray, no torch."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

from rl.config import Config, to_dict

log = logging.getLogger("megamoe.rl")


class RunDirError(ValueError):
    """The run folder does not fit the request (a fresh run over an old one, a resume without a checkpoint)."""


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    pointer = checkpoints_dir(run_dir) / "latest.json"
    if not pointer.exists():
        return None
    info = json.loads(pointer.read_text())
    return int(info["step"]), checkpoints_dir(run_dir) / info["path"]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def folder_in_place(tmp: Path, out: Path):
    """Fill `tmp` (a new folder beside `out`) inside the block; then `tmp` becomes `out`, whose existing
    folder the caller has checked is empty. On any failure `tmp` is removed and `out` stays as it was."""
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def holds_run(run_dir: Path) -> bool:
    """Whether run_dir holds a run's steps: a metrics line or a checkpoint. What a start that failed
    before its first step leaves (config.yaml, train.log, an empty metrics.jsonl) is not a run."""
    metrics = run_dir / "metrics.jsonl"
    ckpts = checkpoints_dir(run_dir)
    return (metrics.is_file() and metrics.stat().st_size > 0) or (ckpts.is_dir() and any(ckpts.iterdir()))


def prepare_run_dir(cfg: Config, resume: bool) -> tuple[Path, int]:
    """Check the run folder against `resume`; return (run_dir, completed steps)."""
    run_dir = Path(cfg.run.out_dir).absolute()
    if not resume:
        if holds_run(run_dir):
            raise RunDirError(f"run.out_dir: {run_dir} already holds a run (steps in metrics.jsonl or checkpoints/); "
                              f"pass --resume to continue it, --overwrite to start it again, or set run.out_dir "
                              f"to a new folder")
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir, 0
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise RunDirError(f"--resume: {run_dir} holds no checkpoint (looked for "
                          f"{checkpoints_dir(run_dir) / 'latest.json'}); start a fresh run without --resume")
    step, path = latest
    if not path.is_dir():
        raise RunDirError(f"--resume: {checkpoints_dir(run_dir) / 'latest.json'} points at {path}, which is missing")
    return run_dir, step


def resume_checkpoint(run_dir: Path) -> int:
    """The step to resume from: latest.json's checkpoint when it verifies (trainer.checkpoint.verify),
    else the newest older one that does, with a warning naming both; latest.json then points at it.
    Raises RunDirError when no checkpoint of the run verifies."""
    from trainer.checkpoint import CheckpointDamaged, step_of, verify

    step, path = latest_checkpoint(run_dir)
    try:
        verify(path)
        return step
    except CheckpointDamaged as e:
        damage = str(e)
    older = sorted((p for p in checkpoints_dir(run_dir).glob("step_*")
                    if p.is_dir() and (step_of(p) or 0) < step), key=step_of, reverse=True)
    for p in older:
        try:
            verify(p)
        except CheckpointDamaged as e:
            log.warning("resume: the older checkpoint %s is damaged too (%s)", p, e)
            continue
        log.warning("resume: the latest checkpoint is damaged (%s); resuming from %s (step %d) instead",
                    damage, p, step_of(p))
        write_atomic(checkpoints_dir(run_dir) / "latest.json",
                      json.dumps({"step": step_of(p), "path": p.name}) + "\n")
        return step_of(p)
    raise RunDirError(f"--resume: the latest checkpoint is damaged ({damage}) and no older checkpoint of "
                      f"{run_dir} is intact; start a fresh run without --resume")


def remove_run(cfg: Config) -> None:
    """Delete the run in run.out_dir (for --overwrite); refuses folders that are not runs."""
    import shutil

    run_dir = Path(cfg.run.out_dir).absolute()
    if not run_dir.exists():
        return
    if not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"--overwrite: {run_dir} holds no config.yaml, so it is not a run folder; "
                          f"refusing to delete it")
    shutil.rmtree(run_dir)


def log_config_changes(run_dir: Path, cfg: Config) -> None:
    import yaml

    old_path = run_dir / "config.yaml"
    if not old_path.exists():
        return

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and v:
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    old, new = flat(yaml.safe_load(old_path.read_text()) or {}), flat(to_dict(cfg))
    changed = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
    for k, (a, b) in changed.items():
        log.info("resume: %s changed from %r to %r", k, a, b)


def base_model_dir(cfg: Config, run_dir: Path) -> Path:
    """Where a run's base model lives: model.path, else the run's model/ (made by model.make)."""
    return Path(cfg.model.path).absolute() if cfg.model.path is not None else run_dir / "model"


def disk_needed(cfg: Config, run_dir: Path) -> dict[str, int]:
    """Bytes a run writes into run.out_dir's file system besides its checkpoints: the model model.make makes
    (where not made yet) and the final export (run.export_final: the base model's tensors again, in their dtype;
    a LoRA run's adapter besides, small). The base's size: its *.safetensors files, or for a model still to be
    made its parameter count (rl/memory_plan.py's arithmetic) x model.make.dtype's bytes."""
    base = base_model_dir(cfg, run_dir)
    made = (base / "config.json").is_file()
    if cfg.model.path is not None or made:
        size = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    else:
        from rl.memory_plan import dims_of

        size = dims_of(cfg).params * (4 if cfg.model.make.dtype == "float32" else 2)
    need = {}
    if cfg.model.make is not None and not made:
        need["the model model.make makes"] = size
    if cfg.run.export_final:
        need["the final export (run.export_final)"] = size
    return need


def check_disk(cfg: Config, run_dir: Path) -> None:
    """RunDirError before anything is written when run.out_dir's file system cannot hold disk_needed()."""
    need = disk_needed(cfg, run_dir)
    free = shutil.disk_usage(run_dir).free
    if sum(need.values()) <= free:
        return
    GiB = 2**30
    parts = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in need.items())
    raise RunDirError(f"run.out_dir: {str(run_dir)!r} is on a file system with {free / GiB:.1f} GiB free, and this "
                      f"run writes about {sum(need.values()) / GiB:.1f} GiB there besides its checkpoints ({parts}): "
                      "free space, choose another run.out_dir"
                      + (", or set run.export_final=false (`megamoe-rl export` writes the policy from a checkpoint "
                         "later)" if cfg.run.export_final else ""))


class Created:
    """What a fresh run's start creates in run.out_dir, to remove when the start is refused: the
    folder itself (and any parents made for it) when it did not exist, else the entries it adds."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.top = None  # the outermost folder that did not exist
        for d in (run_dir, *run_dir.parents):
            if d.exists():
                break
            self.top = d
        self.before = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()

    def remove(self) -> None:
        if self.top is not None:
            shutil.rmtree(self.top, ignore_errors=True)
        elif self.run_dir.is_dir():
            for p in self.run_dir.iterdir():
                if p.name in self.before:
                    continue
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
