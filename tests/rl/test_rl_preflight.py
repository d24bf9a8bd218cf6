"""`megamoe-rl train` refuses bad input before any work: before Ray or vLLM start, exit 2, naming the key.

    .venv/bin/python -m pytest -q tests/rl/test_rl_preflight.py

Each case runs the real CLI (rl.cli.main) in this process on configs/tiny.yaml with one bad setting
and a fresh run folder: the model at model.path (a dense model, unsupported experts or activation, a
missing folder), a trainer.max_seq_len too small for the prompts, a malformed JSONL dataset. A
refused fresh start leaves nothing behind (the folder, a model it made, train.log). One case runs
in a subprocess to show that neither Ray nor vLLM was imported by the time of the refusal.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rl.make_model import make_model

    return make_model(tmp_path_factory.mktemp("preflight") / "tiny", layers=1)


def _model_with(tmp_path: Path, tiny_model: Path, **config) -> Path:
    """A copy of the tiny model whose config.json has `config` merged in (None deletes a key)."""
    out = tmp_path / "model"
    shutil.copytree(tiny_model, out)
    c = json.loads((out / "config.json").read_text())
    c.update(config)
    (out / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    return out


def _train(capsys, run_dir: Path, *overrides: str) -> str:
    """The CLI on tiny.yaml into run_dir; asserts exit status 2 and returns stderr."""
    from rl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(TINY), f"run.out_dir={run_dir}", "run.progress=false", *overrides])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err, err
    return err


def _path(model: Path) -> tuple[str, str]:
    return "model.make=null", f"model.path={model}"


@pytest.mark.parametrize("config, fragments", [
    pytest.param({"hidden_act": "gelu"}, ["Qwen3MoeForCausalLM", "model_type 'qwen3_moe'", "hidden_act='gelu'"],
                 id="activation"),
    pytest.param({"mlp_only_layers": [0]}, ["Qwen3MoeForCausalLM", "no MoE block"], id="dense-layers"),
    pytest.param({"architectures": ["Qwen3MoeForSequenceClassification"]},
                 ["Qwen3MoeForSequenceClassification", "not supported by the megamoe rollout hook"], id="head"),
])
def test_moe_model_the_hook_or_trainer_cannot_run_is_refused(tmp_path, capsys, tiny_model, config, fragments):
    model = _model_with(tmp_path, tiny_model, **config)
    err = _train(capsys, tmp_path / "run", *_path(model))
    assert f"model.path: {str(model)!r} holds a" in err, err
    for f in fragments:
        assert f in err, (f, err)
    assert not (tmp_path / "run").exists()


def test_missing_model_folder_is_refused_naming_the_key(tmp_path, capsys):
    err = _train(capsys, tmp_path / "run", *_path(tmp_path / "no_such_model"))
    assert f"model.path: no such folder {str(tmp_path / 'no_such_model')!r}" in err
    assert not (tmp_path / "run").exists()


def test_dense_model_is_refused_before_ray_or_vllm_is_imported(tmp_path):
    from transformers import LlamaConfig

    dense = tmp_path / "llama"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=512, architectures=["LlamaForCausalLM"]).save_pretrained(dense)
    argv = ["train", "--config", str(TINY), f"run.out_dir={tmp_path / 'run'}", *_path(dense)]
    prog = ("import json, sys\n"
            "from rl.cli import main\n"
            "try:\n"
            f"    main({argv!r})\n"
            "except SystemExit as e:\n"
            "    rc = e.code\n"
            "print('RESULT ' + json.dumps({'rc': rc, 'heavy': sorted(m for m in ('ray', 'vllm') if m in sys.modules)}))\n")
    proc = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, capture_output=True, text=True, timeout=120)
    res = json.loads(proc.stdout.split("RESULT ")[-1])
    assert res == {"rc": 2, "heavy": []}, (res, proc.stderr)
    assert (f"model.path: {str(dense)!r} holds a LlamaForCausalLM (model_type 'llama'), which is not a MoE model "
            f"the trainer trains: expected model_type one of") in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("policy, fragment", [
    pytest.param("refuse", "data.long_prompts=refuse: row 0 of the dataset", id="refuse"),
    pytest.param("drop", "data.long_prompts=drop: no prompt of the dataset (task 'digit') is left to train on: "
                         "every one is longer than the 1 tokens allowed", id="drop-all"),
])
def test_max_seq_len_below_prompt_plus_max_tokens_is_refused_naming_both_keys(tmp_path, capsys, tiny_model,
                                                                            policy, fragment):
    # trainer.max_seq_len = rollout.max_tokens + 1 leaves one token for a prompt; every digit prompt is longer.
    err = _train(capsys, tmp_path / "run", *_path(tiny_model), "rollout.max_tokens=4", "trainer.max_seq_len=5",
                 f"data.long_prompts={policy}")
    assert fragment in err, err
    assert "trainer.max_seq_len=5) - rollout.max_tokens=4" in err, err
    assert not (tmp_path / "run").exists()


def test_malformed_jsonl_is_refused_naming_the_file_and_line(tmp_path, capsys, tiny_model):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 2 =", "answer": "3"}\n\n{"prompt": "2 + 2 =", "answer": "4"}\n'
                    '{"prompt": "3 + 2 =", answer: 5}\n')
    err = _train(capsys, tmp_path / "run", *_path(tiny_model), "data.task=null", f"data.path={data}")
    assert f"data.path: {str(data)!r} is not valid JSON at line 4 column 23" in err, err
    assert "DatasetGenerationError" not in err
    assert not (tmp_path / "run").exists()


def test_a_refused_start_removes_what_it_created_and_only_that(tmp_path, capsys, tiny_model):
    # model.make: the start makes <run>/model and train.log before the dataset is refused.
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 2 =", "answer": "3"}\n[1, 2]\n')
    bad = ("data.task=null", f"data.path={data}")
    err = _train(capsys, tmp_path / "new" / "run", *bad)
    assert "line 2 (expected a JSON object per line, got list)" in err, err
    assert not (tmp_path / "new").exists()  # the parent it made for the run folder too
    # A folder that existed keeps what it held.
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    _train(capsys, kept, *bad, *_path(tmp_path / "no_such_model"))
    _train(capsys, kept, *bad, *_path(tiny_model))
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_a_run_the_disk_cannot_hold_is_refused_before_the_model_is_made(tmp_path, capsys, tiny_model, monkeypatch):
    """run.out_dir's file system must hold the model model.make makes and the final export (run.export_final):
    the 30B config on the GPU machine's 64 GB disk would otherwise fail after its last step. The free space is
    injected; the sizes are the model's: model.make's from its parameter count, model.path's from its files."""
    import collections

    import rl.run_dir as R
    from rl import config as C
    from rl.memory_plan import dims_of

    Usage = collections.namedtuple("Usage", "total used free")
    free = {"bytes": 0}
    monkeypatch.setattr(R.shutil, "disk_usage", lambda p: Usage(1 << 40, 0, free["bytes"]))
    # model.make (fp32 by tiny.yaml): the model and its export, each params x 4 bytes
    size = dims_of(C.load(TINY)).params * 4
    free["bytes"] = 2 * size - 1
    err = _train(capsys, tmp_path / "run")
    assert (f"run writes about {2 * size / 2**30:.1f} GiB there besides its checkpoints (the model model.make makes "
            f"{size / 2**30:.1f} GiB, the final export (run.export_final) {size / 2**30:.1f} GiB)") in err, err
    assert "or set run.export_final=false" in err and not (tmp_path / "run").exists()
    # without the export only the model is written: it fits; the start goes on to the next check
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 + 2 =", "answer": "3"}\n[1, 2]\n')
    err = _train(capsys, tmp_path / "run", "run.export_final=false", "data.task=null", f"data.path={bad}")
    assert "expected a JSON object per line" in err and not (tmp_path / "run").exists()
    # model.path: the export is its safetensors again
    files = sum(p.stat().st_size for p in tiny_model.glob("*.safetensors"))
    free["bytes"] = files - 1
    err = _train(capsys, tmp_path / "run", *_path(tiny_model))
    assert (f"besides its checkpoints (the final export (run.export_final) {files / 2**30:.1f} GiB)") in err, err
    free["bytes"] = files
    err = _train(capsys, tmp_path / "run", *_path(tiny_model), "data.task=null", f"data.path={bad}")
    assert "expected a JSON object per line" in err
