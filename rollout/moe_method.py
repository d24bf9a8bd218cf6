"""The version-independent half of the vLLM MoE hook: what a routed-experts call computes, as torch
custom ops that vLLM's compiled graph calls as opaque nodes, and a count of calls per implementation in
the process that runs the model.

The experts are chosen by `megamoe.route` on megamoe's fp32 router logits (softmax top-k: Qwen3-MoE,
Mixtral, OLMoE; DeepSeek's grouped sigmoid top-k with its score-correction bias; see
adapter.MegaMoEMethod), inside `routed_experts_from_logits`, or by vLLM's router where megamoe.route
cannot reproduce it (`routed_experts`). vLLM's MoE runner adds shared experts and applies
`routed_scaling_factor` after we return. So the ops compute exactly the contract of `megamoe.fused_moe`
on vLLM's weight layout:

    w13_weight [E, 2I, H]  gate rows first, then up rows  (= megamoe's w13; gpt-oss's after
                           adapter.MegaMoEMethod de-interleaved them)
    w2_weight  [E, H, I]                                  (= megamoe's w2)
    w13_bias [E, 2I], w2_bias [E, H]                      (gpt-oss only: megamoe's b13 / b2)

DeepSeek's shared experts (a dense SwiGLU MLP, run by vLLM's runner before the routed experts) are
`shared_experts` below: megamoe.fused_moe with one expert that every token takes with weight 1, which
is what the trainer computes for them (megamoe.moe.dense_mlp on both sides), so both sides agree bitwise.

Why custom ops (namespace `megamoe_rollout`, registered when this module is imported, which the plugin
does in every vLLM process). vLLM compiles the model with torch.compile by default (Dynamo traces it
whole, Inductor generates code for what it traced, CUDA graphs replay it). Traced, megamoe's dispatch
would not compile (its CPU path and Triton launchers are not Dynamo-traceable), the call counter would
run only while tracing, and Inductor would re-derive the routing's softmax and sort in its own code,
whose rounding is not the trainer's. As an opaque op (vLLM's own fused MoE is one for the same
reason) the compiled graph calls these functions with real tensors on every forward, so a compiled
engine's MoE is bitwise the eager engine's, and the trainer's. Registered directly on a
torch.library.Library rather than with torch.library.custom_op, as vLLM registers its ops: the
dispatch costs about 9 us per call instead of 22 us (2-core CPU, torch 2.13, a loaded machine), which an
eager decode step pays once per MoE layer. The ops have no autograd: the sampler never differentiates.

The call counter counts in the op's body, so on CPU it counts every MoE call, eager or compiled. On CUDA
a replayed CUDA graph runs no Python: there it counts the calls made outside graphs (eager steps,
warm-up and capture), not the replays.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.
"""

from __future__ import annotations

import collections
import os
import threading

import torch

import megamoe
from megamoe.contract import SILU, SWIGLU, Activation
from megamoe.moe import dense_mlp

NAMESPACE = "megamoe_rollout"

# Calls of the routed-experts ops in this process, per implementation ("megamoe", "reference").
# Read in vLLM's worker process through rollout.extension (collective_rpc), never in the driver.
_CALLS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()


def moe_calls() -> dict[str, int]:
    with _LOCK:
        return dict(_CALLS)


def reset_moe_calls() -> None:
    with _LOCK:
        _CALLS.clear()


# Routing capture (rollout routing replay, docs/ROUTING_REPLAY.md): while the engine was started with
# MEGAMOE_ROUTING_CAPTURE=1 (RolloutWorker(return_routing=True) sets it before vLLM's processes exist), every
# MoE call that knows its layer writes the experts it routed each row to into its slot of one static buffer,
# row r = the r-th token of the engine step's batch. The write is one tensor copy into a buffer that exists
# before vLLM captures its CUDA graphs (vLLM's warm-up forwards run first, eagerly, at the largest batch), so
# a replayed graph writes it too; on CPU the op's Python runs on every call, compiled or eager. The host
# side (rollout/capture.py) copies the step's rows out after each step (queued on the stream, no wait) and marks
# them unwritten again, so a row an op did not write this step is an error there, never stale routing. One
# buffer for all layers: reading a step and marking it unwritten are one copy and one fill, whatever the
# number of layers (per-layer buffers cost 2L + 1 device operations per engine step on vLLM's host thread).
CAPTURE_ENV_VAR = "MEGAMOE_ROUTING_CAPTURE"
UNWRITTEN = -1
_STORE: dict[str, torch.Tensor] = {}  # "ids": int16 [slots, rows, k] on the MoE's device
_SLOTS: dict[int, int] = {}           # model layer index -> its slot in _STORE["ids"], in order of first write
_MIN_ROWS = 256
_IN_GRAPH = {"seen": False}  # a write was recorded into a CUDA graph: the buffer may no longer be replaced


