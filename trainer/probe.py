"""Trainer-side probes for `megamoe-rl consistency`: logprobs of given completions, the hidden states
entering every MoE block, and each MoE block run on given hidden states.

    model = load_model(model_dir, "megamoe", dtype=torch.bfloat16)
    logps, hidden = score(model, prompt_ids, completion_ids, temperature=1.0, capture=True)
    layers = run_moe_blocks(model, hidden)          # [{"logits", "ids", "out"}, ...] per MoE block

`score` computes what `TrainerWorker.logprobs` computes (the same row checks, right-padded
micro-batches, `trainer.loss.token_logprobs` at the run's temperature) on an unsharded model. With
one rank, FSDP2 changes no number: its bf16 mixed precision casts the fp32 master weights to bf16
for compute, which equals loading them in bf16 (the same round-to-nearest cast).

The hidden states are taken with forward pre-hooks on the MoE blocks (`trainer.experts.moe_blocks`),
for the real (unpadded) positions of every sequence, concatenated in batch order: hidden[i] is
[sum of sequence lengths, H] in the model dtype. Feeding them to both sides' MoE blocks separates the
MoE's own contribution to the mismatch from attention and norms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megamoe.contract import FAST
from trainer.batch import collate, micro_batches, score_rows
from trainer.experts import block_router, moe_blocks
from trainer.loss import token_logprobs


@torch.no_grad()
def score(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *,
          temperature: float = 1.0, micro_batch_size: int = 8, capture: bool = False, numerics: str = FAST
          ) -> tuple[list[list[float]], list[torch.Tensor] | None]:
    """(per-token logprobs of each completion, hidden states entering each MoE block or None); `numerics`:
    the model's (load_model's), for the log-softmax."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    pad = model.config.pad_token_id
    pad_id = int(pad) if pad is not None and 0 <= int(pad) < vocab else 0
    max_len = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    seqs = score_rows(list(prompt_ids), list(completion_ids), vocab_size=vocab, max_seq_len=max_len, truncate=False)
    blocks = [b for _, b in moe_blocks(model)] if capture else []
    per_block: list[dict[int, torch.Tensor]] = [{} for _ in blocks]
    current: list = []  # the micro-batch being run, for the hooks

    def hook(i):
        def pre_hook(module, args):
            h_BLH = args[0]
            for r, s in enumerate(current):
                per_block[i][s.index] = h_BLH[r, : len(s.prompt) + len(s.completion)].detach().clone()
        return pre_hook

    handles = [b.register_forward_pre_hook(hook(i)) for i, b in enumerate(blocks)]
    out: dict[int, list[float]] = {}
    try:
        for mb_seqs in micro_batches(seqs, len(seqs), micro_batch_size):
            current[:] = mb_seqs
            mb = collate(mb_seqs, pad_id, device)
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            V = logits.shape[-1]
            picked = torch.gather(logits, 1, mb.positions.unsqueeze(-1).expand(-1, -1, V))
            lp = token_logprobs(picked, mb.targets, temperature, numerics).cpu()
            for r, s in enumerate(mb.seqs):
                out[s.index] = lp[r, : len(s.completion)].tolist()
    finally:
        for h in handles:
            h.remove()
    hidden = [torch.cat([d[s.index] for s in seqs]) for d in per_block] if capture else None
    return [out[s.index] for s in seqs], hidden


@torch.no_grad()
def run_moe_blocks(model: torch.nn.Module, hidden: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """MoE block i of `model` on hidden[i] [T, H]: router logits [T, E] (fp32), top-k ids [T, k], output [T, H]."""
    blocks = [b for _, b in moe_blocks(model)]
    if len(hidden) != len(blocks):
        raise ValueError(f"hidden: expected one tensor per MoE block ({len(blocks)}), got {len(hidden)}")
    device = next(model.parameters()).device
    result = []
    for block, h in zip(blocks, hidden):
        x = h.to(device)
        # The block's own router: Fp32Router for megamoe / reference, transformers' TopKRouter for stock.
        logits, _, ids = block_router(block)(x)
        y = block(x[None])
        y = (y[0] if isinstance(y, tuple) else y)[0]  # gpt-oss's block returns (hidden, router scores)
        result.append({"logits": logits.float().cpu(), "ids": ids.long().cpu(), "out": y.cpu()})
    return result
