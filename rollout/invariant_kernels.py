"""`numerics="bitwise"` on CUDA: vLLM's batch-invariant kernels, which a bitwise engine runs
(VLLM_BATCH_INVARIANT=1 with the TRITON_ATTN backend) and which the trainer calls here, so that both sides
run one implementation of each op (`vllm.model_executor.layers.batch_invariant` and
`vllm.v1.attention.ops.triton_unified_attention`, measured with the vLLM of rl.stack.CUDA_VLLM_RUN).
The trainer reaches them through megamoe.invariant's registry (the `megamoe.invariant_kernels` entry
point in pyproject.toml names this module), so that megamoe and trainer/ import no vLLM:

- `linear`: vLLM's `linear_batch_invariant` (its Triton persistent matmul, one tile shape per dtype; the
  engine's linear method calls it for every unquantized linear and the LM head in this mode).
- `rms_norm`: vLLM's Triton RMSNorm kernel (one program per row). Both sides call it through
  megamoe.invariant.rms_norm; on vLLM's side the norm layers are rollout/bitwise.py's, which add the
  residual in the model's dtype first (the trainer's `residual + x`) instead of vLLM's fused add + norm.
- `log_softmax`: vLLM's Triton log_softmax (one program per row), the kernel vLLM's sampler reaches for
  its processed logprobs in this mode (an aten override).
- `paged_attention`: vLLM's `unified_attention` (its 2-D kernel: with VLLM_BATCH_INVARIANT a fixed key
  tile of 32 from key 0 for prefill and decode alike) over the trainer's keys and values laid out as
  pages of PAGE tokens, one sequence per row of the block table.

The engine's worker process runs in vLLM's batch-invariant mode (its aten overrides of softmax, mean,
log-softmax and bmm; no split-K); the trainer's process does not (those overrides are Python functions
and cost a trainer about half its speed, H200): every op of a bitwise forward that would reach one of them
calls the shared kernel itself (this module's four functions, through megamoe.invariant; megamoe.router's Triton kernel,
megamoe.routing's softmax spelled out in aten ops that vLLM's mode leaves alone).

Imported lazily (only a CUDA tensor reaches it); `require()` names what a vLLM install lacks.
"""

from __future__ import annotations

import torch

PAGE = 16
"""Tokens per page of the trainer's K/V (the TRITON_ATTN backend's default cache block size; the kernel's
arithmetic does not depend on it, only its addressing)."""


def require():
    """The vLLM modules this file calls; ImportError naming what is missing (another vLLM version)."""
    try:
        from vllm.model_executor.layers import batch_invariant
        from vllm.v1.attention.ops import triton_unified_attention
    except ImportError as e:
        raise ImportError(f"numerics='bitwise' on CUDA needs vLLM's batch-invariant kernels "
                          f"(vllm.model_executor.layers.batch_invariant and vllm.v1.attention.ops."
                          f"triton_unified_attention): {e}") from e
    return batch_invariant, triton_unified_attention


def linear(x_MK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None) -> torch.Tensor:
    bi, _ = require()
    if x_MK.shape[0] == 0:
        out = x_MK.new_zeros(0, w_NK.shape[0])
        return out + b_N.to(out.dtype) if b_N is not None else out
    return bi.linear_batch_invariant(x_MK, w_NK.to(x_MK.dtype), None if b_N is None else b_N.to(x_MK.dtype))


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    bi, _ = require()
    if x.numel() == 0:
        return x.clone()
    return bi.rms_norm_batch_invariant(x, None if w is None else w.to(x.dtype), eps)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    bi, _ = require()
    if x.numel() == 0:
        return x.clone()
    return bi.log_softmax(x, dim=-1)


def paged_attention(q_BThD: torch.Tensor, k_BLgD: torch.Tensor, v_BLgD: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of B sequences, each's T queries the last T of its L key positions, through vLLM's
    unified_attention over pages of PAGE tokens; [B, T, h, D] in q's dtype."""
    _, ua = require()
    B, T, h, D = q_BThD.shape
    L, g = k_BLgD.shape[1], k_BLgD.shape[2]
    if v_BLgD.shape[-1] != D:
        raise ValueError(f"v_BLgD: vLLM's unified attention expects values of the keys' head size {D}, got "
                         f"{v_BLgD.shape[-1]}")
    nb = -(-L // PAGE)
    dev = q_BThD.device

    def pages(t):
        t = t.contiguous()
        if nb * PAGE != L:
            t = torch.cat([t, t.new_zeros(B, nb * PAGE - L, g, D)], 1)
        return t.view(B * nb, PAGE, g, D)

    q = q_BThD.reshape(B * T, h, D).contiguous()
    out = torch.empty_like(q)
    cu = torch.arange(0, (B + 1) * T, T, device=dev, dtype=torch.int32)
    used = torch.full((B,), L, device=dev, dtype=torch.int32)
    table = torch.arange(B * nb, device=dev, dtype=torch.int32).view(B, nb)
    one = torch.ones(B, g, device=dev, dtype=torch.float32)  # the backend's unit K/V scales, expanded
    ua.unified_attention(q=q, k=pages(k_BLgD), v=pages(v_BLgD), out=out, cu_seqlens_q=cu, max_seqlen_q=T,
                         seqused_k=used, max_seqlen_k=L, softmax_scale=scale, causal=True, window_size=(-1, -1),
                         block_table=table, softcap=0, q_descale=None, k_descale=one, v_descale=one)
    return out.view(B, T, h, D)
