"""Weight updates: from the trainer's named tensors to the checkpoint tensors vLLM loads, validated.

The checkpoint on disk defines what a complete, correct update is: every tensor name and shape in
its safetensors files (`CheckpointSpec`). An update is a list of (name, tensor) in either naming:

- the on-disk names (per-expert `...experts.{e}.gate_proj.weight [I,H]`, Mixtral's `w1/w3/w2` under
  `block_sparse_moe`), or
- the transformers 5 in-memory names (`model.state_dict()`): fused `...mlp.experts.gate_up_proj
  [E,2I,H]` (gate rows first) and `...mlp.experts.down_proj [E,H,I]`, Mixtral's `.mlp.` for
  `.block_sparse_moe.`, and `lm_head.weight` beside `model.embed_tokens.weight` when tied.

`plan_update` translates every tensor to on-disk names (per-expert views of fused tensors, no copies)
and checks *all* of them before anything is applied: unknown names, missing names, duplicates, shapes,
dtypes and non-finite values are errors that name the tensor. Nothing is half-applied because nothing
is applied until the whole plan is valid.

Transport across vLLM's process boundary: tensors do not survive collective_rpc's serialisation in
multiprocess mode. The engine's processes always run on the RolloutWorker's host (vLLM's "uni" or
"mp" executor), so the update travels as files: `write_buckets` writes the plan as safetensors files
of bounded size into a private folder in shared memory (/dev/shm when it has room, else the temp
folder), collective_rpc carries only their paths, and `read_buckets` reads them in the engine
process. Sending the same bytes through collective_rpc was the slowest phase of a push (CPU, 0.83 GB
bf16: 6.7 s of 10.5 s; benchmarks/bench_weight_push.py).

Kernel format (the CUDA IPC sync, moe_impl megamoe / reference): the routed experts can also travel
fused, under vLLM's parameter names `<on-disk experts prefix>.w13_weight [E,2I,H]` and `.w2_weight
[E,H,I]` (`KERNEL_EXPERT_SUFFIXES`), the layout megamoe computes from and the trainer holds, so
the engine copies them into its parameters whole instead of re-assembling 3E per-expert tensors
(`to_checkpoint_names(..., kernel_experts=True)`, `plan_metadata(..., kernel_experts=True)`); where the
engine allows, the rest of the update travels as the engine's parameters too (rollout/kernel_format.py).

Shape legend: E experts, I expert intermediate, H hidden.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

# In-memory (transformers) name fragment -> on-disk fragment, per architecture.
_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "MixtralForCausalLM": ((".mlp.", ".block_sparse_moe."),),
}
# On-disk per-expert projection names: (gate, up, down).
_EXPERT_NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")

DEFAULT_BUCKET_BYTES = 256 << 20
# Trainer fused-expert kind -> the suffix of vLLM's FusedMoE parameter holding it (kernel format).
KERNEL_EXPERT_SUFFIXES = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
    """The per-expert tensors of one MoE layer on disk."""
    prefix: str          # e.g. "model.layers.0.mlp.experts"
    num_experts: int     # E
    intermediate: int    # I
    hidden: int          # H
    gate: str
    up: str
    down: str

    def name(self, e: int, proj: str) -> str:
        return f"{self.prefix}.{e}.{proj}.weight"


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """Names and shapes of a local Hugging Face checkpoint's tensors (read from safetensors headers)."""
    model_dir: str
    architecture: str
    shapes: Mapping[str, tuple[int, ...]]
    tie_word_embeddings: bool
    expert_groups: Mapping[str, ExpertGroup]  # by prefix

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> CheckpointSpec:
        from safetensors import safe_open

        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model_dir: expected a Hugging Face checkpoint with config.json, "
                                    f"got {str(model_dir)!r}")
        config = json.loads(config_path.read_text())
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model_dir: expected *.safetensors files in {str(model_dir)!r}, found none")
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    shapes[name] = tuple(st.get_slice(name).get_shape())
        archs = config.get("architectures") or ["<none>"]
        tie = bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)))
        return cls(model_dir=str(model_dir), architecture=archs[0], shapes=shapes,
                   tie_word_embeddings=tie, expert_groups=_expert_groups(shapes))

    def numel(self) -> int:
        total = 0
        for shape in self.shapes.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


