"""Evaluation (rl/evaluation.py), samples.jsonl rows (rl/samples.py) and the W&B refusal
(rl/wandb_log.py), without an engine: pass@k against hand computations, the eval section's refusals.

    .venv/bin/python -m pytest -q tests/rl/test_evaluation.py

The end-to-end evaluation runs inside existing runs: tests/rl/test_rl_loop.py (eval every step,
samples.jsonl, W&B offline, training metrics equal with eval on and off, `megamoe-rl eval`) and
tests/rl/test_rl_math.py (conversational eval prompts, eval every 2 steps and after the last).
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from records import Sample
from rl import config as C
from rl.evaluation import Evaluator, eval_metrics, pass_at_k
from rl.rewards import RewardResult
from rl.samples import sample_rows

from test_rl_loop import TINY


def _enumerated_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """pass@k by definition: the fraction of the k-subsets of the n samples that hold a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n, c, k", [(4, 2, 2), (4, 0, 1), (4, 4, 3), (5, 1, 3), (8, 3, 4), (10, 9, 2), (6, 2, 6)])
def test_pass_at_k_is_the_subset_fraction(n, c, k):
    want = _enumerated_pass_at_k([True] * c + [False] * (n - c), k)
    assert pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-15)


def test_eval_metrics_on_fixed_rewards_match_a_hand_computation():
    # Three prompts x 4 samples; solved = summed reward >= 1.0; None = no function scored the sample.
    totals = [1.0, 0.0, 0.0, 1.0,      # c = 2
              0.0, 0.0, 0.0, 0.5,      # c = 0
              None, 1.0, 1.5, 1.0]     # c = 3 (None is not solved)
    per_fn = {"a": [1, 0, 0, 1, 0, 0, 0, 1, None, 1, 1, 1], "b": [None] * 12}
    lengths = [2, 3, 4, 5, 1, 1, 1, 1, 6, 6, 6, 6]
    m = eval_metrics(totals, per_fn, lengths, n=4, ks=[2, 4], correct_at=1.0, errors=1)
    # Hand: pass@1 = c/n per prompt; pass@2 = 1 - C(n-c,2)/C(4,2) with C(4,2) = 6: 1 - 1/6, 0, 1 - 0/6.
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0 + 3 / 4) / 3, abs=1e-15)
    assert m["eval/pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3, abs=1e-15)
    assert m["eval/pass@4"] == pytest.approx((1 + 0 + 1) / 3, abs=1e-15)
    assert m["eval/reward_mean"] == pytest.approx((2 + 0.5 + 3.5) / 11, abs=1e-15)  # the 11 scored samples
    assert m["eval/len_mean"] == pytest.approx(42 / 12, abs=1e-15)
    assert m["eval/reward/a/mean"] == pytest.approx(6 / 11, abs=1e-15)
    assert m["eval/reward/b/mean"] != m["eval/reward/b/mean"]  # NaN: scored nothing
    assert (m["eval/reward/none"], m["eval/reward/errors"], m["eval/prompts"], m["eval/samples"]) == (1, 1, 3, 12)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_sample_rows_carry_prompt_completion_rewards_advantage():
    rewards = RewardResult(total=[1.0, None, 0.5, 0.0], per_fn={"f": [1.0, None, 0.5, 0.0]}, errors={"f": 0})
    rows = sample_rows(3, ["p0", "p1"], ["a", "b", "c", "d"], rewards, [0.7, -0.7, 1.0, -1.0], [0, 0, 1, 1])
    assert rows[1] == {"step": 3, "prompt_index": 0, "sample_index": 1, "prompt": "p0", "completion": "b",
                       "reward": None, "rewards": {"f": None}, "advantage": -0.7}
    assert [(r["prompt"], r["sample_index"]) for r in rows] == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]


# ---- refusals at start, naming the key ------------------------------------------------------------

