"""What a launch of the megamoe kernels passes besides its tensors: compile-time constants, whether
the weights (and the weight gradients' operands) go through TMA descriptors and those descriptors,
the persistent launch's grid, lag, metadata buffers and counters (`persistent_setup`, shared by the
single-GPU launcher and the EP one in megamoe/ep_fused.py). tests/megamoe/test_kernel_compile.py and
benchmarks/device/compile_check.py compile the kernels with these same functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megamoe.fused.config import KernelConfig, default_lag
from megamoe.fused.workspace import device_counters, metadata_buffers, num_programs, r_max


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (Triton would otherwise use TF32 on the tensor cores)
    return "ieee" if dtype == torch.float32 else "tf32"


def persistent_constexprs(cfg: KernelConfig, is_bwd: bool, dtype: torch.dtype, E: int, gu: bool = False,
                          ep: bool = False, tma_w: bool = False, poll_ns: int = 0) -> dict:
    """The persistent kernel's compile-time arguments (tests/megamoe/test_kernel_compile.py compiles with them).
    gu: the forward writes (gate, up) / the backward reads it instead of recomputing GEMM1.
    ep: the expert-parallel forward (megamoe/ep_fused.py), poll_ns its least time between two polls
    of a signal pad (0: no clock, the interpreter). tma_w: weights through TMA descriptors. BIAS and
    ACT (the experts' biases and activation) are the plain experts' here; launch_persistent sets a
    call's (launch.act_args)."""
    kb = max(16, next_pow2(E + 1))  # keys: id + 1 in [0, E]
    return dict(IS_BWD=is_bwd, GU=gu, BM=cfg.BM, BN1=cfg.bwd_BN1 if is_bwd else cfg.BN1, BK1=cfg.BK1, BN2=cfg.BN2,
                BK2=cfg.BK2, BT=cfg.BT, BH=cfg.BH, BLK=cfg.BLK,
                KB=kb, CB=max(16, 8192 // kb), DOT_PRECISION=dot_precision(dtype), EP=ep, TMA_W=tma_w,
                GT=cfg.group_tiles, POLL_NS=poll_ns, TRACE=False, CLOCK=False, BIAS=False, ACT=0)


def dw_constexprs(cfg: KernelConfig, dtype: torch.dtype, tma: bool) -> dict:
    """The weight-gradient kernel's compile-time arguments."""
    return dict(BMW=cfg.BMW, BNW=cfg.BNW, BKR=cfg.BKR, TMA=tma, DOT_PRECISION=dot_precision(dtype))


def bias_grad_constexprs() -> dict:
    """The bias-gradient kernel's compile-time arguments: rows per step and columns per program."""
    return dict(BR=32, BC=128)


@dataclasses.dataclass
class PersistentSetup:
    """What a persistent launch needs besides its tensors (shared by the single-GPU and EP launchers)."""
    consts: dict                # compile-time arguments
    meta: tuple                 # the routing-metadata buffers (workspace.metadata_buffers)
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
    `counters(r_max)` gives the launch's counter buffer (default: the device's, `device_counters`)."""
    consts = persistent_constexprs(cfg, is_bwd, dtype, E, gu=gu, ep=ep, tma_w=tma_w, poll_ns=poll_ns)
    n1, n2 = -(-I // consts["BN1"]), -(-H // cfg.BN2)
    tiles, nb = r_max(N, E, cfg.BM, cfg.group_tiles), -(-N // cfg.BLK)
    meta = metadata_buffers(N, E, nb, device)
    ctr = counters(tiles) if counters is not None else device_counters(device, tiles)
    programs = programs or num_programs(device, cfg.programs)
    lag = cfg.lag if cfg.lag is not None else default_lag(programs, n1, n2, cfg.group_tiles)
    return PersistentSetup(consts, meta, ctr, programs, lag, tiles, nb, n1, n2)


def tma_addressable(tensors) -> bool:
    """Whether TMA can address every row of these row-major tensors: a 16-byte aligned base and a
    row of a multiple of 16 bytes (w13's rows are H long, w2's I; the weight gradients' operands
    2I, I and H)."""
    return all(t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


def weights_through_tma(cfg: KernelConfig, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the persistent launch reads the weights through TMA descriptors: asked for by the
    config and possible (the hardware needs 16-byte aligned bases and row strides, i.e. H and I a
    multiple of 8 in bf16, of 4 in fp32). Either way the kernel reads the same values into the same
    tiles and gives the same bits (tests/megamoe/test_fused.py); TMA only moves them with fewer registers."""
    return cfg.tma_weights and tma_addressable((w13, w2))


def dw_through_tma(cfg: KernelConfig, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether the weight-gradient launch reads its experts' whole K blocks through TMA descriptors:
    asked for by the config and possible (16-byte aligned bases and row strides of dgu [N, 2I],
    hw [N, I], xs and dys [N, H], i.e. I and H a multiple of 8 in bf16). Either way the same values
    reach the same tiles (tests/megamoe/test_fused.py)."""
    return cfg.dw_tma and tma_addressable(tensors)


WEIGHT_ARGS = ("w13_d1", "w2_d1", "w_d2")  # the persistent kernel's names of weight_args' tuple


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


DW_OPERAND_ARGS = ("xs_d", "dys_d", "dgu_d", "hw_d")  # the dW kernel's names of dw_operand_args' tuple


def dw_operand_args(xs, dys, dgu, hw, cfg: KernelConfig, tma: bool) -> tuple:
    """The weight-gradient kernel's (xs_d, dys_d, dgu_d, hw_d) arguments: with tma, TMA descriptors
    over all N sorted rows (the kernel reads only whole K blocks of one expert through them), else
    the tensors themselves (unused)."""
    if not tma:
        return xs, dys, dgu, hw
    from triton.tools.tensor_descriptor import TensorDescriptor as TD
    return (TD.from_tensor(xs, [cfg.BKR, cfg.BNW]), TD.from_tensor(dys, [cfg.BKR, cfg.BNW]),
            TD.from_tensor(dgu, [cfg.BKR, cfg.BMW]), TD.from_tensor(hw, [cfg.BKR, cfg.BMW]))
