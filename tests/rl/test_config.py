"""The typed config tree (rl/config.py) and the `train` CLI's config handling.

    .venv/bin/python -m pytest -q tests/rl/test_config.py
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rl import config as C

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_folder_is_not_empty():
    names = {p.name for p in CONFIGS}
    assert "tiny.yaml" in names and len(names) >= 3, names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_file_loads(path):
    cfg = C.load(path)
    assert isinstance(cfg, C.Config)
    # A file is an instance of the tree: dumping and reloading gives the same config.
    assert C.from_dict(yaml.safe_load(C.to_yaml(cfg))) == cfg
    # Each file documents the hardware it needs in a comment.
    assert "hardware" in path.read_text().lower(), f"{path.name}: say the hardware it needs in a comment"
    # ... and whether and where it has run (benchmarks/RESULTS.md the evidence), so none implies a run it never had.
    assert "# has run:" in path.read_text().lower(), f"{path.name}: say in a '# Has run:' comment where it has run"


def test_every_field_has_a_doc():
    rows = C.describe()
    assert len(rows) > 50
    undocumented = [key for key, _, doc in rows if len(doc) < 8]
    assert not undocumented, undocumented


def test_unknown_key_names_it_and_suggests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {make: {}}\ndata: {task: digit}\nrollout: {temprature: 0.7}\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    msg = str(e.value)
    assert "rollout.temprature" in msg and "'temperature'" in msg and str(p) in msg


def test_unknown_section_and_misplaced_key():
    with pytest.raises(C.ConfigError, match=r"unknown key 'trainr'.*did you mean 'trainer'"):
        C.from_dict({"trainr": {}})
    with pytest.raises(C.ConfigError, match=r"'rollout.lr'.*it exists as trainer.lr"):
        C.load(None, ["rollout.lr=1e-3"])


@pytest.mark.parametrize("override, fragment", [
    pytest.param("rollout.n=two", "rollout.n: expected an int, got 'two'", id="int"),
    pytest.param("rollout.top_p=1.5", "rollout.top_p: expected a float in (0, 1], got 1.5", id="range"),
    pytest.param("rollout.moe_impl=megamo", "did you mean 'megamoe'", id="literal"),
    pytest.param("run.progress=maybe", "run.progress: expected a bool", id="bool"),
    pytest.param("trainer.is_correction=tis2", "trainer.is_correction: expected one of", id="choice"),
    pytest.param("reward.functions.5.fn=x", "reward.functions is a list of 2 item(s)", id="index"),
    pytest.param("run.steps", "expected key=value", id="no-equals"),
    pytest.param("trainer.lr=inf", "trainer.lr: expected a finite float, got inf", id="inf"),
    pytest.param("rollout.temperature=-inf", "rollout.temperature: expected a finite float", id="-inf"),
    pytest.param("trainer.grad_clip=nan", "trainer.grad_clip: expected a finite float", id="nan"),
])
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(C.ConfigError) as e:
        C.load(ROOT / "configs" / "tiny.yaml", [override])
    assert fragment in str(e.value)


def test_overrides_convert_types():
    cfg = C.load(ROOT / "configs" / "tiny.yaml", [
        "trainer.lr=3e-4", "rollout.n=3", "run.progress=false", "run.out_dir=007",
        "reward.functions.1.weight=0.25", "trainer.clip_eps_high=null", "data.task_kwargs={length: 4}",
        "model.make.layers=3", "ray.env.FOO=1"])
    assert cfg.trainer.lr == 3e-4 and isinstance(cfg.trainer.lr, float)
    assert cfg.rollout.n == 3 and cfg.run.progress is False
    assert cfg.run.out_dir == "007"  # a string field keeps the text as written
    assert cfg.reward.functions[1].weight == 0.25 and cfg.reward.functions[0].weight == 0.5
    assert cfg.trainer.clip_eps_high is None
    assert cfg.data.task_kwargs == {"length": 4}
    assert cfg.model.make.layers == 3 and cfg.model.make.hidden == 64
    assert cfg.ray.env == {"FOO": "1"}


def test_override_into_unset_optional_section():
    cfg = C.load(None, ["model.make.hidden=96", "data.task=digit"])
    assert cfg.model.make == C.MakeModelConfig(hidden=96)


def test_int_accepted_for_float_but_not_the_reverse():
    assert C.load(None, ["model.make.seed=1", "data.task=digit", "trainer.lr=1"]).trainer.lr == 1.0
    with pytest.raises(C.ConfigError, match="rollout.max_tokens: expected an int, got 1.5"):
        C.load(None, ["model.make.seed=1", "data.task=digit", "rollout.max_tokens=1.5"])


def test_cross_field_checks():
    base = ["data.task=digit"]
    with pytest.raises(C.ConfigError, match="exactly one of model.path and model.make"):
        C.load(None, base)
    with pytest.raises(C.ConfigError, match="exactly one of data.task and data.path"):
        C.load(None, ["model.path=/x", "data.task=digit", "data.path=/y"])
    with pytest.raises(C.ConfigError, match="trainer.max_seq_len"):
        C.load(None, base + ["model.path=/x", "rollout.max_tokens=600", "rollout.max_model_len=1000"])
    with pytest.raises(C.ConfigError, match="data.columns: unknown role 'promt'.*did you mean 'prompt'"):
        C.load(None, base + ["model.path=/x", "data.columns={promt: q}"])
    with pytest.raises(C.ConfigError, match="model.make.topk"):
        C.load(None, base + ["model.make.topk=9"])


def test_one_sample_per_prompt_is_refused_with_the_reason():
    # The group-relative advantage of a group of one is 0 for every sample: the run would learn nothing.
    for n in (1, 0):
        with pytest.raises(C.ConfigError, match=r"rollout.n: expected an int >= 2 \(the GRPO advantage .* every "
                                                r"advantage is 0 .*\), got " + str(n)):
            C.load(ROOT / "configs" / "tiny.yaml", [f"rollout.n={n}"])
    assert C.load(ROOT / "configs" / "tiny.yaml", ["rollout.n=2"]).rollout.n == 2


def test_the_trainer_section_is_the_trainers_own_config():
    from trainer.config import TrainerConfig, TrainerSettings

    cfg = C.load(ROOT / "configs" / "tiny.yaml", ["trainer.minibatches=2", "trainer.lr_schedule=cosine",
                                                  "trainer.total_steps=20", "trainer.adam_beta2=0.95"])
    assert type(cfg.trainer) is TrainerConfig
    assert (cfg.trainer.minibatches, cfg.trainer.lr_schedule, cfg.trainer.adam_beta2) == (2, "cosine", 0.95)
    keys = {key for key, _, _ in C.describe()}
    assert {f"trainer.{f.name}" for f in dataclasses.fields(TrainerSettings)} <= keys
    # the trainer's own checks name the key in the run config's terms
    with pytest.raises(C.ConfigError, match=r"trainer.total_steps: expected an int > trainer.warmup_steps \(0\)"):
        C.load(ROOT / "configs" / "tiny.yaml", ["trainer.lr_schedule=cosine"])
    with pytest.raises(C.ConfigError, match="trainer.adam_beta1: expected a float in"):
        C.load(ROOT / "configs" / "tiny.yaml", ["trainer.adam_beta1=1.0"])
    with pytest.raises(C.ConfigError, match="trainer.fsdp: expected true with trainer.world_size=2"):
        C.load(ROOT / "configs" / "tiny.yaml", ["trainer.fsdp=false", "trainer.world_size=2"])


def test_a_rank_gets_the_section_and_three_values_of_other_sections():
    cfg = C.load(ROOT / "configs" / "tiny.yaml", ["rollout.temperature=0.7", "run.seed=5", "trainer.minibatches=3"])
    w = C.trainer_worker_config(cfg)
    assert (w.temperature, w.dtype, w.seed, w.minibatches) == (0.7, cfg.model.dtype, 5, 3)
    # they are set there, once: the trainer section has no such keys and says where they live
    for key, home in (("temperature", "rollout.temperature"), ("dtype", "model.dtype"), ("seed", "run.seed")):
        with pytest.raises(C.ConfigError, match=rf"unknown key 'trainer.{key}'.*it exists as .*{home}"):
            C.load(ROOT / "configs" / "tiny.yaml", [f"trainer.{key}=1"])


@pytest.mark.parametrize("how", ["file", "override"])
def test_trainer_extra_is_gone_and_the_error_names_the_key_to_use(tmp_path, how):
    text = (ROOT / "configs" / "tiny.yaml").read_text()
    if how == "file":
        p = tmp_path / "old.yaml"
        p.write_text(text.replace("trainer:\n", "trainer:\n  extra: {activation_checkpointing: true, temperature: 0.5}\n", 1))
        assert "extra:" in p.read_text()
        args = (p, [])
    else:
        args = (ROOT / "configs" / "tiny.yaml", ["trainer.extra.activation_checkpointing=true"])
    with pytest.raises(C.ConfigError) as e:
        C.load(*args)
    msg = str(e.value)
    assert "trainer.extra: removed" in msg and "trainer.activation_checkpointing: True" in msg, msg
    if how == "file":
        assert "it exists as rollout.temperature" in msg, msg


def test_an_empty_trainer_extra_of_an_older_runs_config_yaml_still_loads():
    data = yaml.safe_load(C.to_yaml(C.load(ROOT / "configs" / "tiny.yaml")))
    data["trainer"]["extra"] = {}
    assert C.from_dict(data) == C.from_dict({**data, "trainer": {k: v for k, v in data["trainer"].items()
                                                                  if k != "extra"}})


def test_help_config_lists_every_key_with_its_default_without_heavy_imports():
    proc = _run_cli("train", "--help-config")
    res = _result(proc)
    assert res["rc"] == 0 and res["heavy"] == [], (res, proc.stderr)
    listed = [ln.split(":", 1)[0] for ln in proc.stdout.splitlines() if ln and not ln.startswith((" ", "RESULT "))]
    assert listed == [key for key, _, _ in C.describe()]
    assert "trainer.activation_checkpointing: a bool (true/false) (default: false)\n    recompute" in proc.stdout
    assert "trainer.moe_impl: one of 'megamoe', 'reference', 'stock' (default: \"megamoe\")" in proc.stdout


def test_defaults_are_independent_instances():
    a, b = C.Config(), C.Config()
    a.reward.functions.append(C.RewardFnConfig(fn="numeric"))
    assert len(b.reward.functions) == 1
    assert dataclasses.asdict(C.Config()) == dataclasses.asdict(b)


def _run_cli(*args, code: str = "") -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter and report which heavy modules it imported."""
    prog = (
        "import sys, json\n"
        "from rl.cli import main\n"
        "try:\n"
        f"    rc = main({list(args)!r})\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'ray', 'transformers') if m in sys.modules)\n"
        "print('RESULT ' + json.dumps({'rc': rc, 'heavy': heavy}))\n")
    return subprocess.run([sys.executable, "-c", prog], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _result(proc) -> dict:
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    return json.loads(line[-1][len("RESULT "):])


def test_train_help_imports_nothing_heavy():
    proc = _run_cli("train", "--help")
    res = _result(proc)
    assert res["rc"] == 0 and res["heavy"] == [], res
    assert "--dry-run" in proc.stdout and "--resume" in proc.stdout and "--reward" in proc.stdout


def test_dry_run_prints_the_resolved_config_without_heavy_imports():
    proc = _run_cli("train", "--config", "configs/tiny.yaml", "rollout.n=3", "--reward", "numeric", "--dry-run")
    res = _result(proc)
    assert res["rc"] == 0 and res["heavy"] == [], (res, proc.stderr)
    text = proc.stdout.split("RESULT ")[0]
    cfg = C.from_dict(yaml.safe_load(text))
    assert cfg.rollout.n == 3
    assert [f.fn for f in cfg.reward.functions] == ["numeric"]


def test_cli_config_error_exits_2_with_the_key():
    proc = _run_cli("train", "--config", "configs/tiny.yaml", "rollout.temprature=0.5", "--dry-run")
    assert _result(proc)["rc"] == 2
    assert "rollout.temprature" in proc.stderr and "did you mean 'temperature'" in proc.stderr


def test_cli_reward_load_error_exits_2_before_any_work(tmp_path):
    proc = _run_cli("train", "--config", "configs/tiny.yaml", "--reward", "no_such_module_xyz:f",
                    f"run.out_dir={tmp_path / 'run'}")
    res = _result(proc)
    assert res["rc"] == 2 and res["heavy"] == [], res
    assert "reward.functions.0.fn" in proc.stderr and "no_such_module_xyz" in proc.stderr
    assert not (tmp_path / "run").exists()


# `megamoe-rl train --help` through the console script: 0.07 s measured (2026-12-05, the 2-core machine
# with other jobs at load ~4); `import torch` alone takes 1.4 s there, so a help that imported it (or
# vLLM, Ray, transformers) would not answer within this.
HELP_WALL_S = 1.0


def test_console_script_help_is_fast():
    import time

    exe = Path(sys.executable).with_name("megamoe-rl")
    if not exe.exists():
        pytest.skip(f"console script not installed next to {sys.executable} (pip install -e .)")
    t0 = time.monotonic()
    proc = subprocess.run([str(exe), "train", "--help"], capture_output=True, text=True, timeout=60)
    wall = time.monotonic() - t0
    assert proc.returncode == 0 and "megamoe-rl train" in proc.stdout
    assert wall < HELP_WALL_S, f"`megamoe-rl train --help` took {wall:.2f} s (bound {HELP_WALL_S} s)"


def test_async_refusals_name_the_key():
    """run.max_async_steps: k < 0 and k >= run.steps are refused when the config loads (the CLI loads
    it before Ray starts); everything on-policy allows loads at k >= 1 as well (docs/ASYNC.md)."""
    tiny = ROOT / "configs" / "tiny.yaml"
    for k in (-1, 10, 11):
        with pytest.raises(C.ConfigError, match=rf"run.max_async_steps: expected an int in \[0, run.steps=10\).*"
                                                rf"got {k}$"):
            C.load(tiny, ["run.steps=10", f"run.max_async_steps={k}"])
    assert C.load(tiny, ["run.steps=10", "run.max_async_steps=9"]).run.max_async_steps == 9
    gpu = ["rollout.gpus_per_worker=1", "trainer.gpus_per_rank=1"]
    nccl = gpu + ["ray.placement=disaggregated", "rollout.weight_sync=nccl"]
    ipc = ["rollout.gpus_per_worker=0.5", "trainer.gpus_per_rank=0.5", "rollout.weight_sync=ipc"]
    for keys in (gpu + ["rollout.sleep_level=1"], nccl, ipc, ["eval.every=2", "eval.data.task=digit"],
                 ["data.dynamic_sampling=true"], gpu + ["rollout.weight_sync=files"]):
        on_policy = C.load(tiny, keys)
        lagged = C.load(tiny, keys + ["run.max_async_steps=2"])
        assert lagged.run.max_async_steps == 2 and C.to_dict(lagged)["rollout"] == C.to_dict(on_policy)["rollout"]


def test_routing_capture_refusals_name_the_key():
    """trainer.routing_replay / routing_metrics: what the engines' routing capture cannot do is refused when the
    config loads (before Ray): stock compiled (explicitly, or by vLLM's CUDA default) and speculative decoding.
    megamoe compiled, on CPU and on CUDA with CUDA graphs, loads (its capture is written inside its opaque op)."""
    tiny = ROOT / "configs" / "tiny.yaml"
    gpu = ["rollout.gpus_per_worker=1", "trainer.gpus_per_rank=1"]
    for key in ("trainer.routing_replay=true", "trainer.routing_metrics=true"):
        with pytest.raises(C.ConfigError, match=r"rollout.engine_kwargs.enforce_eager: expected true with trainer\."
                                                r"routing_.* rollout.moe_impl='stock'.*got False$"):
            C.load(tiny, [key, "rollout.moe_impl=stock", "rollout.engine_kwargs={enforce_eager: false}"])
        with pytest.raises(C.ConfigError, match=r"enforce_eager: expected true .*got None \(vLLM compiles on CUDA"):
            C.load(tiny, gpu + [key, "rollout.moe_impl=stock"])
        with pytest.raises(C.ConfigError, match=r"rollout.engine_kwargs.speculative_config: expected none with "
                                                r"trainer\.routing_"):
            C.load(tiny, [key, "rollout.engine_kwargs={speculative_config: {method: ngram}}"])
        assert C.load(tiny, [key, "rollout.moe_impl=stock"]).rollout.moe_impl == "stock"  # CPU: eager by default
        assert C.load(tiny, gpu + [key, "rollout.moe_impl=stock", "rollout.engine_kwargs={enforce_eager: true}"])
        assert C.load(tiny, gpu + [key, "rollout.engine_kwargs={enforce_eager: false}"]).rollout.moe_impl == "megamoe"
        assert C.load(tiny, [key, "rollout.engine_kwargs={enforce_eager: false}"]).rollout.moe_impl == "megamoe"
    # Without a capture, stock compiled loads.
    assert C.load(tiny, ["rollout.moe_impl=stock", "rollout.engine_kwargs={enforce_eager: false}"])
