"""`megamoe-rl export`: a run's trained policy as a Hugging Face checkpoint folder (rl/export.py).

    megamoe-rl export --run runs/tiny --out policy/                   # the latest checkpoint
    megamoe-rl export --run runs/tiny --step 20 --out policy-20/ --dtype bfloat16
    vllm serve policy/          # or AutoModelForCausalLM.from_pretrained("policy/")

Every check (the run folder, the checkpoint, --out, the tensors against the base model) runs before
anything is written; a refused export exits with status 2 and a message naming what is wrong.
"""

from __future__ import annotations

import argparse

from rl.export import DTYPES


def add_export_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a run's policy as a Hugging Face checkpoint (transformers, vLLM, the Hub)",
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the run folder (run.out_dir of megamoe-rl train)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="the checkpoint of this step")
    which.add_argument("--latest", action="store_true", help="the latest checkpoint (the default)")
    p.add_argument("--out", required=True, help="a new (or empty) folder to write")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of the written weights (default: the base model's)")
    p.set_defaults(handler=run_export, parser=p)


def run_export(args: argparse.Namespace) -> int:
    from rl.export import ExportError, export_policy

    try:
        out = export_policy(args.run, args.out, step=args.step, dtype=args.dtype)
    except ExportError as e:
        args.parser.error(str(e))
    print(out)
    return 0
