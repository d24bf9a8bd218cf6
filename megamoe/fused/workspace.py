"""What the persistent launches keep or allocate besides their outputs: the per-device counter
workspace (left zero by every launch, so a CUDA-graph replay needs no host work), the grid size per
device, and the int32 routing-metadata buffers phase 0 writes."""

from __future__ import annotations

import dataclasses

import torch

_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # earlier counter buffers a captured CUDA graph may still use
_PROGRAMS: dict[int, int] = {}


def device_counters(device: torch.device, r_max: int) -> torch.Tensor:
    """int32 [CTR_SLOTS + r_max] (counters, then one per row tile), zero, one per device; the
    kernel leaves it zero again.

    Allocated (zeroed) once and grown only outside CUDA-graph capture: warm the op up with the
    largest batch before capturing. One buffer per device: two megamoe launches must not run
    concurrently on different streams of one device (vLLM and the trainer use one stream).
    """
    key = _device_key(device)
    buf = _COUNTERS[key] = grown_counters(_COUNTERS.get(key), device, r_max)
    return buf


def grown_counters(buf: torch.Tensor | None, device: torch.device, r_max: int) -> torch.Tensor:
    """`buf` if it holds the counters of a launch with r_max row tiles, else a new zeroed one (the
    old one kept alive for a graph that may use it); never during CUDA-graph capture."""
    from megamoe.kernels.moe_kernels import CTR_SLOTS

    need = CTR_SLOTS.value + r_max
    if buf is not None and buf.numel() >= need:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"megamoe: the counter workspace must grow to {need} entries during CUDA-graph "
            "capture; run the op once eagerly with the largest batch before capturing")
    if buf is not None:
        _RETIRED.append(buf)
    return torch.zeros(max(need, CTR_SLOTS.value + 1024), dtype=torch.int32, device=device)


def counter_buffers(device: torch.device | str | None = None) -> list[torch.Tensor]:
    """The live counter workspaces of the single-GPU launches (of `device`, or of every device): for
    tests that check a launch left them zero."""
    return [buf for key, buf in _COUNTERS.items() if device is None or key == _device_key(device)]


def _device_key(device: torch.device | str) -> tuple[str]:
    """One key per physical device: "cuda" and a tensor's "cuda:0" name the same buffer."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (str(device),)


def num_programs(device: torch.device, programs: int | None) -> int:
    """The persistent grid: `programs` if given, else one program per SM of `device`."""
    if programs is not None:
        return programs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PROGRAMS:
        _PROGRAMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _PROGRAMS[idx]


def r_max(N: int, E: int, BM: int, GT: int = 1) -> int:
    """Row tiles at most, from the shapes alone: sum_e ceil(count_e / BM) <= N / BM + E, rounded up
    to whole groups of GT tiles."""
    r = (N + BM - 1) // BM + E
    return -(-r // GT) * GT


# the persistent kernel's parameter names of the metadata buffers, in `metadata_buffers`' order
METADATA_ARGS = ("sorted_slot_ptr", "inv_slot_ptr", "key_start_ptr", "key_count_ptr", "tile_cum_ptr",
                 "num_tiles_ptr", "blk_ptr")


def metadata_buffers(N: int, E: int, nb: int, device) -> tuple[torch.Tensor, ...]:
    """The routing metadata phase 0 writes, in one int32 allocation: sorted_slot [N], inv_slot [N],
    key_start [E+1], key_count [E+1], tile_cum [E], num_tiles [1], block histograms [nb, E+1]."""
    sizes = [N, N, E + 1, E + 1, E, 1, nb * (E + 1)]
    return torch.empty(sum(sizes), dtype=torch.int32, device=device).split(sizes)


@dataclasses.dataclass
class KernelMeta:
    """The routing metadata the persistent kernel's phase 0 writes (int32, on the device)."""
    sorted_slot: torch.Tensor   # [N]   slots sorted by expert, stable; the -1 slots first
    inv_slot: torch.Tensor      # [N]   sorted row of each valid slot (unwritten for -1 slots)
    expert_start: torch.Tensor  # [E]   first sorted row of each expert
    expert_count: torch.Tensor  # [E]   rows of each expert
    tile_cum: torch.Tensor      # [E]   inclusive cumsum of ceil(count_e / BM): tiles per expert
    num_tiles: torch.Tensor     # [1]   R
