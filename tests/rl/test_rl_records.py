"""The loop's records (records/samples.py): a Sample's JSON round trip (the async checkpoint's in-flight
batches), a TrainBatch validated where it is built, the module torch-free.

    .venv/bin/python -m pytest -q tests/rl/test_rl_records.py
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from records import RecordError, Sample, TrainBatch


def _sample(rng: random.Random, prompt_index: int, version: int, routed: bool = False) -> Sample:
    """A seeded Sample; with routed, int16 routing of shape [prompt + completion tokens, 2 layers, k=2]."""
    import numpy as np

    p = [rng.randrange(3, 500) for _ in range(3)]
    c = [rng.randrange(3, 500) for _ in range(rng.randint(1, 5))]
    r = np.array([rng.randrange(8) for _ in range((len(p) + len(c)) * 4)], dtype=np.int16).reshape(-1, 2, 2)
    return Sample(prompt_index=prompt_index, prompt_ids=p, completion_ids=c,
                  sampler_logprobs=[rng.uniform(-8, 0) for _ in c], text="x", finish_reason="length",
                  policy_version=version, routed_experts=r if routed else None)


def test_sample_round_trips_through_json_exactly():
    rng = random.Random(0)
    samples = [_sample(rng, i // 2, 3) for i in range(8)]
    back = [Sample.from_json(d) for d in json.loads(json.dumps([s.to_json() for s in samples]))]
    assert back == samples  # every float bit for bit (repr round-trips)


def test_train_batch_columns_and_the_optional_routed_experts():
    rng = random.Random(1)
    samples = [_sample(rng, i // 2, 7) for i in range(4)]
    adv = [0.5, -0.5, 1.0, -1.0]
    b = TrainBatch.from_samples(samples, adv)
    assert b.completion_ids == [s.completion_ids for s in samples]
    assert b.sampler_logprobs == [s.sampler_logprobs for s in samples]
    assert b.advantages == adv and b.policy_versions == [7] * 4
    assert b.routed_experts is None and b.loss_mask is None and b.old_logprobs is None
    routed = [_sample(rng, i // 2, 7, routed=True) for i in range(4)]
    assert TrainBatch.from_samples(routed, adv).routed_experts == [s.routed_experts for s in routed]


@pytest.mark.parametrize("field, value, message", [
    ("sampler_logprobs", lambda b: [b.sampler_logprobs[0][:-1]] + b.sampler_logprobs[1:],
     r"TrainBatch.sampler_logprobs\[0\]: expected \d+ values \(one per completion token\), got \d+"),
    ("advantages", lambda b: b.advantages[:-1], r"TrainBatch.advantages: expected 4 entries \(as prompt_ids\), got 3"),
    ("advantages", lambda b: [float("nan")] + b.advantages[1:],
     r"TrainBatch.advantages\[0\]: expected one finite float per sequence, got nan"),
    ("completion_ids", lambda b: b.completion_ids[:2] + [[]] + b.completion_ids[3:],
     r"TrainBatch.completion_ids\[2\]: expected at least one token"),
    ("routed_experts", lambda b: [None], r"TrainBatch.routed_experts: expected 4 entries"),
    ("routed_experts", lambda b: [r[:-1] for r in b.routed_experts],
     r"TrainBatch.routed_experts\[0\]: expected integer expert ids of shape \[\d+ \(prompt \+ completion tokens\), L, k\]"),
    ("routed_experts", lambda b: [r.astype("float32") for r in b.routed_experts],
     r"TrainBatch.routed_experts\[0\]: expected integer expert ids .* got float32"),
    ("old_logprobs", lambda b: [lp + [0.0] for lp in b.sampler_logprobs],
     r"TrainBatch.old_logprobs\[0\]: expected \d+ values \(one per completion token\), got \d+"),
])
def test_train_batch_refuses_what_does_not_fit_naming_field_and_index(field, value, message):
    rng = random.Random(2)
    good = TrainBatch.from_samples([_sample(rng, i // 2, 0, routed=True) for i in range(4)], [0.1, -0.1, 0.2, -0.2])
    cols = {k: getattr(good, k) for k in ("prompt_ids", "completion_ids", "sampler_logprobs", "advantages",
                                          "policy_versions", "routed_experts")}
    cols[field] = value(good)
    with pytest.raises(RecordError, match=message):
        TrainBatch(**cols)


def test_records_import_nothing_heavy():
    code = "import sys, records; print(sorted(m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
