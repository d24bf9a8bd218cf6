"""vLLM's side of `numerics="bitwise"`: the dense ops outside the MoE run the trainer's batch-invariant
kernels, so that the trainer reproduces every logprob bit for bit.

Installed by the plugin (rollout/plugin.py) in every vLLM process when MEGAMOE_NUMERICS=bitwise, through
vLLM's own seams, nothing patched. On both devices:
- RMSNorm: an out-of-tree replacement (CustomOp.register_oot) computing `megamoe.invariant.rms_norm`; with
  a residual it first adds it in the model's dtype (the trainer's `residual + x`), where vLLM would fuse
  the add into the norm.
- rotary: an out-of-tree RotaryEmbedding whose cos/sin table is `megamoe.invariant.rope_cache` (the
  trainer's), applied by vLLM's native formula (transformers' bits).
vLLM CPU (0.32, fp32):
- linears: out-of-tree replacements (PluggableLayer.register_oot) of ReplicatedLinear,
  ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear and RowParallelLinear whose
  linear method computes `megamoe.invariant.linear_parts` over the layer's output partitions (a fused
  q/k/v or gate/up weight part by part: the trainer's separate linears' bits); ParallelLMHead's method
  computes the logits over the unpadded vocabulary the same way. The weights stay as loaded (vLLM CPU would prepack them for oneDNN).
- attention: the CPU_ATTN backend's class path overridden (vLLM's `register_backend`) by a subclass
  whose KV-cache write and attention are plain torch: per request, its keys gathered from the paged
  cache by `megamoe.invariant.paged_causal_attention` (bitwise the trainer's attention per query).
- the dense MLP's activation: vLLM's native formula (`compilation_config.custom_ops` with -silu_and_mul).
- eager: RolloutWorker refuses enforce_eager=False (torch.compile's Dynamo cannot trace the linear's
  weight, a vLLM parameter subclass, and Inductor would round the norms and activations its own way).
vLLM CUDA (0.26, bf16): vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1, set by RolloutWorker before
the engine starts) computes the linears, the LM head (its Triton persistent matmul), the attention (the
TRITON_ATTN backend's unified attention, one key tile size) and the sampler's log-softmax; the trainer
calls the same kernels (rollout/invariant_kernels.py, through megamoe.invariant). The engine runs without
torch.compile (Inductor would fuse the rotary's and the residual's bf16 steps into one rounding), decode
batches in full CUDA graphs.
The MoE (router logits, routing, experts) is megamoe's already (rollout/adapter.py).
"""

from __future__ import annotations

import math

import torch

from megamoe import invariant

ARCHITECTURES = ("Qwen3MoeForCausalLM", "OlmoeForCausalLM", "MixtralForCausalLM")
"""vLLM architectures measured bitwise end to end in this mode (tests/rl/test_rl_bitwise.py): plain causal
attention with rotary, RMSNorm, MoE blocks megamoe computes. DeepSeek's MLA and gpt-oss's sinks and sliding
windows need attention this module does not have."""
CUSTOM_OPS = ["all", "-rotary_embedding", "-silu_and_mul"]
"""vLLM custom-op switches of a bitwise engine: the rotary and the gated activation by their native torch
formulas (transformers' bits), every other custom op as usual."""
CUDA_COMPILATION = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
"""A bitwise CUDA engine's compilation: no torch.compile (mode 0, NONE: eager ops round as the trainer's),
decode steps replayed from full CUDA graphs."""
ENV_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"
_STATE = {"registered": False}


def _linear_classes():
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear)

    return (ReplicatedLinear, ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)


