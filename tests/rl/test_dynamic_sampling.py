"""DAPO's dynamic sampling (rl/dynamic_sampling.py) on scripted draws: no engine, no Ray.

    .venv/bin/python -m pytest -q tests/rl/test_dynamic_sampling.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rl import config as C
from rl.dynamic_sampling import Draw, extra_step, fill_batch, has_signal
from records import Sample
from rl.rewards import RewardResult

ROOT = Path(__file__).resolve().parents[2]
N = 3  # samples per group


def _draw(call: int, group_rewards: list[list[float | None]]) -> Draw:
    """A draw of len(group_rewards) groups; each sample names its call and group in its text."""
    prompts = [f"p{call}.{g}" for g in range(len(group_rewards))]
    samples, texts, total = [], [], []
    for g, rs in enumerate(group_rewards):
        assert len(rs) == N
        for j, r in enumerate(rs):
            samples.append(Sample(prompt_index=g, prompt_ids=[1], completion_ids=[call, g, j], sampler_logprobs=[-1.0],
                                  text=f"c{call}.{g}.{j}", finish_reason="stop", policy_version=0))
            texts.append(f"c{call}.{g}.{j}")
            total.append(r)
    per_fn = {"f": list(total)}
    return Draw(prompts, samples, texts, RewardResult(total, per_fn, {"f": call}), {"rollout": 1.0, "reward": 0.5})


def _script(calls: list[list[list[float | None]]]):
    made = []

    def draw(k: int) -> Draw:
        made.append(k)
        return _draw(k, calls[k])
    return draw, made


def test_has_signal_is_about_distinct_scored_rewards():
    assert has_signal([0.0, 1.0, 1.0])
    assert not has_signal([0.5, 0.5, 0.5])
    assert not has_signal([1.0, None, None])    # one scored sample: advantage 0 for all
    assert has_signal([None, 0.0, 0.25])
    assert not has_signal([None, None, None])


def test_groups_without_signal_are_replaced_by_new_prompts_until_the_batch_is_full():
    flat, good = [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]
    draw, made = _script([
        [flat, good, [None, 0.0, None], good],   # call 0: 2 of 4 groups have signal
        [flat, flat, flat, flat],                 # call 1: none
        [good, [0.2, 0.1, 0.2], good, flat],      # call 2: 3 more; the batch needs 2
    ])
    batch, m = fill_batch(draw, groups=4, n=N, max_extra=3)
    assert made == [0, 1, 2]  # stopped as soon as the batch was full
    assert m == {"dynamic_sampling/generate_calls": 3, "dynamic_sampling/dropped_groups": 2 + 4 + 1,
                 "dynamic_sampling/kept_groups": 4, "dynamic_sampling/surplus_groups": 1,
                 "dynamic_sampling/filled_groups": 0}
    # generation order: call 0's groups 1 and 3, then call 2's groups 0 and 1
    assert batch.prompts == ["p0.1", "p0.3", "p2.0", "p2.1"]
    assert batch.texts == [f"c{c}.{g}.{j}" for c, g in ((0, 1), (0, 3), (2, 0), (2, 1)) for j in range(N)]
    assert [s.prompt_index for s in batch.samples] == [i for i in range(4) for _ in range(N)]
    assert batch.rewards.total == good + good + good + [0.2, 0.1, 0.2]
    assert batch.rewards.per_fn["f"] == batch.rewards.total
    assert batch.rewards.errors == {"f": 0 + 1 + 2}  # every call's scoring failures count
    assert batch.seconds == {"rollout": 3.0, "reward": 1.5}
    assert all(has_signal(batch.rewards.total[g * N:(g + 1) * N]) for g in range(4))


def test_the_cap_on_extra_calls_fills_the_batch_with_dropped_groups_and_counts_them(caplog):
    flat, good = [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]
    draw, made = _script([[flat, good], [flat, flat], [flat, flat]])
    batch, m = fill_batch(draw, groups=2, n=N, max_extra=1)
    assert made == [0, 1]
    assert m == {"dynamic_sampling/generate_calls": 2, "dynamic_sampling/dropped_groups": 3,
                 "dynamic_sampling/kept_groups": 1, "dynamic_sampling/surplus_groups": 0,
                 "dynamic_sampling/filled_groups": 1}
    assert batch.prompts == ["p0.1", "p0.0"]  # the kept group, then the earliest dropped one
    assert "1 of 2 groups had differing rewards after 2 generate calls" in caplog.text


def test_first_call_with_signal_everywhere_costs_nothing_extra():
    g = [0.0, 1.0, 0.5]
    draw, made = _script([[g, g]])
    batch, m = fill_batch(draw, groups=2, n=N, max_extra=4)
    assert made == [0] and m["dynamic_sampling/generate_calls"] == 1 and batch.prompts == ["p0.0", "p0.1"]


def test_extra_calls_read_prompts_no_step_of_the_run_reads():
    steps = 10
    extra = {extra_step(s, k, steps) for s in range(steps) for k in range(1, 5)}
    assert len(extra) == steps * 4 and min(extra) >= steps


def test_cap_of_zero_is_refused_naming_the_key():
    with pytest.raises(C.ConfigError, match="data.max_extra_generates: expected an int >= 1 with "
                                            "data.dynamic_sampling .*got 0"):
        C.load(ROOT / "configs" / "tiny.yaml", ["data.dynamic_sampling=true", "data.max_extra_generates=0"])
    C.load(ROOT / "configs" / "tiny.yaml", ["data.max_extra_generates=0"])  # unused without dynamic sampling
    with pytest.raises(ValueError, match="data.max_extra_generates: expected an int >= 1, got 0"):
        fill_batch(_script([])[0], groups=1, n=N, max_extra=0)


def test_each_extra_call_draws_the_data_rows_after_the_run_and_seeds_no_other_call_uses():
    """The scoring stage's prompts (rl.pipeline.Scoring.prompts): extra call k of step s reads the data
    stream's batch at s + k * run.steps (rl/dynamic_sampling.py's docstring), never the step's own
    rows, and every (step, call) samples with a seed of its own. With the extra calls re-drawing the
    step's own prompts and seed, the end-to-end math run (all groups dropped) still passed."""
    from rl.data import PromptSource
    from rl.pipeline import Scoring

    steps, calls = 6, 4
    cfg = C.load(ROOT / "configs" / "tiny.yaml", [f"run.steps={steps}", "data.dynamic_sampling=true",
                                                  f"data.max_extra_generates={calls - 1}"])
    source = PromptSource.from_config(cfg.data, seed=cfg.run.seed)
    scoring = Scoring(cfg, source, tokenizer=None, scorer=None)
    seeds = []
    for step in range(steps):
        own = source.batch(step, cfg.run.prompts_per_step)
        for call in range(calls):
            batch, prompts, sampling = scoring.prompts(step, call)
            rows = source.batch(step + call * steps, cfg.run.prompts_per_step)
            assert (prompts, batch.columns) == (rows.prompts, rows.columns), (step, call)
            assert (prompts == own.prompts) == (call == 0), (step, call)
            seeds.append(sampling["seed"])
    assert len(set(seeds)) == steps * calls, seeds
