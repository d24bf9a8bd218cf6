"""Packed micro-batches (trainer.packing): the sequences of a micro-batch in one row, no padding.

    groups = packed_groups(minibatch_seqs, world_size, rank, token_budget)   # this rank's micro-batches
    mb = collate_packed(groups[0], pad_id, device)                         # a MicroBatch of one row

A rank's shard of the minibatch (the same contiguous shard as unpacked, trainer.batch.shard_bounds) is cut,
in order, into micro-batches of at most `token_budget` tokens (prompt + completion; a longer sequence gets
one of its own). Every rank computes every rank's packing from the whole batch it holds, so all ranks run
the same number of forward/backward passes (FSDP2's collectives) without communicating: a rank with fewer
pads with empty micro-batches, as unpacked.

Attention stays inside each sequence through transformers' own packed-sequence path: the row's
`position_ids` restart at 0 for every sequence and `attention_mask` is None, so its mask builder
(masking_utils.find_packed_sequence_indices) gives a block-diagonal causal mask (sdpa / eager on CPU), and
flash-attention's varlen kernels take the same position ids on a GPU. The rotary embedding sees each
sequence's own positions. The logits of the row are viewed once per sequence (`expand`, no copy) and each
sequence's completion logits are picked at their offsets in the row, so the loss code is unchanged.
"""

from __future__ import annotations

import torch

from trainer.batch import MicroBatch, Seq, collate, shard_bounds


def pack(seqs: list[Seq], token_budget: int) -> list[list[Seq]]:
    """`seqs` in order, cut into consecutive groups of at most token_budget tokens each (a sequence longer
    than the budget alone)."""
    if token_budget < 1:
        raise ValueError(f"token_budget: expected an int >= 1, got {token_budget!r}")
    groups: list[list[Seq]] = []
    used = 0
    for s in seqs:
        n = len(s.prompt) + len(s.completion)
        if not groups or used + n > token_budget:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += n
    return groups


def packed_groups(seqs: list[Seq], world_size: int, rank: int, token_budget: int) -> list[list[Seq]]:
    """This rank's packed micro-batches of `seqs` (a minibatch every rank holds whole), padded with empty ones
    to the largest count any rank has."""
    per_rank = [pack(seqs[slice(*shard_bounds(len(seqs), world_size, r))], token_budget) for r in range(world_size)]
    steps = max(1, max(len(g) for g in per_rank))
    mine = per_rank[rank]
    return mine + [[] for _ in range(steps - len(mine))]


def collate_packed(seqs: list[Seq], pad_id: int, device: torch.device) -> MicroBatch:
    """One row [1, T] holding the sequences back to back, position ids restarting per sequence, no
    attention mask (transformers builds the block-diagonal one from the position ids); targets, positions
    (offsets in the row), mask, sampler logprobs and advantages per sequence as trainer.batch.collate gives
    them. An empty list is trainer.batch.collate's dummy micro-batch."""
    if not seqs:
        return collate([], pad_id, device)
    b = len(seqs)
    Lc = max(len(s.completion) for s in seqs)
    ids, pos = [], []
    targets = torch.full((b, Lc), pad_id, dtype=torch.long)
    positions = torch.zeros(b, Lc, dtype=torch.long)
    mask = torch.zeros(b, Lc, dtype=torch.bool)
    samp = torch.zeros(b, Lc, dtype=torch.float32)
    adv = torch.zeros(b, dtype=torch.float32)
    offset = 0
    for r, s in enumerate(seqs):
        p, c = len(s.prompt), len(s.completion)
        ids += s.prompt + s.completion
        pos += range(p + c)
        targets[r, :c] = torch.tensor(s.completion)
        # the logits at row offset t predict token t + 1: completion token j sits at offset + p + j
        positions[r, :c] = torch.arange(offset + p - 1, offset + p - 1 + c)
        positions[r, c:] = offset + p - 1
        mask[r, :c] = True if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.bool)
        if s.sampler_logprobs is not None:
            samp[r, :c] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
        adv[r] = s.advantage
        offset += p + c
    input_ids = torch.tensor([ids], dtype=torch.long)
    position_ids = torch.tensor([pos], dtype=torch.long)
    return MicroBatch(input_ids.to(device), None, targets.to(device), positions.to(device), mask.to(device),
                      samp.to(device), adv.to(device), list(seqs), b, None, position_ids.to(device))


def padding_fraction(groups: list[list[Seq]], packed: bool) -> float:
    """The share of the token slots of `groups`' forward passes that hold padding: rows padded to their
    longest sequence (packed=False) or one row per group (packed=True: 0 unless a group is empty)."""
    real = slots = 0
    for g in groups:
        lens = [len(s.prompt) + len(s.completion) for s in g]
        real += sum(lens)
        slots += sum(lens) if packed else len(lens) * max(lens, default=0)
    return 1.0 - real / slots if slots else 0.0