def test_pass_k_above_samples_per_prompt_is_refused():
    with pytest.raises(C.ConfigError, match=r"eval\.pass_k: expected every k <= eval\.n \(4\).*got \[1, 8\]"):
        C.load(TINY, ["eval.every=2", "eval.data.task=digit", "eval.pass_k=[1, 8]"])
    with pytest.raises(C.ConfigError, match=r"eval\.data: expected an eval dataset"):
        C.load(TINY, ["eval.every=2"])


def test_wandb_mode_without_the_package_is_refused_naming_the_extra(monkeypatch):
    import importlib.util

    from rl import wandb_log

    cfg = C.load(TINY, ["run.wandb.mode=offline"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(C.ConfigError, match=r"run\.wandb\.mode: 'offline' needs the wandb package.*megamoe-rl\[wandb\]"):
        wandb_log.check_wandb(cfg)
    wandb_log.check_wandb(C.load(TINY, []))  # disabled (the default) needs nothing


@pytest.fixture(scope="module")
def tokenizer():
    from rl.make_model import DEFAULT_VOCAB, build_tokenizer

    return build_tokenizer(DEFAULT_VOCAB)  # the tiny models' tokenizer, without writing a model


def test_eval_dataset_with_no_rows_left_is_refused_naming_the_key(tokenizer, tmp_path):
    from rl.data import DataError

    # Every prompt of the file is longer than rollout.max_model_len - eval.max_tokens = 16 - 8 tokens.
    path = tmp_path / "long.jsonl"
    path.write_text("".join(f'{{"prompt": "{"word " * 40}{i}", "answer": "{i}"}}\n' for i in range(3)))
    cfg = C.load(TINY, ["eval.every=1", f"eval.data.path={path}", "eval.max_tokens=8", "rollout.max_model_len=16",
                        "rollout.max_tokens=2", "trainer.max_seq_len=16"])
    with pytest.raises(DataError, match=r"^eval\.data\.long_prompts=drop: no prompt of the dataset .* left to evaluate"):
        Evaluator(cfg, tokenizer)
    cfg = C.load(TINY, ["eval.every=1", "eval.data.task=digit", "eval.data.task_size=5", "eval.prompts=6"])
    with pytest.raises(C.ConfigError, match=r"^eval\.prompts: expected at most the 5 rows"):
        Evaluator(cfg, tokenizer)
    cfg = C.load(TINY, ["eval.every=1", f"eval.data.path={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(DataError, match=r"^eval\.data\.path: no such file"):
        Evaluator(cfg, tokenizer)


def test_evaluator_renders_its_rows_in_order_and_draws_with_its_own_fixed_seed(tokenizer):
    cfg = C.load(TINY, ["eval.every=2", "eval.data.task=digit", "eval.data.task_size=6", "eval.prompts=4",
                        "eval.n=2", "eval.functions=[{fn: exact_match, kwargs: {match: prefix}}]", "run.steps=5"])
    ev = Evaluator(cfg, tokenizer)
    from rl.tasks import make_task

    rows = make_task("digit", 6, cfg.run.seed + 1)  # eval.task_seed null: run.seed + 1
    assert ev.prompts == [r["prompt"] for r in rows[:4]]
    assert [ev.due(s) for s in range(6)] == [True, False, True, False, True, True]  # 0, every 2, the last
    seen = []

    def generate(prompts, sampling, n):
        seen.append(sampling)
        return [Sample(prompt_index=i, prompt_ids=[1], completion_ids=[1] * (j + 1), sampler_logprobs=[-1.0] * (j + 1),
                       text=str(rows[i]["answer"]) if j == 0 else "x", finish_reason="stop", policy_version=2)
                for i in range(len(prompts)) for j in range(n)]

    m, out = ev.run(generate, 2)
    m2, _ = ev.run(generate, 4)
    assert seen[0] == seen[1] and seen[0]["seed"] != cfg.run.seed * 1_000_003 + 2  # not a training step's seed
    assert (m["eval/pass@1"], m["eval/reward_mean"], m["eval/len_mean"]) == (0.5, 0.5, 1.5)
    assert [r["correct"] for r in out[:2]] == [True, False] and out[0]["completion"] == str(rows[0]["answer"])
