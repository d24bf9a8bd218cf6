"""Batches: validation (with optional truncation), sharding across ranks, micro-batch tensors.

A batch is a dict of lists, one entry per sequence (docs/CONTRIBUTING.md):
    prompt_ids        list[list[int]]
    completion_ids    list[list[int]]    non-empty
    sampler_logprobs  list[list[float]]  one per completion token (train_step only)
    advantages        list[float]        one per sequence (train_step only)
    old_logprobs      list[list[float]]  optional: the trainer policy's logprobs when the batch was
                                         sampled (e.g. `logprobs(batch)` before several train_steps
                                         on one batch, PPO epochs); default: this step's own
    loss_mask         list[list[int]]    optional: one 0/1 per completion token, 1 where the loss (and the
                                         mismatch metrics) count it: multi-turn episodes (rl/episodes.py)
                                         mark their environment tokens 0 (context the sampler never sampled;
                                         their sampler_logprobs are placeholders); default all 1
    routed_experts    list[array]        optional: per sequence the sampler's experts, int [len(prompt) +
                                         len(completion), L MoE layers, k], -1 rows for tokens without
                                         routing (trainer/replay.py; trainer.routing_replay / routing_metrics)
Every rank receives the whole batch and takes its own contiguous shard, so global normalisers
(token and sequence counts) are known everywhere without communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class BatchError(ValueError):
    """A batch the trainer cannot use; the message names the field and the sequence index."""


@dataclass
class Seq:
    index: int  # position in the caller's batch
    prompt: list[int]
    completion: list[int]
    sampler_logp: list[float] | None
    advantage: float
    truncated: bool = False
    old_logp: list[float] | None = None
    routed: torch.Tensor | None = None  # [len(prompt) + len(completion), L, k] int16, the sampler's experts
    loss_mask: list[bool] | None = None  # per completion token; None: every token counts

    @property
    def loss_tokens(self) -> int:
        return len(self.completion) if self.loss_mask is None else sum(self.loss_mask)


def _int_list(value, field: str, i: int) -> list[int]:
    try:
        out = [int(t) for t in value]
    except (TypeError, ValueError):
        raise BatchError(f"batch[{field!r}][{i}]: expected a list of token ids, got {type(value).__name__}") from None
    return out


def validate_batch(batch: dict, *, vocab_size: int, max_seq_len: int, truncate: bool,
                   need_training_fields: bool = True) -> tuple[list[Seq], int]:
    """Check every field and sequence; return (sequences, number truncated).

    Empty completions are always rejected (there is nothing to score). A sequence longer than
    max_seq_len is rejected, or with truncate=True its completion (and sampler logprobs) is cut to
    fit; a prompt that alone leaves no room for one completion token is rejected either way.
    """
    if not isinstance(batch, dict):
        raise BatchError(f"batch: expected a dict of lists, got {type(batch).__name__}")
    fields = ["prompt_ids", "completion_ids"] + (["sampler_logprobs", "advantages"] if need_training_fields else [])
    for f in fields:
        if f not in batch:
            raise BatchError(f"batch: missing field {f!r}; expected fields {fields}, got {sorted(batch)}")
    n = len(batch["prompt_ids"])
    if n == 0:
        raise BatchError("batch['prompt_ids']: expected at least one sequence, got 0")
    for f in fields:
        if len(batch[f]) != n:
            raise BatchError(f"batch[{f!r}]: expected {n} entries (as prompt_ids), got {len(batch[f])}")
    seqs, n_trunc = [], 0
    for i in range(n):
        prompt = _int_list(batch["prompt_ids"][i], "prompt_ids", i)
        comp = _int_list(batch["completion_ids"][i], "completion_ids", i)
        if not prompt:
            raise BatchError(f"batch['prompt_ids'][{i}]: expected at least one token, got an empty prompt")
        if not comp:
            raise BatchError(f"batch['completion_ids'][{i}]: expected at least one token, got an empty completion")
        for f, ids in (("prompt_ids", prompt), ("completion_ids", comp)):
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= vocab_size:
                raise BatchError(f"batch[{f!r}][{i}]: expected token ids in [0, {vocab_size}), got min {lo}, max {hi}")
        samp = None
        adv = 0.0
        if need_training_fields:
            samp = [float(x) for x in batch["sampler_logprobs"][i]]
            if len(samp) != len(comp):
                raise BatchError(f"batch['sampler_logprobs'][{i}]: expected {len(comp)} values (one per completion "
                                 f"token), got {len(samp)}")
            adv = batch["advantages"][i]
            if isinstance(adv, (list, tuple)) or not isinstance(adv, (int, float)):
                raise BatchError(f"batch['advantages'][{i}]: expected one float per sequence, got {adv!r}")
            adv = float(adv)
        old = None
        if need_training_fields and batch.get("old_logprobs") is not None:
            if len(batch["old_logprobs"]) != n:
                raise BatchError(f"batch['old_logprobs']: expected {n} entries (as prompt_ids), got {len(batch['old_logprobs'])}")
            old = [float(x) for x in batch["old_logprobs"][i]]
            if len(old) != len(comp):
                raise BatchError(f"batch['old_logprobs'][{i}]: expected {len(comp)} values (one per completion "
                                 f"token), got {len(old)}")
        loss_mask = None
        if batch.get("loss_mask") is not None:
            loss_mask = _loss_mask(batch["loss_mask"], n, i, len(comp))
        # --- routing replay (docs/ROUTING_REPLAY.md) ---
        routed = None
        if batch.get("routed_experts") is not None:
            routed = _routed(batch["routed_experts"], n, i, len(prompt) + len(comp))
        # --- end routing replay ---
        truncated = False
        total = len(prompt) + len(comp)
        if total > max_seq_len:
            room = max_seq_len - len(prompt)
            if not truncate or room < 1:
                why = ("set truncate=True to cut the completion" if not truncate
                       else f"the prompt alone has {len(prompt)} tokens")
                raise BatchError(f"batch sequence {i}: prompt + completion = {len(prompt)} + {len(comp)} = {total} tokens, "
                                 f"expected <= max_seq_len={max_seq_len} ({why})")
            comp = comp[:room]
            samp = samp[:room] if samp is not None else None
            old = old[:room] if old is not None else None
            routed = routed[:max_seq_len] if routed is not None else None
            loss_mask = loss_mask[:room] if loss_mask is not None else None
            truncated = True
            n_trunc += 1
        seqs.append(Seq(i, prompt, comp, samp, adv, truncated, old, routed, loss_mask))
    return seqs, n_trunc


def _loss_mask(column, n: int, i: int, tokens: int) -> list[bool]:
    if len(column) != n:
        raise BatchError(f"batch['loss_mask']: expected {n} entries (as prompt_ids), got {len(column)}")
    m = list(column[i])
    if len(m) != tokens or any(v not in (0, 1) or isinstance(v, float) for v in m):
        raise BatchError(f"batch['loss_mask'][{i}]: expected {tokens} values 0 or 1 (one per completion token), got "
                         f"{len(m)} values {sorted(set(map(repr, m)))[:4]}")
    if not any(m):
        raise BatchError(f"batch['loss_mask'][{i}]: expected at least one 1 (a token the loss counts), got all 0")
    return [bool(v) for v in m]


def _routed(column, n: int, i: int, tokens: int) -> torch.Tensor:
    if len(column) != n:
        raise BatchError(f"batch['routed_experts']: expected {n} entries (as prompt_ids), got {len(column)}")
    r = torch.as_tensor(column[i])
    if r.dim() != 3 or r.shape[0] != tokens or r.dtype.is_floating_point:
        raise BatchError(f"batch['routed_experts'][{i}]: expected integer expert ids of shape [{tokens} (prompt + "
                         f"completion tokens), L, k], got {r.dtype} {tuple(r.shape)}")
    return r


def shard_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Contiguous split of n items over ranks, sizes differing by at most one (lower ranks larger)."""
    base, rem = divmod(n, world_size)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def split_even(items: list, parts: int) -> list[list]:
    return [items[slice(*shard_bounds(len(items), parts, p))] for p in range(parts)]


