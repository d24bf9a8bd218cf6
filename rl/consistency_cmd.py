"""`megamoe-rl consistency`: sampler vs trainer logprobs, per MoE implementation, per MoE layer and end to end.

    megamoe-rl consistency --config configs/tiny.yaml                                # fp32, every impl
    megamoe-rl consistency --config configs/tiny.yaml model.dtype=bfloat16 --prompts 8
    megamoe-rl consistency --config configs/tiny.yaml --impls megamoe,stock --out runs/cons

Generates completions once, scores them on the sampler side (vLLM, processed logprobs) and the
trainer side with every implementation, feeds every MoE layer of both sides the same hidden
states, and writes a console table, <out>/consistency.json, <out>/dlogp_hist.png and
<out>/layers.png (rl/consistency.py; the metrics are rl/metrics.py's, the ones `train` logs).
vLLM's own log goes to <out>/vllm.log; its warnings also reach the terminal, once each.
The config's model, rollout (temperature, max_tokens, max_model_len, KV cache), data and run.seed
sections are used; bad input (implementation names, a checkpoint either side cannot load, prompts
longer than the context) is reported before any engine starts. Parsing imports no torch or vLLM.
"""

from __future__ import annotations

import argparse


def add_consistency_parser(subparsers) -> None:
    from rl.consistency import DEFAULT_IMPLS
    from megamoe.contract import HOST_IMPLS as MOE_IMPLS

    p = subparsers.add_parser(
        "consistency", help="compare sampler and trainer logprobs per MoE implementation, per layer and end to end",
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides: dotted keys of the config tree, e.g. model.dtype=bfloat16 rollout.max_tokens=8")
    p.add_argument("--config", help="YAML config (an instance of rl/config.py's tree); its model section is used")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides applied after --config")
    p.add_argument("--prompts", type=int, default=None, help="prompts to generate from (default run.prompts_per_step)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default rollout.n)")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"comma-separated implementations from {','.join(MOE_IMPLS)}; the first generates "
                        "(default %(default)s)")
    p.add_argument("--out", default=None, help="output folder (default <run.out_dir>/consistency)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="trainer-side device (default %(default)s: cuda when available)")
    p.set_defaults(handler=run_consistency, parser=p)


def run_consistency(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from rl import config as C
    from rl.consistency import ConsistencyError, format_table, parse_impls, prepare, run, write_outputs
    from rl.data import DataError
    from rl.logs import vllm_logs_to

    try:
        impls = parse_impls(args.impls)
        cfg = C.load(args.config, args.overrides)
    except (C.ConfigError, ConsistencyError) as e:
        args.parser.error(str(e))
    out_dir = Path(args.out if args.out is not None else Path(cfg.run.out_dir) / "consistency").absolute()
    existed = out_dir.exists()
    # vLLM's INFO lines (engine configs, loading, shutdown: ~150 for three engines) go to
    # <out>/vllm.log; its warnings reach the terminal once each (rl/logs.py).
    with vllm_logs_to(out_dir) as vllm_log:
        try:
            plan = prepare(cfg, impls=impls, prompts=args.prompts, n=args.n, out_dir=out_dir, device=args.device,
                           config_path=args.config)
        except (C.ConfigError, ConsistencyError, DataError) as e:
            if not existed:  # refused input leaves no folder behind
                shutil.rmtree(out_dir, ignore_errors=True)
            args.parser.error(str(e))
        report = run(plan)
    paths = write_outputs(report, plan.out_dir)
    print(format_table(report))
    for name, path in {**paths, "vllm log": vllm_log}.items():
        print(f"{name}: {path}")
    return 0
