"""The `math` task and reward: GSM8K-shaped word problems graded by math-verify, and a short
`megamoe-rl train` run of configs/tiny_math.yaml (conversational prompts, the chat template).

    .venv/bin/python -m pytest -q tests/rl/test_rl_math.py

A random 2-layer model does not solve word problems, so the run cannot show the reward rising.
What it checks instead, at every step: the sampler got the chat-templated prompts (the token
counts the tiny tokenizer gives for this step's batch, and the first prompt's text), the math
reward scored every sample and agrees with math-verify called directly on the completions the
reward functions received (a second reward, in the test's own module, logs that through TRL's
`log_metric` and returns None for the samples it does not judge), the metrics carry
reward/<name>/none and the logged values, and the sampler-trainer mismatch stays at the fp32 bound.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from rl import config as C
from rl import rewards as R
from rl.data import PromptSource, apply_chat_template
from rl.metrics import read_jsonl
from rl.tasks import make_task

from test_rl_loop import ROOT, explain, run_cli

MATH = ROOT / "configs" / "tiny_math.yaml"


@pytest.mark.parametrize("completion, answer, want", [
    pytest.param("So the answer is \\boxed{72}.", "Natalia sold ... #### 72", 1.0, id="boxed"),
    pytest.param("48 + 24 = 72\n#### 72", "#### 72", 1.0, id="hashes"),
    pytest.param("#### 1,234", "#### 1234", 1.0, id="hashes-comma"),
    pytest.param("The half is \\boxed{\\frac{1}{2}}", "0.5", 1.0, id="latex-equivalent"),
    pytest.param("\\boxed{71}", "#### 72", 0.0, id="wrong"),
    pytest.param("I do not know", "#### 72", 0.0, id="no-answer"),
    pytest.param("#### 72", "", None, id="no-gold-not-scored"),
    pytest.param("#### 72", None, None, id="null-gold-not-scored"),
])
def test_math_reward_is_math_verify(completion, answer, want):
    assert R.math_reward(None, [completion], [answer]) == [want]
    conversational = [[{"role": "assistant", "content": completion}]]
    assert R.math_reward(None, conversational, [answer]) == [want]


@pytest.mark.parametrize("conversational", [False, True], ids=["string", "conversational"])
def test_math_task_is_seeded_gsm8k_shaped_and_its_solutions_grade_1(conversational):
    rows = make_task("math", 64, seed=0, conversational=conversational)
    assert rows == make_task("math", 64, seed=0, conversational=conversational)
    assert rows != make_task("math", 64, seed=1, conversational=conversational)
    for r in rows:
        assert re.search(r"\n#### \d+$", r["answer"]), r["answer"]
        text = r["prompt"][-1]["content"] if conversational else r["prompt"]
        assert text.count(". ") >= 2 and text.rstrip().endswith(("?", "answer."))
        if conversational:
            assert [m["role"] for m in r["prompt"]] == ["system", "user"]
    assert R.math_reward(None, [r["answer"] for r in rows], [r["answer"] for r in rows]) == [1.0] * 64
    shifted = [r["answer"].rsplit("#### ", 1)[0] + f"#### {int(r['answer'].rsplit(' ', 1)[1]) + 1}" for r in rows]
    assert R.math_reward(None, shifted, [r["answer"] for r in rows]) == [0.0] * 64


def test_math_prompts_are_100_to_300_tokens_of_the_tiny_tokenizer_after_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from rl.make_model import make_model

    tok = AutoTokenizer.from_pretrained(make_model(tmp_path / "m", seed=0))
    cfg = C.load(MATH)
    rows = make_task("math", cfg.data.task_size, cfg.run.seed, **cfg.data.task_kwargs)
    texts = apply_chat_template(tok, [r["prompt"] for r in rows], strings=False)
    lens = [len(ids) for ids in tok(texts)["input_ids"]]
    assert 100 <= min(lens) and max(lens) <= 300, (min(lens), max(lens))
    assert max(lens) + cfg.rollout.max_tokens <= min(cfg.rollout.max_model_len, cfg.trainer.max_seq_len)


# ---- a short run of configs/tiny_math.yaml ---------------------------------------------------

PROBE = textwrap.dedent('''
    """The e2e test's second reward, written to TRL's signature: not scored (None) for a
    completion with no digit; it logs what math-verify, called here directly, says of the
    completions it got, and whether the prompts arrived as chat messages."""
    import re

    from math_verify import parse, verify


    def probe(prompts, completions, answer, log_metric, **kwargs):
        gold = [parse("$" + a.rsplit("####", 1)[1].strip() + "$") for a in answer]
        texts = [c[0]["content"] for c in completions]
        ok = [float(verify(g, parse(t.rsplit("####", 1)[-1]))) for g, t in zip(gold, texts)]
        log_metric("math_verify_mean", sum(ok) / len(ok))
        log_metric("prompts_are_messages", float(all(p[-1]["role"] == "user" for p in prompts)))
        log_metric("no_digit", float(sum(not re.search(r"[0-9]", t) for t in texts)))
        return [None if not re.search(r"[0-9]", t) else 0.0 for t in texts]
''')
STEPS = 3
# Held-out conversational problems (the task made with run.seed + 1), scored by the training rewards:
# before step 1, after step 2 (eval.every) and after the last step.
EVAL = ["eval.every=2", "eval.data.task=math", "eval.data.task_size=4", "eval.data.task_kwargs={conversational: true}",
        "eval.prompts=2", "eval.n=2", "eval.pass_k=[1, 2]"]
# fp32 on both sides, megamoe both sides: max |dlogp| measured in two runs of these 3 steps
# (2026-12-05, the 2-core machine) was 9.5e-7, 4.8e-7, 4.8e-7 (each run); the bound leaves a
# 100x margin, 10x below the 1e-3 of the older loop tests.
FP32_ABS_LOGP_DIFF_MAX = 1e-4


# DAPO's dynamic sampling (docs/OBJECTIVES.md) through the loop: the random model's math reward is 0
# for every sample, so every group is dropped, the one extra generate call a step finds no signal
# either, and the batch is filled with the step's own groups (earliest first): the prompts the
# assertions below expect.
DYNAMIC = ["data.dynamic_sampling=true", "data.max_extra_generates=1"]


@pytest.fixture(scope="module")
def math_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("rl_math")
    (work / "math_probe.py").write_text(PROBE)
    run_dir = work / "run"
    argv = [__import__("sys").executable, "-m", "rl.cli", "train", "--config", str(MATH), f"run.out_dir={run_dir}",
            f"run.steps={STEPS}", "run.progress=false", "run.tensorboard=false", "run.export_final=false",
            "run.plot=false", *DYNAMIC,
            "reward.functions=[{fn: math, weight: 1.0}, {fn: 'math_probe:probe', weight: 0.0}]", *EVAL]
    proc = run_cli(argv, run_dir, cwd=work)
    return proc, run_dir


@pytest.mark.slow  # a `megamoe-rl train` run (vLLM CPU, Ray, the FSDP2 trainer)
def test_math_run_prompts_rewards_metrics_and_mismatch(math_run):
    from transformers import AutoTokenizer

    proc, run_dir = math_run
    assert proc.returncode == 0, explain(proc)
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), explain(proc)
    cfg = C.load(run_dir / "config.yaml")
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    src = PromptSource.from_config(cfg.data, seed=cfg.run.seed)
    assert src.conversational
    for r in records:
        ds = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("dynamic_sampling/")}
        assert ds == {"generate_calls": 2, "dropped_groups": 8, "kept_groups": 0, "surplus_groups": 0,
                      "filled_groups": 4}, (r["step"], ds)
        # The sampler's prompt token ids are this step's chat-templated messages, as the tokenizer counts them.
        batch = src.batch(r["step"] - 1, cfg.run.prompts_per_step)
        texts = apply_chat_template(tok, batch.prompts, strings=False)
        lens = [len(ids) for ids in tok(texts)["input_ids"]]
        assert (r["prompt/len_min"], r["prompt/len_max"]) == (min(lens), max(lens)), r
        assert r["prompt/len_mean"] == pytest.approx(sum(lens) / len(lens))
        assert 100 <= r["prompt/len_min"] and r["prompt/len_max"] <= 300
        assert r["sample/prompt"] == texts[0] and r["sample/prompt"].startswith("<|im_start|>system\n")
        assert r["reward/probe/metric/prompts_are_messages"] == 1.0
        # The math reward scored every sample (every gold answer parses) and agrees with math-verify.
        assert r["reward/math/none"] == 0 and r["reward/math/errors"] == 0
        assert r["reward/math/mean"] == r["reward/probe/metric/math_verify_mean"]
        # The probe's None for the samples without a digit: counted, never an error.
        assert r["reward/probe/none"] == r["reward/probe/metric/no_digit"] and r["reward/probe/errors"] == 0
        assert r["reward/none"] == 0  # the math reward scored them all
        assert 0.0 <= r["mismatch/abs_logp_diff_max"] < FP32_ABS_LOGP_DIFF_MAX, r["mismatch/abs_logp_diff_max"]
        assert r["mismatch/k3_kl"] >= 0.0
    # Over the run, the probe left some samples unscored and scored others: both paths ran.
    samples = cfg.run.prompts_per_step * cfg.rollout.n * STEPS
    assert 0 < sum(r["reward/probe/none"] for r in records) < samples, [r["sample/completion"] for r in records]
    print("math run:", json.dumps({k: [r[k] for r in records] for k in (
        "prompt/len_min", "prompt/len_max", "reward/math/mean", "reward/probe/none", "mismatch/abs_logp_diff_max",
        "time/step_s")}))


@pytest.mark.slow
def test_math_run_evaluates_held_out_chat_prompts_every_2_steps_and_at_the_end(math_run):
    from transformers import AutoTokenizer

    proc, run_dir = math_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "eval/pass@1" in r] == [0, 2, 3], explain(proc)
    cfg = C.load(run_dir / "config.yaml")
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    held_out = make_task("math", 4, cfg.run.seed + 1, conversational=True)[:2]
    texts = apply_chat_template(tok, [r["prompt"] for r in held_out], strings=False)
    rows = read_jsonl(run_dir / "eval_samples.jsonl")
    assert [r["step"] for r in rows] == [0] * 4 + [2] * 4 + [3] * 4
    for r in rows:
        assert r["prompt"] == texts[r["prompt_index"]]  # the chat template applied, as in training
        gold = held_out[r["prompt_index"]]["answer"]
        assert r["rewards"]["math"] == R.math_reward(None, [r["completion"]], [gold])[0]
    for r in records:
        if "eval/pass@1" in r:
            assert (r["eval/prompts"], r["eval/samples"]) == (2, 4)
            assert r["eval/reward/math/mean"] == r["eval/reward_mean"]  # the probe's weight is 0
            assert 1 <= r["eval/len_mean"] <= cfg.rollout.max_tokens
