"""The `megamoe-rl` command line.

    megamoe-rl --help
    megamoe-rl make-model --out runs/tiny [--arch qwen3_moe|mixtral|olmoe|deepseek_v3|gpt_oss] [--layers 2] [--hidden 64]
                          [--experts 8] [--topk 2] [--intermediate 32] [--vocab 512] [--seed 0]
                          [--overwrite]

Subcommands live in the SUBCOMMANDS registry below: name -> "module:add_<name>_parser". Each
`add_<name>_parser(subparsers)` adds its parser and sets `handler=<function(args) -> int>` as a
default; `main` parses and calls the handler. Adding a subcommand, e.g. `train` in rl/loop.py:

    def add_train_parser(subparsers):                      # in rl/loop.py
        p = subparsers.add_parser("train", help="run the RL loop")
        p.set_defaults(handler=run_train)                  # run_train(args) -> exit code

    "train": "rl.loop:add_train_parser",                   # one line in SUBCOMMANDS

Every registered module is imported to build `--help`, so it must keep torch, vLLM, Ray and
transformers imports inside its handler: `megamoe-rl --help` stays instant, and
tests/rl/test_make_model.py checks that it imports no torch. A handler reports a bad argument with
`args.parser.error(message)` (usage + message, exit status 2) before doing any work. Exit status:
0 done, 2 refused before any work, 1 failed while running, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, str] = {
    "make-model": "rl.cli:add_make_model_parser",
    "train": "rl.train_cmd:add_train_parser",
    "consistency": "rl.consistency_cmd:add_consistency_parser",
    "export": "rl.export_cmd:add_export_parser",
    "eval": "rl.eval_cmd:add_eval_parser",
    "divergence": "rl.divergence_cmd:add_divergence_parser",
    "doctor": "rl.doctor:add_doctor_parser",
}


def add_make_model_parser(subparsers) -> None:
    from rl import make_model as mm  # light: its heavy imports sit inside make_model()

    p = subparsers.add_parser(
        "make-model", help="write a tiny random-init MoE checkpoint + tokenizer (offline, seeded)",
        description=mm.__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory to create (new or empty)")
    p.add_argument("--arch", default="qwen3_moe", choices=mm.ARCHS, help="default %(default)s")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default %(default)s)")
    p.add_argument("--hidden", type=int, default=64,
                   help=f"hidden size H, a multiple of {mm.HIDDEN_MULTIPLE} for vLLM CPU; sets the "
                        "head layout (default %(default)s)")
    p.add_argument("--experts", type=int, default=8, help="experts E per layer (default %(default)s)")
    p.add_argument("--topk", type=int, default=2, help="experts k per token (default %(default)s)")
    p.add_argument("--intermediate", type=int, default=32,
                   help="expert intermediate size I (default %(default)s)")
    p.add_argument("--vocab", type=int, default=None,
                   help=f"tokenizer and embedding size in [{mm.MIN_VOCAB}, {mm.MAX_VOCAB}] "
                        f"(default {mm.DEFAULT_VOCAB})")
    p.add_argument("--seed", type=int, default=0, help="weight init seed (default %(default)s)")
    p.add_argument("--heads", type=int, default=None, help="query heads (with --kv-heads and --head-dim; "
                                                          "default: derived from --hidden)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads, a divisor of --heads")
    p.add_argument("--head-dim", type=int, default=None, help=f"head size, one of {mm.HEAD_DIMS}")
    p.add_argument("--dtype", default="float32", choices=mm.DTYPES, help="weights' dtype (default %(default)s)")
    p.add_argument("--device", default="cpu", choices=mm.DEVICES,
                   help="where the weights are drawn (default %(default)s); cuda takes seconds where the CPU takes "
                        "minutes for large models, and draws other weights than cpu for the same seed")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier make-model output in --out")
    p.set_defaults(handler=run_make_model, parser=p)


def run_make_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rl import make_model as mm
    from rl.memory_plan import check_host_memory

    sizes = dict(arch=args.arch, layers=args.layers, hidden=args.hidden, experts=args.experts,
                 topk=args.topk, intermediate=args.intermediate, vocab=args.vocab, seed=args.seed,
                 heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    try:
        mm.check_args(**sizes)
        mm.check_device(args.device)
        check_host_memory(**sizes)
        mm.check_out_dir(Path(args.out).absolute(), args.overwrite)
    except ValueError as e:
        args.parser.error(str(e))
    out = mm.make_model(args.out, **sizes, overwrite=args.overwrite, device=args.device)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megamoe-rl", description="RL post-training of MoE models with one fused, trainable "
                                       "MoE kernel shared by the vLLM sampler and the trainer.")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name, target in SUBCOMMANDS.items():
        module, _, func = target.partition(":")
        getattr(importlib.import_module(module), func)(subparsers)
        if name not in subparsers.choices:
            raise RuntimeError(f"SUBCOMMANDS[{name!r}]: {target} did not add a parser named {name!r}")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command's arguments, its options and KEY=VALUE positionals in any order.

    A subcommand's parser reads its words with parse_intermixed_args: plain parse_args fills a
    `nargs="*"` positional once, at the first positional word, so `train --config X --dry-run k=v`
    would refuse `k=v` as unrecognized while `train --config X k=v --dry-run` works. The top-level
    parser holds the subparsers (which parse_intermixed_args refuses); it takes only -h before the
    command, so the first word names the command."""
    if argv and not argv[0].startswith("-"):
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if argv[0] in subparsers.choices:
            args = subparsers.choices[argv[0]].parse_intermixed_args(argv[1:])
            args.command = argv[0]
            return args
    return parser.parse_args(argv)  # -h, no command, or an unknown one (argparse names the choices)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C outside a handler's own handling (a train run handles it itself)
        print(f"megamoe-rl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
