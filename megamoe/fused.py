"""The `megamoe` implementation: one persistent Triton launch per forward (routing metadata, both
GEMMs, SwiGLU, weighting and combine; CUDA), or the torch implementation with the same semantics and
reduction order (CPU); fused backward (one persistent launch, then the weight gradients: a row gather
and one weight-gradient launch).

Layers (CONVENTIONS.md): kernels (megamoe/kernels/moe_kernels.py) -> launchers (`_launch_*`) ->
`fused_moe_fwd` / `fused_moe_bwd` (plain functions returning tensors; tests and benchmarks call
them) -> the torch.library op `megamoe::fused_moe` with its fake implementation and autograd ->
`megamoe_moe` (used by `megamoe.fused_moe(..., impl="megamoe")`).

Semantics shared by every backend (so sampler and trainer see one function, bit-for-bit on one
device): per slot, GEMM1 in fp32 accumulation, SwiGLU in fp32, the activation h rounded to the
input dtype; GEMM2 in fp32 accumulation, times the routing weight in fp32, the slot row rounded to
the input dtype; then each token's K slot rows summed in slot order (j = 0..K-1) in fp32 and
rounded once. No float atomics anywhere, so results are deterministic and a token's output does not
depend on the other tokens of the batch (tile and block sizes never depend on T).

The backward differentiates at the GEMM1 result (gate, up) rounded to the input dtype (as the
unfused path, which keeps gate/up in that dtype, does).

Memory. When autograd needs the backward (`megamoe_moe` with grad enabled and an input requiring
grad), the forward also writes (gate, up) and the op saves it with its inputs: K * 2I elements of
the input dtype per token (Qwen3-30B-A3B, bf16: 24.6 KB per token), so the backward skips GEMM1.
Without it (`fused_moe_bwd(..., gu=None)`, the `megamoe::fused_moe` op's own autograd) the backward
recomputes GEMM1 and rounds it the same way, and nothing beyond the inputs is saved. The unfused
`reference` path saves, per token, K rows of its permuted x, gate/up, silu(gate) and activation in
the input dtype and two fp32 [H] rows (the expert output before and after the routing-weight scale):
208 KiB per token for Qwen3 in bf16, measured by benchmarks/bench_memory.py (24 KiB for megamoe;
tests/test_memory.py). Inference (no grad) writes no (gate, up). Transient backward
workspace, freed on return: per token K * (2I + I + H) elements of the input dtype (and K * 2H more
while the weight gradients run: the token rows of x and dy in the sorted order) plus
K * (ceil(I / BN1) + 1) fp32, and int32 routing metadata (2K per token, plus (E + 1) per block of
1024 slots).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megamoe import alloc
from megamoe.blocked import ROWS, rows_mm
from megamoe.contract import check_moe_inputs


# ---------------------------------------------------------------------------------------------
# routing metadata: torch reference (the CPU backend; the Triton kernel computes its own)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RoutingMeta:
    sorted_slot: torch.Tensor   # int64 [N]   slot indices (t*K + j) sorted by id, stable: -1 slots first
    expert_start: torch.Tensor  # int32 [E]   first sorted row of each expert
    expert_count: torch.Tensor  # int32 [E]   rows of each expert


def _r_max(N: int, E: int, BM: int, GT: int = 1) -> int:
    # sum_e ceil(count_e / BM) <= N / BM + E; rounded up to whole groups of GT tiles
    r = (N + BM - 1) // BM + E
    return -(-r // GT) * GT


def routing_metadata(topk_ids_Tk: torch.Tensor, E: int) -> RoutingMeta:
    """Per-expert counts, offsets and the id-sorted slot permutation, in torch ops: the CPU
    backend's metadata and the exact reference for the Triton kernel's phase 0 (which computes the
    same permutation with a stable counting sort inside the persistent launch)."""
    ids = topk_ids_Tk.reshape(-1)
    _, sorted_slot = torch.sort(ids, stable=True)
    ids_m = torch.where(ids < 0, torch.full_like(ids, E), ids).long()
    counts = torch.zeros(E + 1, dtype=torch.int32, device=ids.device).scatter_add_(
        0, ids_m, torch.ones_like(ids_m, dtype=torch.int32))
    count_e = counts[:E]
    start_e = torch.cumsum(count_e, 0, dtype=torch.int32) - count_e + counts[E:]  # after the -1 slots
    return RoutingMeta(sorted_slot, start_e.contiguous(), count_e.contiguous())


# ---------------------------------------------------------------------------------------------
# configuration and workspace
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelConfig:
    BM: int = 128
    BN1: int = 128
    BK1: int = 64
    BN2: int = 256
    BK2: int = 64
    bwd_BN1: int = 64             # the backward's phase 1 holds three accumulators: a narrower block
    BT: int = 32
    BH: int = 256
    num_warps: int = 8
    num_stages: int = 3
    # the backward's persistent launch; None: num_stages. The bf16 default is 4: backward 0-7% faster
    # than 3 on the H200 in three A/Bs, same bits (results/2026-12-01-h200-ab-bwd-stages.log,
    # -ab-tile-groups.log, -ab-tma.log), GPU tests passed with it (-test_fused-gpu-bf16-bwd-stages-4.log);
    # the non-gu backward then needs 229,472 B of shared memory, under the H200's 232,448 B (compile_check)
    bwd_stages: int | None = None
    # the forward's pipeline stages when T <= small_tokens (None: num_stages). Stages change how far
    # ahead the loads run, not the arithmetic: same bits at every T (ab_config's bit check; the GPU batch
    # invariance test crosses the threshold). H200, bf16, 4 vs 3 stages, one process, 3 rounds, forward
    # as a replayed graph (results/2026-12-02-h200-ab-decode-stages.log, -ab-fwd-stages-large.log,
    # -ab-fwd-stages-mid.log): T=64 OLMoE / Qwen3 / DeepSeek-V3 / Mixtral -6 / -6 / -7 / -5 %;
    # T=512 OLMoE / Qwen3 -6 / -6 %; T=1024 -7 / -6 / -3 / +4 %; T=2048 OLMoE / Qwen3 -6 / -9 %;
    # T=4096 -3 / -5 / -5 / +2.5 %; T=16384 -1 / +0.5..+7 / -3 / +4 %. So 4 up to T=4096 (Mixtral, E=8,
    # loses 2.5-4 % from T=1024 on: not understood), 3 above; as the default vs 512: -ab-small-tokens-4096.log,
    # GPU tests on it: -gpu-tests-small-tokens-4096.log
    small_stages: int | None = None
    small_tokens: int = 4096
    # slots per routing-metadata block (phase 0): one tl.histogram and one in-register sort of its
    # (key, slot) pairs per block (power of two). H200, vs the one-hot sums it replaced on 2026-12-01
    # (results/2026-12-01-h200-ab-metadata-sort.log, same bits): forward as a replayed graph Qwen3 /
    # OLMoE / DeepSeek-V3 T=64 0.472 -> 0.381, 0.331 -> 0.275, 0.855 -> 0.830 ms, Qwen3 T=4096
    # 0.951 -> 0.840; T=16384 and DeepSeek-V3 T=4096 within +1..+3 %
    BLK: int = 1024
    lag: int | None = None          # in units of group_tiles tiles; None: see _default_lag
    # row tiles whose items go column block by column block (_decode_ticket), so each weight column
    # block is read once for 8 row tiles. H200, bf16, T=4096 (results/2026-12-01-h200-ab-tile-groups.log):
    # 8 vs 1: forward Mixtral 7.204 -> 5.398 ms, DeepSeek-V3 slice 6.712 -> 5.622; fwd+bwd step 26.47 ->
    # 23.12 and 26.11 -> 23.42; Qwen3 / OLMoE within +-3% (their experts' weights fit in L2)
    group_tiles: int = 8
    programs: int | None = None     # None: one per SM
    # weights through TMA descriptors where the shape allows (_tma_weights). H200, bf16, vs pointer
    # loads (results/2026-12-01-h200-ab-tma.log): forward -8% / -4% at Qwen3 / OLMoE T=16384, -4%
    # DeepSeek-V3 slice, +3% Mixtral, T=4096 within +-1%; backward and step within +-1.7%
    tma_weights: bool = True
    # weight-gradient kernel
    # H200, Qwen3, T=4096 / 16384 (results/2026-12-01-h200-tune-saved-gu.log): 128x128 with 2 stages
    # 1.258 / 3.726 ms (113 registers and 64 KB of shared memory in the compile check: two programs
    # per SM) vs 256x128 1.777 / 5.005; 3 stages 1.277 / 3.807. Operands in the sorted order through
    # per-expert TMA descriptors (dw_tma) with 3 stages: 1.20-1.50x those 2-stage pointer loads of
    # gathered rows, same bits (results/2026-12-01-h200-dw-probe.log). Whole K blocks through host
    # descriptors over all rows instead of descriptors made on the device per program: gather + dW
    # -27 to -29% at T=64/512, -13% Qwen3 4096, -7% Mixtral, DSV3 within +-1% (two repeats; one run
    # +5%), same bits (results/2026-12-01-h200-dw-probe-host-descriptors*.log)
    BMW: int = 128
    BNW: int = 128
    BKR: int = 64
    dw_warps: int = 8
    dw_stages: int = 3
    dw_tma: bool = True
    BR: int = 32                    # token rows per program of the row gather before the dW kernel

    def __post_init__(self) -> None:
        """A config the kernels cannot run (a block that is no power of two, a dot block under 16, a
        negative phase-2 lag, which orders a tile's phase-2 items before its phase-1 items: a
        program would wait for work no program has taken) is refused here, naming the field,
        before any launch."""
        def bad(field: str, expected: str) -> None:
            raise ValueError(f"KernelConfig.{field}: expected {expected}, got {getattr(self, field)!r}")

        def pow2(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0

        for f in ("BM", "BN1", "BK1", "BN2", "BK2", "bwd_BN1", "BMW", "BNW", "BKR"):  # tl.dot blocks
            if not (pow2(getattr(self, f)) and getattr(self, f) >= 16):
                bad(f, "a power of two >= 16 (a tl.dot block)")
        for f in ("BT", "BH", "BLK", "BR"):
            if not pow2(getattr(self, f)):
                bad(f, "a power of two")
        for f in ("num_warps", "dw_warps"):
            if not (pow2(getattr(self, f)) and getattr(self, f) <= 32):
                bad(f, "a power of two <= 32")
        for f, optional, least in (("num_stages", False, 1), ("dw_stages", False, 1), ("bwd_stages", True, 1),
                                   ("small_stages", True, 1), ("small_tokens", False, 0),
                                   ("group_tiles", False, 1), ("programs", True, 1), ("lag", True, 0)):
            v = getattr(self, f)
            if not ((optional and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= least)):
                bad(f, f"an int >= {least}" + (" or None" if optional else ""))
        for f in ("tma_weights", "dw_tma"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "a bool")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_config(dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """Tile sizes depend on dtype and device only, never on T (batch invariance); T picks only the
    forward's pipeline depth (small_stages), which leaves every bit unchanged. The bf16 CUDA
    defaults come from the H200 sweeps in benchmarks/RESULTS.md."""
    if device.type != "cuda":  # the interpreter: small tiles, one program
        return KernelConfig(BM=16, BN1=16, BK1=16, BN2=16, BK2=16, BT=8, BH=32, programs=1,
                            bwd_BN1=16, BMW=16, BNW=16, BKR=16, BLK=32, BR=8)
    if dtype == torch.float32:
        # no TMA: the exact fp32 dots read their operands into registers, and from TMA tiles they
        # spill hundreds of registers (compile_check.py)
        return KernelConfig(BM=64, BN1=32, BK1=32, BN2=64, BK2=32, BT=16, BH=128, num_warps=4, bwd_BN1=32,
                            num_stages=2, BMW=64, BNW=64, BKR=32, dw_warps=4, dw_stages=2, tma_weights=False,
                            dw_tma=False)
    # BT=8: the combine (and the backward's dx / d(topk_weights) gather) in blocks of 8 tokens, not 32,
    # so at decode more programs share it (T=64: 8 items, not 2, at the very end of the launch).
    # H200, one process, 3 rounds (results/2026-12-01-h200-ab-bt8.log): forward as a replayed graph
    # Qwen3 / OLMoE / DeepSeek-V3 / Mixtral T=64 -8 / -10 / -15 / -1.5 %, backward -4 to -8 %;
    # T = 4096 / 16384 within -1.2 ... +3.4 % (forward) and -1.0 ... +0.3 % (backward); same bits
    return KernelConfig(bwd_stages=4, BT=8, small_stages=4)


_CONFIG_OVERRIDE: KernelConfig | None = None


def set_config(cfg: KernelConfig | None) -> None:
    """Benchmarks and tuning only: force a config (None restores the defaults)."""
    global _CONFIG_OVERRIDE
    _CONFIG_OVERRIDE = cfg


def _config(x: torch.Tensor) -> KernelConfig:
    return _CONFIG_OVERRIDE or default_config(x.dtype, x.device)


_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # earlier counter buffers a captured CUDA graph may still use


def _counters(device: torch.device, r_max: int) -> torch.Tensor:
    """int32 [CTR_SLOTS + r_max] (counters, then one per row tile), zero, one per device; the
    kernel leaves it zero again.

    Allocated (zeroed) once and grown only outside CUDA-graph capture: warm the op up with the
    largest batch before capturing. One buffer per device: two megamoe launches must not run
    concurrently on different streams of one device (vLLM and the trainer use one stream).
    """
    key = (str(device),)
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


_PROGRAMS: dict[int, int] = {}


def _num_programs(device: torch.device, cfg: KernelConfig) -> int:
    if cfg.programs is not None:
        return cfg.programs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PROGRAMS:
        _PROGRAMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _PROGRAMS[idx]


def _default_lag(programs: int, n1: int, n2: int, GT: int = 1) -> int:
    """Phase-2 lag in units of GT tiles: a tile's first phase-2 ticket comes about two and a half
    waves of programs after its last phase-1 ticket, so its wait is usually already satisfied (H200,
    Qwen3 shape, T=16384, GT=1, BN1=128: one wave 3.98 ms, ~2.5 waves 3.14 ms, ~10 waves 3.29 ms;
    benchmarks/tune_moe.py). The gap is (LAG - 1) whole units plus the next unit's phase-1 items."""
    gap = (5 * programs) // 2 - GT * n1
    return 1 + max(0, -(-gap // (GT * (n1 + n2))))


def _check_backend(x: torch.Tensor, backend: str) -> None:
    if backend == "triton":
        if x.device.type == "cuda":
            return
        if x.device.type == "cpu" and _interpreting():
            if x.dtype != torch.float32:
                raise ValueError(f"x: the Triton interpreter runs fp32 only (its bf16 tl.dot is wrong), got {x.dtype}")
            return
        raise ValueError(f"backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU), got device {x.device}")
    if backend != "torch":
        raise ValueError(f"backend: expected 'triton' or 'torch', got {backend!r}")


def _pick_backend(x: torch.Tensor, backend: str | None) -> str:
    backend = backend or ("triton" if x.is_cuda else "torch")
    _check_backend(x, backend)
    return backend


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (Triton would otherwise use TF32 on the tensor cores)
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------------
# Triton launchers
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class KernelMeta:
    """The routing metadata the persistent kernel's phase 0 writes (int32, on the device)."""
    sorted_slot: torch.Tensor   # [N]   slots sorted by expert, stable; the -1 slots first
    inv_slot: torch.Tensor      # [N]   sorted row of each valid slot (unwritten for -1 slots)
    expert_start: torch.Tensor  # [E]   first sorted row of each expert
    expert_count: torch.Tensor  # [E]   rows of each expert
    tile_cum: torch.Tensor      # [E]   inclusive cumsum of ceil(count_e / BM): tiles per expert
    num_tiles: torch.Tensor     # [1]   R


def _metadata_buffers(N: int, E: int, nb: int, device) -> tuple[torch.Tensor, ...]:
    """The routing metadata phase 0 writes, in one int32 allocation: sorted_slot [N], inv_slot [N],
    key_start [E+1], key_count [E+1], tile_cum [E], num_tiles [1], block histograms [nb, E+1]."""
    sizes = [N, N, E + 1, E + 1, E, 1, nb * (E + 1)]
    return torch.empty(sum(sizes), dtype=torch.int32, device=device).split(sizes)


@dataclasses.dataclass
class PersistentSetup:
    """What a persistent launch needs besides its tensors (shared by the single-GPU and EP launchers)."""
    consts: dict                # compile-time arguments
    meta: tuple                 # the routing-metadata buffers (_metadata_buffers)
    ctr: torch.Tensor           # the shared counter workspace
    programs: int               # grid size
    lag: int                    # phase-2 ticket lag
    r_max: int                  # row tiles at most
    nb: int                     # phase-0 blocks
    n1: int                     # GEMM1 column blocks
    n2: int                     # GEMM2 column blocks


def persistent_setup(N: int, E: int, H: int, I: int, dtype: torch.dtype, device: torch.device,  # noqa: E741
                     cfg: KernelConfig, is_bwd: bool, gu: bool = False, ep: bool = False,
                     programs: int | None = None, tma_w: bool = False,
                     counters: Callable[[int], torch.Tensor] | None = None, poll_ns: int = 0) -> PersistentSetup:
    """Constants, metadata buffers, counters, grid and lag of one persistent launch over N slot rows
    and E experts; `programs` overrides the grid (default: cfg.programs, else one per SM);
    `counters(r_max)` gives the launch's counter buffer (default: the device's, `_counters`)."""
    consts = persistent_constexprs(cfg, is_bwd, dtype, E, gu=gu, ep=ep, tma_w=tma_w, poll_ns=poll_ns)
    n1, n2 = -(-I // consts["BN1"]), -(-H // cfg.BN2)
    r_max, nb = _r_max(N, E, cfg.BM, cfg.group_tiles), -(-N // cfg.BLK)
    meta = _metadata_buffers(N, E, nb, device)
    ctr = counters(r_max) if counters is not None else _counters(device, r_max)
    programs = programs or _num_programs(device, cfg)
    lag = cfg.lag if cfg.lag is not None else _default_lag(programs, n1, n2, cfg.group_tiles)
    return PersistentSetup(consts, meta, ctr, programs, lag, r_max, nb, n1, n2)


def _tma_weights(cfg: KernelConfig, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the launch reads the weights through TMA descriptors: asked for by the config and
    possible (the hardware needs 16-byte aligned bases and row strides, i.e. H and I a multiple of 8
    in bf16, of 4 in fp32). Either way the kernel reads the same values into the same tiles and
    gives the same bits (tests/test_fused.py); TMA only moves them with fewer registers."""
    return cfg.tma_weights and _tma_addressable((w13, w2))


def _tma_addressable(tensors) -> bool:
    """Whether TMA can address every row of these row-major tensors: a 16-byte aligned base and a
    row of a multiple of 16 bytes (w13's rows are H long, w2's I; the weight gradients' operands
    2I, I and H)."""
    return all(t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


def weight_args(w13: torch.Tensor, w2: torch.Tensor, consts: dict, is_bwd: bool, gu: bool) -> tuple:
    """The persistent kernel's (w13_d1, w2_d1, w_d2) arguments (see its argument list): with
    consts["TMA_W"] the TMA descriptors the launch reads, else (and for those it does not read) the
    weight tensors themselves."""
    if not consts["TMA_W"]:
        return w13, w2, w2
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    E, two_i, H = w13.shape
    I = two_i // 2  # noqa: E741
    BN1, BK1, BN2, BK2 = consts["BN1"], consts["BK1"], consts["BN2"], consts["BK2"]
    w13_d1 = w13 if (is_bwd and gu) else TD.from_tensor(w13.view(E, 2, I, H), [1, 1, BN1, BK1])
    if is_bwd:
        return w13_d1, TD.from_tensor(w2, [1, BK1, BN1]), TD.from_tensor(w13, [1, BK2, BN2])
    return w13_d1, w2, TD.from_tensor(w2, [1, BN2, BK2])


@contextlib.contextmanager
def launch_device(dev: torch.device):
    """Around every Triton launch of the op: on CUDA, the launch's device is `dev` and its context is
    bound to the calling thread. Triton launches on the thread's current device and encodes the TMA
    descriptors (tma_weights, dw_tma) through the driver before its launcher binds a context itself;
    autograd runs a backward on a thread of its own, which has no context until some CUDA runtime
    call binds one. So the op's backward as the first node of a backward pass failed with "Failed to
    create tensor map descriptor: invalid device context" (H200, 2026-12-02,
    results/2026-12-02-h200-host-path-tma.log; the same bug in pytorch/pytorch#124565).
    torch.cuda.device switches the device only where it differs; set_device (same device) binds the
    context. A no-op elsewhere (the interpreter on CPU)."""
    if dev.type != "cuda":
        yield
        return
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    with torch.cuda.device(idx):
        torch.cuda.set_device(idx)
        yield


def _launch_persistent(is_bwd: bool, x, w13, w2, tw, ids, dy, T, H, I, E, K, cfg: KernelConfig,
                       gu: torch.Tensor | None = None, save_gu: bool = False, trace: dict | None = None):
    """One persistent launch: routing metadata, then the forward (or the backward but dW).
    Forward with save_gu: also returns (gate, up) [N, 2I] in sorted rows; backward with gu: reads it
    instead of recomputing GEMM1.

    trace (benchmarks only; a separately compiled variant): a dict the launch fills with "ticks",
    int64 [tickets, 4] = per ticket [start, after its wait, end, program * 16 + kind] (ns of the GPU's
    clock on CUDA, the ticket number under the interpreter; kind 0 routing metadata, 1 GEMM1,
    2 GEMM2, 3 combine, +4 a row tile past the routed ones), and "layout", the launch's ticket
    layout. The outputs are the untraced launch's."""
    from megamoe.kernels.moe_kernels import CTR_SLOTS, _moe_persistent_kernel

    # the kernel indexes every input as a dense row-major array; the public wrappers pass them
    # through _prep, a direct caller (the benchmark tools) might not (topk ids are often a slice)
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", tw), ("topk_ids", ids), ("dy", dy),
                    ("gu", gu)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"_launch_persistent: {name} must be contiguous, got strides {tuple(t.stride())}")
    N = T * K
    dev, dtype = x.device, x.dtype
    use_gu = gu is not None if is_bwd else save_gu
    tma_w = _tma_weights(cfg, w13, w2)
    setup = persistent_setup(N, E, H, I, dtype, dev, cfg, is_bwd, gu=use_gu, tma_w=tma_w)
    weights = weight_args(w13, w2, setup.consts, is_bwd, use_gu)
    sorted_slot, inv_slot, key_start, key_count, tile_cum, num_tiles, blk = setup.meta
    n1 = setup.n1
    act = alloc.empty(N, (2 * I) if is_bwd else I, dtype=dtype, device=dev)
    hw = alloc.empty(N, I, dtype=dtype, device=dev) if is_bwd else act
    dtw_part = alloc.empty(N, n1, dtype=torch.float32, device=dev) if is_bwd else tw
    dtw = alloc.empty(N, dtype=torch.float32, device=dev) if is_bwd else tw
    slot_out = alloc.empty(N, H, dtype=dtype, device=dev)
    out = alloc.empty(T, H, dtype=dtype, device=dev)
    if not is_bwd and save_gu:
        # zeros: the rows of dropped (-1) slots are never written, and an op output must not hold
        # whatever memory held before (opcheck compares two runs)
        gu = torch.zeros(N, 2 * I, dtype=dtype, device=dev)
    ctr = setup.ctr
    extra = {}
    if trace is not None:
        p0 = 2 * setup.nb + 1
        tickets = p0 + setup.r_max * (n1 + setup.n2) + -(-T // cfg.BT)  # the kernel's `total`
        trace["ticks"] = torch.full((tickets, 4), -1, dtype=torch.int64, device=dev)
        trace["layout"] = dict(P0=p0, R_MAX=setup.r_max, n1=n1, n2=setup.n2, lag=setup.lag, GT=cfg.group_tiles,
                               programs=setup.programs, T=T, BT=cfg.BT)
        extra = dict(TRACE=True, CLOCK=dev.type == "cuda")
    with launch_device(dev):
        _moe_persistent_kernel[(setup.programs,)](
            x, w13, w2, tw, ids, dy if dy is not None else x, *weights,
            sorted_slot, inv_slot, key_start, key_count, tile_cum, num_tiles, blk,
            act, hw, gu if use_gu else act, dtw_part, dtw, slot_out, out, ctr, ctr[CTR_SLOTS.value:],
            ctr, ctr, ctr, x, ids, tw, out,  # the EP arguments, unused here
            trace["ticks"] if trace is not None else ids,
            T, N, E, H, I, K, setup.lag, setup.r_max, setup.nb, 0, 1, 0, 0, 0, 0,
            **{**setup.consts, **extra}, num_warps=cfg.num_warps, num_stages=persistent_stages(cfg, is_bwd, T))
    meta = KernelMeta(sorted_slot, inv_slot, key_start[1:], key_count[1:], tile_cum, num_tiles)
    return out, act, hw, dtw, meta, (gu if use_gu and not is_bwd else None)


def persistent_constexprs(cfg: KernelConfig, is_bwd: bool, dtype: torch.dtype, E: int, gu: bool = False,
                          ep: bool = False, tma_w: bool = False, poll_ns: int = 0) -> dict:
    """The persistent kernel's compile-time arguments (tests/test_kernel_compile.py compiles with them).
    gu: the forward writes (gate, up) / the backward reads it instead of recomputing GEMM1.
    ep: the expert-parallel forward (megamoe/ep_fused.py), poll_ns its least time between two polls
    of a signal pad (0: no clock, the interpreter). tma_w: weights through TMA descriptors."""
    kb = max(16, _next_pow2(E + 1))  # keys: id + 1 in [0, E]
    return dict(IS_BWD=is_bwd, GU=gu, BM=cfg.BM, BN1=cfg.bwd_BN1 if is_bwd else cfg.BN1, BK1=cfg.BK1, BN2=cfg.BN2,
                BK2=cfg.BK2, BT=cfg.BT, BH=cfg.BH, BLK=cfg.BLK,
                KB=kb, CB=max(16, 8192 // kb), DOT_PRECISION=_dot_precision(dtype), EP=ep, TMA_W=tma_w,
                GT=cfg.group_tiles, POLL_NS=poll_ns, TRACE=False, CLOCK=False)


def persistent_stages(cfg: KernelConfig, is_bwd: bool, T: int | None = None) -> int:
    """The persistent launch's pipeline stages: the backward's, or the forward's for T tokens (T=None:
    the EP launch, whose T is the received rows, and compile checks: num_stages)."""
    if is_bwd:
        return cfg.bwd_stages or cfg.num_stages
    if T is not None and cfg.small_stages is not None and T <= cfg.small_tokens:
        return cfg.small_stages
    return cfg.num_stages


def dw_constexprs(cfg: KernelConfig, dtype: torch.dtype, tma: bool) -> dict:
    return dict(BMW=cfg.BMW, BNW=cfg.BNW, BKR=cfg.BKR, TMA=tma, DOT_PRECISION=_dot_precision(dtype))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dw_tma(cfg: KernelConfig, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether the weight-gradient launch reads its experts' whole K blocks through TMA descriptors:
    asked for by the config and possible (16-byte aligned bases and row strides of dgu [N, 2I],
    hw [N, I], xs and dys [N, H], i.e. I and H a multiple of 8 in bf16). Either way the same values
    reach the same tiles (tests/test_fused.py)."""
    return cfg.dw_tma and _tma_addressable(tensors)


def dw_operand_args(xs, dys, dgu, hw, cfg: KernelConfig, tma: bool) -> tuple:
    """The weight-gradient kernel's (xs_d, dys_d, dgu_d, hw_d) arguments: with tma, TMA descriptors
    over all N sorted rows (the kernel reads only whole K blocks of one expert through them), else
    the tensors themselves (unused)."""
    if not tma:
        return xs, dys, dgu, hw
    from triton.tools.tensor_descriptor import TensorDescriptor as TD
    return (TD.from_tensor(xs, [cfg.BKR, cfg.BNW]), TD.from_tensor(dys, [cfg.BKR, cfg.BNW]),
            TD.from_tensor(dgu, [cfg.BKR, cfg.BMW]), TD.from_tensor(hw, [cfg.BKR, cfg.BMW]))


def _launch_dw(x, dy, dgu, hw, meta: KernelMeta, E, H, I, K, cfg: KernelConfig):
    """dW13 [E, 2I, H], dW2 [E, H, I]: the token rows gathered into the sorted order (one launch),
    then the weight-gradient kernel (one launch). The gathered copies (2·T·k·H elements) live only
    for this call."""
    from megamoe.kernels.moe_kernels import _gather_token_rows_kernel, _moe_bwd_dw_kernel

    N = meta.sorted_slot.numel()
    xs = alloc.empty(N, H, dtype=x.dtype, device=x.device)
    dys = alloc.empty(N, H, dtype=x.dtype, device=x.device)
    dw13 = alloc.empty(E, 2 * I, H, dtype=x.dtype, device=x.device)
    dw2 = alloc.empty(E, H, I, dtype=x.dtype, device=x.device)
    tma = _dw_tma(cfg, (dgu, hw, xs, dys))
    per_e = (-(-2 * I // cfg.BMW) + -(-I // cfg.BMW)) * (-(-H // cfg.BNW))
    with launch_device(x.device):
        _gather_token_rows_kernel[(-(-N // cfg.BR),)](x, dy, meta.sorted_slot, xs, dys, N, H, K, BR=cfg.BR,
                                                       BH=min(256, _next_pow2(H)), num_warps=4)
        _moe_bwd_dw_kernel[(E * per_e,)](
            xs, dys, dgu, hw, *dw_operand_args(xs, dys, dgu, hw, cfg, tma), meta.expert_start, meta.expert_count,
            dw13, dw2, E, H, I,
            **dw_constexprs(cfg, x.dtype, tma), num_warps=cfg.dw_warps, num_stages=cfg.dw_stages,
        )
    return dw13, dw2


# ---------------------------------------------------------------------------------------------
# torch implementation (CPU): the same semantics and reduction order
# ---------------------------------------------------------------------------------------------
_CPU_ROWS = ROWS  # fixed row block: a row's GEMM result never depends on how many rows share the call


_CPU_COLS = 512  # 32 x 512 elements stay under ATen's parallel grain (32768): one thread, fixed split


def _blockwise(fn, *ts: torch.Tensor) -> torch.Tensor:
    """fn applied elementwise in fixed [_CPU_ROWS, _CPU_COLS] blocks.

    On a whole [rows, I] tensor ATen splits elementwise ops across threads at points that depend on
    the row and thread counts, moving elements between its vectorised and scalar paths (exp differs
    in the last bit): a token's SwiGLU would then depend on its batch and on the process's thread
    count (vLLM's CPU worker runs 1 thread, the trainer 2). Fixed blocks keep every element's path a
    function of its column only.
    """
    M, N = ts[0].shape
    rows = []
    for r0 in range(0, M, _CPU_ROWS):
        rows.append(torch.cat([fn(*(t[r0:r0 + _CPU_ROWS, c0:c0 + _CPU_COLS] for t in ts))
                               for c0 in range(0, N, _CPU_COLS)], dim=1))
    return torch.cat(rows) if rows else fn(*ts)


def _combine_slots(slot_out_NH: torch.Tensor, ids_Tk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    T, K = ids_Tk.shape
    rows = slot_out_NH.reshape(T, K, slot_out_NH.shape[-1])  # explicit H: T may be 0
    acc = torch.zeros(T, rows.shape[-1], dtype=torch.float32, device=rows.device)
    for j in range(K):  # slot order, fp32
        acc += torch.where((ids_Tk[:, j] >= 0)[:, None], rows[:, j].float(), 0.0)
    return acc.to(dtype)


def _fwd_torch(x, w13, w2, tw, ids, meta: RoutingMeta, T, H, I, K, save_gu: bool = False):
    """y, and (gate, up) [N, 2I] in sorted rows rounded to x's dtype when save_gu (else None)."""
    dtype = x.dtype
    slot_out = torch.zeros(T * K, H, dtype=dtype)
    gu_saved = torch.zeros(T * K, 2 * I, dtype=dtype, device=x.device) if save_gu else None  # -1 slots: 0
    sorted_slot = meta.sorted_slot.long()
    for e, (s, n) in enumerate(zip(meta.expert_start.tolist(), meta.expert_count.tolist())):
        if n == 0:
            continue
        slot = sorted_slot[s:s + n]
        gu = rows_mm(x[slot // K].float(), w13[e].float().t())
        if gu_saved is not None:
            gu_saved[s:s + n] = gu.to(dtype)
        h = _blockwise(lambda g, u: F.silu(g) * u, gu[:, :I], gu[:, I:]).to(dtype)
        o = rows_mm(h.float(), w2[e].float().t()) * tw.reshape(-1)[slot].float()[:, None]
        slot_out[slot] = o.to(dtype)
    return _combine_slots(slot_out, ids, dtype), gu_saved


def _bwd_torch(dy, x, w13, w2, tw, ids, meta: RoutingMeta, T, H, I, K, gu_saved=None):
    dtype = x.dtype
    dx_slot = torch.zeros(T * K, H, dtype=dtype)
    dw13 = torch.zeros_like(w13)
    dw2 = torch.zeros_like(w2)
    dtw = torch.zeros(T * K, dtype=torch.float32)
    sorted_slot = meta.sorted_slot.long()
    for e, (s, n) in enumerate(zip(meta.expert_start.tolist(), meta.expert_count.tolist())):
        if n == 0:
            continue
        slot = sorted_slot[s:s + n]
        tok = slot // K
        xe = x[tok].float()
        dye = dy[tok].float()
        w = tw.reshape(-1)[slot].float()[:, None]
        if gu_saved is not None:
            gu = gu_saved[s:s + n].float()
        else:  # recomputed and rounded as the forward saves it
            gu = rows_mm(xe, w13[e].float().t()).to(dtype).float()
        g, u = gu[:, :I], gu[:, I:]
        sg = _blockwise(torch.sigmoid, g)
        h = (g * sg * u).to(dtype).float()
        dA = rows_mm(dye, w2[e].float())
        dtw[slot] = (dA * h).sum(dim=1)
        da = dA * w
        dgu = torch.cat([da * u * sg * (1 + g * (1 - sg)), da * g * sg], dim=1).to(dtype)
        hw = (h * w).to(dtype)
        dx_slot[slot] = rows_mm(dgu.float(), w13[e].float()).to(dtype)
        dw13[e] = (dgu.float().t() @ xe).to(dtype)
        dw2[e] = (dye.t() @ hw.float()).to(dtype)
    dx = _combine_slots(dx_slot, ids, dtype)
    dtw = torch.where(ids.reshape(-1) >= 0, dtw, 0.0)
    return dx, dw13, dw2, dtw.reshape(T, K)


# ---------------------------------------------------------------------------------------------
# fused_moe_fwd / fused_moe_bwd
# ---------------------------------------------------------------------------------------------
def _prep(x, w13, w2, tw, ids):
    # topk_weights keep their dtype: every backend widens them to fp32 where it reads them
    return x.contiguous(), w13.contiguous(), w2.contiguous(), tw.contiguous(), ids.contiguous()


def fused_moe_fwd(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, *,
                  backend: str | None = None, check: bool = True, save_gu: bool = False):
    """y[T,H]; with save_gu, (y, gu) where gu [T*k, 2I] is the GEMM1 result (gate, up) rounded to
    x's dtype, in the op's internal expert-sorted row order: pass it to `fused_moe_bwd(..., gu=gu)`
    with the same inputs. backend: None (triton on CUDA, torch on CPU), "triton" (CUDA, or the
    interpreter on CPU with TRITON_INTERPRET=1) or "torch". Never falls back: an unusable backend
    raises."""
    if check:
        s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=not x_TH.is_cuda)
    else:
        s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=False)
    backend = _pick_backend(x_TH, backend)
    x, w13, w2, tw, ids = _prep(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk)
    if s.T == 0:
        y, gu = x.new_zeros(0, s.H), x.new_zeros(0, 2 * s.I)
    elif backend == "torch":
        meta = routing_metadata(ids, s.E)
        y, gu = _fwd_torch(x, w13, w2, tw, ids, meta, s.T, s.H, s.I, s.k, save_gu=save_gu)
    else:
        y, *_, gu = _launch_persistent(False, x, w13, w2, tw, ids, None, s.T, s.H, s.I, s.E, s.k, _config(x),
                                       save_gu=save_gu)
    return (y, gu) if save_gu else y


def fused_moe_bwd(dy_TH, x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, *,
                  backend: str | None = None, gu: torch.Tensor | None = None):
    """(dx[T,H], dw13[E,2I,H], dw2[E,H,I], dtopk_weights[T,k]) for upstream gradient dy[T,H].

    gu: the (gate, up) that `fused_moe_fwd(..., save_gu=True)` returned for these inputs; None
    recomputes GEMM1 (same result: both round it to x's dtype). Triton: one persistent launch
    ((gate, up) + d(gate,up) + per-slot dx + slot-order combine), then the token rows of x and dy
    gathered into the sorted order (2·T·k·H elements of workspace while the weight gradients run) and
    one weight-gradient launch.
    """
    s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=False)
    if tuple(dy_TH.shape) != (s.T, s.H):
        raise ValueError(f"dy: expected shape [T={s.T}, H={s.H}], got {tuple(dy_TH.shape)}")
    if gu is not None and (tuple(gu.shape) != (s.T * s.k, 2 * s.I) or gu.dtype != x_TH.dtype
                           or gu.device != x_TH.device):
        raise ValueError(f"gu: expected the [T*k={s.T * s.k}, 2I={2 * s.I}] {x_TH.dtype} tensor on {x_TH.device} "
                         f"that fused_moe_fwd(..., save_gu=True) returned, got {tuple(gu.shape)} {gu.dtype} on {gu.device}")
    backend = _pick_backend(x_TH, backend)
    x, w13, w2, tw, ids = _prep(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk)
    dy = dy_TH.contiguous().to(x.dtype)
    if s.T == 0:
        return (x.new_zeros(0, s.H), torch.zeros_like(w13), torch.zeros_like(w2),
                topk_weights_Tk.new_zeros(0, s.k))
    gu = gu.contiguous() if gu is not None else None
    if backend == "torch":
        meta = routing_metadata(ids, s.E)
        dx, dw13, dw2, dtw = _bwd_torch(dy, x, w13, w2, tw, ids, meta, s.T, s.H, s.I, s.k, gu_saved=gu)
        return dx, dw13, dw2, dtw.to(topk_weights_Tk.dtype)
    cfg = _config(x)
    dx, dgu, hw, dtw, meta, _ = _launch_persistent(True, x, w13, w2, tw, ids, dy, s.T, s.H, s.I, s.E, s.k, cfg,
                                                   gu=gu)
    dw13, dw2 = _launch_dw(x, dy, dgu, hw, meta, s.E, s.H, s.I, s.k, cfg)
    return dx, dw13, dw2, dtw.reshape(s.T, s.k).to(topk_weights_Tk.dtype)


# ---------------------------------------------------------------------------------------------
# torch.library op with fake implementation and autograd
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("megamoe::fused_moe", mutates_args=())
def _fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    return fused_moe_fwd(x, w13, w2, topk_weights, topk_ids, check=False)


@_fused_moe_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return x.new_empty(x.shape)


@torch.library.custom_op("megamoe::fused_moe_train", mutates_args=())
def _fused_moe_train_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward for training: y and the (gate, up) its backward reads instead of recomputing."""
    return fused_moe_fwd(x, w13, w2, topk_weights, topk_ids, check=False, save_gu=True)


@_fused_moe_train_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return x.new_empty(x.shape), x.new_empty(topk_ids.numel(), 2 * w2.shape[2])


@torch.library.custom_op("megamoe::fused_moe_bwd", mutates_args=())
def _fused_moe_bwd_op(dy: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, gu: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_moe_bwd(dy, x, w13, w2, topk_weights, topk_ids, gu=gu)


@_fused_moe_bwd_op.register_fake
def _(dy, x, w13, w2, topk_weights, topk_ids, gu=None):
    return x.new_empty(x.shape), w13.new_empty(w13.shape), w2.new_empty(w2.shape), \
        topk_weights.new_empty(topk_weights.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy, *_):
    # the training op also saved (gate, up): passed on, the backward reads it instead of recomputing;
    # (gate, up) itself is an internal output that receives no gradient
    x, w13, w2, tw, ids, *gu = ctx.saved_tensors
    dx, dw13, dw2, dtw = _fused_moe_bwd_op(dy, x, w13, w2, tw, ids, *gu)
    return dx, dw13, dw2, dtw, None


_fused_moe_op.register_autograd(_backward, setup_context=_setup_context)


def _setup_context_train(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])
    # (gate, up) gets no gradient: without these, autograd would hand the backward a materialised
    # zero tensor of its size ([T*k, 2I]: 403 MB for Qwen3 at T=16384) on every call
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


_fused_moe_train_op.register_autograd(_backward, setup_context=_setup_context_train)


def megamoe_moe(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk) -> torch.Tensor:
    """The differentiable `megamoe` implementation (inputs already checked by `megamoe.fused_moe`).
    When autograd will need the backward, the forward also saves (gate, up) so the backward skips
    GEMM1; otherwise (inference) it writes only y. Both give the same y bits."""
    args = (x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk)
    if torch.is_grad_enabled() and any(t.requires_grad for t in args[:4]):
        return _fused_moe_train_op(*args)[0]
    return _fused_moe_op(*args)
