"""Rewards (built-ins, dotted paths, both calling styles, failures), tasks and datasets of the RL loop.

    .venv/bin/python -m pytest -q tests/rl/test_rl_rewards.py
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from rl import config as C
from rl import rewards as R
from rl.data import DataError, PromptSource
from rl.tasks import TASK_REWARDS, TASKS, make_task


def _spec(fn, **kw):
    return C.RewardFnConfig(fn=fn, **kw)


def _scorer(*specs):
    return R.RewardScorer(R.load_rewards(C.RewardConfig(functions=list(specs))))


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A reward module on sys.path, as a user would write it."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        import asyncio, math

        def length_reward(prompts, completions, answer, **kwargs):
            return [min(len(c), 10) / 10 for c in completions]

        def needs_flag(prompts, completions, *, flag):
            return [float(flag)] * len(completions)

        async def async_reward(prompts, completions, **kwargs):
            await asyncio.sleep(0)
            return [1.0 if c.startswith("a") else 0.0 for c in completions]

        def picky(prompts, completions, answer):
            out = []
            for c in completions:
                if c == "boom":
                    raise RuntimeError("reward server said no")
                out.append(float("nan") if c == "nan" else 1.0)
            return out

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            assert data_source == "src" and extra_info["prompt"].startswith("p")
            return {"score": float(solution_str.strip() == ground_truth), "acc": 1}

        async def async_compute_score(data_source, solution_str, ground_truth, extra_info):
            return float(solution_str == ground_truth)

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


# ---- built-ins -------------------------------------------------------------------------------

def test_exact_match_full_and_prefix():
    comps = [" 7", "7 apples", "8", ""]
    ans = ["7", "7", "7", "7"]
    assert R.exact_match(None, comps, ans) == [1.0, 0.0, 0.0, 0.0]
    assert R.exact_match(None, comps, ans, match="prefix") == [1.0, 1.0, 0.0, 0.0]
    assert R.exact_match(None, ["ABC"], ["abc"], ignore_case=True) == [1.0]


@pytest.mark.parametrize("completion, answer, which, expected", [
    ("The answer is 42.", "42", "last", 1.0),
    ("3 + 4 = 7", "7", "last", 1.0),
    ("3 + 4 = 7", "7", "first", 0.0),
    ("1,234 total", "1234", "last", 1.0),
    ("-5", "-5.0", "last", 1.0),
    ("no number", "1", "last", 0.0),
    ("so 72", "Natalia sold 48/2 = 24 clips ... #### 72", "last", 1.0),  # GSM8K-style answer
])
def test_numeric(completion, answer, which, expected):
    assert R.numeric(None, [completion], [answer], which=which) == [expected]


def test_format():
    assert R.format_reward(None, [" 3x", "x3", "\n9"], pattern=r"^\s*\d") == [1.0, 0.0, 1.0]


# ---- loading errors --------------------------------------------------------------------------

@pytest.mark.parametrize("fn, kwargs, fragment", [
    pytest.param("exact_matc", {}, "did you mean 'exact_match'", id="builtin-typo"),
    pytest.param("no_such_pkg_q.mod:f", {}, "cannot import module 'no_such_pkg_q.mod'", id="no-module"),
    pytest.param("my_rewards:lenght_reward", {}, "has no attribute 'lenght_reward' (did you mean 'length_reward'", id="typo"),
    pytest.param("my_rewards:NOT_CALLABLE", {}, "is a int, expected a callable", id="not-callable"),
    pytest.param("my_rewards:", {}, "expected 'pkg.module:function'", id="empty-attr"),
    pytest.param("my_rewards:needs_flag", {"bogus": 1}, "does not fit the batch style", id="bad-kwarg"),
    pytest.param("format", {}, "reward.functions.0.kwargs: the built-in 'format' needs pattern", id="missing-kwarg"),
])
def test_reward_load_errors_name_the_key(user_module, fn, kwargs, fragment):
    with pytest.raises(R.RewardLoadError) as e:
        R.load_rewards(C.RewardConfig(functions=[_spec(fn, kwargs=kwargs)]))
    assert fragment in str(e.value)
    assert "reward.functions.0" in str(e.value)


def test_duplicate_names_are_refused():
    with pytest.raises(R.RewardLoadError, match="distinct"):
        R.load_rewards(C.RewardConfig(functions=[_spec("numeric"), _spec("numeric")]))


# ---- scoring ---------------------------------------------------------------------------------

def test_custom_reward_by_dotted_path_and_weights(user_module):
    s = _scorer(_spec(f"{user_module}:length_reward", weight=0.5), _spec("exact_match", weight=0.5))
    res = s(["p1", "p2"], ["7", "abcdefghijkl"], {"answer": ["7", "8"], "extra": [1, 2]})
    assert res.per_fn == {"length_reward": [0.1, 1.0], "exact_match": [1.0, 0.0]}
    assert res.total == pytest.approx([0.55, 0.5])
    assert res.errors == {"length_reward": 0, "exact_match": 0}


def test_function_gets_only_the_columns_it_names(user_module):
    s = _scorer(_spec(f"{user_module}:needs_flag", kwargs={"flag": 1}))
    # `answer` and `extra` are not parameters of needs_flag, so they must not be passed.
    assert s(["p"], ["c"], {"answer": ["x"], "extra": [0]}).total == [1.0]


def test_async_batch_reward(user_module):
    s = _scorer(_spec(f"{user_module}:async_reward"))
    assert s(["p", "p"], ["abc", "xyz"], {}).total == [1.0, 0.0]


def test_failing_samples_get_zero_are_counted_and_logged_once(user_module, caplog):
    s = _scorer(_spec(f"{user_module}:picky"))
    caplog.set_level(logging.ERROR, logger="megamoe.rl.rewards")
    res = s(["p"] * 4, ["ok", "boom", "nan", "boom"], {"answer": ["a"] * 4})
    # The batch call raised, so the samples were scored one by one: only the bad ones are 0.
    assert res.total == [1.0, 0.0, 0.0, 0.0]
    assert res.errors == {"picky": 3}
    res2 = s(["p"], ["boom"], {"answer": ["a"]})
    assert res2.total == [0.0] and s.errors_total == {"picky": 4}
    records = [r for r in caplog.records if "picky" in r.getMessage()]
    # One record per failure kind (the RuntimeError with its traceback, the NaN), not one per sample.
    assert len(records) == 2, [r.getMessage() for r in records]
    raised = [r for r in records if r.exc_info]
    assert len(raised) == 1 and "reward server said no" in str(raised[0].exc_info[1])
    assert any("non-finite" in r.getMessage() for r in records)


def test_wrong_number_of_values_fails_every_sample_of_the_call_counted_and_logged_once(user_module, tmp_path,
                                                                                       caplog):
    (tmp_path / "short_rewards.py").write_text("def short(prompts, completions, **kw):\n    return [1.0]\n")
    s = _scorer(_spec("short_rewards:short"))
    caplog.set_level(logging.ERROR, logger="megamoe.rl.rewards")
    res = s(["p", "q"], ["a", "b"], {})
    # One value for two samples: not re-scored per sample (where `[1.0]` would fit and earn full
    # reward), but a failure of both samples.
    assert res.total == [0.0, 0.0] and res.errors == {"short": 2}
    s(["p", "q", "r"], ["a", "b", "c"], {})
    assert s.errors_total == {"short": 5}
    records = [r for r in caplog.records if "'short'" in r.getMessage()]
    assert len(records) == 1 and "returned 1 values for 2 samples" in str(records[0].exc_info[1])


def test_per_sample_adapter(user_module):
    s = _scorer(_spec(f"{user_module}:compute_score"))
    assert s.fns[0].style == "per_sample"
    res = s(["p1", "p2"], [" 4", "5"], {"answer": ["4", "4"], "data_source": ["src", "src"]})
    assert res.total == [1.0, 0.0] and res.errors == {"compute_score": 0}


def test_per_sample_adapter_async_and_failures(user_module):
    s = _scorer(_spec(f"{user_module}:async_compute_score"))
    assert s.fns[0].style == "per_sample" and s.fns[0].is_async
    res = s(["p", "p"], ["x", "y"], {"answer": ["x", "x"]})
    assert res.total == [1.0, 0.0]
    bad = _scorer(_spec(f"{user_module}:compute_score"))  # its assert fails without data_source "src"
    res = bad(["p"], ["4"], {"answer": ["4"], "data_source": ["other"]})
    assert res.total == [0.0] and res.errors == {"compute_score": 1}


def test_scorer_checks_lengths():
    s = _scorer(_spec("numeric"))
    with pytest.raises(ValueError, match="one entry per sample"):
        s(["p"], ["1", "2"], {"answer": ["1", "2"]})


# ---- tasks -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [t for t in TASKS if t != "tool_arith"])  # tool_arith: tests/rl/test_env.py
def test_tasks_are_seeded_and_scored_by_their_rewards(name):
    rows = make_task(name, 64, seed=3)
    assert rows == make_task(name, 64, seed=3)
    assert rows != make_task(name, 64, seed=4)
    assert {"prompt", "answer", "data_source"} <= set(rows[0])
    s = _scorer(*[C.RewardFnConfig(**r) for r in TASK_REWARDS[name]])
    prompts = [r["prompt"] for r in rows]
    perfect = s(prompts, [r["answer"] for r in rows], {"answer": [r["answer"] for r in rows]})
    assert perfect.total == pytest.approx([1.0] * len(rows))
    junk = s(prompts, ["##"] * len(rows), {"answer": [r["answer"] for r in rows]})
    assert junk.total == [0.0] * len(rows)


def test_digit_task_pays_partial_credit_by_chance():
    """The demo task's reward must separate samples within a group (GRPO needs variance): a
    digit that is not the answer earns the format half."""
    rows = make_task("digit", 200, seed=0)
    s = _scorer(*[C.RewardFnConfig(**r) for r in TASK_REWARDS["digit"]])
    wrong = [str((int(r["answer"]) + 1) % 10) for r in rows]
    assert s([r["prompt"] for r in rows], wrong, {"answer": [r["answer"] for r in rows]}).total == [0.5] * 200
    assert len({r["answer"] for r in rows}) == 10


def test_unknown_task_suggests():
    with pytest.raises(ValueError, match="did you mean 'digit'"):
        make_task("digits", 4, 0)


# ---- data ------------------------------------------------------------------------------------

def _rows(n=10):
    return [{"question": f"q{i}", "solution": str(i), "level": i % 3} for i in range(n)]


def test_batches_are_a_function_of_seed_and_step():
    src = PromptSource(_rows(), {"prompt": "question", "answer": "solution"}, template="Q: {prompt}", seed=1)
    again = PromptSource(_rows(), {"prompt": "question", "answer": "solution"}, template="Q: {prompt}", seed=1)
    b3 = src.batch(3, 4)
    assert again.batch(3, 4) == b3  # no state: a resumed run sees the same prompts
    assert b3.prompts[0].startswith("Q: q") and set(b3.columns) == {"answer", "level"}
    # Each epoch visits every row once.
    seen = [p for s in range(5) for p in src.batch(s, 2).prompts]
    assert sorted(seen) == sorted(f"Q: q{i}" for i in range(10))


def test_column_mapping_errors_name_the_key():
    with pytest.raises(DataError, match=r"data.columns.prompt: .*no column 'questoin'.*did you mean 'question'"):
        PromptSource(_rows(), {"prompt": "questoin"})
    with pytest.raises(DataError, match="besides the column"):
        PromptSource([{"q": "x", "answer": "1", "sol": "2"}], {"prompt": "q", "answer": "sol"})


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "disk", "disk-dict"])
def test_local_datasets_load_with_a_column_mapping(tmp_path, kind):
    import datasets

    ds = datasets.Dataset.from_list(_rows(12))
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        ds.to_json(str(path), lines=True)
    elif kind == "json":
        path = tmp_path / "d.json"
        ds.to_json(str(path), lines=False)
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif kind == "disk":
        path = tmp_path / "d"
        ds.save_to_disk(str(path))
    else:
        path = tmp_path / "dd"
        datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(path))
    cfg = C.DataConfig(path=str(path), columns={"prompt": "question", "answer": "solution"})
    src = PromptSource.from_config(cfg, seed=0)
    assert src.n == 12
    b = src.batch(0, 5)
    assert len(b.prompts) == 5 and all(p.startswith("q") for p in b.prompts)
    assert [str(int(p[1:])) for p in b.prompts] == [str(a) for a in b.columns["answer"]]
    if kind == "disk-dict":
        bad = C.DataConfig(path=str(path), split="validation", columns={"prompt": "question"})
        with pytest.raises(DataError, match=r"data.split: expected one of \['train', 'test'\]"):
            PromptSource.from_config(bad, seed=0)


def test_missing_or_unsupported_dataset_path(tmp_path):
    with pytest.raises(DataError, match="data.path: no such file"):
        PromptSource.from_config(C.DataConfig(path=str(tmp_path / "nope.jsonl")), seed=0)
    (tmp_path / "d.csv").write_text("a\n1\n")
    with pytest.raises(DataError, match=r"expected a \.json, \.jsonl or \.parquet"):
        PromptSource.from_config(C.DataConfig(path=str(tmp_path / "d.csv")), seed=0)


def test_builtin_task_source_and_kwargs_errors():
    src = PromptSource.from_config(C.DataConfig(task="copy_letter", task_size=50, task_kwargs={"length": 5}), seed=0)
    b = src.batch(0, 3)
    assert all(p.startswith("copy: ") and len(p.split()[1]) == 5 for p in b.prompts)
    with pytest.raises(DataError, match="data.task_kwargs"):
        PromptSource.from_config(C.DataConfig(task="digit", task_kwargs={"length": 5}), seed=0)


TRL_STYLE = textwrap.dedent("""
    def only_completions(completions, **kwargs):          # TRL's documented signature
        return [float(len(c)) for c in completions]

    def with_ids(prompts, completions, completion_ids, answer, **kwargs):
        return [float(len(i)) + (a == c) for c, i, a in zip(completions, completion_ids, answer)]

    def keyword_only(*, completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    def everything(**kwargs):
        return [float(sorted(kwargs) == ["answer", "completion_ids", "completions", "log_extra", "log_metric",
                                         "prompts"])] * len(kwargs["prompts"])

    def other_names(p, c):                                 # positional names TRL would not pass
        return [0.0] * len(c)

    def positional_only(prompts, completions, /):
        return [0.0] * len(completions)
""")


@pytest.fixture
def trl_module(tmp_path, monkeypatch):
    (tmp_path / "trl_rewards.py").write_text(TRL_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "trl_rewards"


@pytest.mark.parametrize("fn, want", [
    ("only_completions", [2.0, 1.0]),
    ("with_ids", [4.0, 1.0]),          # ids of lengths 3 and 1; the first completion equals its answer
    ("keyword_only", [1.0, 0.0]),
    ("everything", [1.0, 1.0]),
])
def test_trl_reward_signatures_are_called_by_keyword(trl_module, fn, want):
    s = _scorer(_spec(f"{trl_module}:{fn}"))
    res = s(["p1", "p2"], ["ab", "c"], {"answer": ["ab", "x"]}, completion_ids=[[5, 6, 7], [8]])
    assert res.total == want and res.errors == {fn: 0}


@pytest.mark.parametrize("fn, fragment", [
    ("other_names", r"neither `completions` nor \*\*kwargs"),
    ("positional_only", "positional only"),
])
def test_a_batch_reward_trl_could_not_call_is_refused_at_load(trl_module, fn, fragment):
    with pytest.raises(R.RewardLoadError, match=fragment) as e:
        R.load_rewards(C.RewardConfig(functions=[_spec(f"{trl_module}:{fn}")]))
    assert "reward.functions.0" in str(e.value)


# ---- over-long prompts (data.long_prompts) ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl.make_model import make_model

    return AutoTokenizer.from_pretrained(make_model(tmp_path_factory.mktemp("tok") / "m", seed=0))


def _long_rows():
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(8)]
    rows[5]["prompt"] = "a much longer prompt " * 20
    return rows


def test_long_prompts_are_dropped_and_batches_stay_seeded(tiny_tokenizer):
    from rl.data import check_prompt_lengths

    src = PromptSource(_long_rows(), {"prompt": "prompt", "answer": "answer"}, seed=3)
    limit = 40
    assert len(tiny_tokenizer(src.prompt_texts()[5])["input_ids"]) > limit  # the case is real
    assert check_prompt_lengths(src, tiny_tokenizer, limit, "drop") == [5]
    assert src.dropped == 1 and src.n == 7
    seen = [a for step in range(7) for a in src.batch(step, 1).columns["answer"]]
    assert sorted(seen) == ["0", "1", "2", "3", "4", "6", "7"]  # one epoch: every kept row once, never row 5
    again = PromptSource(_long_rows(), {"prompt": "prompt", "answer": "answer"}, seed=3)
    check_prompt_lengths(again, tiny_tokenizer, limit, "drop")
    assert [again.batch(s, 3).prompts for s in range(4)] == [src.batch(s, 3).prompts for s in range(4)]


def test_long_prompts_refused_naming_the_row(tiny_tokenizer):
    from rl.data import check_prompt_lengths

    src = PromptSource(_long_rows(), {"prompt": "prompt", "answer": "answer"})
    with pytest.raises(DataError, match=r"data.long_prompts=refuse: row 5 .* tokens, more than the 40 allowed"):
        check_prompt_lengths(src, tiny_tokenizer, 40, "refuse")
    with pytest.raises(DataError, match="no prompt of the dataset"):
        check_prompt_lengths(src, tiny_tokenizer, 1, "drop")


def test_long_prompts_policy_is_a_checked_setting():
    with pytest.raises(C.ConfigError, match="data.long_prompts"):
        C.load(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml", ["data.long_prompts=truncate"])


# ---- TRL's conversational data, None, the extra keywords, factories --------------------------

# Written to TRL's documented signatures and data shapes (conversational completions read as
# completion[0]["content"]; None for a sample a function does not judge; log_metric / log_extra /
# trainer_state by keyword; factories returning the reward function).
TRL_CONVERSATIONAL = textwrap.dedent('''
    import re

    SEEN = {}

    def accuracy(completions, solution, **kwargs):
        SEEN["prompts"], SEEN["completions"] = kwargs["prompts"], completions
        out = []
        for completion, sol in zip(completions, solution):
            content = completion[0]["content"]
            out.append(None if not sol else float(content.split("</think>")[-1].strip() == sol))
        return out

    def think_format(completions, **kwargs):
        pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
        return [1.0 if re.match(pattern, c[0]["content"], re.DOTALL) else 0.0 for c in completions]

    def logging_only(completions, log_metric=None, log_extra=None, trainer_state=None, **kwargs):
        lens = [len(c[0]["content"]) for c in completions]
        log_metric("chars", sum(lens) / len(lens))
        log_metric("chars", 0.0)                      # twice in one step: the step's metric is the mean
        log_metric("step", trainer_state.global_step)
        log_extra("chars", lens)
        return [None] * len(completions)

    def get_len_reward(max_len):
        if max_len <= 0:
            raise ValueError("max_len must be positive")
        def len_reward(completions, **kwargs):
            return [min(len(c[0]["content"]), max_len) / max_len for c in completions]
        return len_reward

    def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
        def soft_overlong_punishment(completion_ids, **kwargs):
            out = []
            for ids in completion_ids:
                n = len(ids)
                if n <= max_completion_len - soft_punish_cache:
                    out.append(0.0)
                elif n <= max_completion_len:
                    out.append((max_completion_len - soft_punish_cache - n) / soft_punish_cache)
                else:
                    out.append(-1.0)
            return out
        return soft_overlong_punishment
''')


@pytest.fixture
def conv_batch(tmp_path, monkeypatch):
    """Two conversational prompts (one with a gold solution, one without) x 2 samples, from a JSONL
    file in TRL's layout, and the reward module above on sys.path."""
    import json

    rows = [{"prompt": [{"role": "system", "content": "Think first."}, {"role": "user", "content": "2+2?"}],
             "solution": "4"},
            {"prompt": [{"role": "user", "content": "Name a colour."}], "solution": ""}]
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "trl_conv_rewards.py").write_text(TRL_CONVERSATIONAL)
    monkeypatch.syspath_prepend(str(tmp_path))
    src = PromptSource.from_config(C.DataConfig(path=str(path), columns={"prompt": "prompt"}, shuffle=False), seed=0)
    b = src.batch(0, 2)
    prompts = [b.prompts[0], b.prompts[0], b.prompts[1], b.prompts[1]]
    columns = {k: [v[0], v[0], v[1], v[1]] for k, v in b.columns.items()}
    texts = ["<think>easy</think>4", "5", "<think>hm</think>red", "blue"]
    return prompts, texts, columns, rows


