"""The records the RL loop passes between its stages; torch-free, so the driver, the tests and a
reader need nothing heavy to use them.

    Sample      one completion as the sampler produced it, with the policy version that produced it
    TrainBatch  a step's samples in column form with their advantages, validated once here, where
                it is built (the trainer ranks then check only that the columns fit their tensors)

Policy versions count optimizer steps (trainer train_step calls): version 0 is the initial weights
(model_dir, or the checkpoint a run resumed from counts its steps), version v the weights after v
steps. With run.max_async_steps = k, the batch trained at step t (1-based, as in metrics.jsonl) was
sampled with version max(0, t - 1 - k) (docs/ASYNC.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


class RecordError(ValueError):
    """A record whose fields do not fit together; the message names the field and the index."""


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt.

    Built where the sampler returns it (rollout.worker.RolloutWorker.generate; multi-turn episodes:
    rl/episode_step.py). prompt_index: the prompt's position in its step's batch; the GRPO group is
    the samples of one prompt_index (rollout.n of them, consecutive). sampler_logprobs: the sampler's
    processed logprob of each completion token (rollout/worker.py). reward: the weighted total of
    the reward functions, set when the step scores it (None before, or where no function scored it).
    routed_experts: the sampler's expert choices for rollout routing replay, None where not recorded.
    """
    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]
    text: str
    finish_reason: str | None
    policy_version: int
    reward: float | None = None
    routed_experts: Any = None
    loss_mask: list[int] | None = None  # multi-turn episodes: 1 on sampled tokens, 0 on environment tokens

    @property
    def group(self) -> int:
        return self.prompt_index

    def to_json(self) -> dict:
        """A JSON-ready dict; from_json inverts it exactly (Python floats round-trip through repr;
        routed_experts, an int16 array, as nested lists)."""
        d = dataclasses.asdict(self)
        if self.routed_experts is not None:
            d["routed_experts"] = self.routed_experts.tolist()
        return d

    @classmethod
    def from_json(cls, d: dict) -> Sample:
        if d.get("routed_experts") is not None:
            import numpy as np

            d = {**d, "routed_experts": np.asarray(d["routed_experts"], dtype=np.int16)}
        return cls(**d)


@dataclass(frozen=True)
class TrainBatch:
    """One step's training data in columns (one entry per sequence), validated where it is built; what
    the trainer's train_step takes (trainer/worker.py), as itself.

    prompt_ids, completion_ids (non-empty each), sampler_logprobs (one per completion token), advantages
    (one finite float per sequence) and policy_versions (the version that sampled each, for the
    metrics) are always there; optional: routed_experts (per sequence the sampler's experts, integer
    [len(prompt) + len(completion), L MoE layers, k], for routing replay), loss_mask (per completion
    token 0 or 1, at least one 1: multi-turn episodes mark their environment tokens 0) and
    old_logprobs (per completion token the trainer policy's logprobs when the batch was sampled, for
    several train_steps on one batch; default: each step's own). What depends on the model (token ids
    against its vocabulary, lengths against trainer.max_seq_len, the routing's L and k) the trainer
    checks (trainer/batch.py).
    """
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    advantages: list[float]
    policy_versions: list[int]
    routed_experts: list | None = field(default=None)
    loss_mask: list[list[int]] | None = field(default=None)
    old_logprobs: list[list[float]] | None = field(default=None)

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if n == 0:
            raise RecordError("TrainBatch.prompt_ids: expected at least one sequence, got 0")
        cols = {"completion_ids": self.completion_ids, "sampler_logprobs": self.sampler_logprobs,
                "advantages": self.advantages, "policy_versions": self.policy_versions}
        for name in ("routed_experts", "loss_mask", "old_logprobs"):
            if getattr(self, name) is not None:
                cols[name] = getattr(self, name)
        for name, col in cols.items():
            if len(col) != n:
                raise RecordError(f"TrainBatch.{name}: expected {n} entries (as prompt_ids), got {len(col)}")
        for i in range(n):
            p, c = self.prompt_ids[i], self.completion_ids[i]
            if not p:
                raise RecordError(f"TrainBatch.prompt_ids[{i}]: expected at least one token, got an empty prompt")
            if not c:
                raise RecordError(f"TrainBatch.completion_ids[{i}]: expected at least one token, got an empty "
                                  "completion")
            for name in ("sampler_logprobs", "old_logprobs"):
                col = getattr(self, name)
                if col is not None and len(col[i]) != len(c):
                    raise RecordError(f"TrainBatch.{name}[{i}]: expected {len(c)} values (one per completion "
                                      f"token), got {len(col[i])}")
            if self.loss_mask is not None:
                _check_loss_mask(self.loss_mask[i], i, len(c))
            if self.routed_experts is not None:
                _check_routed(self.routed_experts[i], i, len(p) + len(c))
            a = self.advantages[i]
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
                raise RecordError(f"TrainBatch.advantages[{i}]: expected one finite float per sequence, got {a!r}")

    @classmethod
    def from_samples(cls, samples: list[Sample], advantages: list[float]) -> TrainBatch:
        routed = [s.routed_experts for s in samples]
        masks = [s.loss_mask for s in samples]
        if any(m is not None for m in masks):
            masks = [m if m is not None else [1] * len(s.completion_ids) for m, s in zip(masks, samples)]
        else:
            masks = None
        return cls(prompt_ids=[s.prompt_ids for s in samples], completion_ids=[s.completion_ids for s in samples],
                   sampler_logprobs=[s.sampler_logprobs for s in samples], advantages=list(advantages),
                   policy_versions=[s.policy_version for s in samples],
                   routed_experts=None if all(r is None for r in routed) else routed, loss_mask=masks)


def _check_loss_mask(mask: list, i: int, tokens: int) -> None:
    if len(mask) != tokens or any(v not in (0, 1) or isinstance(v, float) for v in mask):
        raise RecordError(f"TrainBatch.loss_mask[{i}]: expected {tokens} values 0 or 1 (one per completion token), "
                          f"got {len(mask)} values {sorted(set(map(repr, mask)))[:4]}")
    if not any(mask):
        raise RecordError(f"TrainBatch.loss_mask[{i}]: expected at least one 1 (a token the loss counts), got all 0")


def _check_routed(routed, i: int, tokens: int) -> None:
    """An integer array [tokens, L, k] (numpy's, as the sampler records it; anything numpy reads)."""
    import numpy as np

    r = np.asarray(routed)
    if r.ndim != 3 or r.shape[0] != tokens or r.dtype.kind not in "iu":
        raise RecordError(f"TrainBatch.routed_experts[{i}]: expected integer expert ids of shape [{tokens} (prompt + "
                          f"completion tokens), L, k], got {r.dtype} {tuple(r.shape)}")
