"""The `math` task: seeded word problems with GSM8K's shape, made offline (`data.task: math`).

    from rl.tasks import make_task
    rows = make_task("math", n=256, seed=0)                          # prompts as strings
    rows = make_task("math", n=256, seed=0, conversational=True)     # prompts as chat messages

Each row is one problem of a few sentences (a person, things, prices or counts, two to four
operations) and its worked solution ending in GSM8K's `#### <number>` line:
    {"prompt": "...", "answer": "... = 36\\n#### 36", "data_source": "math_word"}
In the conversational form (TRL's and verl's layout) the prompt is
`[{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem}]`; in the string form
the instruction follows the problem. The answers are integers, so the built-in `math` reward
(math-verify) grades them exactly. No download: templates filled with seeded names and numbers, so
CI and the tiny config (configs/tiny_math.yaml) can train on a realistic prompt length (100-300
tokens of the tiny tokenizer after the chat template) and a real grader.
"""

from __future__ import annotations

import random

SYSTEM = "Solve the math word problem step by step. End with a line '#### <number>' holding only the final answer."
INSTRUCTION = "Solve it step by step and end with a line '#### <number>' holding only the final answer."

NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Mark", "Tina", "Ken", "Alexis", "Randy", "Joy",
         "Carla", "Mei", "Tobias", "Olga", "Samir", "Ines", "Hugo", "Priya")
GOODS = (("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"), ("cupcake", "cupcakes"),
         ("marble", "marbles"), ("sticker", "stickers"), ("book", "books"), ("candle", "candles"))
PLACES = ("the farmers' market", "the school fair", "a bakery", "the corner shop", "a flea market")


def _sell(rng: random.Random, name: str) -> tuple[str, str]:
    one, many = rng.choice(GOODS)
    first = rng.randint(12, 60) * 2
    half = first // 2
    price = rng.randint(2, 9)
    text = (f"{name} sells {many} at {rng.choice(PLACES)}. In April {name} sold {first} {many} to friends and "
            f"neighbours. In May {name} sold half as many {many} as in April, as it rained a lot. Every {one} costs {price} dollars. How many dollars did {name} earn from the "
            f"{many} sold in April and May altogether?")
    total = first + half
    answer = total * price
    sol = (f"In May {name} sold {first} / 2 = {half} {many}.\nAltogether {name} sold {first} + {half} = {total} "
           f"{many}.\nSo {name} earned {total} * {price} = {answer} dollars.\n#### {answer}")
    return text, sol


def _save(rng: random.Random, name: str) -> tuple[str, str]:
    weekly = rng.randint(5, 25)
    weeks = rng.randint(3, 9)
    gift = rng.randint(1, 5) * 10
    saved = weekly * weeks
    have = saved + gift
    cost = (have // 10 + rng.randint(1, 20)) * 10  # always more than the savings: a positive answer
    text = (f"{name} wants to buy a new bicycle that costs {cost} dollars. {name} saves {weekly} dollars every "
            f"week from a summer job for {weeks} weeks. At the end, a grandparent gives {name} {gift} dollars as "
            f"a birthday present. How many more dollars does {name} need to buy the bicycle?")
    answer = cost - have
    sol = (f"{name} saves {weekly} * {weeks} = {saved} dollars.\nWith the present {name} has {saved} + {gift} = "
           f"{have} dollars.\nSo {name} needs {cost} - {have} = {answer} more dollars.\n#### {answer}")
    return text, sol


def _share(rng: random.Random, name: str) -> tuple[str, str]:
    one, many = rng.choice(GOODS)
    boxes = rng.randint(3, 9)
    per_box = rng.randint(6, 15)
    kept = rng.randint(2, 10)
    friends = rng.randint(2, 6)
    total = boxes * per_box
    while (total - kept) % friends:
        kept += 1
    text = (f"{name} buys {boxes} boxes of {many}, and every box holds {per_box} {many}. {name} keeps {kept} "
            f"of the {many} for the family and shares the rest equally among {friends} friends, so that every "
            f"friend gets the same number of {many} and none are left over. How many {many} does each friend get?")
    rest = total - kept
    answer = rest // friends
    sol = (f"{name} has {boxes} * {per_box} = {total} {many}.\nAfter keeping {kept}, {total} - {kept} = {rest} "
           f"are shared.\nEach friend gets {rest} / {friends} = {answer} {many}.\n#### {answer}")
    return text, sol


def _trip(rng: random.Random, name: str) -> tuple[str, str]:
    speed = rng.randint(4, 12) * 5
    hours = rng.randint(2, 6)
    back_speed = speed + rng.randint(1, 4) * 5
    back_hours = rng.randint(1, hours)
    text = (f"{name} drives to visit a cousin who lives in another town. On the way there {name} drives for "
            f"{hours} hours at {speed} miles per hour without stopping. On the way back {name} takes a different "
            f"road and drives for {back_hours} hours at {back_speed} miles per hour. How many miles did {name} "
            f"drive in total on the whole trip, there and back?")
    there = speed * hours
    back = back_speed * back_hours
    answer = there + back
    sol = (f"On the way there {name} drove {speed} * {hours} = {there} miles.\nOn the way back {name} drove "
           f"{back_speed} * {back_hours} = {back} miles.\nIn total {there} + {back} = {answer} miles.\n#### {answer}")
    return text, sol


TEMPLATES = (_sell, _save, _share, _trip)


def math_word(n: int, rng: random.Random, conversational: bool = False) -> list[dict]:
    """`n` word problems (module docstring); `conversational`: prompts as chat-message lists."""
    if not isinstance(conversational, bool):
        raise ValueError(f"data.task_kwargs.conversational: expected true or false, got {conversational!r}")
    rows = []
    for _ in range(n):
        text, sol = rng.choice(TEMPLATES)(rng, rng.choice(NAMES))
        prompt = ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}] if conversational
                  else f"{text}\n{INSTRUCTION}")
        rows.append({"prompt": prompt, "answer": sol, "data_source": "math_word"})
    return rows
