"""The `megamoe` implementation: one persistent Triton launch per forward (routing metadata, both
GEMMs, SwiGLU, weighting and combine; CUDA), or the torch implementation with the same semantics and
reduction order (CPU); fused backward (one persistent launch, then the weight gradients: a row gather
and one weight-gradient launch).

Layers (CONVENTIONS.md), one module each, imports pointing down:
  megamoe/kernels/moe_kernels.py   the Triton kernels (pointer math only)
  config.py       KernelConfig, the defaults per dtype and device, set_config / config_for
  workspace.py    the per-device counter workspace, grid size, routing-metadata buffers
  kernel_args.py  compile-time constants, TMA choice and descriptors, persistent_setup (also EP's)
  launch.py       launch_persistent, launch_dw: the raw launches, arguments by keyword
  cpu.py          the torch implementation (the CPU backend) and its routing metadata
  backend.py      which backend computes a call (triton / torch), never a fallback
  op.py           fused_moe_fwd / fused_moe_bwd (tests and benchmarks call them), the torch.library
                  ops with fake implementations and autograd, megamoe_moe (behind
                  `megamoe.fused_moe(..., impl="megamoe")`)

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
tests/megamoe/test_memory.py). Inference (no grad) writes no (gate, up). Transient backward
workspace, freed on return: per token K * (2I + I + H) elements of the input dtype (and K * 2H more
while the weight gradients run: the token rows of x and dy in the sorted order) plus
K * (ceil(I / BN1) + 1) fp32, and int32 routing metadata (2K per token, plus (E + 1) per block of
1024 slots).
"""

from megamoe.fused.backend import check_backend, pick_backend
from megamoe.fused.config import KernelConfig, config_for, default_config, persistent_stages, set_config
from megamoe.fused.cpu import RoutingMeta, combine_slots, routing_metadata
from megamoe.fused.kernel_args import (DW_OPERAND_ARGS, WEIGHT_ARGS, PersistentSetup, bias_grad_constexprs, dw_constexprs, dw_operand_args,
                                       dw_through_tma, persistent_constexprs, persistent_setup, weight_args,
                                       weights_through_tma)
from megamoe.fused.launch import launch_device, launch_dw, launch_persistent
from megamoe.fused.op import fused_moe_bwd, fused_moe_fwd, megamoe_moe
from megamoe.fused.workspace import METADATA_ARGS, KernelMeta, counter_buffers, grown_counters

__all__ = [
    "DW_OPERAND_ARGS", "METADATA_ARGS", "WEIGHT_ARGS", "KernelConfig", "KernelMeta", "PersistentSetup", "RoutingMeta", "bias_grad_constexprs", "check_backend", "combine_slots", "config_for",
    "counter_buffers", "default_config", "dw_constexprs", "dw_operand_args", "dw_through_tma", "fused_moe_bwd",
    "fused_moe_fwd", "grown_counters", "launch_device", "launch_dw", "launch_persistent", "megamoe_moe",
    "persistent_constexprs", "persistent_setup", "persistent_stages", "pick_backend", "routing_metadata",
    "set_config", "weight_args", "weights_through_tma",
]