def _expert_groups(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, ExpertGroup]:
    found: dict[str, dict[str, set[int]]] = {}
    for name in shapes:
        m = _PER_EXPERT.match(name)
        if m:
            found.setdefault(m["prefix"], {}).setdefault(m["proj"], set()).add(int(m["e"]))
    groups = {}
    for prefix, projs in found.items():
        for gate, up, down in _EXPERT_NAMINGS:
            if {gate, up, down} <= projs.keys():
                experts = projs[gate]
                E = max(experts) + 1
                if not all(projs[p] == set(range(E)) for p in (gate, up, down)):
                    continue  # holes in the expert numbering: leave the names to the exact-name path
                I, H = shapes[f"{prefix}.0.{gate}.weight"]
                groups[prefix] = ExpertGroup(prefix, E, I, H, gate, up, down)
                break
    return groups


def _check_tensor(name: str, t: object, check_values: bool = True) -> torch.Tensor:
    if not isinstance(name, str):
        raise TypeError(f"weight update: expected (str, torch.Tensor) pairs, got a name of type {type(name).__name__}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"tensor {name!r}: expected a floating dtype, got {t.dtype}")
    t = t.detach()
    if not check_values:
        return t
    # A non-finite element makes the fp32 sum non-finite, so a finite sum proves the tensor clean; only
    # a non-finite sum (a bad tensor, or finite values overflowing fp32) pays for the exact count. This
    # one reduction is ~5x faster than counting (measured on 1 CPU thread, bf16; the RL loop's update of
    # a 1.6 GB bf16 model spent ~9 s in this check on the H200 machine's rollout actor).
    bad = 0
    if t.numel() and not bool(torch.isfinite(torch.sum(t, dtype=torch.float32))):
        bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"tensor {name!r}: {bad} non-finite value(s) (NaN/Inf); refusing the update")
    return t.detach()


def _disk_candidates(spec: CheckpointSpec, name: str) -> list[str]:
    """`name`, and its on-disk spelling for this architecture (Mixtral's `.block_sparse_moe.`)."""
    return [name] + [name.replace(src, dst) for src, dst in _RENAMES.get(spec.architecture, ()) if src in name]


def _translate(spec: CheckpointSpec, name: str, t: torch.Tensor,
               kernel_experts: bool = False) -> list[tuple[str, torch.Tensor]]:
    """On-disk (name, tensor) pairs that `name` provides; raises naming the tensor if none.
    kernel_experts: a fused expert tensor stays whole, under its kernel-format name."""
    for cand in _disk_candidates(spec, name):
        if cand in spec.shapes:
            want = spec.shapes[cand]
            if tuple(t.shape) != want:
                raise ValueError(f"tensor {name!r}: expected shape {list(want)} (checkpoint tensor {cand!r}), "
                                 f"got {list(t.shape)}")
            return [(cand, t)]
        m = _FUSED.match(cand)
        if m and m["prefix"] in spec.expert_groups:
            g = spec.expert_groups[m["prefix"]]
            if m["kind"] == "gate_up_proj":
                want = (g.num_experts, 2 * g.intermediate, g.hidden)
                if tuple(t.shape) != want:
                    raise ValueError(f"tensor {name!r}: expected shape [E={want[0]}, 2I={want[1]}, H={want[2]}] "
                                     f"(fused gate rows then up rows of {g.prefix}), got {list(t.shape)}")
                if kernel_experts:
                    return [(f"{g.prefix}.{KERNEL_EXPERT_SUFFIXES[m['kind']]}", t)]
                out = []
                for e in range(g.num_experts):
                    out.append((g.name(e, g.gate), t[e, : g.intermediate]))
                    out.append((g.name(e, g.up), t[e, g.intermediate:]))
                return out
            want = (g.num_experts, g.hidden, g.intermediate)
            if tuple(t.shape) != want:
                raise ValueError(f"tensor {name!r}: expected shape [E={want[0]}, H={want[1]}, I={want[2]}] "
                                 f"(fused down projections of {g.prefix}), got {list(t.shape)}")
            if kernel_experts:
                return [(f"{g.prefix}.{KERNEL_EXPERT_SUFFIXES[m['kind']]}", t)]
            return [(g.name(e, g.down), t[e]) for e in range(g.num_experts)]
    raise ValueError(f"unexpected tensor {name!r}: the checkpoint at {spec.model_dir} ({spec.architecture}) has "
                     "no tensor of that name, neither on disk nor as transformers' fused experts")