def _methods():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    class InvariantLinearMethod(UnquantizedLinearMethod):
        """megamoe.invariant.linear_parts over the layer's output partitions; weight kept as loaded."""

        keeps_weights_as_loaded = True  # rollout.adapter.kernel_format_blockers

        def process_weights_after_loading(self, layer) -> None:
            return None

        def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            sizes = getattr(layer, "output_partition_sizes", None) or [layer.weight.shape[0]]
            return invariant.linear_parts(x, layer.weight, sizes, bias)

    class InvariantEmbeddingMethod(UnquantizedEmbeddingMethod):
        """The LM head's logits through megamoe.invariant.linear over the real vocabulary (vLLM pads the
        weight's rows; the logits processor keeps the first org_vocab_size columns); the lookup as vLLM's."""

        keeps_weights_as_loaded = True  # rollout.adapter.kernel_format_blockers

        def process_weights_after_loading(self, layer) -> None:
            return None

        def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            V = layer.org_vocab_size
            logits = invariant.linear(x, layer.weight[:V], bias[:V] if bias is not None else None)
            pad = layer.weight.shape[0] - V  # the padding's columns, which vLLM drops or masks: zeros
            return torch.cat([logits, logits.new_zeros(*logits.shape[:-1], pad)], -1) if pad else logits

    return InvariantLinearMethod, InvariantEmbeddingMethod


def _replacement(base, method_cls, unquantized_cls):
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        if type(self.quant_method) is not unquantized_cls:
            raise NotImplementedError(
                f"numerics=bitwise: {base.__name__} {getattr(self, 'prefix', '')!r} uses "
                f"{type(self.quant_method).__name__}; the batch-invariant linear computes unquantized weights only")
        self.quant_method = method_cls()

    return type(f"Invariant{base.__name__}", (base,), {"__init__": __init__, "__doc__":
                f"vLLM's {base.__name__} computing megamoe.invariant's batch-invariant linear (numerics=bitwise)."})


def _attention_backend():
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class InvariantCPUAttentionImpl(CPUAttentionBackendImpl):
        """Decoder self-attention over vLLM's paged KV cache with megamoe.invariant.causal_attention."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            unsupported = [name for name, bad in (
                ("ALiBi slopes", self.alibi_slopes is not None), ("a sliding window", self.sliding_window != -1),
                ("a logits soft cap", bool(self.logits_soft_cap)), ("attention sinks", self.sinks is not None),
                (f"kv_cache_dtype={self.kv_cache_dtype!r}", self.is_fp8_kv_cache),
                (f"attention type {self.attn_type!r}", self.attn_type != AttentionType.DECODER),
                ("a KV-sharing layer", self.kv_sharing_target_layer_name is not None)) if bad]
            if unsupported:
                raise NotImplementedError(f"numerics=bitwise: the batch-invariant attention computes causal decoder "
                                          f"self-attention only; this layer has {', '.join(unsupported)}")

        @staticmethod
        def _caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # [blocks, kv heads, block size, 2 * D] as the CPU backend views it: keys, then values,
            # each [blocks, kv heads, block size, D]; this class alone writes and reads them.
            nb, g, bs, _ = kv_cache.shape
            return kv_cache.view(nb, g, 2 * bs, -1).chunk(2, dim=2)

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            key_cache, value_cache = self._caches(kv_cache)
            bs = key_cache.shape[2]
            n = slot_mapping.shape[0]
            keep = slot_mapping >= 0
            slots = slot_mapping[keep].long()
            blk, off = slots // bs, slots % bs
            key_cache[blk, :, off] = key[:n][keep].to(key_cache.dtype)
            value_cache[blk, :, off] = value[:n][keep].to(value_cache.dtype)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("numerics=bitwise: fused output quantization")
            if attn_metadata is None:  # warm-up
                return output
            key_cache, value_cache = self._caches(kv_cache)
            bs = key_cache.shape[2]
            n = attn_metadata.num_actual_tokens
            starts = attn_metadata.query_start_loc.long()
            lens = attn_metadata.seq_lens.long()
            R = lens.shape[0]
            if n == 0 or R == 0:
                return output
            # each query's request and position from the metadata; keys read from the pages
            nblk = math.ceil(int(lens.max()) / bs)
            q_len = starts[1:R + 1] - starts[:R]
            seq = torch.repeat_interleave(torch.arange(R), q_len)
            pos = torch.arange(n) - starts[seq] + (lens - q_len)[seq]
            o = invariant.paged_causal_attention(query[:n], key_cache, value_cache,
                                                 attn_metadata.block_table[:R, :nblk], lens, seq, pos, self.scale)
            output[:n] = o.reshape(output[:n].shape).to(output.dtype)
            return output

    class InvariantCPUAttentionBackend(CPUAttentionBackend):
        """vLLM's CPU attention backend (its metadata, its KV-cache shape) with the batch-invariant impl."""

        @staticmethod
        def get_impl_cls():
            return InvariantCPUAttentionImpl

    return InvariantCPUAttentionBackend


