"""Load a transformers MoE model from a local checkpoint for training, experts on megamoe.

    model = load_model("runs/tiny/model", moe_impl="megamoe")   # or "reference", "stock"

moe_impl (the rollout's names):
  megamoe    experts through megamoe.fused_moe(impl="megamoe"), fp32 router via megamoe.route
  reference  experts through megamoe.fused_moe(impl="reference"), fp32 router via megamoe.route
  stock      transformers' own experts and router, untouched

Before anything is loaded, the checkpoint's tensor names and shapes (safetensors headers only) are
checked against the model its config.json describes; missing keys, extra keys and mismatched
shapes are reported together, by name, in one error (transformers alone would silently
re-initialise a missing tensor, and its shape errors do not name the tensor). For megamoe /
reference, every MoE block of that model, built on the meta device, must be one megamoe computes
(trainer.experts.check_megamoe_eligible): another activation or expert biases fail before any
weight is read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from megamoe.contract import BITWISE, FAST, MEGAMOE, NUMERICS
from trainer.experts import (EXPERTS_IMPLEMENTATION, check_megamoe_eligible, install_megamoe,
                             register_experts_implementations)

# On-disk per-expert names -> the fused in-memory tensors of transformers 5 (gate/up rows are
# concatenated into gate_up_proj [E, 2I, H]; down_proj is [E, H, I]). OLMoE's and DeepSeek-V3's checkpoints
# name their experts as Qwen3-MoE's do (transformers converts them with the qwen2_moe mapping).
_QWEN_EXPERTS = (re.compile(r"^(?P<prefix>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"),
                 {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
_PER_EXPERT = {
    "qwen3_moe": _QWEN_EXPERTS,
    "mixtral": (re.compile(r"^(?P<prefix>.+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<proj>w1|w2|w3)\.weight$"),
                {"w1": "gate", "w3": "up", "w2": "down"}),
    "olmoe": _QWEN_EXPERTS,
    "deepseek_v3": _QWEN_EXPERTS,
}
# Architectures whose checkpoints hold the experts fused, under the in-memory names and shapes (gpt-oss:
# gate_up_proj [E, H, 2I] interleaved, its bias, down_proj [E, I, H], its bias): nothing to map.
_FUSED_ON_DISK = ("gpt_oss",)
SUPPORTED_ARCHS = tuple(_PER_EXPERT) + _FUSED_ON_DISK
"""transformers model_type of every architecture the trainer loads (the authoritative list)."""
# Other on-disk renames (Mixtral's legacy module name).
_RENAMES = {"mixtral": ((".block_sparse_moe.", ".mlp."),)}


class CheckpointMismatchError(ValueError):
    """A checkpoint whose tensors do not match the model: lists missing, extra and mismatched keys."""


def format_mismatch(where: str, missing: list[str], extra: list[str], mismatched: list[str], limit: int = 20) -> str:
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", extra), ("mismatched shapes", mismatched)):
        if items:
            shown = ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
            parts.append(f"{len(items)} {label}: {shown}")
    return f"{where}: checkpoint does not match the model; " + "; ".join(parts)


def _disk_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_dir: expected *.safetensors weights in {model_dir}, found none")
    shapes = {}
    for fname in files:
        with safe_open(str(model_dir / fname), "pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """state_dict names and shapes of the model `config` describes (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_checkpoint(model_dir: str | Path, config=None) -> None:
    """Raise CheckpointMismatchError naming every missing, extra and mis-shaped tensor."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    config = config or AutoConfig.from_pretrained(model_dir)
    arch = config.model_type
    want = expected_shapes(config)
    if getattr(config, "tie_word_embeddings", False):
        want.pop("lm_head.weight", None)  # tied: not stored separately
    disk = _disk_shapes(model_dir)
    pattern, roles = _PER_EXPERT.get(arch, (None, {}))
    renames = _RENAMES.get(arch, ())

    missing, extra, mismatched = [], [], []
    covered: set[str] = set()
    experts: dict[str, dict[tuple[str, int], tuple[int, ...]]] = {}  # fused target -> (role, e) -> shape
    disk_name_of: dict[tuple[str, str, int], str] = {}  # (fused target, role, e) -> on-disk name
    for key, shape in disk.items():
        m = pattern.match(key) if pattern else None
        if m:
            target = f"{m['prefix']}.mlp.experts" if arch == "mixtral" else f"{m['prefix']}.experts"
            experts.setdefault(target, {})[(roles[m["proj"]], int(m["e"]))] = shape
            disk_name_of[(target, roles[m["proj"]], int(m["e"]))] = key
            continue
        name = key
        for old, new in renames:
            name = name.replace(old, new)
        if name not in want:
            extra.append(key)
        elif tuple(want[name]) != shape:
            mismatched.append(f"{key} (expected {list(want[name])}, got {list(shape)})")
            covered.add(name)
        else:
            covered.add(name)

    proj_of = {role: proj for proj, role in roles.items()}
    for target, found in experts.items():
        gu, dn = f"{target}.gate_up_proj", f"{target}.down_proj"
        if gu not in want or dn not in want:
            extra.extend(disk_name_of[(target, r, e)] for (r, e) in found)
            continue
        E, two_i, H = want[gu]
        per_role = {"gate": (two_i // 2, H), "up": (two_i // 2, H), "down": tuple(want[dn][1:])}
        for (role, e), shape in sorted(found.items()):
            if e >= E:
                extra.append(disk_name_of[(target, role, e)])
            elif shape != per_role[role]:
                mismatched.append(f"{disk_name_of[(target, role, e)]} (expected {list(per_role[role])}, got {list(shape)})")
        # Name a missing per-expert tensor the way this checkpoint names its siblings.
        some = next(iter(disk_name_of[(target, r, e)] for (r, e) in found))
        m = pattern.match(some)
        for role in ("gate", "up", "down"):
            for e in range(E):
                if (role, e) not in found:
                    missing.append(some[:m.start("e")] + str(e) + "." + proj_of[role] + ".weight")
        covered.update((gu, dn))

    missing.extend(sorted(k for k in want if k not in covered))
    if missing or extra or mismatched:
        raise CheckpointMismatchError(format_mismatch(str(model_dir), sorted(missing), sorted(extra), sorted(mismatched)))


def load_model(model_dir: str | Path, moe_impl: str, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", numerics: str = FAST) -> nn.Module:
    """The checkpoint as a transformers CausalLM whose experts run on `moe_impl`.

    Parameters are loaded in `dtype` (fp32 master weights for training); names are the stock ones.
    numerics="bitwise" (moe_impl="megamoe" only) puts the dense linears and attention on the
    batch-invariant kernels vLLM's side shares (trainer/bitwise.py).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if moe_impl not in EXPERTS_IMPLEMENTATION:
        raise ValueError(f"moe_impl: expected one of {tuple(EXPERTS_IMPLEMENTATION)}, got {moe_impl!r}")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics: expected one of {NUMERICS}, got {numerics!r}")
    if numerics == BITWISE and moe_impl != MEGAMOE:
        raise ValueError(f"numerics='bitwise': expected moe_impl='megamoe' (the sampler's MoE kernel), got {moe_impl!r}")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model_dir: expected a Hugging Face checkpoint folder with config.json, got {model_dir}")
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_ARCHS:
        raise ValueError(f"{model_dir}/config.json model_type: expected one of {SUPPORTED_ARCHS}, got {config.model_type!r}")
    check_checkpoint(model_dir, config)
    if moe_impl != "stock":
        # Experts or a router megamoe does not compute (another activation, biases, ...) are refused
        # here, on a meta-device model, before any weight is read.
        with torch.device("meta"):
            check_megamoe_eligible(AutoModelForCausalLM.from_config(config))

    register_experts_implementations()
    kwargs = {}
    if EXPERTS_IMPLEMENTATION[moe_impl] is not None:
        kwargs["experts_implementation"] = EXPERTS_IMPLEMENTATION[moe_impl]
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, output_loading_info=True, **kwargs)
    # A second guard behind check_checkpoint, in transformers' own terms.
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"] or info["error_msgs"]:
        raise CheckpointMismatchError(format_mismatch(
            str(model_dir), sorted(info["missing_keys"]), sorted(info["unexpected_keys"]),
            sorted(str(k) for k in info["mismatched_keys"]) + list(map(str, info["error_msgs"]))))
    if moe_impl != "stock":
        install_megamoe(model, moe_impl)
    if numerics == BITWISE:
        from trainer import bitwise

        bitwise.install(model)
    # Training semantics without randomness the sampler does not have (dropout is 0 in these
    # architectures; Mixtral's router jitter is 0 unless configured).
    model.config.use_cache = False
    return model.to(device)
