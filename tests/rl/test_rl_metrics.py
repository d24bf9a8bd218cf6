"""Step metrics of the RL loop: mismatch on known values, the JSONL sink, resume truncation, the plot.

    .venv/bin/python -m pytest -q tests/rl/test_rl_metrics.py
"""

from __future__ import annotations

import json
import math

import pytest

from rl.metrics import MISMATCH_KEYS, MetricsLogger, mismatch_metrics, read_jsonl, truncate_jsonl
from rl.plot import plot_run


def test_mismatch_metrics_on_hand_computed_values():
    # Two sequences; per-token d = logp_trainer - logp_sampler = [-0.1, 0.0] and [0.3].
    t = [[-1.1, -2.0], [-0.2]]
    s = [[-1.0, -2.0], [-0.5]]
    d = [-0.1, 0.0, 0.3]
    m = mismatch_metrics(t, s, mode="token_mask", is_low=0.95, is_high=1.2)
    assert set(MISMATCH_KEYS) <= set(m)
    k3 = [math.exp(x) - 1 - x for x in d]
    assert m["mismatch/k3_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert m["mismatch/abs_logp_diff_mean"] == pytest.approx(0.4 / 3, rel=1e-5)
    assert m["mismatch/abs_logp_diff_max"] == pytest.approx(0.3, rel=1e-5)
    assert m["mismatch/is_ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-5)
    assert m["mismatch/is_ratio_min"] == pytest.approx(math.exp(-0.1), rel=1e-5)
    # exp(-0.1)=0.905 < 0.95 and exp(0.3)=1.35 > 1.2 are dropped by token_mask: 2 of 3 tokens.
    assert m["mismatch/masked_frac"] == pytest.approx(2 / 3)
    # seq_mask uses the geometric-mean ratio per sequence: exp(-0.05)=0.951 kept, exp(0.3) dropped.
    assert mismatch_metrics(t, s, mode="seq_mask", is_low=0.95, is_high=1.2)["mismatch/masked_frac"] == \
        pytest.approx(1 / 3)
    assert mismatch_metrics(t, s, mode="tis")["mismatch/masked_frac"] == 0.0


def test_identical_logprobs_have_zero_mismatch():
    lp = [[-0.3, -1.7, -0.01], [-2.5]]
    m = mismatch_metrics(lp, lp)
    assert m["mismatch/k3_kl"] == 0.0 and m["mismatch/abs_logp_diff_max"] == 0.0
    assert m["mismatch/is_ratio_mean"] == 1.0


def test_mismatch_metrics_refuses_misaligned_sequences():
    with pytest.raises(ValueError, match="sequence 0 has 2 trainer logprobs and 1 sampler"):
        mismatch_metrics([[-1.0, -1.0]], [[-1.0]])


def test_jsonl_sink_resume_truncation_and_plot(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True) as sink:
        for step in range(1, 7):
            sink.log(step, {"reward/mean": step / 10, "reward/std": 0.1, "mismatch/k3_kl": 1e-6 * step,
                            "mismatch/abs_logp_diff_mean": 1e-3, "mismatch/abs_logp_diff_max": 1e-2,
                            "weird": float("nan"), "sample/completion": "7"})
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert recs[0]["weird"] is None  # strict JSON: NaN is written as null
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])

    assert truncate_jsonl(tmp_path / "metrics.jsonl", 4) == 4
    with MetricsLogger(tmp_path, tensorboard=False) as sink:
        sink.log(5, {"reward/mean": 0.9})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    png = plot_run(tmp_path)
    assert png == tmp_path / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_refuses_an_empty_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics"):
        plot_run(tmp_path)


def test_tensorboard_mirror_writes_every_numeric_metric(tmp_path):
    """run.tensorboard: every numeric metric lands in <run>/tensorboard as a scalar (read back with
    TensorBoard's own reader); strings and booleans are left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as sink:
        sink.log(3, {"reward/mean": 0.5, "sample/completion": "7", "flag": True})
        sink.log(4, {"reward/mean": 0.75})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["reward/mean"]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(3, 0.5), (4, 0.75)]


def test_tensorboard_missing_is_refused_naming_the_key(tmp_path, monkeypatch):
    import importlib.util

    from rl.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="run.tensorboard: true, but the tensorboard package is not installed"):
        MetricsLogger(tmp_path, tensorboard=True)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before anything is written
