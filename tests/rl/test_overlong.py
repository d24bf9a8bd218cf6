"""DAPO's overlong reward shaping (rl/overlong.py) and the objective settings that span sections.

    .venv/bin/python -m pytest -q tests/rl/test_overlong.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rl import config as C
from rl.overlong import overlong_penalty, shape
from rl.rewards import RewardResult

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("length, want", [
    (1, 0.0), (12, 0.0),            # up to L - B = 12: no penalty
    (13, -0.5 * 1 / 4), (14, -0.5 * 2 / 4), (16, -0.5),   # linear over the last B = 4 tokens
])
def test_penalty_is_dapos_ramp(length, want):
    assert overlong_penalty(length, max_tokens=16, buffer=4, penalty=0.5) == pytest.approx(want, abs=0, rel=1e-15)


def test_shape_adds_the_penalty_to_scored_samples_only():
    r = RewardResult([1.0, None, 0.25, 0.0], {"acc": [1.0, None, 0.25, 0.0]}, {"acc": 0})
    out = shape(r, [16, 16, 14, 3], max_tokens=16, buffer=4, penalty=1.0)
    assert out.total == [0.0, None, -0.25, 0.0]
    assert out.per_fn["overlong"] == [-1.0, -1.0, -0.5, 0.0]
    assert out.per_fn["acc"] == r.per_fn["acc"] and r.total == [1.0, None, 0.25, 0.0]  # the input is unchanged
    m = out.metrics(group_size=2)
    assert m["reward/overlong/mean"] == pytest.approx(-2.5 / 4) and m["reward/overlong/errors"] == 0


def test_a_reward_function_named_overlong_is_refused():
    r = RewardResult([1.0], {"overlong": [1.0]}, {"overlong": 0})
    with pytest.raises(ValueError, match="a function is named 'overlong'"):
        shape(r, [3], max_tokens=4, buffer=2, penalty=1.0)


@pytest.mark.parametrize("overrides, match", [
    (["reward.overlong_buffer=-1"], "reward.overlong_buffer: expected an int >= 0"),
    (["rollout.max_tokens=8", "reward.overlong_buffer=9"], r"reward.overlong_buffer: expected an int <= "
                                                            r"rollout.max_tokens \(8\), got 9"),
    (["reward.overlong_penalty=-0.5"], "reward.overlong_penalty: expected a float >= 0"),
    (["trainer.kl_coef=-0.01"], "trainer.kl_coef: expected a float >= 0"),
    (["trainer.loss=ppo"], "trainer.loss: expected one of 'grpo', 'gspo', 'cispo', 'dr_grpo', got 'ppo'"),
    (["trainer.loss=dr_grpo", "reward.scale_by_std=true"], "reward.scale_by_std: expected null or false with "
                                                            "trainer.loss='dr_grpo'"),
    (["trainer.loss=dr_grpo", "trainer.loss_agg=token_mean"], "trainer.loss_agg: expected null or 'constant'"),
])
def test_bad_settings_are_refused_at_load_naming_the_key(overrides, match):
    with pytest.raises(C.ConfigError, match=match):
        C.load(ROOT / "configs" / "tiny.yaml", overrides)


def test_dr_grpo_resolves_to_no_std_scaling_and_the_sampler_limit_as_normaliser():
    cfg = C.load(ROOT / "configs" / "tiny.yaml", ["trainer.loss=dr_grpo", "rollout.max_tokens=24"])
    assert C.scale_by_std(cfg) is False
    w = C.trainer_worker_config(cfg)
    assert (w.aggregation, w.max_tokens) == ("constant", 24)
    assert C.scale_by_std(C.load(ROOT / "configs" / "tiny.yaml")) is True
    assert C.scale_by_std(C.load(ROOT / "configs" / "tiny.yaml", ["reward.scale_by_std=false"])) is False
