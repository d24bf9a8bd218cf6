"""Atomic torch.distributed.checkpoint (DCP) checkpoints of the trainer.

    save(path, model, optimizer, trainer_state, rank_state)   # every rank calls it
    load(path, model, optimizer) -> (trainer_state, rank_state)
    latest_checkpoint(root) -> Path | None                     # newest complete step_* folder

Layout of a checkpoint folder:
    .metadata, __*_*.distcp   DCP: {"model": sharded model state, "optim": sharded optimizer state}
    rank{r}.pt                that rank's RNG states (they differ per rank, so not in DCP)
    trainer.pt                rank 0: step counters, LR-schedule state
    meta.json                 written last: the completion marker (and a human-readable summary)

Atomicity: everything is written into `.<name>.tmp` beside the target, fsynced, and only then
renamed into place; an existing checkpoint of the same name is moved aside first and removed
after. A crash at any point leaves the previous checkpoint (or none) under the target name, never
a partial one; `load` and `latest_checkpoint` accept only folders with meta.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from trainer.model import CheckpointMismatchError, format_mismatch

META = "meta.json"
FORMAT_VERSION = 1


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file of a folder, then the folder."""
    for p in path.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def is_complete(path: Path) -> bool:
    return (Path(path) / META).is_file()


def _write_rank_state(tmp: Path, rank: int, rank_state: dict) -> None:
    torch.save(rank_state, tmp / f"rank{rank}.pt")


def save(path: str | Path, model, optimizer, trainer_state: dict, rank_state: dict) -> Path:
    """Write a checkpoint atomically (see the module docstring). Collective: every rank calls it."""
    path = Path(path).absolute()
    tmp = tmp_path(path)
    rank = _rank()
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # a save that crashed earlier
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    state = {"model": get_model_state_dict(model)}
    # An optimizer that has not stepped yet has no state; asking DCP for it would make torch take a
    # zero-learning-rate step to create some (changing Adam's step count), so such a checkpoint
    # records "no optimizer state" and load() recreates a fresh optimizer instead.
    has_optim = bool(optimizer.state)
    if has_optim:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(tmp), no_dist=not _dist())
    _write_rank_state(tmp, rank, rank_state)
    _barrier()
    if rank == 0:
        torch.save(trainer_state, tmp / "trainer.pt")
        meta = {"format": FORMAT_VERSION, "has_optimizer_state": has_optim,
                "world_size": dist.get_world_size() if _dist() else 1,
                **{k: v for k, v in trainer_state.items() if isinstance(v, (int, float, str, bool))}}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        fsync_tree(tmp)
        old = path.with_name(f".{path.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return path


class CheckpointDamaged(ValueError):
    """A checkpoint folder whose files do not hold what its metadata says (the message names the file)."""


def verify(path: str | Path) -> Path:
    """Check that a checkpoint is complete and undamaged without loading it: meta.json, trainer.pt,
    readable DCP metadata, and every file that metadata lists present and as long as it says.
    Raises CheckpointDamaged naming the first bad file."""
    path = Path(path)
    if not is_complete(path):
        raise CheckpointDamaged(f"checkpoint {path}: incomplete (no {META}: a save that did not finish)")
    if not (path / "trainer.pt").is_file():
        raise CheckpointDamaged(f"checkpoint {path}: {path / 'trainer.pt'} is missing")
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unreadable metadata of any kind is damage
        raise CheckpointDamaged(f"checkpoint {path}: its DCP metadata ({path / '.metadata'}) is unreadable: "
                                f"{type(e).__name__}: {e}") from e
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(need.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointDamaged(f"checkpoint {path}: {f} is missing (listed by its DCP metadata)")
        if f.stat().st_size < end:
            raise CheckpointDamaged(f"checkpoint {path}: {f} is truncated ({f.stat().st_size} bytes, the "
                                    f"metadata points up to byte {end})")
    return path


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(Path(path).name)
    return int(m[1]) if m else None


def check_model_keys(path: Path, model_state: dict) -> None:
    """Compare the checkpoint's model tensors (names, global shapes) with the model's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    have = {k[len("model."):]: tuple(v.size) for k, v in md.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    want = {k: tuple(v.shape) for k, v in model_state.items()}
    missing = sorted(k for k in want if k not in have)
    extra = sorted(k for k in have if k not in want)
    mismatched = sorted(f"{k} (expected {list(want[k])}, got {list(have[k])})"
                        for k in want if k in have and have[k] != want[k])
    if missing or extra or mismatched:
        raise CheckpointMismatchError(format_mismatch(str(path), missing, extra, mismatched))


def load(path: str | Path, model, optimizer) -> tuple[dict, dict | None, bool]:
    """Restore model (and optimizer) state in place; return (trainer_state, this rank's rank_state or
    None when the checkpoint was written by another world size, has_optimizer_state)."""
    path = Path(path).absolute()
    if not is_complete(path):
        why = "it does not exist" if not path.exists() else f"it has no {META} (an interrupted save?)"
        raise FileNotFoundError(f"checkpoint {path}: expected a complete checkpoint folder, but {why}")
    meta = json.loads((path / META).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path}/{META}: expected format {FORMAT_VERSION}, got {meta.get('format')!r}")
    model_state = get_model_state_dict(model)
    check_model_keys(path, model_state)
    state = {"model": model_state}
    has_optim = bool(meta["has_optimizer_state"])
    if has_optim:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(path), no_dist=not _dist())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    if has_optim:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    trainer_state = torch.load(path / "trainer.pt", weights_only=True)
    rank_file = path / f"rank{_rank()}.pt"
    world = dist.get_world_size() if _dist() else 1
    rank_state = torch.load(rank_file, weights_only=True) if rank_file.is_file() and meta["world_size"] == world else None
    return trainer_state, rank_state, has_optim


_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    """The checkpoint folder of `step` under root (the RL loop's checkpoints/step_NNNNNN)."""
    return Path(root) / f"step_{step:06d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete `step_N` folder with the largest N under root, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    best = None
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and is_complete(p) and (best is None or int(m[1]) > best[0]):
            best = (int(m[1]), p)
    return best[1] if best else None
