"""`megamoe-rl eval`: evaluate a policy on the `eval` section's dataset with vLLM alone (no trainer, no Ray).

    megamoe-rl eval --model policy/ eval.data.task=digit eval.n=8 eval.pass_k=[1,4]
    megamoe-rl eval --run runs/tiny --latest                      # the run's config.yaml and eval section
    megamoe-rl eval --run runs/tiny --step 10 --step 20 --model runs/tiny/final --out report.json \
                    --samples-out samples.jsonl --moe-impl reference

Targets: every --model (an exported policy folder, `megamoe-rl export`'s output or a run's final/,
or any local Hugging Face MoE checkpoint the rollout hook serves) and every checkpoint of --run named
by --step / --latest (exported to a temporary folder with rl/export.py, then evaluated). One vLLM
engine (rollout.worker.RolloutWorker, in this process) starts on the first target; the others are
loaded into it in place (RolloutWorker.update_weights), so they must share its architecture.

The config: the run's config.yaml with --run, else --config, else the defaults; KEY=VALUE overrides
after it; eval.every is ignored. rollout.max_model_len / kv_cache_bytes / engine_kwargs, model.dtype
and run.seed shape the engine and the seeds (rl/evaluation.py: the same seeds as the run's own
evaluations, so a checkpoint evaluated here gives the eval/* metrics its run logged at that step). With an
`env` section every sample is a multi-turn episode, one engine call per turn (docs/MULTI_TURN.md).

Writes: the JSON report (--out, default eval_report.json: the targets with their eval/* metrics, the
eval section, moe_impl), a table on stdout, and with --samples-out every completion with its rewards
(JSONL, one line per sample: target, step, prompt, completion, reward, rewards, correct). Exit 2:
refused before any engine starts (a key, a folder or a checkpoint named); 1: failed while running.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megamoe.contract import HOST_IMPLS


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="evaluate an exported policy, a run's checkpoint or a local HF MoE checkpoint with vLLM",
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides: dotted keys of the config tree, e.g. eval.data.task=digit eval.n=8 eval.pass_k=[1,4]")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of the config")
    p.add_argument("--model", action="append", default=[], metavar="DIR",
                   help="a Hugging Face MoE checkpoint folder to evaluate (repeatable)")
    p.add_argument("--run", default=None, help="a run folder (run.out_dir of megamoe-rl train)")
    p.add_argument("--step", type=int, action="append", default=[], help="a checkpoint step of --run (repeatable)")
    p.add_argument("--latest", action="store_true", help="the latest checkpoint of --run")
    p.add_argument("--config", default=None, help="YAML config (default: --run's config.yaml, else the defaults)")
    p.add_argument("--moe-impl", choices=HOST_IMPLS, default=None,
                   help="MoE implementation inside vLLM (default: rollout.moe_impl)")
    p.add_argument("--out", default="eval_report.json", help="JSON report path (default %(default)s)")
    p.add_argument("--samples-out", default=None, help="write every completion with its rewards here (JSONL)")
    p.set_defaults(handler=run_eval, parser=p)


def resolve(args: argparse.Namespace):
    """(config, targets [(label, folder or None, run checkpoint step or None)]); ConfigError / ValueError
    naming the argument or key, before anything heavy starts."""
    from rl import config as C

    if (args.step or args.latest) and args.run is None:
        raise C.ConfigError("--step/--latest: name the run folder with --run")
    if args.run is not None and not (args.step or args.latest):
        raise C.ConfigError("--run: name its checkpoints with --step N (repeatable) or --latest")
    if not args.model and args.run is None:
        raise C.ConfigError("nothing to evaluate: give --model DIR and/or --run DIR with --step N / --latest")
    overrides = list(args.overrides)
    config = args.config
    if config is None and args.run is not None:
        config = Path(args.run) / "config.yaml"
        if not config.is_file():
            raise C.ConfigError(f"--run: expected a run folder with config.yaml, got {args.run!r}")
    if config is None:
        # The defaults: the sections the evaluation reads are checked (a run's `data` is not one of them).
        data: dict = {}
        for o in overrides:
            C.apply_override(data, o)
        cfg = C.from_dict(data)
        for name in ("rollout", "run", "eval", "env"):
            getattr(cfg, name).validate(name)
        C.check_env(cfg)
    else:
        cfg = C.load(config, overrides)
    if cfg.eval.data is None:
        raise C.ConfigError("eval.data: expected an eval dataset (e.g. eval.data.task=digit or eval.data.path=FILE), "
                            "got null")
    if args.moe_impl is not None:
        cfg.rollout.moe_impl = args.moe_impl
    targets = [(str(Path(m).absolute()), Path(m).absolute(), None) for m in args.model]
    if args.run is not None:
        from rl.export import resolve_checkpoint

        run = Path(args.run).absolute()
        steps = list(args.step) + ([None] if args.latest else [])
        for s in steps:
            step, _ = resolve_checkpoint(run, s)
            targets.append((f"{run} step {step}", None, step))
    return cfg, targets


def run_eval(args: argparse.Namespace) -> int:
    from rl import config as C
    from rl.data import DataError
    from rl.envs import EnvError
    from rl.export import ExportError
    from rl.rewards import RewardLoadError

    try:
        cfg, targets = resolve(args)
        from rl.base_model import check_model
        for label, folder, _ in targets:
            if folder is not None:
                check_model(folder, key="--model")
    except (C.ConfigError, ExportError, RewardLoadError, DataError) as e:
        args.parser.error(str(e))
    try:
        return evaluate(args, cfg, targets)
    except (C.ConfigError, ExportError, RewardLoadError, DataError, EnvError) as e:
        args.parser.error(str(e))


def evaluate(args: argparse.Namespace, cfg, targets: list) -> int:
    import tempfile

    from transformers import AutoTokenizer

    from rl.evaluation import Evaluator, summary_table
    from rl.export import export_policy

    with tempfile.TemporaryDirectory(prefix="megamoe-eval-") as tmp:
        folders = []
        for label, folder, step in targets:
            if folder is None:
                folder = export_policy(args.run, Path(tmp) / f"step_{step}", step=step)
            folders.append(folder)
        _check_same_architecture(folders, [t[0] for t in targets])
        tokenizer = AutoTokenizer.from_pretrained(folders[0])
        episodes = None
        if cfg.env.enabled:  # multi-turn episodes (docs/MULTI_TURN.md): the environment and template checked here
            from rl.episode_step import EpisodeStep

            episodes = EpisodeStep(cfg, tokenizer, folders[0])
        evaluator = Evaluator(cfg, tokenizer, episodes=episodes)  # every refusal of the eval section before the engine starts
        from rollout.worker import RolloutWorker

        r = cfg.rollout
        worker = RolloutWorker(str(folders[0]), cfg.rollout.moe_impl, dtype=cfg.model.dtype, seed=cfg.run.seed,
                               max_model_len=r.max_model_len, kv_cache_memory_bytes=r.kv_cache_bytes,
                               numerics=cfg.run.numerics, **r.engine_kwargs)
        results, all_rows = [], []
        try:
            for i, ((label, _, step), folder) in enumerate(zip(targets, folders)):
                if i > 0:
                    worker.update_weights(_read_weights(folder))
                step = step if step is not None else _export_step(folder)
                version = step or 0  # the checkpoint's step counts the train steps that made its weights
                metrics, rows = evaluator.run(lambda p, s, n, m=None: worker.generate(p, n, s, policy_version=version,
                                                                                      max_tokens=m), version)
                results.append({"target": label, "step": step, "metrics": metrics})
                all_rows += [{"target": label, **row} for row in rows]
        finally:
            worker.close()
    from trainer.config import to_plain

    report = {"targets": results, "moe_impl": cfg.rollout.moe_impl, "eval": to_plain(cfg.eval)}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.samples_out:
        Path(args.samples_out).write_text("".join(json.dumps(r) + "\n" for r in all_rows))
    for res in results:
        print(f"== {res['target']}" + (f" (step {res['step']})" if res["step"] is not None else ""))
        print(summary_table(res["metrics"]))
    print(f"report: {Path(args.out).absolute()}", file=sys.stderr)
    return 0


def _check_same_architecture(folders: list[Path], labels: list[str]) -> None:
    """Later targets are loaded into the first one's engine: same config.json but for the dtype."""
    from rl.config import ConfigError

    def arch(folder: Path) -> dict:
        c = json.loads((Path(folder) / "config.json").read_text())
        return {k: v for k, v in c.items() if k not in ("dtype", "torch_dtype", "transformers_version")}

    first = arch(folders[0])
    for folder, label in zip(folders[1:], labels[1:]):
        diff = sorted(k for k in set(first) | set(arch(folder)) if first.get(k) != arch(folder).get(k))
        if diff:
            raise ConfigError(f"--model/--run: {label} differs from {labels[0]} in config.json ({diff}); one engine "
                              "evaluates models of one architecture: evaluate it in a separate call")


def _read_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _export_step(folder: Path) -> int | None:
    """The run step an exported policy came from (megamoe_export.json), None for any other checkpoint."""
    from rl.export import PROVENANCE

    p = Path(folder) / PROVENANCE
    return json.loads(p.read_text()).get("step") if p.is_file() else None