def test_trl_rewards_on_conversational_data_none_and_extra_keywords(conv_batch):
    import trl_conv_rewards as mod

    prompts, texts, columns, rows = conv_batch
    s = _scorer(_spec("trl_conv_rewards:accuracy"), _spec("trl_conv_rewards:logging_only"))
    res = s(prompts, texts, columns, completion_ids=[[1, 2], [3], [4, 5, 6], [7]],
            trainer_state=R.TrainerState(global_step=3, max_steps=10))
    # What TRL passes: the message lists, and each completion as one assistant message.
    assert mod.SEEN["prompts"] == [rows[0]["prompt"]] * 2 + [rows[1]["prompt"]] * 2
    assert mod.SEEN["completions"] == [[{"role": "assistant", "content": t}] for t in texts]
    assert res.per_fn == {"accuracy": [1.0, 0.0, None, None], "logging_only": [None] * 4}
    # Samples 2 and 3: no function scored them; no reward, not 0, and not an error.
    assert res.total == [1.0, 0.0, None, None] and res.errors == {"accuracy": 0, "logging_only": 0}
    m = res.metrics(group_size=2)
    assert m["reward/none"] == 2 and m["reward/accuracy/none"] == 2 and m["reward/logging_only/none"] == 4
    assert m["reward/mean"] == 0.5 and m["reward/accuracy/mean"] == 0.5
    assert m["reward/zero_std_groups_frac"] == 0.5  # the unscored group has no signal
    chars = sum(map(len, texts)) / 4
    assert m["reward/logging_only/metric/chars"] == pytest.approx(chars / 2)  # mean of (chars, 0.0)
    assert m["reward/logging_only/metric/step"] == 3.0
    assert m["sample/chars"] == len(texts[0])


