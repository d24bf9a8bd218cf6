"""Built-in synthetic tasks: seeded generators of prompt/answer rows (`data.task` in a config).

    from rl.tasks import make_task, TASKS
    rows = make_task("digit", n=1024, seed=0)   # [{"prompt": "digit 7:", "answer": "7", "data_source": "digit"}, ...]

Each task is a function `(n, rng, **kwargs) -> list[dict]` registered in TASKS with the reward
functions it is meant to be scored with (`TASK_REWARDS`, used by configs and tests). Rows carry
`prompt`, `answer` and `data_source`, the columns rewards receive.

Why these tasks. The CPU demo trains a randomly initialised 2-layer model whose tokenizer has 512
tokens (rl/make_model.py), so its first samples are close to uniform over the vocabulary. GRPO
learns only from groups whose samples score differently, so a task must pay something by chance
and must then be learnable in a few dozen steps:
- `digit` ("digit 7:" -> "7"): the shaped reward pays 0.5 for starting with a digit (ten of the
  512 tokens are digits; the tokenizer splits digits one per token, so the first token decides)
  and 0.5 for that digit being the prompt's. "Start with a digit" does not depend on the prompt,
  so the model can learn it from the first lucky samples by moving the output layer; copying the
  right digit is the harder, context-dependent half that a longer run can still climb.
- `copy_letter` ("copy: kqz ->" -> "k"): the same shape with letters (26 of 512 by chance).
- `add` ("3+4=" -> "7"): single-digit addition scored by the numeric reward, for real models.
- `math` (rl/math_task.py): word problems with GSM8K's shape ("... #### 36"), in string or
  conversational form, graded by math-verify (the `math` reward); realistic prompt lengths for CI
  and configs/tiny_math.yaml, not something a random tiny model can learn.
- `tool_arith` (rl/tool_task.py): arithmetic with a calculator tool, multi-turn episodes
  (configs/tiny_tools.yaml, docs/MULTI_TURN.md).
"""

from __future__ import annotations

import random
import string
from typing import Callable

from rl.math_task import math_word
from rl.tool_task import check_max_operand, tool_arith


def digit(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        d = rng.randrange(10)
        rows.append({"prompt": f"digit {d}:", "answer": str(d), "data_source": "digit"})
    return rows


def copy_letter(n: int, rng: random.Random, length: int = 3) -> list[dict]:
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"data.task_kwargs.length: expected an int >= 1, got {length!r}")
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        rows.append({"prompt": f"copy: {word} ->", "answer": word[0], "data_source": "copy_letter"})
    return rows


def add(n: int, rng: random.Random, max_operand: int = 9) -> list[dict]:
    check_max_operand(max_operand)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "data_source": "add"})
    return rows


TASKS: dict[str, Callable[..., list[dict]]] = {"digit": digit, "copy_letter": copy_letter, "add": add,
                                               "math": math_word, "tool_arith": tool_arith}

# The reward each task is designed for (the `reward.functions` entries of a config).
TASK_REWARDS: dict[str, list[dict]] = {
    "digit": [{"fn": "format", "weight": 0.5, "kwargs": {"pattern": r"^\s*\d"}},
              {"fn": "exact_match", "weight": 0.5, "kwargs": {"match": "prefix"}}],
    "copy_letter": [{"fn": "format", "weight": 0.5, "kwargs": {"pattern": r"^\s*[a-z]"}},
                    {"fn": "exact_match", "weight": 0.5, "kwargs": {"match": "prefix"}}],
    "add": [{"fn": "numeric", "weight": 1.0, "kwargs": {"which": "first"}}],
    "math": [{"fn": "math", "weight": 1.0}],
    "tool_arith": [{"fn": "rl.tool_task:tool_used", "weight": 0.5}, {"fn": "numeric", "weight": 0.5}],
}


def check_task(name: str) -> None:
    if name not in TASKS:
        import difflib
        close = difflib.get_close_matches(name, TASKS, n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"data.task: expected one of {', '.join(TASKS)}, got {name!r}{hint}")


def make_task(name: str, n: int, seed: int, **kwargs) -> list[dict]:
    """`n` rows of task `name`, the same for the same seed."""
    check_task(name)
    return TASKS[name](n, random.Random(f"{name}:{seed}"), **kwargs)
