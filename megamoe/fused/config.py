"""Tile sizes and launch settings of the megamoe Triton kernels: `KernelConfig`, the defaults per
dtype and device, and the override benchmarks set.

Tile sizes depend on dtype and device only, never on T, so a token's result does not depend on its
batch (batch invariance); T picks only the forward's pipeline depth, which leaves every bit
unchanged. The measurements behind each default: benchmarks/RESULTS.md, "Kernel config: why these
defaults".
"""

from __future__ import annotations

import dataclasses

import torch
import triton


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    # the persistent kernel: GEMM1 tile [BM rows, BN1 of 2I] over K blocks of BK1, GEMM2 [BM, BN2 of H]
    # over BK2; the bf16 values won the H200 tile sweeps (tune_moe.py)
    BM: int = 128
    BN1: int = 128
    BK1: int = 64
    BN2: int = 256
    BK2: int = 64
    bwd_BN1: int = 64             # the backward's phase 1 holds three accumulators: a narrower block
    BT: int = 32                  # tokens per combine item (bf16 CUDA default: 8, more programs share it at decode)
    BH: int = 256                 # hidden columns per step of the combine
    num_warps: int = 8
    num_stages: int = 3
    # the backward's persistent launch; None: num_stages (bf16 default 4: 0-7 % faster, fits shared memory)
    bwd_stages: int | None = None
    # the backward without saved (gate, up), which recomputes GEMM1; None: bwd_stages (see default_config)
    recompute_stages: int | None = None
    # the forward's stages when T <= small_tokens, None: num_stages (bf16 default 4: 3-9 % faster there, Mixtral aside)
    small_stages: int | None = None
    small_tokens: int = 4096
    # slots per routing-metadata block (phase 0): one tl.histogram and one in-register sort each (power of two)
    BLK: int = 1024
    lag: int | None = None          # in units of group_tiles tiles; None: see default_lag
    # row tiles whose items go column block by column block, so each weight block is read once for 8 tiles
    group_tiles: int = 8
    programs: int | None = None     # None: one per SM
    # weights through TMA descriptors where the shape allows (launch args: weights_through_tma)
    tma_weights: bool = True
    # the weight-gradient kernel: 128x128 tiles (two programs per SM), 3 stages, operands through TMA
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
                                   ("recompute_stages", True, 1), ("small_stages", True, 1), ("small_tokens", False, 0),
                                   ("group_tiles", False, 1), ("programs", True, 1), ("lag", True, 0)):
            v = getattr(self, f)
            if not ((optional and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= least)):
                bad(f, f"an int >= {least}" + (" or None" if optional else ""))
        for f in ("tma_weights", "dw_tma"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "a bool")


# The one setting that depends on the Triton version (the bf16 CUDA default_config below); the kernels,
# their launchers and compile_check.py otherwise run unchanged on Triton 3.6 and 3.7. The bf16 defaults
# were tuned on the H200 with Triton 3.6.0. Triton 3.7.1 makes the one-thread predicate of a scalar
# atomic from the warp index (tid >> 5, a uniform value) where 3.6.0 tests tid's bits; at the register
# ceiling of the backward that recomputes GEMM1 with 4 stages, ptxas spills that index and reloads it
# in every poll of the _wait_geq spin loops (the GEMM loops stay free of local memory). sm_90 compile
# report (benchmarks/device/compile_check.py, E=128, 2026-12-05), "persistent bwd tma" bf16:
#   Triton 3.6.0, 4 stages: 229,472 B shared, 254 registers, 0 B stack, 0 local ops
#   Triton 3.7.1, 4 stages: 229,472 B shared, 255 registers, 48 B stack, 30 local ops, 3 in innermost loops
#   Triton 3.7.1, 3 stages: 172,120 B shared, 255 registers, 48 B stack, 18 local ops, 0 in innermost loops
# (5 stages: 286,856 B, over the limit.) So from 3.7 on that backward takes 3 stages. Every other kernel
# passes the check on 3.7.1 with 3.6.0's config, so it keeps it.
TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])


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
    # BT=8: at decode more programs share the combine (and the backward's dx / d(topk_weights) gather)
    return KernelConfig(bwd_stages=4, BT=8, small_stages=4, recompute_stages=3 if TRITON_VERSION >= (3, 7) else None)


_CONFIG_OVERRIDE: KernelConfig | None = None


def set_config(cfg: KernelConfig | None) -> None:
    """Benchmarks and tuning only: force a config (None restores the defaults)."""
    global _CONFIG_OVERRIDE
    _CONFIG_OVERRIDE = cfg


def config_for(x: torch.Tensor) -> KernelConfig:
    """The config a launch on x uses: the one `set_config` forced, else x's dtype and device default."""
    return _CONFIG_OVERRIDE or default_config(x.dtype, x.device)


def persistent_stages(cfg: KernelConfig, is_bwd: bool, T: int | None = None, recompute: bool = False) -> int:
    """The persistent launch's pipeline stages: the backward's (recompute: the one without saved
    (gate, up)), or the forward's for T tokens (T=None: the EP launch, whose T is the received rows,
    and compile checks: num_stages)."""
    if is_bwd:
        return (recompute and cfg.recompute_stages) or cfg.bwd_stages or cfg.num_stages
    if T is not None and cfg.small_stages is not None and T <= cfg.small_tokens:
        return cfg.small_stages
    return cfg.num_stages


def default_lag(programs: int, n1: int, n2: int, GT: int = 1) -> int:
    """Phase-2 lag in units of GT tiles: a tile's first phase-2 ticket comes about two and a half
    waves of programs after its last phase-1 ticket, so its wait is usually already satisfied (H200,
    Qwen3 shape, T=16384, GT=1, BN1=128: one wave 3.98 ms, ~2.5 waves 3.14 ms, ~10 waves 3.29 ms;
    benchmarks/tune_moe.py). The gap is (LAG - 1) whole units plus the next unit's phase-1 items."""
    gap = (5 * programs) // 2 - GT * n1
    return 1 + max(0, -(-gap // (GT * (n1 + n2))))