def _norm_and_rotary():
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    class InvariantRMSNorm(RMSNorm):
        """vLLM's RMSNorm computing megamoe.invariant.rms_norm (the residual, if any, added first)."""

        def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
            if self.variance_size_override is not None:
                raise NotImplementedError("numerics=bitwise: an RMSNorm over part of the hidden size")
            w = self.weight.data if self.has_weight else None
            if residual is None:
                return invariant.rms_norm(x, w, self.variance_epsilon)
            x = x + residual
            return invariant.rms_norm(x, w, self.variance_epsilon), x

    class InvariantRotaryEmbedding(RotaryEmbedding):
        """vLLM's default rotary with megamoe.invariant.rope_cache's table, applied by its native formula."""

        def _compute_cos_sin_cache(self) -> torch.Tensor:
            return invariant.rope_cache(self.base, self.rotary_dim, self.max_position_embeddings).to(
                torch.get_default_device())

        def forward(self, positions, query, key=None):
            if not self.is_neox_style:
                raise NotImplementedError("numerics=bitwise: a GPT-J style (interleaved) rotary")
            return self.forward_native(positions, query, key)

    return InvariantRMSNorm, InvariantRotaryEmbedding


InvariantCPUAttentionBackend = None  # the class, once built (the path vLLM resolves)


def _build() -> None:
    """The replacement classes, built once per process (isinstance checks need the same classes)."""
    global InvariantCPUAttentionBackend
    if "replacements" in _STATE:
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    from vllm.platforms import current_platform

    norm, rotary = _norm_and_rotary()
    _STATE["norm_rotary"] = (norm, rotary)
    custom_ops = [(norm, "RMSNorm"), (rotary, "RotaryEmbedding")]
    _STATE["custom_ops"] = custom_ops
    if not current_platform.is_cpu():
        _STATE["replacements"] = []
        return
    linear_method, embedding_method = _methods()
    _STATE["methods"] = (linear_method, embedding_method)
    replacements = [(_replacement(base, linear_method, UnquantizedLinearMethod), base.__name__)
                    for base in _linear_classes()]
    replacements.append((_replacement(ParallelLMHead, embedding_method, UnquantizedEmbeddingMethod), "ParallelLMHead"))
    _STATE["replacements"] = replacements
    InvariantCPUAttentionBackend = _attention_backend()
    _STATE["attention_impl"] = InvariantCPUAttentionBackend.get_impl_cls()


def _registrations() -> list:
    """(class, name, registry) of everything this mode registers in vLLM's out-of-tree registry."""
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer

    return ([(cls, name, CustomOp) for cls, name in _STATE["custom_ops"]]
            + [(cls, name, PluggableLayer) for cls, name in _STATE["replacements"]])


