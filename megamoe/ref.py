"""Reference implementations of the MoE contract.

(a) ``moe_ground_truth``: a loop over experts computed in fp32 (or fp64) from upcast inputs. Tests
    compare every implementation, forward and gradients, against it.
(b) ``moe_unfused``: the unfused production path, the `reference` implementation every comparison
    in the project uses: permute by expert -> grouped GEMM -> SwiGLU -> grouped GEMM -> weighted
    un-permute and sum. Differentiable through plain PyTorch autograd.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.
"""

from __future__ import annotations

import torch

from megamoe.activation import act_forward
from megamoe.contract import SWIGLU, Activation, check_activation, check_biases, check_moe_inputs


def moe_ground_truth(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                     topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor,
                     dtype: torch.dtype = torch.float32, *, b13_E2I: torch.Tensor | None = None,
                     b2_EH: torch.Tensor | None = None, activation: Activation = SWIGLU,
                     round_gate_up: torch.dtype | None = None) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * (W2[e] act(G[e] x[t] + bg[e], U[e] x[t] + bu[e]) + b2[e]), every operand
    upcast to `dtype` (no biases: + 0; act: the contract's activation, default silu(gate) * up).

    round_gate_up: (gate, up) rounded to that dtype before the activation, the gradient passed
    through the rounding unchanged: the point at which the implementations' backward differentiates
    (megamoe/fused/__init__.py). It matters where the activation's gradient jumps (the clamped
    SwiGLU's limit: a value within a rounding step of it lands on the other side).

    Returns y in `dtype` (not cast back), differentiable w.r.t. all float inputs.
    """
    s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk)
    bias = check_biases(b13_E2I, b2_EH, s, x_TH)
    check_activation(activation)
    x, w13, w2, tw = (t.to(dtype) for t in (x_TH, w13_E2IH, w2_EHI, topk_weights_Tk))
    b13, b2 = (b13_E2I.to(dtype), b2_EH.to(dtype)) if bias else (None, None)
    y = x.new_zeros(s.T, s.H)
    for e in range(s.E):
        tok, slot = torch.nonzero(topk_ids_Tk == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gate_up = x[tok] @ w13[e].t()
        if bias:
            gate_up = gate_up + b13[e]
        if round_gate_up is not None:
            gate_up = gate_up + (gate_up.to(round_gate_up).to(dtype) - gate_up).detach()
        h = act_forward(gate_up[:, : s.I], gate_up[:, s.I:], activation)
        out = h @ w2[e].t()
        if bias:
            out = out + b2[e]
        y = y.index_add(0, tok, out * tw[tok, slot, None])
    return y


def _grouped_mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch._grouped_mm runs on Hopper-class CUDA GPUs in bf16 with 16-byte aligned strides."""
    if not (a.is_cuda and hasattr(torch, "_grouped_mm") and a.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(a.device) < (9, 0):
        return False
    return all((d * a.element_size()) % 16 == 0 for d in (a.shape[-1], b.shape[-1], b.shape[-2]))


def grouped_mm(a_NK: torch.Tensor, b_EKM: torch.Tensor, counts_E: torch.Tensor,
               offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows of `a` grouped by expert (counts/offsets), each group times its expert's matrix."""
    if _grouped_mm_ok(a_NK, b_EKM):
        return torch._grouped_mm(a_NK, b_EKM, offs=offsets_E.to(torch.int32))
    out = []
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        if n:
            out.append(a_NK[start:start + n] @ b_EKM[e])
        start += n
    if not out:
        # No rows at all (T=0 or every slot -1): an empty product keeps `a` and `b` in the autograd
        # graph, so their gradients are zeros rather than missing.
        return a_NK[:0] @ b_EKM[0]
    return torch.cat(out)


def routing_permutation(topk_ids_Tk: torch.Tensor, E: int):
    """Sort the T*k slots by expert (stable); -1 slots go to a sink past the last expert.

    Returns (order[N] slot indices of the valid slots in expert order, counts[E], inclusive offsets[E]).
    """
    ids = topk_ids_Tk.reshape(-1).long()
    ids = torch.where(ids < 0, torch.full_like(ids, E), ids)
    counts = torch.zeros(E + 1, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    order = torch.sort(ids, stable=True).indices
    n_valid = ids.numel() - int(counts[E])
    return order[:n_valid], counts[:E], torch.cumsum(counts[:E], 0)


def _row_experts(counts_E: torch.Tensor, n: int) -> torch.Tensor:
    """The expert of each of the n expert-sorted rows."""
    return torch.repeat_interleave(torch.arange(counts_E.numel(), device=counts_E.device), counts_E, output_size=n)


def moe_unfused(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor,
                *, b13_E2I: torch.Tensor | None = None, b2_EH: torch.Tensor | None = None,
                activation: Activation = SWIGLU, check_ids: bool = True) -> torch.Tensor:
    """The `reference` implementation: the unfused permute -> grouped GEMMs -> un-permute path.

    GEMMs run in the input dtype with fp32 accumulation (their outputs rounded to that dtype, as in
    production unfused MoEs; a bias is added to the rounded GEMM result in that dtype, as an unfused
    `x @ w + b` does); the routing-weight scale and the sum over a token's k slots run in fp32 and
    the result is rounded to x's dtype once.
    """
    s = check_moe_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, check_ids=check_ids)
    bias = check_biases(b13_E2I, b2_EH, s, x_TH)
    check_activation(activation)
    order, counts, offsets = routing_permutation(topk_ids_Tk, s.E)
    token = order // s.k
    x_sorted = x_TH.index_select(0, token)
    gate_up = grouped_mm(x_sorted, w13_E2IH.transpose(1, 2), counts, offsets)
    if bias:
        gate_up = gate_up + b13_E2I.index_select(0, _row_experts(counts, gate_up.shape[0]))
    act = act_forward(gate_up[:, : s.I], gate_up[:, s.I:], activation)
    out = grouped_mm(act, w2_EHI.transpose(1, 2), counts, offsets)
    if bias:
        out = out + b2_EH.index_select(0, _row_experts(counts, out.shape[0]))
    weighted = out.float() * topk_weights_Tk.reshape(-1).index_select(0, order).float()[:, None]
    y = torch.zeros(s.T, s.H, dtype=torch.float32, device=x_TH.device).index_add(0, token, weighted)
    return y.to(x_TH.dtype)
