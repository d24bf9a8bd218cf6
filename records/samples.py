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

    prompt_index: the prompt's position in its step's batch; the GRPO group is the samples of one
    prompt_index (rollout.n of them, consecutive). sampler_logprobs: the sampler's processed logprob
    of each completion token (rollout/worker.py). reward: the weighted total of the reward functions,
    set when the step scores it (None before, or where no function scored it). routed_experts: the
    sampler's expert choices for rollout routing replay, None where not recorded.
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

    @classmethod
    def from_worker(cls, out: dict, *, offset: int, policy_version: int) -> Sample:
        """RolloutWorker.generate's dict (prompt_index relative to the worker's slice, which starts
        at `offset` of the step's prompts)."""
        return cls(prompt_index=offset + out["prompt_index"], prompt_ids=list(out["prompt_ids"]),
                   completion_ids=list(out["completion_ids"]), sampler_logprobs=list(out["logprobs"]),
                   text=out["text"], finish_reason=out.get("finish_reason"), policy_version=policy_version,
                   routed_experts=out.get("routed_experts"))

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
    """One step's training data in columns (one entry per sequence), validated where it is built.

    The trainer's train_step takes `columns()`; prompt_ids / completion_ids / sampler_logprobs /
    advantages are the trainer's batch fields (trainer/batch.py), policy_versions rides along for the
    metrics, routed_experts (optional) for routing replay and loss_mask (optional) for multi-turn episodes.
    """
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    advantages: list[float]
    policy_versions: list[int]
    routed_experts: list | None = field(default=None)
    loss_mask: list[list[int]] | None = field(default=None)

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if n == 0:
            raise RecordError("TrainBatch.prompt_ids: expected at least one sequence, got 0")
        cols = {"completion_ids": self.completion_ids, "sampler_logprobs": self.sampler_logprobs,
                "advantages": self.advantages, "policy_versions": self.policy_versions}
        if self.routed_experts is not None:
            cols["routed_experts"] = self.routed_experts
        if self.loss_mask is not None:
            cols["loss_mask"] = self.loss_mask
        for name, col in cols.items():
            if len(col) != n:
                raise RecordError(f"TrainBatch.{name}: expected {n} entries (as prompt_ids), got {len(col)}")
        for i in range(n):
            p, c, lp = self.prompt_ids[i], self.completion_ids[i], self.sampler_logprobs[i]
            if not p:
                raise RecordError(f"TrainBatch.prompt_ids[{i}]: expected at least one token, got an empty prompt")
            if not c:
                raise RecordError(f"TrainBatch.completion_ids[{i}]: expected at least one token, got an empty "
                                  "completion")
            if len(lp) != len(c):
                raise RecordError(f"TrainBatch.sampler_logprobs[{i}]: expected {len(c)} values (one per completion "
                                  f"token), got {len(lp)}")
            if self.loss_mask is not None and len(self.loss_mask[i]) != len(c):
                raise RecordError(f"TrainBatch.loss_mask[{i}]: expected {len(c)} values (one per completion token), "
                                  f"got {len(self.loss_mask[i])}")
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

    def columns(self) -> dict[str, list]:
        """The dict of lists the trainer's train_step takes (routed_experts only where recorded)."""
        out = {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids,
               "sampler_logprobs": self.sampler_logprobs, "advantages": self.advantages,
               "policy_versions": self.policy_versions}
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts
        if self.loss_mask is not None:
            out["loss_mask"] = self.loss_mask
        return out
