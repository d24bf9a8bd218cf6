"""`megamoe-rl train`: parse and validate the config, then hand it to the RL loop (rl/loop.py).

    megamoe-rl train --config configs/tiny.yaml                       # the CPU demo
    megamoe-rl train --config configs/tiny.yaml run.steps=5 rollout.n=4 --dry-run
    megamoe-rl train --config configs/tiny.yaml --reward my_pkg.rewards:judge
    megamoe-rl train --config configs/tiny.yaml --resume               # continue from the last checkpoint
    megamoe-rl train --help-config                                     # every config key: type, default, doc

Everything up to the loop (argument parsing, YAML, overrides, validation, reward loading, the dry
run, --help-config) imports neither torch nor vLLM nor Ray, so `--help` and `--dry-run` answer at once.

Exit status: 0 done; 2 refused before any work (a config, model, dataset or run-folder error, named
by its key; a fresh run refused this way leaves nothing in run.out_dir); 1 failed while running (an
actor raised or died: one paragraph in train.log and on the terminal says which, where, why, and
the command that continues the run); 130 interrupted (Ctrl-C; the last checkpoint stands).
"""

from __future__ import annotations

import argparse
import sys


def add_train_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="run the RL loop (GRPO) on Ray with vLLM rollouts and the FSDP2 trainer",
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides: dotted keys of the config tree, e.g. trainer.lr=3e-4 data.task=digit "
               "reward.functions.0.weight=0.5 (see --dry-run for the resolved tree)")
    p.add_argument("--config", help="YAML config (an instance of rl/config.py's tree)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides applied after --config")
    p.add_argument("--reward", action="append", metavar="SPEC", default=None,
                   help="reward function: a built-in name or pkg.module:function (repeatable; replaces "
                        "reward.functions, each with weight 1)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.add_argument("--resume", action="store_true", help="continue the run in run.out_dir from its last checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="delete an earlier run in run.out_dir first (only a folder that holds a run's config.yaml)")
    p.add_argument("--list-tasks", action="store_true", help="list the built-in tasks and exit")
    p.add_argument("--help-config", action="store_true",
                   help="list every config key with its type, default and one-line doc, and exit")
    p.set_defaults(handler=run_train, parser=p)


def resolve_config(args: argparse.Namespace):
    """Config from --config, overrides and --reward; ConfigError / RewardLoadError name the key."""
    from rl import config as C

    cfg = C.load(args.config, args.overrides)
    if args.reward:
        cfg.reward.functions = [C.RewardFnConfig(fn=spec) for spec in args.reward]
        C.validate(cfg)
    return cfg


def run_train(args: argparse.Namespace) -> int:
    from rl import config as C
    from rl.rewards import RewardLoadError, load_rewards
    from rl.tasks import TASK_REWARDS, TASKS, check_task

    if args.list_tasks:
        for name, fn in TASKS.items():
            print(f"{name}: rewards {TASK_REWARDS[name]}")
        return 0
    if args.help_config:
        sys.stdout.write(config_help())
        return 0
    try:
        cfg = resolve_config(args)
        if cfg.data.task is not None:
            check_task(cfg.data.task)
        rewards = load_rewards(cfg.reward)  # a reward that cannot load fails here, before any actor starts
        if cfg.eval.functions is not None:
            load_rewards(cfg.eval.reward_config(cfg.reward), "eval.functions")
    except (C.ConfigError, RewardLoadError, ValueError) as e:
        args.parser.error(str(e))
    if args.dry_run:
        sys.stdout.write(C.to_yaml(cfg))
        if cfg.trainer.gpus_per_rank > 0:  # a GPU config: its memory plan (rl/memory_plan.py), as YAML comments
            from rl.memory_plan import report

            sys.stdout.write("".join(f"# {line}\n" for line in report(cfg, None)[1].splitlines()))
        return 0
    if args.overwrite and args.resume:
        args.parser.error("--overwrite and --resume: choose one")
    from rl.data import DataError
    from rl.loop import train
    from rl.run_dir import RunDirError, remove_run
    try:
        if args.overwrite:
            remove_run(cfg)
        return train(cfg, resume=args.resume, command=start_command(args), rewards=rewards)
    except (RunDirError, DataError, C.ConfigError) as e:
        args.parser.error(str(e))


def config_help() -> str:
    """Every key of the config tree: `key: type (default: value)` and its doc on the next line."""
    import json

    from rl import config as C

    defaults: dict[str, object] = {}

    def walk(node, prefix):
        for k, v in node.items():
            defaults[prefix + k] = v
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")

    # model.make and eval.data are null by default; their own defaults are shown all the same
    walk(C.to_dict(C.Config(model=C.ModelConfig(make=C.MakeModelConfig()), eval=C.EvalConfig(data=C.DataConfig()))), "")
    defaults["model.make"] = defaults["eval.data"] = None
    lines = []
    for key, tp, doc in C.describe():
        default = defaults.get(key)
        shown = "" if isinstance(default, dict) else f" (default: {json.dumps(default)})"
        lines.append(f"{key}: {tp}{shown}\n    {doc}\n")
    return "".join(lines)


def start_command(args: argparse.Namespace) -> str:
    """This run's command line without --resume / --overwrite (a failed run names it, plus the flag
    that continues it)."""
    import shlex

    words = ["megamoe-rl", "train"] + (["--config", args.config] if args.config else []) + list(args.overrides)
    for spec in args.reward or ():
        words += ["--reward", spec]
    return shlex.join(words)