def test_weighted_sum_is_over_the_functions_that_scored(conv_batch):
    prompts, texts, columns, _ = conv_batch
    s = _scorer(_spec("trl_conv_rewards:accuracy", weight=1.0), _spec("trl_conv_rewards:think_format", weight=0.5))
    res = s(prompts, texts, columns)
    assert res.per_fn == {"accuracy": [1.0, 0.0, None, None], "think_format": [1.0, 0.0, 1.0, 0.0]}
    assert res.total == [1.5, 0.0, 0.5, 0.0]
    assert res.metrics(2)["reward/none"] == 0


def test_unscored_samples_get_advantage_zero_and_stay_out_of_the_group_statistics():
    from rl.advantages import group_advantages

    adv = group_advantages([1.0, None, 0.0, 0.5, None, None, None, None], group_size=4).tolist()
    # Scored: 1.0, 0.0, 0.5 -> mean 0.5, population std sqrt((0.25 + 0.25 + 0) / 3) = 0.40825.
    assert adv == pytest.approx([0.5 / 0.408248, 0.0, -0.5 / 0.408248, 0.0, 0.0, 0.0, 0.0, 0.0], rel=1e-5)
    plain = group_advantages([1.0, None, 0.0, 0.5], group_size=4, scale_by_std=False).tolist()
    assert plain == pytest.approx([0.5, 0.0, -0.5, 0.0])


