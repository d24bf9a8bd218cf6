"""The built-in tool task (`data.task: tool_arith`, configs/tiny_tools.yaml; docs/MULTI_TURN.md): arithmetic
questions the model answers with the help of a calculator tool, the way a TRL user writes both.

    env.tools: [rl.tool_task:calculator]
    reward.functions: [{fn: rl.tool_task:tool_used, weight: 0.5}, {fn: numeric, weight: 0.5}]

`calculator` is a plain function with type hints and a docstring (its JSON schema comes from transformers'
get_json_schema); it evaluates + - * and parentheses on integers only, and raises on anything else (the
model reads the error as the tool's answer). `tool_used` pays 1 for an episode whose assistant made at least
one tool call that returned a result (a tool message that is not an error).
"""

from __future__ import annotations

import ast
import operator
import random

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_ABS = 10**12  # results beyond this are refused (a runaway product is not arithmetic the task asks for)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression on integers.

    Args:
        expression: the expression, e.g. "37 * (12 + 5)"; integers, + - * and parentheses only
    """
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(value) > MAX_ABS:
                raise ValueError(f"the result exceeds {MAX_ABS}")
            return value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    return str(ev(ast.parse(expression, mode="eval")))


def check_max_operand(max_operand) -> None:
    """data.task_kwargs.max_operand of the arithmetic tasks (tool_arith here, rl/tasks.py's add): an int >= 1."""
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"data.task_kwargs.max_operand: expected an int >= 1, got {max_operand!r}")


def tool_arith(n: int, rng: random.Random, max_operand: int = 99) -> list[dict]:
    """Rows in TRL's conversational form: one user message asking for a product or sum; answer the number."""
    check_max_operand(max_operand)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
        op = rng.choice("+*")
        question = f"What is {a} {op} {b}? Use the calculator tool, then reply with the number only."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b if op == "+" else a * b),
                     "data_source": "tool_arith"})
    return rows


def transcript(row: dict) -> list[dict]:
    """The conversation that solves a tool_arith row the way the task intends (the supervised warm start's
    data, rl/warm_start.py): the question, the assistant's calculator call on the question's expression,
    the tool's result (computed by `calculator` itself), the assistant's answer, the number only."""
    question = row["prompt"][-1]["content"]
    if not question.startswith("What is ") or "?" not in question:
        raise ValueError(f"transcript: expected a tool_arith question ('What is a op b? ...'), got {question!r}")
    expression = question[len("What is "):question.index("?")]
    result = calculator(expression)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [*row["prompt"], {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": result},
            {"role": "assistant", "content": result}]


def tool_used(completions: list[list[dict]], **_) -> list[float]:
    """1.0 where the episode holds a tool message that is a result, not an error (a well-formed call of a
    known tool that returned), else 0.0."""
    return [float(any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("Error:") for m in c))
            for c in completions]
