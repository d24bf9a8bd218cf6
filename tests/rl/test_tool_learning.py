"""The tool task's learning path (rl/tool_task.py's transcript, rl/warm_start.py, benchmarks/bench_tool_task.py):
the warm start's data solves the task, its labels are exactly the assistant turns, it refuses bad arguments,
and a few of its steps raise the log-probability of a well-formed calculator call by hundreds of nats.

    .venv/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/rl/test_tool_learning.py
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest

from rl.rewards import numeric
from rl.tool_task import tool_arith, tool_used, transcript
from rl.warm_start import IGNORE, check_args, encode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from rl.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tool_learning") / "base", seed=0)


@pytest.fixture(scope="module")
def fmt(base):
    from transformers import AutoTokenizer

    from rl.envs import tool_schema
    from rl.episode_step import eos_ids
    from rl.episodes import ChatFormat
    from rl.tool_task import calculator

    tok = AutoTokenizer.from_pretrained(base)
    return ChatFormat(tok, [tool_schema(calculator, "calculator")], eos_ids(tok, base))


def test_the_transcript_solves_its_row():
    rows = tool_arith(32, random.Random(5))
    for row in rows:
        a, op, b = re.fullmatch(r"What is (\d+) ([+*]) (\d+)\? .*", row["prompt"][0]["content"]).groups()
        truth = str(int(a) + int(b) if op == "+" else int(a) * int(b))
        conv = transcript(row)
        assert [m["role"] for m in conv] == ["user", "assistant", "tool", "assistant"]
        assert conv[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": f"{a} {op} {b}"}}
        assert conv[2]["content"] == truth == row["answer"] and conv[3]["content"] == truth
    completions = [transcript(r)[1:] for r in rows]
    assert tool_used(completions) == [1.0] * len(rows)
    assert numeric([None] * len(rows), completions, [r["answer"] for r in rows]) == [1.0] * len(rows)
    with pytest.raises(ValueError, match="expected a tool_arith question"):
        transcript({"prompt": [{"role": "user", "content": "digit 7:"}]})


def test_the_warm_starts_labels_are_exactly_the_assistant_turns(fmt):
    row = {"prompt": [{"role": "user", "content": "What is 37 * 12? Use the calculator tool, then reply with the "
                                                  "number only."}], "answer": "444"}
    ids, labels = encode(fmt, transcript(row))
    assert len(ids) == len(labels)
    marked = [i for i, lab in enumerate(labels) if lab != IGNORE]
    assert all(labels[i] == ids[i] for i in marked)
    split = next(j for j in range(1, len(marked)) if marked[j] != marked[j - 1] + 1)
    call, answer = marked[:split], marked[split:]
    dec = fmt.tok.decode
    # Written out by hand: Qwen3's call format, each turn through its end-of-turn token, nothing after it.
    assert dec([ids[i] for i in call]) == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12"}}'
                                           '\n</tool_call><|im_end|>')
    assert dec([ids[i] for i in answer]) == "444<|im_end|>"
    assert dec(ids[:call[0]]).endswith("reply with the number only.<|im_end|>\n<|im_start|>assistant\n")
    assert dec(ids[call[-1] + 1:answer[0]]) == ("\n<|im_start|>user\n<tool_response>\n444\n</tool_response><|im_end|>\n"
                                               "<|im_start|>assistant\n")
    assert answer[-1] == len(ids) - 2 and dec(ids[-1:]) == "\n"  # the template's newline after the last turn: context


@pytest.mark.parametrize("kw, match", [
    (dict(steps=0), "--steps: expected an int >= 1, got 0"),
    (dict(batch=-1), "--batch: expected an int >= 1, got -1"),
    (dict(lr=0.0), r"--lr: expected a float in \(0, 1\), got 0.0"),
    (dict(seed=-2), "--seed: expected a non-negative int, got -2"),
    (dict(max_operand=0), "--max-operand: expected an int >= 1, got 0"),
])
def test_the_warm_start_refuses_bad_arguments_naming_them(base, tmp_path, kw, match):
    args = dict(base=base, out=tmp_path / "out", steps=1, batch=1, lr=1e-3, seed=0, max_operand=9) | kw
    with pytest.raises(ValueError, match=match):
        check_args(**args)


def test_the_warm_start_refuses_a_missing_base_and_a_full_out(base, tmp_path):
    with pytest.raises(ValueError, match="--base: expected a model folder holding config.json"):
        check_args(tmp_path, tmp_path / "out", 1, 1, 1e-3, 0, 9)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="--out: expected a new or empty folder"):
        check_args(base, tmp_path / "full", 1, 1, 1e-3, 0, 9)


# Under the random model a call is ~78 tokens at ~ln(512) = 6.2 nats each: about -490 nats. Ten steps of the
# warm start (batch 4, its default lr) measured -477.5 -> -291.3 (2026-12-07, the 2-core machine); the bar is the random model's
# log-probability plus 150 nats, well above the random model and well below what ten steps reach.
RISE_NATS = 150.0


def test_a_few_warm_start_steps_raise_the_calls_logprob_by_hundreds_of_nats(base, tmp_path):
    from benchmarks.bench_tool_task import call_logprobs
    from rl.warm_start import warm_start

    before = call_logprobs(base, n=4)
    assert before["call_logprob"] < -400, before  # ~78 tokens of a near-uniform 512-token vocabulary
    warm = warm_start(base, tmp_path / "warm", steps=10, batch=4, seed=0, log=lambda _: None)
    after = call_logprobs(warm, n=4)
    print(f"log p(call): random {before['call_logprob']:.1f} -> 10 warm-start steps {after['call_logprob']:.1f} nats")
    assert after["call_logprob"] > before["call_logprob"] + RISE_NATS, (before, after)


@pytest.mark.parametrize("bad", [0, -3, "9", 2.5])
def test_the_arithmetic_tasks_refuse_a_bad_max_operand_naming_the_key(bad):
    """rl/tasks.py's add and rl/tool_task.py's tool_arith share one check of data.task_kwargs.max_operand."""
    import random

    from rl.tasks import add
    from rl.tool_task import tool_arith

    for task in (add, tool_arith):
        with pytest.raises(ValueError, match=r"data\.task_kwargs\.max_operand: expected an int >= 1, got "):
            task(2, random.Random(0), max_operand=bad)
