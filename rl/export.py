"""The trained policy out of a run: a Hugging Face checkpoint folder that transformers and vLLM load.

    megamoe-rl export --run runs/tiny [--step N | --latest] --out policy/ [--dtype bfloat16|float32]
    rl.export.export_policy(run_dir, out, step=None, dtype=None) -> Path

What is written (into `.<out>.tmp-<pid>` beside `out`, renamed to `out` at the end):
- the weights in the base checkpoint's on-disk names and layout (per-expert tensors where the base
  had them; rollout/weights.py translates the trainer's fused experts), in the base checkpoint's
  dtype unless `dtype` says otherwise, as `model.safetensors` or `model-0000i-of-0000n.safetensors`
  shards of at most `shard_bytes` with transformers' `model.safetensors.index.json`;
- every other file of the base folder (config.json with its dtype set to the export's,
  generation_config.json, the tokenizer and chat template);
- a LoRA run (trainer.lora): the weights above are the merged ones, base + (alpha/r) B@A computed as the
  trainer's forward computes them (trainer.lora.merge in model.dtype), and `adapter/` holds the adapter in
  PEFT's format (adapter_model.safetensors, adapter_config.json; trainer/lora.py gives the layouts);
- `megamoe_export.json`: where it came from (run folder, step, checkpoint, SHA-256 of the run's
  config.yaml, base model, dtype).

Before any work: the run folder, the checkpoint (complete: meta.json, DCP metadata, and every file the
metadata lists present and long enough), the output folder (absent or empty) and the update plan (every
trainer tensor maps to the base checkpoint's names and shapes) are checked; each failure raises
ExportError naming what is wrong. The DCP shards are read without a process group, so any world size
the run had works. Memory: the full trainer tensors one output shard needs at a time (a layer's fused
experts may be read twice when a shard boundary splits them), plus that shard's output tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

INDEX = "model.safetensors.index.json"
PROVENANCE = "megamoe_export.json"
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_SHARD_BYTES = 4 << 30


class ExportError(ValueError):
    """A run, checkpoint or output folder that cannot be exported (raised before any work)."""


def resolve_checkpoint(run_dir: Path, step: int | None) -> tuple[int, Path]:
    """(step, folder) of the run's checkpoint at `step`, or its latest (checkpoints/latest.json)."""
    from rl.run_dir import checkpoints_dir, latest_checkpoint
    from trainer.checkpoint import CheckpointDamaged, is_complete, step_dir, step_of, verify

    root = checkpoints_dir(run_dir)
    if step is None:
        latest = latest_checkpoint(run_dir)
        if latest is None:
            raise ExportError(f"--run: {run_dir} has no checkpoint ({root / 'latest.json'} is missing); the run "
                              "must have checkpointed a step (trainer.checkpoint_every, and at the end)")
        step, path = latest
    else:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ExportError(f"--step: expected a step number >= 1, got {step!r}")
        path = step_dir(root, step)
        if not path.is_dir():
            have = sorted(step_of(p) for p in root.glob("step_*") if is_complete(p)) if root.is_dir() else []
            raise ExportError(f"--step: {run_dir} has no checkpoint of step {step} ({path}); complete "
                              f"checkpoints: steps {have or 'none'}")
    try:
        verify(path)
    except CheckpointDamaged as e:
        raise ExportError(str(e)) from e
    return step, path


def checkpoint_model_metas(path: Path) -> list[tuple[str, list[int], str]]:
    """(trainer tensor name, full shape, dtype name) of the model tensors in a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return [(k[len("model."):], list(v.size), str(v.properties.dtype).removeprefix("torch."))
            for k, v in md.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)]


def base_model_dir(run_dir: Path) -> Path:
    """The run's base checkpoint: model.path of its config.yaml, else the model it made (run/model)."""
    from rl import config as C
    from rl.run_dir import base_model_dir as run_base_model

    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ExportError(f"--run: expected a run folder with config.yaml (written by megamoe-rl train), "
                          f"got {str(run_dir)!r}")
    path = run_base_model(C.load(cfg_path), run_dir)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ExportError(f"the run's base model {path} (model.path, or the run's model/) is not a "
                          "Hugging Face folder with config.json and *.safetensors")
    return path


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out: {out} exists and is not an empty folder; choose a new folder")


def _base_dtype(base: Path) -> str:
    cfg = json.loads((base / "config.json").read_text())
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"


