"""Helpers for the trainer's tests: seeded batches, a free port, weight comparisons.

Batches use token ids >= 3 (the tiny tokenizer's special tokens are 0..2) and sampler logprobs
drawn near log(1/vocab), where a random-init model's logprobs sit, so the mismatch metrics are
small but not zero.
"""

from __future__ import annotations

import math
import socket

import torch

from records import TrainBatch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(n: int = 8, *, vocab: int = 512, seed: int = 0, prompt_len: tuple[int, int] = (2, 6),
               completion_len: tuple[int, int] = (1, 7), group_size: int = 4) -> TrainBatch:
    """A seeded records.TrainBatch: random prompts/completions, sampler logprobs, group-normalised advantages,
    policy version 0."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return torch.randint(3, vocab, (length,), generator=g).tolist()

    prompts = [ids(*prompt_len) for _ in range(n)]
    completions = [ids(*completion_len) for _ in range(n)]
    base = -math.log(vocab)
    sampler = [(base + 0.05 * torch.randn(len(c), generator=g)).tolist() for c in completions]
    rewards = torch.rand(n, generator=g)
    gs = group_size if n % group_size == 0 else 1
    if gs > 1:  # GRPO-like: (r - group mean) / (group std + 1e-6), the shape of rl.advantages' values
        r = rewards.double().view(-1, gs)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).reshape(-1).float().tolist()
    else:
        adv = (rewards - rewards.mean()).tolist()
    return TrainBatch(prompt_ids=prompts, completion_ids=completions, sampler_logprobs=sampler, advantages=adv,
                      policy_versions=[0] * n)


def weights_rel_err(a: list[tuple[str, torch.Tensor]] | dict, b: list[tuple[str, torch.Tensor]] | dict) -> dict[str, float]:
    """Per-tensor scale-free error ||a - b|| / ||b|| of two exports; their names must agree."""
    from megamoe.testing import rel_err

    a, b = dict(a), dict(b)
    if a.keys() != b.keys():
        raise AssertionError(f"exports differ in names: only in first {sorted(a.keys() - b.keys())}, "
                             f"only in second {sorted(b.keys() - a.keys())}")
    return {k: rel_err(a[k], b[k]) for k in a}


def assert_same_weights(a, b) -> None:
    """Bitwise equality of two exports, naming the first tensor that differs."""
    a, b = dict(a), dict(b)
    assert a.keys() == b.keys(), f"names differ: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        if not torch.equal(a[k], b[k]):
            diff = float((a[k].double() - b[k].double()).abs().max())
            raise AssertionError(f"{k}: not bitwise equal (max abs diff {diff:.3e})")


def damage_checkpoint(ckpt, how: str) -> None:
    """Damage a checkpoint folder the ways a disk or a killed save does (tests of verify / resume /
    export): "truncated" halves a .distcp file, "no_metadata" / "no_distcp" delete one, "unfinished"
    deletes meta.json (the completion marker)."""
    from pathlib import Path

    ckpt = Path(ckpt)
    if how == "truncated":
        f = next(ckpt.glob("*.distcp"))
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "no_metadata":
        (ckpt / ".metadata").unlink()
    elif how == "no_distcp":
        next(ckpt.glob("*.distcp")).unlink()
    elif how == "unfinished":
        (ckpt / "meta.json").unlink()
    else:
        raise ValueError(f"how: expected truncated, no_metadata, no_distcp or unfinished, got {how!r}")
