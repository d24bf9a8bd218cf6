"""`fused_moe_fwd` / `fused_moe_bwd` (plain functions returning tensors: checks, backend choice,
then the Triton launchers or the CPU implementation), the torch.library ops `megamoe::fused_moe`,
`megamoe::fused_moe_train` and `megamoe::fused_moe_bwd` with their fake implementations and
autograd, and `megamoe_moe`, the differentiable implementation behind
`megamoe.fused_moe(..., impl="megamoe")`."""

from __future__ import annotations

import torch

from megamoe.contract import SILU, SWIGLU, Activation, check_activation, check_biases, check_moe_inputs
from megamoe.fused.backend import pick_backend
from megamoe.fused.config import config_for
from megamoe.fused.cpu import cpu_bwd, cpu_fwd, routing_metadata
from megamoe.fused.launch import launch_dw, launch_persistent


def _prep(x, w13, w2, tw, ids):
    # topk_weights keep their dtype: every backend widens them to fp32 where it reads them
    return x.contiguous(), w13.contiguous(), w2.contiguous(), tw.contiguous(), ids.contiguous()


def _biases(b13, b2):
    return (b13.contiguous(), b2.contiguous()) if b13 is not None else (None, None)


def fused_moe_fwd(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, *, b13=None, b2=None,
                  activation: Activation = SWIGLU, backend: str | None = None, check: bool = True,
                  save_gu: bool = False):
    """y[T,H]; with save_gu, (y, gu) where gu [T*k, 2I] is the GEMM1 result (gate, up), biases
    added, rounded to x's dtype, in the op's internal expert-sorted row order: pass it to
    `fused_moe_bwd(..., gu=gu)` with the same inputs. b13 [E, 2I], b2 [E, H]: the experts' biases
    (both or neither); activation: the contract's (megamoe.contract). backend: None (triton on CUDA,
    torch on CPU), "triton" (CUDA, or the interpreter on CPU with TRITON_INTERPRET=1) or "torch".
    Never falls back: an unusable backend raises."""
    if check:
        s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=not x_TH.is_cuda)
    else:
        s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=False)
    check_biases(b13, b2, s, x_TH)
    check_activation(activation)
    backend = pick_backend(x_TH, backend)
    x, w13, w2, tw, ids = _prep(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk)
    b13, b2 = _biases(b13, b2)
    if s.T == 0:
        y, gu = x.new_zeros(0, s.H), x.new_zeros(0, 2 * s.I)
    elif backend == "torch":
        meta = routing_metadata(ids, s.E)
        y, gu = cpu_fwd(x, w13, w2, tw, ids, meta, s.T, s.H, s.I, s.k, save_gu=save_gu, b13=b13, b2=b2,
                        act=activation)
    else:
        y, *_, gu = launch_persistent(False, x, w13, w2, tw, ids, None, s.T, s.H, s.I, s.E, s.k, config_for(x),
                                      save_gu=save_gu, b13=b13, b2=b2, activation=activation)
    return (y, gu) if save_gu else y


def fused_moe_bwd(dy_TH, x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, *, b13=None, b2=None,
                  activation: Activation = SWIGLU, backend: str | None = None, gu: torch.Tensor | None = None):
    """(dx[T,H], dw13[E,2I,H], dw2[E,H,I], dtopk_weights[T,k]) for upstream gradient dy[T,H]; with
    the biases, (dx, dw13, dw2, dtopk_weights, db13[E,2I], db2[E,H]).

    gu: the (gate, up) that `fused_moe_fwd(..., save_gu=True)` returned for these inputs; None
    recomputes GEMM1 (same result: both round it to x's dtype). Triton: one persistent launch
    ((gate, up) + d(gate,up) + per-slot dx + slot-order combine), then the token rows of x and dy
    gathered into the sorted order (2·T·k·H elements of workspace while the weight gradients run) and
    one weight-gradient launch (and, with biases, one bias-gradient launch: per expert, its rows of
    d(gate, up) and of the weighted dy summed in row order).
    """
    s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=False)
    bias = check_biases(b13, b2, s, x_TH)
    check_activation(activation)
    if tuple(dy_TH.shape) != (s.T, s.H):
        raise ValueError(f"dy: expected shape [T={s.T}, H={s.H}], got {tuple(dy_TH.shape)}")
    if gu is not None and (tuple(gu.shape) != (s.T * s.k, 2 * s.I) or gu.dtype != x_TH.dtype
                           or gu.device != x_TH.device):
        raise ValueError(f"gu: expected the [T*k={s.T * s.k}, 2I={2 * s.I}] {x_TH.dtype} tensor on {x_TH.device} "
                         f"that fused_moe_fwd(..., save_gu=True) returned, got {tuple(gu.shape)} {gu.dtype} on {gu.device}")
    backend = pick_backend(x_TH, backend)
    x, w13, w2, tw, ids = _prep(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk)
    b13, b2 = _biases(b13, b2)
    dy = dy_TH.contiguous().to(x.dtype)
    if s.T == 0:
        out = (x.new_zeros(0, s.H), torch.zeros_like(w13), torch.zeros_like(w2), topk_weights_Tk.new_zeros(0, s.k))
        return out + (torch.zeros_like(b13), torch.zeros_like(b2)) if bias else out
    gu = gu.contiguous() if gu is not None else None
    if backend == "torch":
        meta = routing_metadata(ids, s.E)
        dx, dw13, dw2, dtw, db13, db2 = cpu_bwd(dy, x, w13, w2, tw, ids, meta, s.T, s.H, s.I, s.k, gu_saved=gu,
                                                b13=b13, b2=b2, act=activation)
    else:
        cfg = config_for(x)
        dx, dgu, hw, dtw, meta, _ = launch_persistent(True, x, w13, w2, tw, ids, dy, s.T, s.H, s.I, s.E, s.k, cfg,
                                                      gu=gu, b13=b13, b2=b2, activation=activation)
        dw13, dw2, *db = launch_dw(x, dy, dgu, hw, meta, s.E, s.H, s.I, s.k, cfg, tw=tw if bias else None)
        db13, db2 = db if bias else (None, None)
    out = (dx, dw13, dw2, dtw.reshape(s.T, s.k).to(topk_weights_Tk.dtype))
    return out + (db13, db2) if bias else out


