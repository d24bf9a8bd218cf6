"""Test helpers for the rollout: the transformers-side numbers a RolloutWorker must reproduce.

`processed_logprobs` recomputes, with a transformers model in fp32, the log-probabilities vLLM
reports in "processed_logprobs" mode for sampled tokens: logits / temperature, then vLLM's top-k and
top-p masks (same rule, same tie handling), then log_softmax. This is also what a trainer must
compute to match the sampler.
"""

from __future__ import annotations

import torch


def top_k_top_p_mask(logits_NV: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p_pytorch` rule on rows of logits (returns a masked copy).

    top-k: keep logits >= the k-th largest. top-p: sort ascending, drop the prefix whose cumulative
    probability is <= 1 - p, always keep the largest.
    """
    logits = logits_NV.clone()
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None and top_k > 0:
        kth = logits_sort[:, logits_sort.shape[1] - top_k].unsqueeze(1)
        logits_sort.masked_fill_(logits_sort < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = probs_sum <= 1 - top_p
        mask[:, -1] = False
        logits_sort.masked_fill_(mask, -float("inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


@torch.no_grad()
def processed_logprobs(model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int],
                       temperature: float = 1.0, top_p: float | None = None,
                       top_k: int | None = None) -> list[float]:
    """Log-probabilities of `completion_ids` after temperature/top-k/top-p, from one fp32 forward."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long)
    logits = model(input_ids=ids).logits[0].float()
    start = len(prompt_ids) - 1
    rows = logits[start:start + len(completion_ids)]
    if temperature > 0:
        rows = rows / temperature
        rows = top_k_top_p_mask(rows, top_k, top_p)
    logp = torch.log_softmax(rows, dim=-1)
    return logp.gather(1, torch.tensor(completion_ids, dtype=torch.long)[:, None])[:, 0].tolist()


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |a - b| over ragged lists of equal shape (raises on a shape mismatch)."""
    if [len(x) for x in a] != [len(y) for y in b]:
        raise AssertionError(f"shapes differ: {[len(x) for x in a]} vs {[len(y) for y in b]}")
    diffs = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    if not diffs:
        raise AssertionError("nothing to compare")
    return max(diffs)


def gpu_engine_kwargs() -> dict:
    """Engine arguments the GPU tests add on this machine's vLLM (rollout.vllm026.gpu_engine_kwargs); the
    trainer may share the GPU, so the engine takes 30% of its memory rather than vLLM's 90%."""
    from rollout import vllm026

    return {"gpu_memory_utilization": 0.3, **vllm026.gpu_engine_kwargs()}


def favour_expert_in_decode(worker, on: bool, expert: int) -> int:
    """Run in vLLM's worker process (`llm.collective_rpc(favour_expert_in_decode, args=(...))`, an eager engine):
    while on, every megamoe MoE gate adds 1e3 to `expert`'s logit on the rows that compute a generated token
    (position >= its request's prompt length, from the model runner's record of the step), so decode and
    prefill route apart whatever the steps mix; off removes the hooks. Returns the number of gates hooked."""
    from rollout import adapter

    for h in getattr(worker, "_megamoe_test_hooks", []):
        h.remove()
    worker._megamoe_test_hooks = []
    if not on:
        return 0
    runner = worker.model_runner

    def hook(mod, args, out):
        logits = out[0] if isinstance(out, tuple) else out
        T = logits.shape[0]
        n = runner.input_batch.num_reqs
        qsl = torch.as_tensor(runner.query_start_loc.np[:n + 1]).long()
        prompt = torch.as_tensor(runner.input_batch.num_prompt_tokens[:n]).long()
        prompt_rows = torch.repeat_interleave(prompt, qsl.diff())
        decode = runner.positions[:T].cpu().long() >= prompt_rows
        logits = logits.clone()
        logits[decode, expert] += 1e3
        return (logits,) + tuple(out[1:]) if isinstance(out, tuple) else logits

    gates = [m for m in adapter.worker_model(worker).modules() if isinstance(m, adapter.MegaMoEGate)]
    worker._megamoe_test_hooks = [g.register_forward_hook(hook) for g in gates]
    return len(gates)