def apply(enabled: bool) -> None:
    """Install (enabled) or remove the norms, the rotary, and on CPU the linears, the LM head's method and
    the attention backend, in this process's vLLM registries. The plugin calls it in every process on
    every registration, so that a process which registered them for a bitwise engine (the driver runs the
    plugin too) and then builds, or forks, a fast one does not carry them over; RolloutWorker's census
    checks the result. On CUDA the mode needs vLLM's batch-invariant mode on (ENV_BATCH_INVARIANT)."""
    if not enabled and not _STATE["registered"]:
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if enabled and not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise NotImplementedError(f"numerics=bitwise: vLLM on {current_platform.device_type}: built for vLLM's "
                                  "CPU and CUDA backends")
    if enabled and current_platform.is_cuda():
        import vllm.envs as envs

        from rollout import invariant_kernels

        invariant_kernels.require()
        invariant.register_gpu_kernels(invariant_kernels)  # the norm layers' megamoe.invariant.rms_norm
        if not envs.VLLM_BATCH_INVARIANT:
            raise RuntimeError(f"numerics=bitwise on CUDA: {ENV_BATCH_INVARIANT}=1 must be set before vLLM starts "
                               "(RolloutWorker sets it): the linears, attention and log-softmax are vLLM's "
                               "batch-invariant kernels")
    _build()
    path = f"{__name__}.InvariantCPUAttentionBackend"
    if not enabled:
        for cls, name, _ in _registrations():
            if op_registry_oot.get(name) is cls:
                del op_registry_oot[name]
        if _STATE["replacements"] and AttentionBackendEnum.CPU_ATTN.get_path() == path:
            AttentionBackendEnum.CPU_ATTN.clear_override()
        _STATE["registered"] = False
        return
    if _STATE["registered"]:
        return
    for cls, name, _ in _registrations():
        current = op_registry_oot.get(name)
        if current is not None and current is not cls:
            raise RuntimeError(f"another plugin already replaced vLLM's {name} with {current!r}; "
                               "numerics=bitwise cannot take its place")
    for cls, name, registry in _registrations():
        if op_registry_oot.get(name) is None:
            registry.register_oot(name=name)(cls)
    if _STATE["replacements"]:
        register_backend(AttentionBackendEnum.CPU_ATTN, path)
    _STATE["registered"] = True


def census(model: torch.nn.Module) -> dict:
    """What computes the dense ops of `model` (in a vLLM worker): the linears (LM head included), attention
    layers, norms and rotaries on this mode's kernels, the MoE gates (megamoe.router's batch-invariant
    logits in either numerics), and the names of the others. On CUDA a linear counts as bitwise when it is
    unquantized and vLLM's batch-invariant mode is on (its method then calls linear_batch_invariant), an
    attention layer when it is the TRITON_ATTN backend's (`vllm_batch_invariant`: that mode is on)."""
    from rollout.adapter import MegaMoERouterMethod
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    cuda_invariant = False
    if current_platform.is_cuda():
        import vllm.envs as envs

        cuda_invariant = bool(envs.VLLM_BATCH_INVARIANT)
    methods = _STATE.get("methods", ()) or ((UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
                                            if cuda_invariant else ())
    attn_impl = _STATE.get("attention_impl")
    if cuda_invariant:
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

        attn_impl = TritonAttentionImpl
    norm, rotary = _STATE.get("norm_rotary", (None, None))
    out = {"bitwise_linears": 0, "router_gates": 0, "other_linears": [], "bitwise_attention": 0,
           "other_attention": [], "bitwise_norms": 0, "other_norms": [], "vllm_batch_invariant": cuda_invariant}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, LinearMethodBase) or isinstance(m, ParallelLMHead):
            if methods and type(qm) in methods:
                out["bitwise_linears"] += 1
            elif isinstance(qm, MegaMoERouterMethod):
                out["router_gates"] += 1
            else:
                out["other_linears"].append(f"{name} ({type(qm).__name__})")
        impl = getattr(m, "impl", None)
        if impl is not None and hasattr(impl, "do_kv_cache_update"):
            if attn_impl is not None and type(impl) is attn_impl:
                out["bitwise_attention"] += 1
            else:
                out["other_attention"].append(f"{name} ({type(impl).__name__})")
        if isinstance(m, (RMSNorm, RotaryEmbeddingBase)):
            if type(m) in (norm, rotary):
                out["bitwise_norms"] += 1
            else:
                out["other_norms"].append(f"{name} ({type(m).__name__})")
    return out