def capture_enabled() -> bool:
    return os.environ.get(CAPTURE_ENV_VAR) == "1"


def capture_routing(layer: int, topk_ids_Tk: torch.Tensor) -> None:
    """Write one MoE call's routing into layer `layer`'s slot (layer < 0: a call that does not know its
    layer; nothing is written unless the capture is enabled)."""
    if layer < 0 or not capture_enabled():
        return
    T, k = topk_ids_Tk.shape
    store = _STORE.get("ids")
    slot = _SLOTS.get(layer)
    if slot is None or store.shape[1] < T or store.shape[2] != k or store.device != topk_ids_Tk.device:
        capturing = topk_ids_Tk.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or _IN_GRAPH["seen"]:
            # A CUDA graph holds the old buffer's address: a new one would never be written by its replays.
            raise RuntimeError(f"routing capture: layer {layer} saw {T} rows (k={k}) during/after a CUDA-graph "
                               f"capture, more than the buffer of {None if store is None else tuple(store.shape)} "
                               "(slots, rows, k) made by the eager warm-up forwards")
        if store is not None and (store.shape[2] != k or store.device != topk_ids_Tk.device):
            raise RuntimeError(f"routing capture: layer {layer} routes to k={k} experts on {topk_ids_Tk.device}, "
                               f"the layers before it to k={store.shape[2]} on {store.device}")
        slots = len(_SLOTS) + (slot is None)
        rows = max(T, _MIN_ROWS, 0 if store is None else store.shape[1])
        new = torch.full((slots, rows, k), UNWRITTEN, dtype=torch.int16, device=topk_ids_Tk.device)
        if store is not None:
            new[:store.shape[0], :store.shape[1]].copy_(store)
        if slot is None:
            slot = _SLOTS[layer] = slots - 1
        _STORE["ids"] = store = new
    if topk_ids_Tk.is_cuda and torch.cuda.is_current_stream_capturing():
        _IN_GRAPH["seen"] = True
    store[slot, :T].copy_(topk_ids_Tk)


def read_routing(rows: int) -> tuple[list[int], torch.Tensor]:
    """(model layer indices, int16 [rows, L, k] on the buffer's device): a copy of the first `rows` rows of
    every layer's slot, which are then marked unwritten again. Nothing here waits for the device: on CUDA
    the copy and the marking are queued on the current stream behind the step that wrote the rows, and the
    caller checks the copy with `check_written` once it is on the host. Raises when no layer wrote."""
    store = _STORE.get("ids")
    if store is None:
        raise RuntimeError("routing capture: no MoE layer wrote its routing (was the engine started with "
                           f"{CAPTURE_ENV_VAR}=1?)")
    if store.shape[1] < rows:
        raise RuntimeError(f"routing capture: the buffer has {store.shape[1]} rows, the step ran {rows}")
    layers = sorted(_SLOTS)
    order = [_SLOTS[layer] for layer in layers]
    view = store[:, :rows]
    # clone, not contiguous(): with one layer the transposed view is already "contiguous" and would be returned
    # as a view of the buffer the fill below clears
    ids = (view if order == list(range(len(order))) else view[order]).transpose(0, 1).clone(
        memory_format=torch.contiguous_format)
    view.fill_(UNWRITTEN)
    return layers, ids


def check_written(layers: list[int], ids: torch.Tensor) -> None:
    """Raises when a row of `ids` (read_routing's [rows, L, k], on the host) was not written by its layer."""
    missing = (ids == UNWRITTEN).all(dim=2)
    if bool(missing.any()):
        row, li = (int(v) for v in missing.nonzero()[0])
        raise RuntimeError(f"routing capture: layer {layers[li]} did not write row {row} of a {ids.shape[0]}-row "
                           "step (a MoE call outside the capture)")


def activation_fields(activation: Activation | None) -> tuple[str, float, float]:
    """An Activation as the ops' (act, alpha, limit) arguments (a schema takes primitive types)."""
    activation = activation or SWIGLU
    return activation.name, activation.alpha or 0.0, activation.limit or 0.0


def _activation(act: str, alpha: float, limit: float) -> Activation:
    return SWIGLU if act == SILU else Activation(act, alpha=alpha, limit=limit)


