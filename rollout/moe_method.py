"""The version-independent half of the vLLM MoE hook: what a routed-experts call computes, and a
count of calls per implementation in the process that runs the model.

The experts are chosen before this runs: by `megamoe.route` on megamoe's fp32 router logits (softmax
top-k: Qwen3-MoE, Mixtral, OLMoE; DeepSeek's grouped sigmoid top-k with its score-correction bias; see
adapter.MegaMoEMethod), or by vLLM's router where megamoe.route cannot reproduce it. vLLM's MoE runner
adds shared experts and applies `routed_scaling_factor` after we return. So the hook computes exactly
the contract of `megamoe.fused_moe` on vLLM's weight layout:

    w13_weight [E, 2I, H]  gate rows first, then up rows  (= megamoe's w13; gpt-oss's after
                           adapter.MegaMoEMethod de-interleaved them)
    w2_weight  [E, H, I]                                  (= megamoe's w2)
    w13_bias [E, 2I], w2_bias [E, H]                      (gpt-oss only: megamoe's b13 / b2)

DeepSeek's shared experts (a dense SwiGLU MLP, run by vLLM's runner before the routed experts) are
`shared_experts` below: megamoe.fused_moe with one expert that every token takes with weight 1, which
is what the trainer computes for them (megamoe.moe.dense_mlp on both sides), so both sides agree bitwise.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.
"""

from __future__ import annotations

import collections
import threading

import torch

import megamoe
from megamoe.moe import dense_mlp

# Calls of `routed_experts` in this process, per implementation ("megamoe", "reference").
# Read in vLLM's worker process through rollout.extension (collective_rpc), never in the driver.
_CALLS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()


def moe_calls() -> dict[str, int]:
    with _LOCK:
        return dict(_CALLS)


def reset_moe_calls() -> None:
    with _LOCK:
        _CALLS.clear()


# Kept out of torch.compile graphs on purpose: a traced call would run the Python counter only while
# tracing, and megamoe's own dispatch (CPU torch path or Triton launch) is not dynamo-traceable code.
# On CUDA, vLLM already wraps the MoE layer in an opaque custom op; there, CUDA-graph replays do not
# run Python at all, so the counter then counts only eager (capture and warm-up) calls.
@torch.compiler.disable
def routed_experts(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                   topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor, impl: str, *,
                   b13_E2I: torch.Tensor | None = None, b2_EH: torch.Tensor | None = None,
                   activation=None) -> torch.Tensor:
    """y[T,H] = megamoe.fused_moe(...) for vLLM's precomputed routing; counts the call. gpt-oss passes
    its expert biases and its clamped SwiGLU (`activation`, a megamoe.contract.Activation)."""
    with _LOCK:
        _CALLS[impl] += 1
    # check_ids=False: vLLM's router produces ids in [0, E) by construction, and the range check reads
    # the ids back to the host, which a CUDA-graph capture cannot contain.
    if activation is None and b13_E2I is None and b2_EH is None:
        return megamoe.fused_moe(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk,
                                 impl=impl, check_ids=False)
    return megamoe.fused_moe(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, impl=impl, b13=b13_E2I,
                             b2=b2_EH, activation=activation, check_ids=False)


@torch.compiler.disable
def shared_experts(x_TH: torch.Tensor, w13_2IH: torch.Tensor, w2_HI: torch.Tensor, impl: str) -> torch.Tensor:
    """y[T,H] = the SwiGLU MLP of x with w13 = [gate; up] rows (vLLM's merged gate_up_proj) and w2:
    megamoe.moe.dense_mlp, which the trainer's shared experts call too (not counted in moe_calls)."""
    return dense_mlp(x_TH, w13_2IH, w2_HI, impl)
