"""`megamoe-rl divergence`: where the sampler and the trainer part, op by op (rl/divergence.py).

    megamoe-rl divergence --model runs/tiny-model [--prompts 4] [--max-tokens 4] [--numerics bitwise]
                          [--json report.json]

Starts its own vLLM engine on the model and runs the trainer's model in this process; prints, per
op of every decoder layer, whether both sides' activations are bitwise equal, and the first op where
they part (docs/BITWISE.md). Every argument is checked before anything starts (exit status 2).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from megamoe.contract import FAST, NUMERICS  # standard library only at import time

DEFAULT_PROMPT_COUNT = 4  # rl.divergence.DEFAULT_PROMPTS (checked in tests/rl/test_divergence.py)


def add_divergence_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "divergence", help="find the first op where the sampler's and the trainer's activations differ",
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint folder (e.g. megamoe-rl make-model)")
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPT_COUNT,
                   help=f"how many of the built-in prompts, 1..{DEFAULT_PROMPT_COUNT} (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens sampled per prompt, the decode view (default %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampler's temperature, > 0 (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numerics", choices=NUMERICS, default=FAST,
                   help="both sides' ops outside the MoE, as run.numerics (default %(default)s)")
    p.add_argument("--json", help="also write the report here")
    p.set_defaults(handler=run_divergence, parser=p)


def check_args(args: argparse.Namespace) -> None:
    """Refuse a bad argument before any work, naming it and what it expects."""
    if not (Path(args.model) / "config.json").is_file():
        args.parser.error(f"--model: expected a Hugging Face checkpoint folder with a config.json, got {args.model!r}")
    if not 1 <= args.prompts <= DEFAULT_PROMPT_COUNT:
        args.parser.error(f"--prompts: expected 1..{DEFAULT_PROMPT_COUNT}, got {args.prompts}")
    if args.max_tokens < 1:
        args.parser.error(f"--max-tokens: expected an int >= 1, got {args.max_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        args.parser.error(f"--temperature: expected a finite number > 0, got {args.temperature}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        args.parser.error(f"--json: expected a path in an existing folder, got {args.json!r}")


def run_divergence(args: argparse.Namespace) -> int:
    check_args(args)
    import json

    from rl.divergence import DEFAULT_PROMPTS, format_report, measure

    report = measure(args.model, prompts=DEFAULT_PROMPTS[:args.prompts], max_tokens=args.max_tokens,
                     temperature=args.temperature, seed=args.seed, numerics=args.numerics)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