def test_factories_are_built_once_from_their_kwargs(conv_batch):
    prompts, texts, columns, _ = conv_batch
    spec = _spec("trl_conv_rewards:get_len_reward", factory=True, factory_kwargs={"max_len": 10})
    s = _scorer(spec, _spec("trl_conv_rewards:get_soft_overlong_punishment", factory=True,
                            factory_kwargs={"max_completion_len": 4, "soft_punish_cache": 2}))
    assert [f.name for f in s.fns] == ["len_reward", "soft_overlong_punishment"]
    res = s(prompts, texts, columns, completion_ids=[[1], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]])
    assert res.per_fn["len_reward"] == [1.0, 0.1, 1.0, 0.4]
    assert res.per_fn["soft_overlong_punishment"] == [0.0, -0.5, -1.0, -1.0]


def test_factory_errors_name_the_key(conv_batch):
    with pytest.raises(R.RewardLoadError, match=r"reward.functions.0.factory_kwargs: .*raised ValueError: max_len "
                                                r"must be positive"):
        R.load_rewards(C.RewardConfig(functions=[_spec("trl_conv_rewards:get_len_reward", factory=True,
                                                       factory_kwargs={"max_len": 0})]))
    with pytest.raises(C.ConfigError, match="reward.functions.0.factory_kwargs: expected empty unless factory: true"):
        C.load(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml",
               ["reward.functions=[{fn: 'x:y', factory_kwargs: {max_len: 1}}]"])