def plan_shards(plan: dict[str, tuple], shard_bytes: int) -> list[list[str]]:
    """On-disk names grouped, in the checkpoint's order, into shards of at most shard_bytes (a tensor
    larger than that gets a shard of its own)."""
    import torch

    shards, size = [[]], 0
    for name, (shape, dtype) in plan.items():
        n = math.prod(shape) * getattr(torch, dtype).itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def export_policy(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
                  dtype: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Export the run's checkpoint at `step` (None: the latest) to the new folder `out`; returns it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from rl.make_model import MARKER_FILE  # make-model's mark: the export is not its output
    from rl.run_dir import folder_in_place
    from rl import config as C
    from rollout import weights
    from trainer.checkpoint import fsync_tree
    from trainer.lora import is_factor

    run_dir, out = Path(run_dir).absolute(), Path(out).absolute()
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype: expected one of {DTYPES}, got {dtype!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise ExportError(f"shard_bytes: expected a positive int, got {shard_bytes!r}")
    base = base_model_dir(run_dir)
    step, ckpt = resolve_checkpoint(run_dir, step)
    _check_out(out)
    dtype = dtype or _base_dtype(base)
    spec = weights.CheckpointSpec.from_dir(base)
    metas = checkpoint_model_metas(ckpt)
    # LoRA (trainer/lora.py): the factors are merged into their base weights here, and written as a PEFT adapter.
    run_cfg = C.load(run_dir / "config.yaml")
    factor_metas = [m for m in metas if is_factor(m[0])]
    metas = [m for m in metas if not is_factor(m[0])]
    if factor_metas and not run_cfg.trainer.lora.enabled:
        raise ExportError(f"checkpoint {ckpt} holds LoRA factors ({factor_metas[0][0]}, ...) but the run's "
                          "config.yaml has trainer.lora.enabled false")
    factors_of = _factors_of([n for n, _, _ in factor_metas])
    try:
        plan = weights.plan_metadata(spec, [(n, s, dtype) for n, s, _ in metas])
    except (ValueError, TypeError) as e:
        raise ExportError(f"checkpoint {ckpt} does not fit the base model {base}: {e}") from e
    trainer_dtypes = {n: d for n, _, d in metas + factor_metas}
    trainer_shapes = {n: s for n, s, _ in metas + factor_metas}
    # which trainer tensor provides each on-disk name (its fused experts provide several)
    source = {}
    for name, shape, _ in metas:
        for disk, _t in weights.to_checkpoint_names(spec, [(name, torch.empty(shape, device="meta"))]):
            source[disk] = name

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with folder_in_place(tmp, out):  # the folder appears whole or not at all
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX, PROVENANCE, MARKER_FILE):
                shutil.copy2(f, tmp / f.name)
        _set_config_dtype(tmp / "config.json", dtype)
        shards = plan_shards(plan, shard_bytes)
        files = ["model.safetensors"] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map, total = {}, 0
        for names, fname in zip(shards, files):
            needed = sorted({source[n] for n in names})
            needed += [f for n in needed for f in factors_of.get(n, ())]
            state = {"model": {n: torch.empty(trainer_shapes[n], dtype=getattr(torch, trainer_dtypes[n]))
                               for n in needed}}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
            if factors_of:
                state["model"] = _merged(state["model"], factors_of, run_cfg)
            wanted = set(names)
            tensors = {}
            for disk, t in weights.to_checkpoint_names(spec, state["model"].items()):
                if disk in wanted:
                    tensors[disk] = t.to(getattr(torch, dtype)).contiguous().clone()
                    total += tensors[disk].numel() * tensors[disk].element_size()
                    weight_map[disk] = fname
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del state, tensors
        if len(files) > 1:
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")
        if factor_metas:
            _write_adapter(tmp / ADAPTER_DIR, ckpt, factor_metas, run_cfg, str(base))
        (tmp / PROVENANCE).write_text(json.dumps({
            "run_dir": str(run_dir), "step": step, "checkpoint": str(ckpt),
            "config_sha256": hashlib.sha256((run_dir / "config.yaml").read_bytes()).hexdigest(),
            "base_model": str(base), "dtype": dtype, "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=2) + "\n")
        fsync_tree(tmp)
    return out


def _factors_of(factor_names: list[str]) -> dict[str, tuple[str, str]]:
    """LoRA: adapted base name -> (lora_A name, lora_B name), from the checkpoint's factor names."""
    out: dict[str, list] = {}
    for n in factor_names:
        mod, kind, p = n.rsplit(".", 2)
        out.setdefault(f"{mod}.{p}", [None, None])[0 if kind == "lora_A" else 1] = n
    return {k: tuple(v) for k, v in out.items()}


def _merged(tensors: dict, factors_of: dict, run_cfg) -> dict:
    """The base tensors with their factors merged in as the trainer's forward merges them (trainer.lora.merge,
    in the run's compute dtype model.dtype), the factors dropped."""
    import torch

    from trainer.lora import merge

    dtype = getattr(torch, run_cfg.model.dtype)
    scale = run_cfg.trainer.lora.scale
    out = {}
    for name, t in tensors.items():
        if name in factors_of:
            a, b = (tensors[f] for f in factors_of[name])
            t = merge(t.to(dtype), a.to(dtype), b.to(dtype), scale).to(t.dtype)
        if not any(name in fs for fs in factors_of.values()):
            out[name] = t
    return out


ADAPTER_DIR = "adapter"
"""The export's subfolder with the LoRA adapter in PEFT's format (adapter_model.safetensors, adapter_config.json);
a subfolder, because transformers takes a folder with adapter_config.json at its top for a PEFT adapter."""


def _write_adapter(folder: Path, ckpt: Path, factor_metas: list, run_cfg, base: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from trainer.lora import peft_config, peft_tensors

    state = {"model": {n: torch.empty(s, dtype=getattr(torch, d)) for n, s, d in factor_metas}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    folder.mkdir()
    save_file(peft_tensors(state["model"]), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = peft_config(run_cfg.trainer.lora, base, sorted(state["model"]))
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _set_config_dtype(path: Path, dtype: str) -> None:
    """The exported config names the dtype its weights are stored in (transformers' `dtype`, and the
    older `torch_dtype` where the base config has it)."""
    cfg = json.loads(path.read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
    for k in keys:
        cfg[k] = dtype
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def export_final(run_dir: Path) -> Path:
    """The latest checkpoint's policy into run_dir/final (replacing an earlier export: a resumed run)."""
    final = run_dir / "final"
    if not final.exists():
        return export_policy(run_dir, final)
    new, old = run_dir / ".final.new", run_dir / ".final.old"
    for p in (new, old):
        if p.exists():
            shutil.rmtree(p)
    export_policy(run_dir, new)
    final.rename(old)
    new.rename(final)
    shutil.rmtree(old)
    return final
