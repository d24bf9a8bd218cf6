"""Datasets in TRL's and verl's layouts: conversational prompts, malformed rows, verl's nested columns.

    .venv/bin/python -m pytest -q tests/rl/test_rl_data.py

The files are written here in the shapes TRL's and verl's documentation give (a `prompt` column of
chat messages; verl's parquet with `data_source`, `prompt`, `ability`, `reward_model.ground_truth`
and `extra_info`), and read through `data.path` as a user's would be.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from rl import config as C
from rl import rewards as R
from rl.data import DataError, PromptSource, apply_chat_template


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _conv(text: str, system: str | None = "Answer briefly.") -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def _source(path: str, **columns) -> PromptSource:
    return PromptSource.from_config(C.DataConfig(path=path, columns=columns or {"prompt": "prompt"}), seed=0)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl.make_model import make_model

    return AutoTokenizer.from_pretrained(make_model(tmp_path_factory.mktemp("tok") / "m", seed=0))


def test_conversational_jsonl_keeps_messages_and_gets_the_chat_template(tmp_path, tiny_tokenizer):
    # One row with a system turn, one without: Arrow's struct column must not invent keys or turns.
    rows = [{"prompt": _conv("What is 2+2?"), "solution": "4"},
            {"prompt": _conv("What is 3+3?", system=None), "solution": "6"}]
    src = _source(_jsonl(tmp_path / "c.jsonl", rows))
    assert src.conversational
    b = src.batch(0, 2)
    by_solution = dict(zip(b.columns["solution"], b.prompts))
    assert by_solution == {"4": rows[0]["prompt"], "6": rows[1]["prompt"]}  # the lists as written, no repr
    texts = apply_chat_template(tiny_tokenizer, b.prompts, strings=False)
    for p, t in zip(b.prompts, texts):
        assert t == tiny_tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        assert t.endswith("<|im_start|>assistant\n") and "[{" not in t
    assert texts[b.prompts.index(rows[0]["prompt"])].startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")


def test_string_prompts_stay_strings(tmp_path, tiny_tokenizer):
    src = _source(_jsonl(tmp_path / "s.jsonl", [{"prompt": "2+2=", "answer": "4"}]), prompt="prompt", answer="answer")
    assert not src.conversational and src.batch(0, 1).prompts == ["2+2="]
    assert apply_chat_template(tiny_tokenizer, ["2+2="], strings=False) == ["2+2="]
    assert apply_chat_template(tiny_tokenizer, ["2+2="], strings=True) == [tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2="}], tokenize=False, add_generation_prompt=True)]


@pytest.mark.parametrize("bad, fragment", [
    pytest.param([{"content": "hi"}], r"row 1 .*message 0 has no 'role'", id="message-without-role"),
    pytest.param([{"role": "wizard", "content": "hi"}], r"row 1 .*message 0 has the unknown role 'wizard'",
                 id="unknown-role"),
    pytest.param([], r"row 1 .*is an empty list", id="empty-list"),
    pytest.param(["hi", "there"], r"row 1 .*message 0 is of type str", id="list-of-strings"),
    pytest.param({"text": "hi"}, r"row 1 .*(type dict|message 0 is of type str)", id="dict"),
    pytest.param(7, r"row 1 .*type int", id="number"),
    pytest.param("plain text", r"row 1 .*is a string, but earlier rows are lists of messages", id="mixed-forms"),
])
def test_malformed_prompt_rows_are_refused_naming_file_row_and_expectation(tmp_path, bad, fragment):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": _conv("fine")}, {"prompt": bad}, {"prompt": _conv("fine too")}])
    with pytest.raises(DataError, match=fragment) as e:
        _source(path)
    assert path in str(e.value) and "expected" in str(e.value)


def test_first_row_of_another_type_is_refused(tmp_path):
    path = _jsonl(tmp_path / "num.jsonl", [{"prompt": 3}, {"prompt": 4}])
    with pytest.raises(DataError, match=r"row 0 of column 'prompt' .*num\.jsonl.* type int .*expected a prompt string"):
        _source(path)


def test_prompt_template_cannot_apply_to_messages(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"prompt": _conv("q")}])
    with pytest.raises(DataError, match="data.prompt_template: .*chat messages"):
        PromptSource.from_config(C.DataConfig(path=path, columns={"prompt": "prompt"}, prompt_template="Q: {prompt}"),
                                 seed=0)


# ---- verl's parquet layout -------------------------------------------------------------------

VERL_REWARD = textwrap.dedent('''
    import re

    SEEN = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):   # verl's signature
        SEEN.append((data_source, solution_str, ground_truth, extra_info))
        m = re.search(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
        if m is None:
            return 0.0
        return 1.0 if m.group(1).replace(",", "") == ground_truth else 0.0
''')


def _verl_rows(n: int) -> list[dict]:
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}? Let's think step by step and output the "
                                                    "final answer after \"####\"."}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i, "question": f"What is {i} + {i}?"}}
            for i in range(n)]


def test_verl_parquet_loads_with_a_column_mapping_and_feeds_compute_score(tmp_path, monkeypatch):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(_verl_rows(6)).to_parquet(str(path))
    cfg = C.DataConfig(path=str(path), columns={"prompt": "prompt", "answer": "reward_model.ground_truth",
                                                "data_source": "data_source"})
    src = PromptSource.from_config(cfg, seed=0)
    assert src.conversational
    b = src.batch(0, 4)
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in b.prompts)
    assert {"answer", "data_source", "extra_info", "reward_model", "ability"} <= set(b.columns)
    # The nested ground truth reached the answer role; the row's own extra_info travels whole.
    assert [e["index"] * 2 for e in b.columns["extra_info"]] == [int(a) for a in b.columns["answer"]]

    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    import verl_reward

    scorer = R.RewardScorer(R.load_rewards(C.RewardConfig(functions=[C.RewardFnConfig(fn="verl_reward:compute_score")])))
    assert scorer.fns[0].style == "per_sample"
    answers = b.columns["answer"]
    texts = [f"so #### {answers[0]}", f"#### {int(answers[1]) + 1}", "no answer", f"#### {answers[3]}"]
    res = scorer(b.prompts, texts, b.columns)
    assert res.total == [1.0, 0.0, 0.0, 1.0] and res.errors == {"compute_score": 0}
    # verl's arguments: the data source, the completion's text, the ground truth, the row's extra_info.
    assert [s[0] for s in verl_reward.SEEN] == ["openai/gsm8k"] * 4
    assert [s[1] for s in verl_reward.SEEN] == texts
    assert [s[3] for s in verl_reward.SEEN] == b.columns["extra_info"]


def test_a_nested_mapping_missing_from_a_row_is_refused(tmp_path):
    rows = _verl_rows(3)
    rows[2]["reward_model"] = {"style": "model"}  # no ground truth in row 2
    path = _jsonl(tmp_path / "v.jsonl", rows)
    with pytest.raises(DataError, match=r"data.columns.answer: row 2 .*v\.jsonl.*has no field 'reward_model.ground_truth'"):
        PromptSource.from_config(C.DataConfig(path=path, columns={"prompt": "prompt",
                                                                  "answer": "reward_model.ground_truth"}), seed=0)
    with pytest.raises(DataError, match=r"data.columns.answer: .*no column 'reward_modl'.*did you mean 'reward_model'"):
        PromptSource.from_config(C.DataConfig(path=path, columns={"prompt": "prompt",
                                                                  "answer": "reward_modl.ground_truth"}), seed=0)


def test_a_tokenizer_that_adds_its_own_bos_gets_the_templates_ids_with_one_bos(tmp_path, tiny_tokenizer):
    """Mixtral's and Llama's chat templates open with the BOS token that their tokenizers also add:
    the sampler (which tokenizes with special tokens) must see the template's ids, one BOS."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tiny_tokenizer)
    bos_id = tok.convert_tokens_to_ids("<|im_start|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos_id)])
    tok.bos_token = "<|im_start|>"  # the tiny ChatML template opens with it, as Mixtral's opens with <s>
    messages = _conv("What is 2+2?")
    want = list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert want[:2] != [bos_id, bos_id] and want[0] == bos_id
    naive = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok(naive)["input_ids"][:2] == [bos_id, bos_id]  # the case is real: rendered text + added BOS
    for prompt, strings in ((messages, False), ("What is 2+2?", True)):
        text, = apply_chat_template(tok, [prompt], strings=strings)
        ids = tok(text)["input_ids"]
        assert ids[:2] != [bos_id, bos_id]
        if strings is False:
            assert ids == want
    # The tiny tokenizer adds none: its rendered text is untouched.
    assert apply_chat_template(tiny_tokenizer, [messages], strings=False) == [
        tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)]