def _describe_missing(spec: CheckpointSpec, missing: list[str]) -> list[str]:
    """Missing on-disk names, with per-expert ones summarised under the fused name a trainer sends."""
    out, seen = [], set()
    for name in missing:
        m = _PER_EXPERT.match(name)
        g = spec.expert_groups.get(m["prefix"]) if m else None
        if g is None:
            out.append(repr(name))
            continue
        fused = "down_proj" if m["proj"] == g.down else "gate_up_proj"
        in_memory = f"{g.prefix}.{fused}"
        for src, dst in _RENAMES.get(spec.architecture, ()):
            in_memory = in_memory.replace(dst, src)
        if in_memory not in seen:
            seen.add(in_memory)
            projs = g.down if fused == "down_proj" else f"{g.gate}/{g.up}"
            out.append(f"{in_memory!r} (on disk {g.prefix}.{{0..{g.num_experts - 1}}}.{projs}.weight)")
    return out


def plan_update(spec: CheckpointSpec, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                *, check_values: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Validate a complete weight update and translate it to on-disk names, in the checkpoint's order.

    Raises TypeError/ValueError naming the offending tensor before returning anything.
    check_values=False checks names, shapes and dtypes only: for tensors on the meta device (an
    update described before its bytes move, `plan_metadata`) and for bytes already checked.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    provided: dict[str, tuple[str, torch.Tensor]] = {}  # on-disk name -> (source name, tensor)
    tied_lm_head: torch.Tensor | None = None
    for name, t in items:
        t = _check_tensor(name, t, check_values)
        if name == "lm_head.weight" and name not in spec.shapes and spec.tie_word_embeddings:
            tied_lm_head = t  # transformers lists the tied head; the checkpoint stores it once
            continue
        for disk_name, view in _translate(spec, name, t):
            if disk_name in provided:
                raise ValueError(f"tensor {name!r} provides checkpoint tensor {disk_name!r}, which tensor "
                                 f"{provided[disk_name][0]!r} already provided (duplicate)")
            provided[disk_name] = (name, view)
    missing = [n for n in spec.shapes if n not in provided]
    if missing:
        described = _describe_missing(spec, missing)
        shown = ", ".join(described[:5])
        more = f" and {len(described) - 5} more" if len(described) > 5 else ""
        raise ValueError(f"weight update is missing {len(missing)} of the checkpoint's {len(spec.shapes)} "
                         f"tensors: {shown}{more}")
    if tied_lm_head is not None:
        embed = provided.get("model.embed_tokens.weight")
        if embed is None or tied_lm_head.shape != embed[1].shape or (
                check_values and not torch.equal(tied_lm_head, embed[1])):
            raise ValueError("tensor 'lm_head.weight': the checkpoint ties it to 'model.embed_tokens.weight', "
                             "but the update gives it different values")
    return [(n, provided[n][1]) for n in spec.shapes]


def plan_metadata(spec: CheckpointSpec, metas: Iterable[tuple[str, Iterable[int], str]], *,
                  kernel_experts: bool = False) -> dict[str, tuple]:
    """Validate a complete update described as (name, shape, dtype name) before any byte of it moves.

    The same checks as `plan_update` (unknown, missing, duplicate names; shapes; floating dtypes),
    on meta tensors. Returns {name: (shape, dtype name)}: what the chunks of a streamed update
    (`to_checkpoint_names` with the same `kernel_experts`) must deliver, each name exactly once.
    """
    named = []
    for name, shape, dtype in metas:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise TypeError(f"tensor {name!r}: expected a torch dtype name, got {dtype!r}")
        named.append((name, torch.empty(tuple(shape), dtype=dt, device="meta")))
    plan = plan_update(spec, named, check_values=False)
    if kernel_experts:
        plan = list(to_checkpoint_names(spec, named, kernel_experts=True))
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in plan}


