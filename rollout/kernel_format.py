"""Kernel format: an update laid out as the engine's own parameters, copied into them in place.

vLLM loads a checkpoint through each layer's weight loader, which may fuse tensors (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`: the model's `packed_modules_mapping`, the shards in list
order along dim 0 at tensor_parallel_size 1), pad rows (an embedding's vocabulary) and rename
(vLLM 0.26 keeps the routed experts at `<experts>.routed_experts.w13_weight`). An update in kernel
format arrives in that layout, under the engine's parameter names, and each tensor is copied into
its parameter: what vLLM's `reload_weights(is_checkpoint_format=False)` does, with no layer-wise
reload. That gives the model a load from the checkpoint gives only where no layer computes
anything from its weights after loading; rollout.adapter.kernel_format_blockers names the layers
that do, and an engine with any keeps checkpoint format for them (rollout/sync.py).

    targets = kernel_targets(update_names, engine_names, packed)  # {engine param: [update names]}
    layout = kernel_layout(plan, engine_params, packed)            # [(engine param, shape, dtype, parts)]

Update names are rollout.weights' (on-disk names, the routed experts fused as
`<experts>.w13_weight` / `.w2_weight`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rollout import weights


def expert_param(name: str, engine_names: Iterable[str]) -> str:
    """The engine parameter that holds kernel-format expert tensor `name` (`<prefix>.w13_weight`): the
    one engine parameter with that suffix at or below the prefix. Raises ValueError otherwise."""
    prefix, suffix = name.rsplit(".", 1)
    found = [p for p in engine_names if p.endswith("." + suffix) and (p == name or p.startswith(prefix + "."))]
    if len(found) != 1:
        raise ValueError(f"tensor {name!r}: expected one engine parameter for it at or below {prefix!r}, found "
                         f"{found or 'none'}; kernel format needs the engine's own expert parameters")
    return found[0]


def kernel_targets(update_names: Iterable[str], engine_names: Iterable[str],
                   packed: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """{engine parameter: the update tensors it is made of, in order}, in the order the update
    first reaches each parameter. Raises ValueError naming the tensor when an update tensor has no
    engine parameter, when a packed parameter would get only some of its shards, or when an engine
    parameter would get nothing (the update would leave it stale)."""
    engine_names = list(engine_names)
    engine_set = set(engine_names)
    shard_of = {m: (fused, i) for fused, mods in packed.items() for i, m in enumerate(mods)}
    parts: dict[str, dict[int, str]] = {}
    shards: dict[str, int] = {}  # engine parameter -> how many update tensors make it
    for u in update_names:
        count = 1
        if weights.is_kernel_expert_name(u):
            target, index = expert_param(u, engine_names), 0
        elif u in engine_set:
            target, index = u, 0
        else:
            module, leaf = u.rsplit(".", 1) if "." in u else ("", u)
            prefix, _, mod = module.rpartition(".")
            if mod not in shard_of:
                raise ValueError(f"tensor {u!r}: the engine has no parameter of that name and {mod!r} is no shard "
                                 f"of a packed parameter (packed_modules_mapping {dict(packed)})")
            fused, index = shard_of[mod]
            count = len(packed[fused])
            target = f"{prefix}.{fused}.{leaf}" if prefix else f"{fused}.{leaf}"
            if target not in engine_set:
                raise ValueError(f"tensor {u!r}: shard {index} of {target!r}, which the engine does not have")
        slots = parts.setdefault(target, {})
        if shards.setdefault(target, count) != count:
            raise ValueError(f"tensor {u!r} lands in {target!r}, which other tensors fill whole")
        if index in slots:
            raise ValueError(f"tensors {slots[index]!r} and {u!r} both land in {target!r} (shard {index})")
        slots[index] = u
    for target, slots in parts.items():
        if sorted(slots) != list(range(shards[target])):
            raise ValueError(f"engine parameter {target!r}: the update brings shards {sorted(slots)} of "
                             f"{shards[target]} ({sorted(slots.values())})")
    missing = [n for n in engine_names if n not in parts]
    if missing:
        raise ValueError(f"engine parameter(s) {missing[:4]}{' ...' if len(missing) > 4 else ''} get nothing from "
                         f"the update ({len(missing)} of {len(engine_names)}); kernel format must write every one")
    return {t: [slots[i] for i in sorted(slots)] for t, slots in parts.items()}


def kernel_layout(plan: Mapping[str, tuple], engine_params: Mapping[str, tuple],
                  packed: Mapping[str, list[str]]) -> list[tuple[str, tuple, str, list[str]]]:
    """The update `plan` ({update name: (shape, dtype name)}) as the engine's parameters
    (`engine_params` {name: (shape, dtype name)}): (engine name, shape, dtype, update names), the
    parts concatenated along dim 0 in order. A one-part parameter may have more rows than its
    tensor (vLLM pads an embedding's vocabulary; the padding rows keep what the first load left
    there, as a reload does not change them either). Raises ValueError naming the parameter when a
    shape or dtype does not fit."""
    out = []
    for target, names in kernel_targets(plan, engine_params, packed).items():
        have_shape, have_dtype = tuple(engine_params[target][0]), engine_params[target][1]
        shapes = [tuple(plan[u][0]) for u in names]
        dtypes = {plan[u][1] for u in names}
        if dtypes != {have_dtype}:
            raise ValueError(f"engine parameter {target!r} is {have_dtype}, the update brings {sorted(dtypes)} "
                             f"({names})")
        if not have_shape or any(not s for s in shapes):  # a scalar: exactly the engine's
            if shapes != [have_shape]:
                raise ValueError(f"engine parameter {target!r} is {list(have_shape)}, the update brings "
                                 f"{[list(s) for s in shapes]} ({names})")
            out.append((target, have_shape, have_dtype, names))
            continue
        if any(len(s) != len(have_shape) or s[1:] != have_shape[1:] for s in shapes):
            raise ValueError(f"engine parameter {target!r} is {list(have_shape)}, the update brings "
                             f"{[list(s) for s in shapes]} ({names})")
        rows = sum(s[0] for s in shapes)
        if rows != have_shape[0] and not (len(names) == 1 and rows < have_shape[0]):
            raise ValueError(f"engine parameter {target!r} has {have_shape[0]} rows, the update brings {rows} "
                             f"({names})")
        out.append((target, (rows,) + have_shape[1:], have_dtype, names))
    return out
