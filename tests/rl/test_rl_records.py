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


def _sample(rng: random.Random, prompt_index: int, version: int, routed=None) -> Sample:
    c = [rng.randrange(3, 500) for _ in range(rng.randint(1, 5))]
    return Sample(prompt_index=prompt_index, prompt_ids=[rng.randrange(3, 500) for _ in range(3)], completion_ids=c,
                  sampler_logprobs=[rng.uniform(-8, 0) for _ in c], text="x", finish_reason="length",
                  policy_version=version, routed_experts=routed)


def test_sample_round_trips_through_json_exactly():
    rng = random.Random(0)
    samples = [_sample(rng, i // 2, 3) for i in range(8)]
    back = [Sample.from_json(d) for d in json.loads(json.dumps([s.to_json() for s in samples]))]
    assert back == samples  # every float bit for bit (repr round-trips)


def test_sample_from_a_workers_dict_offsets_the_prompt_index():
    out = {"prompt_index": 1, "prompt_ids": [5, 6], "completion_ids": [7], "text": "7", "logprobs": [-0.5],
           "finish_reason": "stop"}
    s = Sample.from_worker(out, offset=4, policy_version=2)
    assert (s.prompt_index, s.group, s.sampler_logprobs, s.policy_version, s.routed_experts) == (5, 5, [-0.5], 2, None)


def test_train_batch_columns_and_the_optional_routed_experts():
    rng = random.Random(1)
    samples = [_sample(rng, i // 2, 7) for i in range(4)]
    adv = [0.5, -0.5, 1.0, -1.0]
    cols = TrainBatch.from_samples(samples, adv).columns()
    assert cols["completion_ids"] == [s.completion_ids for s in samples]
    assert cols["sampler_logprobs"] == [s.sampler_logprobs for s in samples]
    assert cols["advantages"] == adv and cols["policy_versions"] == [7] * 4
    assert "routed_experts" not in cols
    routed = [_sample(rng, i // 2, 7, routed=[[i, i + 1]]) for i in range(4)]
    assert TrainBatch.from_samples(routed, adv).columns()["routed_experts"] == [[[i, i + 1]] for i in range(4)]


@pytest.mark.parametrize("field, value, message", [
    ("sampler_logprobs", lambda b: [b.sampler_logprobs[0][:-1]] + b.sampler_logprobs[1:],
     r"TrainBatch.sampler_logprobs\[0\]: expected \d+ values \(one per completion token\), got \d+"),
    ("advantages", lambda b: b.advantages[:-1], r"TrainBatch.advantages: expected 4 entries \(as prompt_ids\), got 3"),
    ("advantages", lambda b: [float("nan")] + b.advantages[1:],
     r"TrainBatch.advantages\[0\]: expected one finite float per sequence, got nan"),
    ("completion_ids", lambda b: b.completion_ids[:2] + [[]] + b.completion_ids[3:],
     r"TrainBatch.completion_ids\[2\]: expected at least one token"),
    ("routed_experts", lambda b: [None], r"TrainBatch.routed_experts: expected 4 entries"),
])
def test_train_batch_refuses_what_does_not_fit_naming_field_and_index(field, value, message):
    rng = random.Random(2)
    good = TrainBatch.from_samples([_sample(rng, i // 2, 0) for i in range(4)], [0.1, -0.1, 0.2, -0.2])
    cols = {k: getattr(good, k) for k in ("prompt_ids", "completion_ids", "sampler_logprobs", "advantages",
                                          "policy_versions", "routed_experts")}
    cols[field] = value(good)
    with pytest.raises(RecordError, match=message):
        TrainBatch(**cols)


def test_records_import_nothing_heavy():
    code = "import sys, records; print(sorted(m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