# torch.library ops with fake implementations and autograd. The activation travels as its three
# fields (a custom op's schema takes primitive types): name, and alpha / limit (0.0 for silu).
def _act(act: str, alpha: float, limit: float) -> Activation:
    return SWIGLU if act == SILU else Activation(act, alpha=alpha, limit=limit)


def _act_fields(activation: Activation) -> tuple[str, float, float]:
    return activation.name, activation.alpha or 0.0, activation.limit or 0.0


@torch.library.custom_op("megamoe::fused_moe", mutates_args=())
def _fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  act: str = SILU, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    return fused_moe_fwd(x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, activation=_act(act, alpha, limit),
                         check=False)


@_fused_moe_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, act=SILU, alpha=0.0, limit=0.0):
    return x.new_empty(x.shape)


@torch.library.custom_op("megamoe::fused_moe_train", mutates_args=())
def _fused_moe_train_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                        act: str = SILU, alpha: float = 0.0, limit: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward for training: y and the (gate, up) its backward reads instead of recomputing."""
    return fused_moe_fwd(x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, activation=_act(act, alpha, limit),
                         check=False, save_gu=True)


@_fused_moe_train_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, act=SILU, alpha=0.0, limit=0.0):
    return x.new_empty(x.shape), x.new_empty(topk_ids.numel(), 2 * w2.shape[2])


@torch.library.custom_op("megamoe::fused_moe_bwd", mutates_args=())
def _fused_moe_bwd_op(dy: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, gu: torch.Tensor | None = None,
                      b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      act: str = SILU, alpha: float = 0.0, limit: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw13, dw2, dtopk_weights, db13, db2); without biases db13 and db2 are empty tensors (an
    op's outputs cannot be None)."""
    out = fused_moe_bwd(dy, x, w13, w2, topk_weights, topk_ids, gu=gu, b13=b13, b2=b2,
                        activation=_act(act, alpha, limit))
    return out if b13 is not None else out + (x.new_empty(0), x.new_empty(0))


@_fused_moe_bwd_op.register_fake
def _(dy, x, w13, w2, topk_weights, topk_ids, gu=None, b13=None, b2=None, act=SILU, alpha=0.0, limit=0.0):
    biases = (b13.new_empty(b13.shape), b2.new_empty(b2.shape)) if b13 is not None else (x.new_empty(0), x.new_empty(0))
    return (x.new_empty(x.shape), w13.new_empty(w13.shape), w2.new_empty(w2.shape),
            topk_weights.new_empty(topk_weights.shape), *biases)


def _setup_context(ctx, inputs, output):
    x, w13, w2, tw, ids, b13, b2, act, alpha, limit = inputs
    ctx.save_for_backward(x, w13, w2, tw, ids, b13, b2)
    ctx.act = (act, alpha, limit)


def _backward(ctx, dy, *_):
    # the training op also saved (gate, up): passed on, the backward reads it instead of recomputing;
    # (gate, up) itself is an internal output that receives no gradient
    x, w13, w2, tw, ids, b13, b2, *gu = ctx.saved_tensors
    dx, dw13, dw2, dtw, db13, db2 = _fused_moe_bwd_op(dy, x, w13, w2, tw, ids, *(gu or [None]), b13, b2, *ctx.act)
    if b13 is None:
        db13 = db2 = None
    return dx, dw13, dw2, dtw, None, db13, db2, None, None, None


_fused_moe_op.register_autograd(_backward, setup_context=_setup_context)


def _setup_context_train(ctx, inputs, output):
    x, w13, w2, tw, ids, b13, b2, act, alpha, limit = inputs
    ctx.save_for_backward(x, w13, w2, tw, ids, b13, b2, output[1])
    ctx.act = (act, alpha, limit)
    # (gate, up) gets no gradient: without these, autograd would hand the backward a materialised
    # zero tensor of its size ([T*k, 2I]: 403 MB for Qwen3 at T=16384) on every call
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


_fused_moe_train_op.register_autograd(_backward, setup_context=_setup_context_train)


def megamoe_moe(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, *, b13=None, b2=None,
                activation: Activation = SWIGLU) -> torch.Tensor:
    """The differentiable `megamoe` implementation (inputs already checked by `megamoe.fused_moe`).
    When autograd will need the backward, the forward also saves (gate, up) so the backward skips
    GEMM1; otherwise (inference) it writes only y. Both give the same y bits."""
    args = (x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk)
    fields = _act_fields(activation)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*args[:4], b13, b2) if t is not None):
        return _fused_moe_train_op(*args, b13, b2, *fields)[0]
    return _fused_moe_op(*args, b13, b2, *fields)