def _experts(x, w13, w2, topk_weights, topk_ids, impl, b13, b2, act, alpha, limit) -> torch.Tensor:
    with _LOCK:
        _CALLS[impl] += 1
    # check_ids=False: the ids come from a router, in [0, E) by construction, and the range check reads
    # them back to the host, which a CUDA-graph capture cannot contain.
    return megamoe.fused_moe(x, w13, w2, topk_weights, topk_ids, impl=impl, b13=b13, b2=b2,
                             activation=_activation(act, alpha, limit), check_ids=False)


def _routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, impl: str, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None, act: str = SILU, alpha: float = 0.0,
                    limit: float = 0.0) -> torch.Tensor:
    return _experts(x, w13, w2, topk_weights, topk_ids, impl, b13, b2, act, alpha, limit)


def _routed_experts_from_logits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
                                impl: str, top_k: int, scoring: str, renormalize: bool,
                                e_score_correction_bias: torch.Tensor | None = None, n_group: int = 1,
                                topk_group: int = 1, b13: torch.Tensor | None = None,
                                b2: torch.Tensor | None = None, act: str = SILU, alpha: float = 0.0,
                                limit: float = 0.0, capture_layer: int = -1) -> torch.Tensor:
    # check_finite=False: the check would read the logits back to the host (no CUDA-graph capture).
    topk_weights, topk_ids = megamoe.route(router_logits, top_k, scoring, renormalize,
                                           e_score_correction_bias=e_score_correction_bias, n_group=n_group,
                                           topk_group=topk_group, check_finite=False)
    capture_routing(capture_layer, topk_ids)
    return _experts(x, w13, w2, topk_weights, topk_ids, impl, b13, b2, act, alpha, limit)


def _shared_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, impl: str) -> torch.Tensor:
    return dense_mlp(x, w13, w2, impl)


def _like_x(x, *args, **kwargs):
    # Every op returns y [T, H], contiguous, in x's dtype (megamoe.fused_moe's contract).
    return x.new_empty(x.shape)


_LIB = torch.library.Library(NAMESPACE, "DEF")


def _register(fn) -> torch._ops.OpOverload:
    name = fn.__name__.lstrip("_")
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
    # One Python kernel for every device: megamoe.fused_moe picks its backend from the tensors.
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", _like_x, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


routed_experts_op = _register(_routed_experts)
routed_experts_from_logits_op = _register(_routed_experts_from_logits)
shared_experts_op = _register(_shared_experts)


def routed_experts(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                   topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor, impl: str, *,
                   b13_E2I: torch.Tensor | None = None, b2_EH: torch.Tensor | None = None,
                   activation: Activation | None = None) -> torch.Tensor:
    """y[T,H] = megamoe.fused_moe(...) for vLLM's precomputed routing, as one op; counts the call.
    gpt-oss passes its expert biases and its clamped SwiGLU (`activation`)."""
    return routed_experts_op(x_TH, w13_E2IH, w2_EHI, topk_weights_Tk, topk_ids_Tk, impl, b13_E2I, b2_EH,
                             *activation_fields(activation))


def routed_experts_from_logits(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                               router_logits_TE: torch.Tensor, impl: str, *, top_k: int, scoring: str,
                               renormalize: bool, e_score_correction_bias: torch.Tensor | None = None,
                               n_group: int = 1, topk_group: int = 1, b13_E2I: torch.Tensor | None = None,
                               b2_EH: torch.Tensor | None = None, activation: Activation | None = None,
                               capture_layer: int = -1) -> torch.Tensor:
    """y[T,H] = megamoe.fused_moe(...) on the experts megamoe.route chooses from the router logits (the
    trainer's routing: see megamoe.route for top_k .. topk_group), as one op; counts the call. The
    experts it routes to are recorded as layer `capture_layer` while a routing capture is on."""
    return routed_experts_from_logits_op(x_TH, w13_E2IH, w2_EHI, router_logits_TE, impl, top_k, scoring,
                                         renormalize, e_score_correction_bias, n_group, topk_group, b13_E2I, b2_EH,
                                         *activation_fields(activation), capture_layer)


def shared_experts(x_TH: torch.Tensor, w13_2IH: torch.Tensor, w2_HI: torch.Tensor, impl: str) -> torch.Tensor:
    """y[T,H] = the SwiGLU MLP of x with w13 = [gate; up] rows (vLLM's merged gate_up_proj) and w2:
    megamoe.moe.dense_mlp, which the trainer's shared experts call too (not counted in moe_calls)."""
    return shared_experts_op(x_TH, w13_2IH, w2_HI, impl)
