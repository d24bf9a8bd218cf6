"""FSDP2 wrapping of a transformers CausalLM, and streaming full weights out of it.

    apply_fsdp(model, mesh, compute_dtype=torch.bfloat16)   # one fully_shard per decoder layer + root
    for name, tensor in iter_full_weights(model): ...       # every rank iterates; rank 0 gets tensors

Precision: parameters stay fp32 (the master weights, and so the optimizer state); with a bf16
compute dtype, FSDP2's MixedPrecisionPolicy all-gathers them in bf16 for forward/backward and
reduce-scatters gradients in fp32. The router's logits are fp32 regardless (trainer/experts.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers")
    return list(layers)


def apply_fsdp(model: nn.Module, mesh, compute_dtype: torch.dtype = torch.float32, *,
               reshard_after_forward: bool = True) -> nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head; tied weights
    stay together in the root group). Returns the model (now an FSDPModule)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = None
    if compute_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _lora_mergers(model: nn.Module) -> dict:
    """LoRA (trainer/lora.py): base name -> its merge, in the dtype the forward computes in."""
    from trainer import lora

    if getattr(model, "lora_settings", None) is None:
        return {}
    return lora.mergers(model, _full_tensor, model.lora_compute_dtype)


def _unique_state(model: nn.Module, factors: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """state_dict entries in order, tied parameters once (under the first name); LoRA's factors are left out
    (what leaves the trainer is the merged weight, under the base's name)."""
    from trainer.lora import is_factor

    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or (is_factor(name) and not factors):
            continue
        seen.add(id(t))
        yield name, t


def iter_full_weights(model: nn.Module, *, dtype: torch.dtype | None = None, to_cpu: bool = True,
                      rank: int = 0, dst: int | None = 0, select=None, names: list[str] | None = None,
                      may_alias: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in state_dict order with transformers' names, one tensor at a time.

    Every rank must iterate (each DTensor.full_tensor() is a collective); only rank `dst` yields
    (dst=None: every rank yields, each its own full copy on its device, which is what a CUDA IPC
    sync needs: each engine reads the copy on its own GPU), so at most one unsharded tensor exists
    at once. Tied parameters are sent once, under the first name. Names are the checkpoint's,
    because neither FSDP2 nor our experts rename parameters.

    select: a predicate on names (the same on every rank): only those tensors are gathered.
    names: exactly these tensors, in this order (the same on every rank; KeyError for one the model
    does not hold), instead of state_dict order.
    may_alias: the caller copies each tensor before the weights change (a CUDA IPC sync packs it
    into its buffer at once), so a tensor that is the live parameter itself is not cloned.
    """
    state = _unique_state(model)
    merged = _lora_mergers(model)
    if names is not None:
        held = dict(state)
        missing = [n for n in names if n not in held]
        if missing:
            raise KeyError(f"names: the model holds no tensor {missing[0]!r} ({len(missing)} missing)")
        state = ((n, held[n]) for n in names)
    for name, t in state:
        if select is not None and not select(name):
            continue
        full = _full_tensor(t)
        if name in merged:  # LoRA: the merged weight the forward computes with (trainer/lora.py)
            full = merged[name](full)
        if dst is not None and rank != dst:
            del full
            continue
        full = full.detach()
        if dtype is not None and full.dtype != dtype:
            full = full.to(dtype)  # a new tensor: aliases nothing
        # What the consumer holds must never alias live weights (the next optimizer step changes
        # them in place): a plain parameter, or a DTensor whose full_tensor() is its own local shard
        # (a one-rank mesh gathers nothing), is cloned.
        if not may_alias:
            local = t.to_local() if isinstance(t, DTensor) else t
            if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                full = full.clone()
        if to_cpu:
            full = full.cpu()
        yield name, full


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter on this rank. On a one-rank mesh the local shard is the whole
    tensor, so no collective runs (DTensor.full_tensor() there costs ~85 us of host time per tensor,
    to_local() ~12: 7.6 vs 1.1 ms for the 91 tensors of an 8-layer Qwen3-MoE, configs/h200_rl.yaml's count,
    on the CPU machine); every rank of a mesh takes the same branch."""
    if not isinstance(t, DTensor):
        return t.detach()
    if t.device_mesh.size() == 1:
        return t.to_local().detach()
    return t.full_tensor()


def weight_metadata(model: nn.Module, dtype: torch.dtype | None = None) -> list[tuple[str, list[int], str]]:
    """(name, full shape, dtype name) of what `iter_full_weights` yields, without gathering anything."""
    out = []
    for name, t in _unique_state(model):
        out.append((name, list(t.shape), str(dtype or t.dtype).removeprefix("torch.")))
    return out


def nonfinite_weights(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Names of the weights with a NaN/Inf once cast to `dtype` (an fp32 value beyond the 16-bit
    range becomes Inf), checked on each rank's local shard where it lives (no gather, no cast copy,
    no host copy of the data), one flag per tensor all-reduced over the ranks; every rank must call it.

    Two multi-tensor reductions per dtype instead of a cast and a check per tensor (H200,
    configs/h200_rl.yaml's model: 6.9 -> 3.2 ms, benchmarks/RESULTS.md): the sum of |x| is NaN/Inf exactly when a value
    is (a sum of finite values would need to pass 3.4e38 in fp32 to overflow), and the largest |x|
    cast to `dtype` is Inf exactly when some value would become Inf in the cast (rounding is
    monotonic)."""
    import torch.distributed as dist

    names, locals_ = [], []
    for name, t in _unique_state(model, factors=True):  # a non-finite LoRA factor makes its merged weight so
        names.append(name)
        locals_.append((t.to_local() if isinstance(t, DTensor) else t).detach())
    if not names:
        return []
    device = locals_[0].device
    ok = torch.ones(len(names), dtype=torch.int32, device=device)
    for of in {t.dtype for t in locals_}:
        idx = [i for i, t in enumerate(locals_) if t.dtype == of and t.numel()]
        if not idx:
            continue
        group = [locals_[i] for i in idx]
        total = torch.stack(torch._foreach_norm(group, 1, dtype=torch.promote_types(of, torch.float32)))
        largest = torch.stack(torch._foreach_norm(group, float("inf")))
        good = torch.isfinite(total) & torch.isfinite(largest.to(dtype) if dtype is not None else largest)
        ok[torch.tensor(idx, device=device)] = good.to(torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    ok = ok.cpu()  # the one host read: a flag per tensor
    return [n for n, good in zip(names, ok.tolist()) if not good]


def buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive tensors into lists of about bucket_bytes (a tensor larger than that alone)."""
    bucket, size = [], 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
