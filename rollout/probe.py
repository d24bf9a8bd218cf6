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

def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of every MoE block of a vLLM model (a `gate` and a FusedMoE runner), in layer order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "gate", None), torch.nn.Module)
            and hasattr(getattr(m, "experts", None), "routed_experts")]


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
            logits = block.gate(x)
            logits = logits[0] if isinstance(logits, tuple) else logits
            ids = _route(block, x, logits)
            y = block(x)
            out[f"{i}.logits"] = logits.float().cpu().contiguous()
            out[f"{i}.ids"] = ids.cpu().contiguous()
            out[f"{i}.out"] = y.cpu().contiguous()
    return save(out)
