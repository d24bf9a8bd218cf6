"""Sampler-side probes for `megamoe-rl consistency`: processed logprobs of given completions, and each
MoE block of the served model run on given hidden states, inside vLLM's worker process.

    lps = score_completions(worker, prompt_ids, completion_ids, temperature=1.0, top_p=1.0)
    layers = run_moe_blocks(worker, [h_TH for each MoE layer])   # [{"logits", "ids", "out"}, ...]

Scoring. vLLM's `prompt_logprobs` are raw: prompt tokens skip the sampling processors (vLLM 0.32's
model runner says so: "processed_* and raw_* yield the same scores here"), so they ignore temperature
and top-k / top-p. To get the processed logprob (what the sampler reports while sampling) of a
*given* token, each completion position j becomes one request: the prompt plus completion[:j],
max_tokens=1, the run's temperature / top_p, and `logprob_token_ids=[completion[j]]`, which makes
vLLM gather that token's logprob from the same processed distribution it samples from. The cost is
one prefill per completion token (fine for the short completions a consistency run uses); the
logits come from a prefill, not from the decode step that sampled the token, which the command
reports separately (`generation_vs_scoring`).

Per-layer probe. Tensors do not cross vLLM's process boundary (collective_rpc pickles with msgpack),
so hidden states travel as safetensors bytes to `rollout.extension`'s `megamoe_probe_moe`, which
calls `probe_in_worker` here. Each block is run exactly the way the model runs it: the block's own
forward (gate, router, experts, in vLLM's forward context), and its routing is recomputed with the
functions the runner uses (`MegaMoEMethod.select_experts` for megamoe / reference, vLLM's router for
stock), so the ids reported are the ids the output was computed with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


# -- driver side ----------------------------------------------------------------------------------

def score_completions(worker, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *,
                      temperature: float, top_p: float = 1.0) -> list[list[float]]:
    """Processed logprobs (after temperature / top-p, vLLM's sampler path) of each given completion token."""
    from vllm import SamplingParams, TokensPrompt

    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"completion_ids: expected {len(prompt_ids)} lists (one per prompt), "
                         f"got {len(completion_ids)}")
    requests, params, where = [], [], []
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        for j, tok in enumerate(c):
            requests.append(TokensPrompt(prompt_token_ids=list(p) + list(c[:j])))
            # seed: the sampled token is thrown away, but a seeded request keeps the run reproducible.
            params.append(SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, seed=0,
                                         logprobs=1, logprob_token_ids=[int(tok)]))
            where.append((i, j, int(tok)))
    out: list[list[float]] = [[0.0] * len(c) for c in completion_ids]
    if not requests:
        return out
    results = worker.llm.generate(requests, params, use_tqdm=False)
    for (i, j, tok), res in zip(where, results):
        entries = res.outputs[0].logprobs[0]
        if tok not in entries:
            raise RuntimeError(f"vLLM returned no logprob for the given token {tok} (sequence {i}, position {j}); "
                               f"got tokens {sorted(entries)}")
        out[i][j] = float(entries[tok].logprob)
    return out


def run_moe_blocks(worker, hidden: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Run MoE block i of the engine's model on hidden[i] ([T, H], the model dtype) in vLLM's worker.

    Returns per block: logits [T, E] (what the router saw), ids [T, k] (int64), out [T, H].
    """
    from safetensors.torch import load, save

    blob = save({str(i): h.detach().cpu().contiguous() for i, h in enumerate(hidden)})
    result = load(worker.llm.collective_rpc("megamoe_probe_moe", args=(blob,))[0])
    return [{key: result[f"{i}.{key}"] for key in ("logits", "ids", "out")} for i in range(len(hidden))]


# -- worker side (called through rollout.extension) -----------------------------------------------

# The MoE block's attribute that holds its gate: `gate`, or `router` (gpt-oss's MLPBlock).
GATE_ATTRS = ("gate", "router")


MOE_BLOCK_ATTRS = ("mlp", "block_sparse_moe")
"""A vLLM decoder layer's MoE block attribute (vLLM's Mixtral keeps the legacy `block_sparse_moe`)."""


def moe_block_of(layer: torch.nn.Module) -> torch.nn.Module:
    """The decoder layer's MoE block (MOE_BLOCK_ATTRS)."""
    for attr in MOE_BLOCK_ATTRS:
        if isinstance(getattr(layer, attr, None), torch.nn.Module):
            return getattr(layer, attr)
    raise AttributeError(f"{type(layer).__name__}: expected an MoE block in one of {MOE_BLOCK_ATTRS}")