def test_none_from_a_per_sample_reward_is_not_scored(user_module, tmp_path, monkeypatch):
    (tmp_path / "verl_none.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return None if ground_truth is None else float(solution_str == ground_truth)\n")
    s = _scorer(_spec("verl_none:compute_score"))
    res = s(["p", "q"], ["1", "1"], {"answer": ["1", None]})
    assert res.total == [1.0, None] and res.errors == {"compute_score": 0}


def test_trls_own_rewards_run_unchanged(tmp_path):
    """TRL's shipped reward functions and factories through the scorer, on conversational data.
    trl is not a dependency (it brings accelerate, which changes how transformers loads models);
    with it on the path (pip install trl==1.16.0) this runs, without it it skips saying so."""
    pytest.importorskip("trl.rewards", reason="trl is not installed (optional: pip install trl==1.16.0)")
    s = _scorer(_spec("trl.rewards:accuracy_reward"), _spec("trl.rewards:think_format_reward", weight=0.5),
                _spec("trl.rewards:get_cosine_scaled_reward", factory=True, factory_kwargs={"max_len": 8}, weight=0.0),
                _spec("trl.rewards:get_soft_overlong_punishment", factory=True,
                      factory_kwargs={"max_completion_len": 4, "soft_punish_cache": 2}, weight=0.0))
    prompts = [[{"role": "user", "content": "2+2?"}]] * 3
    texts = ["<think>easy</think>\\boxed{4}", "5", "<think>hm</think>5"]
    res = s(prompts, texts, {"solution": ["$4$", "$4$", ""]}, completion_ids=[[1, 2], [3, 4, 5], [6, 7, 8, 9, 10]],
            trainer_state=R.TrainerState(global_step=0, max_steps=1))
    assert res.per_fn["accuracy_reward"] == [1.0, 0.0, None]  # TRL's None: an empty gold cannot be judged
    assert res.per_fn["think_format_reward"] == [1.0, 0.0, 1.0]
    assert res.per_fn["soft_overlong_punishment_reward"] == [0.0, -0.5, -1.0]
    assert res.total == [1.5, 0.0, 0.5] and sum(res.errors.values()) == 0
