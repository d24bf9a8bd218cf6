"""Out-of-tree vLLM model classes, registered with vLLM's `ModelRegistry` under vLLM's own names
(adapter.register_moe_method). The MoE gates reach megamoe's router through adapter.MegaMoEGate (and,
for the plain gates of the GPU machine's vLLM, through rollout/vllm026.py's classes).

DeepSeek-V2/V3 (vLLM's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM, whose gates are GateLinear in
every vLLM rl.stack supports): each MoE block's shared experts (vLLM's DeepseekV2MLP) become
`MegaMoESharedMLP`: the same module with its parameters, weight loaders and names, computing
`moe_method.shared_experts` (megamoe.fused_moe with one expert, the trainer's function for them)
instead of vLLM's dense GEMMs, whose rounding differs from the trainer's. vLLM's MoE runner holds the
shared-experts module object itself and calls it, and the module is built inside vLLM's DeepseekV2MoE,
so there is no layer registry to reach it through: the instance gets the subclass (`__class__`), the
one narrow step where no registry exists. Its linears keep their weights unpacked
(`KeepWeightLinearMethod`), which megamoe reads.

gpt-oss (vLLM's GptOssForCausalLM), registered for every moe_impl: its gate is a GateLinear (with the
router bias: `MegaMoEGate` under megamoe / reference), so the class exists for its weights. vLLM 0.32's
loader copies the fused expert tensors (`mlp.experts.gate_up_proj` [E,H,2I], `down_proj` [E,I,H] and
their biases) and the attention sinks straight into the parameters (`param.copy_`). On a first load
that works; vLLM's in-place reload (`reload_weights(is_checkpoint_format=True)`, every weight sync)
takes each layer's parameters to the meta device and only counts what arrives through a weight loader,
so those copies are lost and both layers keep their old values ("GptOssRoutedExperts: Failed to load
weights", "OAIAttention: Failed to load weights": a synced engine scored 0.63 in logprob away from a
fresh one on the same weights, vLLM CPU 0.32, stock). `GptOssForCausalLM.load_weights` below hands the
fused experts to vLLM's own per-expert path (`...experts.{e}.gate_up_proj`, which the class loads through
the experts' weight loader) and loads the sinks through the parameter's weight loader, on the first load
and on every reload alike, so a synced engine holds what a fresh one does (scores bitwise equal to a
fresh engine's on the same weights, stock and megamoe alike, vLLM CPU 0.32, fp32).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models import deepseek_v2, gpt_oss

from rollout import archs, moe_method
from rollout.adapter import _REGISTERED, KeepWeightLinearMethod
from rollout.vllm_surface import VLLM


class MegaMoESharedMLP(deepseek_v2.DeepseekV2MLP):
    """vLLM's DeepSeek shared-experts MLP computed by megamoe (module docstring)."""

    def forward(self, x):
        return moe_method.shared_experts(x, self.gate_up_proj.weight, self.down_proj.weight, self.megamoe_impl)


def use_megamoe_shared_experts(model: torch.nn.Module) -> int:
    """Give each DeepSeek MoE block's shared-experts MLP megamoe's computation; returns how many."""
    impl = _REGISTERED["impl"]
    n = 0
    for name, module in model.named_modules():
        shared = getattr(module, "shared_experts", None)
        if shared is None or not hasattr(module, "experts") or isinstance(shared, MegaMoESharedMLP):
            continue
        if type(shared) is not deepseek_v2.DeepseekV2MLP:
            raise NotImplementedError(f"megamoe rollout hook: {name}.shared_experts is {type(shared).__name__}; the "
                                      "hook computes vLLM's DeepseekV2MLP shared experts only (use moe_impl='stock')")
        for proj in (shared.gate_up_proj, shared.down_proj):
            if type(proj.quant_method) is not UnquantizedLinearMethod or proj.bias is not None or proj.tp_size != 1:
                raise NotImplementedError(f"megamoe rollout hook: {name}.shared_experts is quantized, biased or "
                                          "tensor-parallel; megamoe computes it whole and unquantized "
                                          "(use moe_impl='stock')")
            proj.quant_method = KeepWeightLinearMethod()
        shared.__class__ = MegaMoESharedMLP
        shared.megamoe_impl = impl
        n += 1
    return n


def built_then(base: type, module: str, after_init) -> type:
    """vLLM's model class `base`, under its name in `module`, calling after_init(model) once built."""
    # vLLM builds model classes as cls(vllm_config=..., prefix=...) and checks the signature.
    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        after_init(self)

    # Same name as vLLM's class: vLLM reports and checks model classes by name.
    return type(base.__name__, (base,), {"__init__": __init__, "__module__": module, "__qualname__": base.__qualname__})


def _shared_experts_after_init(model) -> None:
    model.megamoe_shared_experts = use_megamoe_shared_experts(model)


DeepseekV2ForCausalLM = built_then(deepseek_v2.DeepseekV2ForCausalLM, __name__, _shared_experts_after_init)
DeepseekV3ForCausalLM = built_then(deepseek_v2.DeepseekV3ForCausalLM, __name__, _shared_experts_after_init)


# gpt-oss's fused expert tensors (transformers' names), each split into vLLM's per-expert names
# `<prefix>.mlp.experts.<e>.<name>` (tensor [e]).
_GPT_OSS_FUSED_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_GPT_OSS_SINKS = ".self_attn.sinks"


class GptOssForCausalLM(gpt_oss.GptOssForCausalLM):
    """vLLM's gpt-oss, refused before it is built when the hook cannot serve its checkpoint (quantized,
    another activation or layout: rollout.archs), and loading its experts and sinks through weight
    loaders, so that vLLM's in-place reload updates them (module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        archs.check_model_config(vllm_config.model_config.hf_config, where="vLLM model (megamoe plugin)")
        if not VLLM.gpt_oss_streamed_experts:
            raise VLLM.missing("gpt_oss_streamed_experts",
                               "gpt_oss.GptOssModel has no per-expert weight loading (_try_load_streamed_expert), which "
                               "the megamoe hook loads gpt-oss's experts through so that weight syncs reach them "
                               "(rollout/models.py, written against vLLM 0.32); this version's FusedMoE weight loader "
                               "takes no unquantized expert biases, and its gpt-oss router (`router`, with a bias) is "
                               "not megamoe.router")
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def _sinks(self, name: str, loaded: torch.Tensor) -> str:
        """Load one layer's attention sinks (this rank's heads) through the parameter's weight loader."""
        target = name.replace(".self_attn.", ".attn.")
        param = self.get_parameter(target)
        heads = param.shape[0]
        if get_tensor_model_parallel_world_size() > 1:
            loaded = loaded.narrow(0, get_tensor_model_parallel_rank() * heads, heads)
        getattr(param, "weight_loader", default_weight_loader)(param, loaded)
        return target

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        sinks: set[str] = set()

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                prefix, _, kind = name.rpartition(".")
                if prefix.endswith(".mlp.experts") and kind in _GPT_OSS_FUSED_EXPERTS:
                    for e in range(t.shape[0]):
                        yield f"{prefix}.{e}.{kind}", t[e]
                elif name.endswith(_GPT_OSS_SINKS):
                    sinks.add(self._sinks(name, t))
                else:
                    yield name, t

        return super().load_weights(stream()) | sinks