def block_gate(block: torch.nn.Module) -> torch.nn.Module | None:
    """The MoE block's gate module (GATE_ATTRS), or None."""
    return next((g for g in (getattr(block, a, None) for a in GATE_ATTRS) if isinstance(g, torch.nn.Module)), None)


def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of every MoE block of a vLLM model (a gate and a FusedMoE runner), in layer order."""
    return [(name, m) for name, m in model.named_modules()
            if block_gate(m) is not None and hasattr(getattr(m, "experts", None), "routed_experts")]


def _route(block: torch.nn.Module, x_TH: torch.Tensor, logits_TE: torch.Tensor) -> torch.Tensor:
    from rollout import adapter

    runner = block.experts
    layer = runner.routed_experts
    method = layer.quant_method
    if method.is_monolithic:
        # A monolithic method routes inside its kernel; only megamoe's says how (select_experts).
        if not isinstance(method, adapter.MegaMoEMethod):
            raise NotImplementedError(f"{layer.layer_name}: {type(method).__name__} routes inside a monolithic "
                                      "kernel; its expert choice cannot be observed")
        _, ids = method.select_experts(layer, logits_TE)
    else:
        _, ids = runner.router.select_experts(hidden_states=x_TH, router_logits=logits_TE,
                                              topk_indices_dtype=method.topk_indices_dtype, input_ids=None)
    return ids.long()


def probe_in_worker(worker, blob: bytes) -> bytes:
    from safetensors.torch import load, save
    from vllm.forward_context import set_forward_context

    from rollout import adapter

    model = adapter.worker_model(worker)
    blocks = moe_blocks(model)
    hidden = load(blob)
    if len(hidden) != len(blocks):
        raise ValueError(f"hidden states: expected one tensor per MoE block ({len(blocks)}), got {len(hidden)}")
    device = next(model.parameters()).device
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode(), set_forward_context(None, worker.vllm_config):
        for i, (name, block) in enumerate(blocks):
            x = hidden[str(i)].to(device)
            logits = block_gate(block)(x)
            logits = logits[0] if isinstance(logits, tuple) else logits
            ids = _route(block, x, logits)
            y = block(x)
            out[f"{i}.logits"] = logits.float().cpu().contiguous()
            out[f"{i}.ids"] = ids.cpu().contiguous()
            out[f"{i}.out"] = y.cpu().contiguous()
    return save(out)


# -- op-boundary capture (rl/divergence.py) -------------------------------------------------------
#
# Forward hooks on the served model record the activations at every op boundary of every decoder
# layer, for every forward the engine runs between "start" and "collect". vLLM's modules fuse what
# transformers keeps apart (qkv_proj, add + RMSNorm), so the names recorded here are the canonical
# op names of rl.divergence, and fused outputs are split: qkv_proj's output into q, k, v; a fused
# add-norm's (normed, residual) into the norm's output and the residual stream it summed.
# Every tensor is cloned when its hook runs: several of vLLM's CPU ops work in place (rotary
# embedding on q/k, the fused add-norm on its input), so a later op would overwrite it.

CAPTURE_STATE = "_megamoe_capture"


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _dispatch_name(module: torch.nn.Module) -> str:
    """Which kernel a vLLM layer runs on this platform: the CustomOp method it dispatched to, or the
    CPU GEMM vLLM bound to a linear (oneDNN, sgl-kernel, or torch's F.linear)."""
    cpu_linear = getattr(module, "cpu_linear", None)
    if cpu_linear is not None:
        names = set(getattr(getattr(cpu_linear, "__code__", None), "co_names", ()))
        for kernel in ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary"):
            if kernel in names:
                return kernel
        return "torch.nn.functional.linear" if "linear" in names else repr(cpu_linear)
    method = getattr(module, "_forward_method", None)
    if method is not None:
        return f"{type(module).__name__}.{getattr(method, '__name__', repr(method))}"
    impl = getattr(module, "impl", None)
    if impl is not None:
        return type(impl).__name__
    quant = getattr(module, "quant_method", None)
    return type(quant).__name__ if quant is not None else type(module).__name__


def _capture_hooks(model: torch.nn.Module, records: dict[str, list[torch.Tensor]]) -> tuple[list, dict]:
    """Install the hooks; returns (handles, {op kind: the kernel it dispatches to})."""
    handles, dispatch = [], {}

    def put(name: str, t: torch.Tensor) -> None:
        records.setdefault(name, []).append(t.detach().float().cpu().clone())

    def on_out(module, fn):
        handles.append(module.register_forward_hook(lambda m, args, out: fn(out)))

    def on_in(module, fn):
        handles.append(module.register_forward_pre_hook(lambda m, args: fn(args)))

    inner = model.model
    on_out(inner.embed_tokens, lambda out: put("embed", _first(out)))
    current, rotaries = [0], []

    def rope_hook(out):
        put(f"L{current[0]}.q_rope", out[0])
        put(f"L{current[0]}.k_rope", out[1])

    layers = list(inner.layers)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        p = f"L{i}."

        def norm_hook(prefix, resid_name):
            def fn(out):
                if isinstance(out, (tuple, list)):  # fused add + norm: (normed, the summed residual)
                    put(prefix, out[0])
                    if resid_name is not None:
                        put(resid_name, out[1])
                else:
                    put(prefix, out)
            return fn

        # The fused add of layer i's input norm is layer i-1's residual output.
        on_out(layer.input_layernorm, norm_hook(p + "input_norm", f"L{i - 1}.resid_out" if i else None))

        def qkv_hook(out, p=p, attn=attn):
            q, k, v = _first(out).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            put(p + "q_proj", q)
            put(p + "k_proj", k)
            put(p + "v_proj", v)

        on_out(attn.qkv_proj, qkv_hook)
        for norm in ("q_norm", "k_norm"):
            if hasattr(attn, norm):
                on_out(getattr(attn, norm), lambda out, n=p + norm: put(n, _first(out).reshape(out.shape[0], -1)))

        # vLLM shares one rotary module between layers (get_rope caches it): the layer that calls it
        # is the one whose attention is running.
        on_in(attn, lambda args, i=i: current.__setitem__(0, i))
        if not any(r is attn.rotary_emb for r in rotaries):
            rotaries.append(attn.rotary_emb)
            on_out(attn.rotary_emb, rope_hook)
            on_in(attn.rotary_emb, lambda args: put("positions", args[0].to(torch.float64)) if current[0] == 0 else None)
        on_in(attn.o_proj, lambda args, n=p + "attn": put(n, args[0]))
        on_out(attn.o_proj, lambda out, n=p + "o_proj": put(n, _first(out)))
        on_out(layer.post_attention_layernorm, norm_hook(p + "post_norm", p + "resid_mid"))
        mlp = moe_block_of(layer)
        if isinstance(getattr(mlp, "gate", None), torch.nn.Module):
            on_out(mlp.gate, lambda out, n=p + "router_logits": put(n, _first(out)))
        on_out(mlp, lambda out, n=p + "moe": put(n, _first(out)))
        if i == 0:
            dispatch.update({
                "input_norm": _dispatch_name(layer.input_layernorm), "qkv_proj": _dispatch_name(attn.qkv_proj),
                "q_norm": _dispatch_name(attn.q_norm) if hasattr(attn, "q_norm") else "-",
                "rotary": _dispatch_name(attn.rotary_emb), "attention": _dispatch_name(attn.attn),
                "o_proj": _dispatch_name(attn.o_proj), "post_norm": _dispatch_name(layer.post_attention_layernorm),
                "router": _dispatch_name(mlp.gate) if hasattr(mlp, "gate") else "-",
            })
    on_out(inner.norm, norm_hook("final_norm", f"L{len(layers) - 1}.resid_out"))
    # compute_logits: once for the sampled positions, once more for prompt logprobs if asked.
    on_out(model.logits_processor, lambda out: put("logits", out))
    handles.append(model.logits_processor.register_forward_pre_hook(lambda m, args: put("logits_in", args[1])))
    dispatch["lm_head"] = _dispatch_name(model.lm_head)
    dispatch["logits_processor"] = _dispatch_name(model.logits_processor)
    return handles, dispatch


def capture_ops_in_worker(worker, action: str) -> bytes:
    """action "start": hook every op boundary (clearing earlier records); "collect": remove the hooks
    and return the records as safetensors bytes, key `<op>#<n>` for the n-th call of that op since
    "start", with metadata "dispatch" (JSON: the kernel behind each vLLM layer) and "threads"."""
    import json

    from safetensors.torch import save

    from rollout import adapter

    state = worker.__dict__.setdefault(CAPTURE_STATE, {"handles": [], "records": {}, "dispatch": {}})
    for h in state["handles"]:
        h.remove()
    state["handles"] = []
    if action == "start":
        state["records"] = {}
        state["handles"], state["dispatch"] = _capture_hooks(adapter.worker_model(worker), state["records"])
        return b""
    if action != "collect":
        raise ValueError(f"action: expected 'start' or 'collect', got {action!r}")
    tensors = {f"{name}#{n}": t.contiguous() for name, ts in state["records"].items() for n, t in enumerate(ts)}
    state["records"] = {}
    return save(tensors, metadata={"dispatch": json.dumps(state["dispatch"]),
                                   "threads": str(torch.get_num_threads())})
