"""The `megamoe-rl` command line itself (rl/cli.py): options and KEY=VALUE overrides in any order, and
`megamoe-rl eval`'s refusals (rl/eval_cmd.py), all before any engine, Ray or torch work.

    .venv/bin/python -m pytest -q tests/rl/test_cli.py

`megamoe-rl eval`'s flags on a real engine (--model, --run with --step and --latest, --config) are
tested on the e2e run of tests/rl/test_rl_loop.py (its `eval_cli` fixture).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rl import cli
from rl import config as C

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


# ---- options and overrides in any order -------------------------------------------------------

def _dry_run(capsys, *argv: str) -> str:
    assert cli.main(["train", *argv]) == 0
    return capsys.readouterr().out


def test_train_dry_run_resolves_the_same_config_wherever_the_overrides_stand(capsys):
    a = _dry_run(capsys, "--config", TINY, "--dry-run", "run.steps=2")
    b = _dry_run(capsys, "--config", TINY, "run.steps=2", "--dry-run")
    # Overrides on both sides of an option: plain parse_args refused the second group as
    # "unrecognized arguments" (it fills a nargs="*" positional once).
    c = _dry_run(capsys, "run.steps=2", "--config", TINY, "rollout.n=4", "--dry-run", "run.seed=3")
    d = _dry_run(capsys, "--config", TINY, "--dry-run", "run.steps=2", "rollout.n=4", "run.seed=3")
    assert a == b and c == d
    assert C.from_dict(yaml.safe_load(a)).run.steps == 2
    got = C.from_dict(yaml.safe_load(c))
    assert (got.run.steps, got.rollout.n, got.run.seed) == (2, 4, 3)


def _override_commands() -> dict:
    """Every subcommand parser that takes KEY=VALUE overrides, by name."""
    import argparse

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: p for name, p in sub.choices.items() if any(a.dest == "overrides" for a in p._actions)}


def test_every_command_with_overrides_takes_them_around_its_options():
    commands = _override_commands()
    assert {"train", "consistency", "eval"} <= set(commands), sorted(commands)
    parser = cli.build_parser()
    for name in commands:
        split = cli.parse(parser, [name, "a.b=1", "--config", "x.yaml", "c.d=2"])
        grouped = cli.parse(parser, [name, "--config", "x.yaml", "a.b=1", "c.d=2"])
        assert split.overrides == ["a.b=1", "c.d=2"] and split.config == "x.yaml", (name, split)
        assert vars(split) == vars(grouped), name
        assert split.command == name and callable(split.handler)


def test_eval_resolves_the_same_config_wherever_the_overrides_stand(tmp_path):
    from rl.eval_cmd import resolve

    parser = cli.build_parser()
    model = str(tmp_path / "m")
    one = cli.parse(parser, ["eval", "eval.n=2", "--config", TINY, "eval.data.task=digit", "--model", model,
                             "eval.pass_k=[1,2]"])
    two = cli.parse(parser, ["eval", "--config", TINY, "--model", model, "eval.n=2", "eval.data.task=digit",
                             "eval.pass_k=[1,2]"])
    (cfg1, targets1), (cfg2, targets2) = resolve(one), resolve(two)
    assert C.to_dict(cfg1) == C.to_dict(cfg2) and targets1 == targets2
    assert (cfg1.eval.n, cfg1.eval.pass_k, cfg1.eval.data.task) == (2, [1, 2], "digit")


def test_unknown_command_and_no_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["trian", "--config", TINY])
    assert e.value.code == 2 and "invalid choice: 'trian'" in capsys.readouterr().err
    assert cli.main([]) == 2


# ---- megamoe-rl eval: refused before any engine ------------------------------------------------

@pytest.fixture
def run_folder(tmp_path):
    """A run folder with a config.yaml (with an eval section) and no checkpoint."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(C.to_yaml(C.load(TINY, ["eval.data.task=digit"])))
    return run


def _refused(monkeypatch, capsys, *argv: str) -> str:
    import rl.eval_cmd

    def no_engine(*a, **k):
        raise AssertionError("reached the evaluation")

    monkeypatch.setattr(rl.eval_cmd, "evaluate", no_engine)
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("usage: megamoe-rl eval"), err
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv, says", [
    pytest.param([], "nothing to evaluate: give --model DIR and/or --run DIR", id="no-target"),
    pytest.param(["--step", "2"], "--step/--latest: name the run folder with --run", id="step-without-run"),
    pytest.param(["--latest"], "--step/--latest: name the run folder with --run", id="latest-without-run"),
    pytest.param(["--run", "{run}"], "--run: name its checkpoints with --step N (repeatable) or --latest",
                 id="run-without-step"),
    pytest.param(["--run", "{tmp}", "--latest"], "--run: expected a run folder with config.yaml", id="not-a-run"),
    pytest.param(["--run", "{run}", "--latest"], "has no checkpoint (", id="latest-of-no-checkpoint"),
    pytest.param(["--run", "{run}", "--step", "3"], "--step: {run} has no checkpoint of step 3", id="missing-step"),
    pytest.param(["--run", "{run}", "--step", "0"], "--step: expected a step number >= 1, got 0", id="step-0"),
    pytest.param(["--model", "{tmp}/nope", "eval.data.task=digit"], "--model: no such folder", id="missing-model"),
    pytest.param(["--model", "{tmp}"], "eval.data: expected an eval dataset", id="no-eval-data"),
    pytest.param(["--model", "{tmp}", "eval.data.task=digit", "eval.n=0"], "eval.n", id="bad-eval-key"),
    pytest.param(["--model", "{tmp}", "eval.data.task=digit", "--config", "{tmp}/none.yaml"], "none.yaml",
                 id="missing-config"),
    pytest.param(["--run", "{run}", "--latest", "eval.nn=2"], "unknown key 'eval.nn'", id="unknown-key-over-run"),
])
def test_eval_refuses_before_any_engine_naming_the_argument(monkeypatch, capsys, run_folder, argv, says):
    fill = {"run": str(run_folder), "tmp": str(run_folder.parent)}
    said = _refused(monkeypatch, capsys, *[a.format(**fill) for a in argv])
    assert says.format(**fill) in said, said


def test_eval_refuses_targets_of_two_architectures(tmp_path):
    from rl.eval_cmd import _check_same_architecture

    a, b = tmp_path / "a", tmp_path / "b"
    for folder, experts in ((a, 8), (b, 4)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": experts,
                                                         "torch_dtype": "float32"}))
    _check_same_architecture([a, a], ["a", "a again"])
    with pytest.raises(C.ConfigError, match=r"--model/--run: b differs from a in config.json \(\['num_experts'\]\)"):
        _check_same_architecture([a, b], ["a", "b"])
