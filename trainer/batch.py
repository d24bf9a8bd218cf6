"""The trainer's rows of a batch, sharding across ranks, micro-batch tensors.

train_step takes a records.TrainBatch (records/samples.py), whose own invariants (columns of equal
length, non-empty prompts and completions, one sampler logprob per completion token, finite
advantages, the loss mask's and the routing's shapes) were checked where it was built. Here only
what depends on this trainer is checked, once per row: token ids against the model's vocabulary and
lengths against max_seq_len (cut or refused), while the rows (`Seq`: one sequence, cut to fit) are
made; the routing's L and k against the model where it is replayed (trainer/replay.py). `score_rows`
does the same for bare (prompt, completion) pairs (TrainerWorker.logprobs, trainer/probe.py).
Every rank receives the whole batch and takes its own contiguous shard, so global normalisers
(token and sequence counts) are known everywhere without communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from records import TrainBatch


class BatchError(ValueError):
    """A batch this trainer cannot use; the message names the field and the sequence index."""


@dataclass
class Seq:
    index: int  # position in the caller's batch
    prompt: list[int]
    completion: list[int]
    sampler_logprobs: list[float] | None
    advantage: float
    truncated: bool = False
    old_logprobs: list[float] | None = None
    routed: torch.Tensor | None = None  # [len(prompt) + len(completion), L, k] int16, the sampler's experts
    loss_mask: list[bool] | None = None  # per completion token; None: every token counts

    @property
    def loss_tokens(self) -> int:
        return len(self.completion) if self.loss_mask is None else sum(self.loss_mask)


def _check_ids(ids: list[int], field: str, i: int, vocab_size: int) -> None:
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise BatchError(f"{field}[{i}]: expected token ids in [0, {vocab_size}) (the model's vocabulary), got min "
                         f"{lo}, max {hi}")


def _fit(s: Seq, max_seq_len: int, truncate: bool) -> bool:
    """Cut `s`'s completion (and what runs along it) to max_seq_len, or refuse it; whether it was cut."""
    p, c = len(s.prompt), len(s.completion)
    if p + c <= max_seq_len:
        return False
    room = max_seq_len - p
    if not truncate or room < 1:
        why = "set truncate=True to cut the completion" if not truncate else f"the prompt alone has {p} tokens"
        raise BatchError(f"batch sequence {s.index}: prompt + completion = {p} + {c} = {p + c} tokens, "
                         f"expected <= max_seq_len={max_seq_len} ({why})")
    s.completion = s.completion[:room]
    for name in ("sampler_logprobs", "old_logprobs", "loss_mask"):
        if getattr(s, name) is not None:
            setattr(s, name, getattr(s, name)[:room])
    if s.routed is not None:
        s.routed = s.routed[:max_seq_len]
    s.truncated = True
    return True


def train_rows(batch: TrainBatch, *, vocab_size: int, max_seq_len: int, truncate: bool) -> tuple[list[Seq], int]:
    """The rows of a TrainBatch, checked against this trainer; (rows, number truncated). A sequence
    longer than max_seq_len is refused, or with truncate=True its completion (and what runs along
    it) is cut to fit; a prompt that alone leaves no room for one completion token is refused either way."""
    if not isinstance(batch, TrainBatch):
        raise BatchError(f"batch: expected a records.TrainBatch, got {type(batch).__name__}")
    seqs, n_trunc = [], 0
    for i, (prompt, comp) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
        _check_ids(prompt, "TrainBatch.prompt_ids", i, vocab_size)
        _check_ids(comp, "TrainBatch.completion_ids", i, vocab_size)
        s = Seq(i, list(prompt), list(comp), list(batch.sampler_logprobs[i]), float(batch.advantages[i]),
                old_logprobs=None if batch.old_logprobs is None else list(batch.old_logprobs[i]),
                # --- routing replay (docs/ROUTING_REPLAY.md) ---
                routed=None if batch.routed_experts is None else torch.as_tensor(batch.routed_experts[i]),
                loss_mask=None if batch.loss_mask is None else [bool(v) for v in batch.loss_mask[i]])
        n_trunc += _fit(s, max_seq_len, truncate)
        seqs.append(s)
    return seqs, n_trunc


def score_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]], *, vocab_size: int, max_seq_len: int,
               truncate: bool) -> list[Seq]:
    """The rows of bare (prompt, completion) pairs to score (no training fields), checked as train_rows checks."""
    if len(prompt_ids) != len(completion_ids) or not prompt_ids:
        raise BatchError(f"completion_ids: expected one non-empty list per prompt ({len(prompt_ids)} prompts, at "
                         f"least one), got {len(completion_ids)}")
    seqs = []
    for i, (prompt, comp) in enumerate(zip(prompt_ids, completion_ids)):
        for field, ids in (("prompt_ids", prompt), ("completion_ids", comp)):
            if not ids:
                raise BatchError(f"{field}[{i}]: expected at least one token, got none")
            _check_ids(ids, field, i, vocab_size)
        s = Seq(i, list(prompt), list(comp), None, 0.0)
        _fit(s, max_seq_len, truncate)
        seqs.append(s)
    return seqs


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
    sampler_logprobs: torch.Tensor  # [b, Lc] fp32 (zeros when absent)
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
        if s.sampler_logprobs is not None:
            samp[r, :c] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
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