def micro_batches(local: list[Seq], n_global_max: int, micro_batch_size: int) -> list[list[Seq]]:
    """This rank's sequences in micro-batches; every rank gets the same number of micro-batches
    (FSDP's collectives run once per forward/backward on every rank), empty ones are padded later."""
    steps = max(1, math.ceil(n_global_max / micro_batch_size))
    out = [local[s * micro_batch_size:(s + 1) * micro_batch_size] for s in range(steps)]
    return out


@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # [b, L] right-padded (packed: [1, T])
    attention_mask: torch.Tensor | None  # [b, L] (packed: None)
    targets: torch.Tensor         # [b, Lc] completion tokens, right-padded
    positions: torch.Tensor       # [b, Lc] index into the logits that predicts each target
    mask: torch.Tensor            # [b, Lc] bool, real completion tokens
    sampler_logp: torch.Tensor    # [b, Lc] fp32 (zeros when absent)
    advantages: torch.Tensor      # [b] fp32
    seqs: list[Seq]               # empty for a padding micro-batch
    n_real: int
    routed: torch.Tensor | None = None  # [L, b * L_tokens, k] int64, -1 where no routing (padding included)
    position_ids: torch.Tensor | None = None  # packed (trainer/packing.py): [1, T], restarting per sequence


def collate(seqs: list[Seq], pad_id: int, device: torch.device) -> MicroBatch:
    """Right-pad a micro-batch. An empty list becomes one dummy sequence with an all-False mask, so a
    rank without data still runs the forward/backward (and FSDP collectives) contributing zero."""
    real = len(seqs)
    if not seqs:
        seqs_for_tensors = [Seq(-1, [pad_id], [pad_id], [0.0], 0.0)]
    else:
        seqs_for_tensors = seqs
    b = len(seqs_for_tensors)
    L = max(len(s.prompt) + len(s.completion) for s in seqs_for_tensors)
    Lc = max(len(s.completion) for s in seqs_for_tensors)
    input_ids = torch.full((b, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, L, dtype=torch.long)
    targets = torch.full((b, Lc), pad_id, dtype=torch.long)
    positions = torch.zeros(b, Lc, dtype=torch.long)
    mask = torch.zeros(b, Lc, dtype=torch.bool)
    samp = torch.zeros(b, Lc, dtype=torch.float32)
    adv = torch.zeros(b, dtype=torch.float32)
    for r, s in enumerate(seqs_for_tensors):
        p, c = len(s.prompt), len(s.completion)
        input_ids[r, : p + c] = torch.tensor(s.prompt + s.completion)
        attention_mask[r, : p + c] = 1
        targets[r, :c] = torch.tensor(s.completion)
        # logits at position t predict token t + 1: completion token j sits at p + j.
        positions[r, :c] = torch.arange(p - 1, p - 1 + c)
        positions[r, c:] = p - 1
        mask[r, :c] = real > 0
        if s.loss_mask is not None and real:
            mask[r, :c] = torch.tensor(s.loss_mask, dtype=torch.bool)
        if s.sampler_logp is not None:
            samp[r, :c] = torch.tensor(s.sampler_logp, dtype=torch.float32)
        adv[r] = s.advantage
    # --- routing replay (docs/ROUTING_REPLAY.md): the rows the MoE blocks see, [b, L] flattened row-major ---
    routed = None
    with_routing = [s for s in seqs if s.routed is not None]
    if with_routing:
        Lm, k = with_routing[0].routed.shape[1:]
        routed = torch.full((b, L, Lm, k), -1, dtype=torch.long)
        for r, s in enumerate(seqs):
            if s.routed is not None:
                routed[r, : s.routed.shape[0]] = s.routed.long()
        routed = routed.reshape(b * L, Lm, k).permute(1, 0, 2).contiguous().to(device)
    # --- end routing replay ---
    return MicroBatch(input_ids.to(device), attention_mask.to(device), targets.to(device), positions.to(device),
                      mask.to(device), samp.to(device), adv.to(device), list(seqs) if real else [], real, routed)
