"""Router logits in fp32, batch invariant: the one function both sides compute them with.

    router_logits(x[T,H], w[E,H], b[E] = None) -> logits[T,E] fp32   (differentiable w.r.t. x, w and b)

Why a function of its own. The sampler (vLLM's gate layer) and the trainer (transformers' router)
otherwise compute `x @ w.T` with different GEMMs: on CPU vLLM prepacks the gate into its own small-GEMM
kernel and computes it in the model dtype, while the trainer calls F.linear; on GPU either side's BLAS
picks a kernel by the number of rows. Different kernels round differently, and one flipped top-k
choice changes a token's output completely (a gate computed with bmm on one side and mm on the other
flipped top-k choices in published MoE RL stacks). Here both operands are
upcast to fp32 and every row's logits are computed the same way whatever T is, so a row's logits
depend only on that row and w, bitwise, on one device:
- CUDA: Triton (megamoe/kernels/router_kernels.py: fixed blocks; IEEE fp32 multiply-adds over chunks
  of 256 columns, the chunks' sums added in order). It replaced one BLAS call per 32 rows, whose
  launches were a quarter of the host time of a training pass at configs/h200_rl.yaml's shape (91 GEMM
  calls per layer for a micro-batch of about 2,900 tokens; H200,
  benchmarks/results/2026-12-04-h200-bench-numerics-before.md).
- CPU: fixed blocks of ROWS rows through the BLAS (the last one zero-padded), so every row goes through
  a GEMM call of the same shape (the same scheme as megamoe's CPU expert GEMMs).
A router bias (gpt-oss's) is added to the fp32 product afterwards, elementwise: still row by row.

Registered as the torch.library op `megamoe::router_logits` (fake implementation + autograd) so that
torch.compile treats it as one opaque call instead of tracing a loop over T.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from megamoe.blocked import ROWS, rows_mm  # noqa: F401  (ROWS: the rows per GEMM call, documented above)
from megamoe.fused.backend import pick_backend


def check_router_inputs(x_TH: torch.Tensor, w_EH: torch.Tensor, b_E: torch.Tensor | None = None) -> None:
    for name, t in (("x", x_TH), ("w", w_EH)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor ({'[T, H]' if name == 'x' else '[E, H]'}), "
                             f"got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if x_TH.shape[1] != w_EH.shape[1]:
        raise ValueError(f"w: expected shape [E, H={x_TH.shape[1]}] (H of x), got {tuple(w_EH.shape)}")
    if x_TH.device != w_EH.device:
        raise ValueError(f"w: expected the device of x ({x_TH.device}), got {w_EH.device}")
    if b_E is None:
        return
    if not isinstance(b_E, torch.Tensor):
        raise TypeError(f"b: expected a torch.Tensor or None, got {type(b_E).__name__}")
    if tuple(b_E.shape) != (w_EH.shape[0],):
        raise ValueError(f"b: expected shape [E={w_EH.shape[0]}] (one per expert), got {tuple(b_E.shape)}")
    if not b_E.dtype.is_floating_point:
        raise TypeError(f"b: expected a floating dtype, got {b_E.dtype}")
    if b_E.device != x_TH.device:
        raise ValueError(f"b: expected the device of x ({x_TH.device}), got {b_E.device}")


@contextlib.contextmanager
def _ieee_fp32(device: torch.device):
    """fp32 products on CUDA, never TF32, whatever the process-wide setting is (vLLM and the trainer
    may set it differently)."""
    if device.type != "cuda":
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


BLOCKS = dict(BT=16, BE=32, BH=64, CH=256)
"""The Triton kernels' blocks (rows, experts, columns per step, columns per chunk): fixed, never chosen by
shape, since the chunks decide the order of the sums. Small row and expert blocks and short chunks spread
a decode step's few rows over many programs (megamoe/kernels/router_kernels.py)."""


def _logits_triton(x_TH: torch.Tensor, w_EH: torch.Tensor, blocks: dict = BLOCKS) -> torch.Tensor:
    """The Triton kernels over x, w; `blocks` other than BLOCKS only for measuring other tiles (router_probe.py
    --sweep, test_router.py)."""
    from megamoe.fused.launch import launch_device
    from megamoe.kernels.router_kernels import _router_logits_chunk_kernel, _router_logits_sum_kernel

    x, w = x_TH.contiguous(), w_EH.contiguous()
    (T, H), E = x.shape, w.shape[0]
    BT, BE, BH, CH = blocks["BT"], blocks["BE"], blocks["BH"], blocks["CH"]
    S = triton.cdiv(H, CH)
    out = torch.empty(T, E, device=x.device, dtype=torch.float32)
    if T == 0:
        return out
    part = out if S == 1 else torch.empty(S, T, E, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(T, BT), triton.cdiv(E, BE))
    with launch_device(x.device):
        _router_logits_chunk_kernel[grid + (S,)](x, w, part, T, E, H, x.stride(0), w.stride(0),
                                                   part.stride(0) if S > 1 else 0, E, BT=BT, BE=BE, BH=BH, CH=CH,
                                                   num_warps=4)
        if S > 1:
            _router_logits_sum_kernel[grid](part, out, T, E, part.stride(0), E, E, BT=BT, BE=BE, S=S, num_warps=4)
    return out


def router_logits_fwd(x_TH: torch.Tensor, w_EH: torch.Tensor, b_E: torch.Tensor | None = None,
                      backend: str | None = None) -> torch.Tensor:
    """fp32 logits [T, E] = x @ w.T (+ b) (inputs unchecked). backend: "triton" (the default on CUDA; on
    CPU under TRITON_INTERPRET=1, fp32) or "torch" (ROWS-row BLAS blocks; the default on CPU)."""
    if pick_backend(x_TH, backend) == "triton":
        logits = _logits_triton(x_TH, w_EH)
    else:
        x = x_TH.float()
        w_HE = w_EH.float().t().contiguous()  # one layout on both sides: the BLAS call is identical
        with _ieee_fp32(x.device):
            logits = rows_mm(x, w_HE)
    return logits if b_E is None else logits + b_E.float()


@torch.library.custom_op("megamoe::router_logits", mutates_args=())
def _router_logits_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return router_logits_fwd(x, w, b)


@_router_logits_op.register_fake
def _(x, w, b=None):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, w, b = inputs
    ctx.save_for_backward(x, w)
    ctx.b_dtype = None if b is None else b.dtype


def _backward(ctx, g_TE):
    # Gradients need no batch invariance; they are what F.linear(x.float(), w.float(), b.float()) would give.
    x, w = ctx.saved_tensors
    g = g_TE.float()
    dx = (g @ w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
    dw = (g.t() @ x.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
    db = g.sum(dim=0).to(ctx.b_dtype) if ctx.b_dtype is not None and ctx.needs_input_grad[2] else None
    return dx, dw, db


_router_logits_op.register_autograd(_backward, setup_context=_setup_context)


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor, b_E: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 router logits [T, E] of x [T, H] (any float dtype), the router weight w [E, H] and an
    optional router bias b [E] (gpt-oss), added in fp32.

    Bitwise batch invariant on one device: row t depends only on x[t], w and b. Differentiable.
    """
    check_router_inputs(x_TH, w_EH, b_E)
    if b_E is None:
        return _router_logits_op(x_TH, w_EH)
    return _router_logits_op(x_TH, w_EH, b_E)
