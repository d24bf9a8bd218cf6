"""A short supervised warm start on the tool task's transcripts: the step before RL that a random tiny model
needs to make a first well-formed tool call (configs/tiny_tools_warm.yaml, benchmarks/bench_tool_task.py).

    megamoe-rl make-model --out runs/tiny_tools_base
    python -m rl.warm_start --base runs/tiny_tools_base --out runs/tiny_tools_warm --max-operand 9
                            [--steps 100 --batch 8 --lr 3e-3 --seed 0]
    megamoe-rl train --config configs/tiny_tools_warm.yaml

Why: under the random model a well-formed call (78 tokens of `<tool_call>{"name": "calculator", ...}`
</tool_call>` in the tiny tokenizer) has a log-probability of about -490 nats, so RL from the random model
never samples one and its reward stays 0 (benchmarks/RESULTS.md, "The tool task learns").

What it does: tool_arith rows (their own seed, not the training set's) become the conversations that solve
them (rl.tool_task.transcript: the question, a calculator call, the tool's result, the answer), rendered
with the model's own chat template and tools (rl.episodes.ChatFormat, the renderer the episodes use, which
also checks that every assistant turn is a token prefix of the whole). The loss is teacher-forced
cross-entropy on the assistant tokens only (each assistant turn up to and including its end-of-turn token;
prompt, tool and template tokens are context, labels -100), through transformers' own causal-LM loss, in a
plain torch AdamW loop. Deliberately short: the warm-started model calls the tool and answers right only
part of the time (sampled at temperature 1), which is what leaves RL something to raise.

Writes `<out>`: the model (save_pretrained), its tokenizer, and warm_start.json (the arguments, the
base model's path, the loss of the first and last steps). The folder appears complete or not at all.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

MARKER_FILE = "warm_start.json"
DATA_SEED_PREFIX = "tool_arith:warm_start"  # rows drawn apart from the training set's ("tool_arith:<seed>")
IGNORE = -100  # transformers' ignore index of the causal-LM loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rl.warm_start", description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the model folder to start from (e.g. a make-model output)")
    p.add_argument("--out", required=True, help="a new or empty folder for the warm-started model")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="conversations per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="data and shuffling seed (default %(default)s)")
    p.add_argument("--max-operand", type=int, default=99,
                   help="tool_arith's max_operand, as the RL config's data.task_kwargs (default %(default)s)")
    return p.parse_args(argv)


def check_args(base: Path, out: Path, steps: int, batch: int, lr: float, seed: int, max_operand: int) -> None:
    """Every argument before any work; ValueError naming the flag."""
    if not (base / "config.json").is_file():
        raise ValueError(f"--base: expected a model folder holding config.json, got {str(base)!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out: expected a new or empty folder, {str(out)!r} is not")
    for name, value in (("--steps", steps), ("--batch", batch), ("--max-operand", max_operand)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if not 0 < lr < 1:
        raise ValueError(f"--lr: expected a float in (0, 1), got {lr!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"--seed: expected a non-negative int, got {seed!r}")


def encode(fmt, conversation: list[dict]) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one conversation: the template's tokens, labels = the ids on every assistant
    turn (from its generation prompt's end through its end-of-turn token), IGNORE elsewhere."""
    ids = fmt.render_ids(conversation, False)
    labels = [IGNORE] * len(ids)
    for i, m in enumerate(conversation):
        if m["role"] != "assistant":
            continue
        start = len(fmt.render_ids(conversation[:i], True))
        turn = fmt.render_ids(conversation[:i + 1], False)
        if ids[:len(turn)] != turn or turn[:start] != fmt.render_ids(conversation[:i], True):
            raise RuntimeError(f"{fmt.name}: assistant turn {i} does not render as a token prefix of the conversation")
        end = fmt.turn_tail(turn, closed=True)  # the template's tokens after the end-of-turn token (context)
        stop = len(turn) - len(end)
        labels[start:stop] = ids[start:stop]
    return ids, labels


def warm_start(base: str | Path, out: str | Path, *, steps: int = 100, batch: int = 8, lr: float = 3e-3,
               seed: int = 0, max_operand: int = 99, log=print) -> Path:
    """Fine-tune `base` on tool_arith transcripts for `steps` steps; write the result into `out`."""
    base, out = Path(base).absolute(), Path(out).absolute()
    check_args(base, out, steps, batch, lr, seed, max_operand)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.envs import tool_schema
    from rl.episode_step import eos_ids
    from rl.episodes import ChatFormat
    from rl.run_dir import folder_in_place
    from rl.tool_task import calculator, tool_arith, transcript

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(base)
    fmt = ChatFormat(tok, [tool_schema(calculator, "calculator")], eos_ids(tok, base))
    rows = tool_arith(steps * batch, random.Random(f"{DATA_SEED_PREFIX}:{seed}"), max_operand=max_operand)
    data = [encode(fmt, transcript(r)) for r in rows]
    pad = tok.pad_token_id

    threads = torch.get_num_threads()
    # One thread: this model's matmuls gain nothing from a second one and lose much when the cores are shared
    # (0.25 s against 2.4 s per step on the loaded 2-core machine, 2026-12-07).
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        losses = []
        for step in range(steps):
            chunk = data[step * batch:(step + 1) * batch]
            width = max(len(ids) for ids, _ in chunk)
            input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in chunk])
            labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in chunk])
            mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in chunk])
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if step == 0 or (step + 1) % 10 == 0 or step + 1 == steps:
                log(f"warm start step {step + 1}/{steps}: loss {losses[-1]:.3f} (per assistant token), "
                    f"{time.monotonic() - t0:.0f} s")
    model.eval()
    torch.set_num_threads(threads)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    with folder_in_place(tmp, out):  # the folder appears whole or not at all
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        marker = dict(base=str(base), steps=steps, batch=batch, lr=lr, seed=seed, max_operand=max_operand,
                      data=f"tool_arith rows, random.Random('{DATA_SEED_PREFIX}:{seed}')", first_loss=losses[0],
                      last_loss=losses[-1], seconds=round(time.monotonic() - t0, 1))
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(Path(args.base), Path(args.out), args.steps, args.batch, args.lr, args.seed, args.max_operand)
    except ValueError as e:
        print(f"python -m rl.warm_start: error: {e}", file=sys.stderr)
        return 2
    out = warm_start(args.base, args.out, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                     max_operand=args.max_operand)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