def to_checkpoint_names(spec: CheckpointSpec, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                        kernel_experts: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
    """Stream (on-disk name, tensor) pairs for a stream of trainer tensors: fused experts become
    per-expert views (no copies), or stay whole under their kernel-format names (kernel_experts).
    Tensors go through one at a time; the whole update is checked beforehand by `plan_metadata`,
    and the receiver checks that each planned name arrives once."""
    for name, t in named_tensors:
        if name == "lm_head.weight" and name not in spec.shapes and spec.tie_word_embeddings:
            continue  # stored once, under the embedding
        yield from _translate(spec, name, t, kernel_experts)


def kernel_sources(spec: CheckpointSpec, metas: Iterable[tuple[str, Iterable[int], str]]) -> dict[str, str]:
    """{update name: the trainer tensor it is} of a stream with `kernel_experts` (each trainer tensor
    gives one update tensor; a tied lm_head gives none), from metadata alone."""
    out = {}
    for name, shape, dtype in metas:
        meta = torch.empty(tuple(shape), dtype=getattr(torch, str(dtype)), device="meta")
        for update_name, _ in to_checkpoint_names(spec, [(name, meta)], kernel_experts=True):
            out[update_name] = name
    return out


def is_fused_experts(spec: CheckpointSpec, name: str) -> bool:
    """Whether trainer tensor `name` is a layer's fused routed experts (gate_up_proj / down_proj)."""
    for cand in _disk_candidates(spec, name):
        m = _FUSED.match(cand)
        if m and m["prefix"] in spec.expert_groups:
            return True
    return False


def is_kernel_expert_name(name: str) -> bool:
    """Whether an update name is a kernel-format fused expert tensor (`...experts.w13_weight` / `.w2_weight`)."""
    return name.endswith(tuple(f".experts.{s}" for s in KERNEL_EXPERT_SUFFIXES.values()))


_FOLDER_PREFIX = "megamoe-weights-"


def _remove_orphans(base: Path) -> None:
    """Remove update folders whose writing process is gone (killed mid-update): in /dev/shm they
    would hold a model's worth of RAM until reboot. Folder names carry the writer's pid."""
    import shutil

    for folder in base.glob(_FOLDER_PREFIX + "*"):
        pid = folder.name[len(_FOLDER_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def bucket_folder(nbytes: int) -> Path:
    """A new private folder for `nbytes` of update files: in /dev/shm (RAM) when it has room for them
    plus 10% and 64 MiB to spare, else in the temp folder. The caller removes it; folders left by
    processes that died are removed here first."""
    import shutil
    import tempfile

    shm, tmp = Path("/dev/shm"), Path(tempfile.gettempdir())
    use_shm = shm.is_dir() and os.access(shm, os.W_OK)
    if use_shm:
        _remove_orphans(shm)
    base = shm if use_shm and shutil.disk_usage(shm).free >= nbytes * 1.1 + (64 << 20) else tmp
    if base == tmp:
        _remove_orphans(tmp)
    return Path(tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-", dir=str(base)))


def write_buckets(named_tensors: list[tuple[str, torch.Tensor]], folder: str | os.PathLike,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[str]:
    """safetensors files of at most ~bucket_bytes each (a larger single tensor gets its own) in `folder`."""
    from safetensors.torch import save_file

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: expected a positive number of bytes, got {bucket_bytes}")
    paths: list[str] = []
    bucket: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        path = os.path.join(os.fspath(folder), f"bucket-{len(paths):05d}.safetensors")
        save_file(bucket, path)
        paths.append(path)

    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
            bucket, size = {}, 0
        # A private contiguous CPU copy: views of one fused tensor share storage, which safetensors refuses.
        bucket[name] = t.detach().to("cpu").contiguous().clone()
        size += nbytes
    if bucket:
        flush()
    return paths


def read_buckets(paths: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of the files `write_buckets` wrote, in order."""
    from safetensors.torch import load_file

    out = []
    for i, path in enumerate(paths):
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ValueError(f"weight bucket {i}: expected the path of a file written by write_buckets, got {path!r}")
        out.extend(load_file(path).items())
    return out
