"""CPU: `megamoe-rl export` (rl/export.py): a run's checkpoint as a Hugging Face folder.

A trained "run" per architecture (tiny Qwen3-MoE, Mixtral, OLMoE): a one-rank FSDP2 TrainerWorker on
the run's base model takes two optimizer steps on a seeded batch and checkpoints like the RL loop
does (checkpoints/step_000002, latest.json); the export of that checkpoint must
- hold the trainer's weights bit for bit in the base checkpoint's names, shapes and dtype,
- load in transformers and in vLLM CPU with logprobs equal to the trainer's (fp32, FP32_LOGPROB_TOL),
- start a new trainer (model.path) from exactly those weights (same logprobs, bitwise),
- with run.numerics=bitwise, serve in vLLM CPU with the bitwise trainer's logprobs bit for bit,
and every bad input is refused before anything is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl import config as C
from rl.export import ExportError, export_policy
from trainer.testing import damage_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# fp32, the exported folder in transformers (eager experts) and in vLLM CPU (megamoe) against the
# trainer (megamoe) that wrote the checkpoint: measured max |dlogp| 4.8e-7 for both tiny models in
# transformers, 4.8e-7 (Qwen3-MoE) and 0 (Mixtral) in vLLM; bound 1e-6.
FP32_LOGPROB_TOL = 1e-6


# The Mixtral run trains LoRA adapters (attention and experts): its export is the merged weights plus adapter/.
LORA_RUNS = {"mixtral": {"enabled": True, "rank": 4, "alpha": 8.0}}


def _make_run(root: Path, arch: str) -> dict:
    from rl.make_model import make_model
    from trainer.testing import free_port, make_batch
    from trainer.worker import TrainerWorker

    run = root / "run"
    base = make_model(run / "model", arch=arch, seed=3)
    cfg = C.load(ROOT / "configs" / "tiny.yaml", [f"run.out_dir={run}", f"model.make.arch={arch}"])
    (run / "config.yaml").write_text(C.to_yaml(cfg))
    lora = LORA_RUNS.get(arch)
    if lora:
        cfg = C.load(ROOT / "configs" / "tiny.yaml", [f"run.out_dir={run}", f"model.make.arch={arch}",
                                                      *(f"trainer.lora.{k}={str(v).lower()}" for k, v in lora.items())])
        (run / "config.yaml").write_text(C.to_yaml(cfg))
    trainer = TrainerWorker(0, 1, "127.0.0.1", free_port(), str(base), "megamoe",
                            {"dtype": "float32", "device": "cpu", "lr": 1e-2,
                             **({"lora": lora} if lora else {})})
    for seed in (1, 2):
        trainer.train_step(make_batch(8, seed=seed))
    (run / "checkpoints").mkdir()
    trainer.save_checkpoint(str(run / "checkpoints" / "step_000002"))
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 2, "path": "step_000002"}))
    probe = make_batch(4, seed=9)
    return {"run": run, "base": base, "trainer": trainer, "probe": probe,
            "trainer_logprobs": trainer.logprobs(probe.prompt_ids, probe.completion_ids),
            "trainer_weights": dict(trainer.export_weights())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One exported run per architecture, made when first asked for, shared by the module."""
    made = {}

    def get(arch):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"export_{arch}")
            made[arch] = _make_run(root, arch)
            made[arch]["out"] = export_policy(made[arch]["run"], root / "policy")
        return made[arch]

    yield get
    for r in made.values():
        r["trainer"].close()


@pytest.fixture(params=["qwen3_moe", "mixtral", "olmoe"])
def exported(request, runs):
    """Every architecture make-model builds: what the export must hold and how it must load."""
    return runs(request.param)


@pytest.fixture(scope="module")
def served(runs):
    """The Mixtral export (a LoRA run, LORA_RUNS: the merged weights) served by one vLLM CPU engine in
    run.numerics=bitwise (an engine start is ~25 s on 2 cores, so one engine serves both tests below): its
    logprobs of the probe, a greedy generation, and the bitwise trainer's logprobs on the same folder. The
    Qwen3-MoE export is served by `megamoe-rl eval` on the e2e run's final/ (tests/rl/test_rl_loop.py: the run's
    own evaluation, completion for completion); make-model's OLMoE folders by vLLM in
    tests/rollout/test_rollout_archs_olmoe.py and tests/rl/test_consistency.py."""
    from rollout.worker import RolloutWorker
    from trainer.testing import free_port
    from trainer.worker import TrainerWorker

    exported = runs("mixtral")
    out, probe = str(exported["out"]), exported["probe"]
    trainer = TrainerWorker(0, 1, "127.0.0.1", free_port(), out, "megamoe",
                            {"dtype": "float32", "device": "cpu", "numerics": "bitwise"})
    try:
        bitwise_trainer = trainer.logprobs(probe.prompt_ids, probe.completion_ids)
    finally:
        trainer.close()
    engine = RolloutWorker(exported["out"], "megamoe", dtype="float32", seed=0, max_model_len=64, numerics="bitwise")
    try:
        scores = engine.score(probe.prompt_ids, probe.completion_ids)
        samples = engine.generate(["1 + 2 ="], 1, {"temperature": 0.0, "max_tokens": 4})
    finally:
        engine.close()
    return {**exported, "scores": scores, "samples": samples, "bitwise_trainer_logprobs": bitwise_trainer}


@pytest.fixture
def exported_one(runs):
    """One architecture: the export's options and refusals, which do not depend on it."""
    return runs("qwen3_moe")


def test_export_holds_the_trainers_weights_in_the_base_layout(exported):
    from rollout.weights import CheckpointSpec, plan_update

    base = load_file(str(exported["base"] / "model.safetensors"))
    out = load_file(str(exported["out"] / "model.safetensors"))
    assert {n: (t.shape, t.dtype) for n, t in out.items()} == {n: (t.shape, t.dtype) for n, t in base.items()}
    want = dict(plan_update(CheckpointSpec.from_dir(exported["base"]), exported["trainer_weights"]))
    assert all(torch.equal(out[n], want[n]) for n in out)
    assert any(not torch.equal(out[n], base[n]) for n in out)  # the trained weights, not the base's
    files = {p.name for p in exported["out"].iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "megamoe_export.json"} <= files
    assert "make_model.json" not in files and not any(p.name.startswith(".") for p in exported["out"].parent.iterdir())
    prov = json.loads((exported["out"] / "megamoe_export.json").read_text())
    assert prov["step"] == 2 and prov["run_dir"] == str(exported["run"]) and prov["dtype"] == "float32"


def test_export_loads_in_transformers_with_the_trainers_logprobs(exported):
    from transformers import AutoModelForCausalLM

    from rollout.testing import max_abs_diff, processed_logprobs

    model = AutoModelForCausalLM.from_pretrained(exported["out"], dtype=torch.float32)
    probe = exported["probe"]
    hf = [processed_logprobs(model, p, c, 1.0) for p, c in zip(probe.prompt_ids, probe.completion_ids)]
    err = max_abs_diff(hf, exported["trainer_logprobs"])
    print(f"[export] transformers vs trainer: max |dlogp| {err:.2e}")
    assert err <= FP32_LOGPROB_TOL


def test_export_starts_a_new_trainer_from_the_same_weights(exported):
    from trainer.testing import free_port
    from trainer.worker import TrainerWorker

    fresh = TrainerWorker(0, 1, "127.0.0.1", free_port(), str(exported["out"]), "megamoe",
                          {"dtype": "float32", "device": "cpu"})
    try:
        probe = exported["probe"]
        assert fresh.logprobs(probe.prompt_ids, probe.completion_ids) == exported["trainer_logprobs"]
    finally:
        fresh.close()


@pytest.mark.slow  # a vLLM engine per architecture
def test_lora_export_writes_a_peft_adapter_that_rebuilds_the_merged_weights(runs):
    """The LoRA run's export: adapter/ with PEFT's adapter_config.json keys and tensor names; base weights plus
    PEFT's deltas of those tensors (its formulas: lora.Linear B @ A, ParamWrapper's einsum) are the trainer's
    merged weights, which the folder's model.safetensors holds (test_export_holds_the_trainers_weights...)."""
    from trainer.model import load_model

    r = runs("mixtral")
    adapter = r["out"] / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert {"peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters",
            "bias", "base_model_name_or_path"} <= set(cfg)
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == ("LORA", 4, 8.0, 0.0)
    assert sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith(("lora_A.weight", "lora_B.weight"))
               for k in tensors)
    base = dict(load_model(r["base"], "megamoe").state_dict())
    merged, scale = r["trainer_weights"], 8.0 / 4
    for i in range(2):
        at = f"model.layers.{i}.self_attn.q_proj"
        got = base[f"{at}.weight"] + scale * (tensors[f"base_model.model.{at}.lora_B.weight"]
                                              @ tensors[f"base_model.model.{at}.lora_A.weight"])
        torch.testing.assert_close(got, merged[f"{at}.weight"], rtol=0, atol=1e-6)
        ex = f"model.layers.{i}.mlp.experts"
        for param, prefix in (("down_proj", ""), ("gate_up_proj", "base_layer.")):
            a, b = tensors[f"base_model.model.{ex}.{prefix}lora_A.weight"], tensors[f"base_model.model.{ex}.{prefix}lora_B.weight"]
            E = base[f"{ex}.{param}"].shape[0]
            # peft 0.21's ParamWrapper.get_delta_weight for an experts module without `is_transposed` (transformers'):
            # P read as [experts, out, in], delta = einsum("o r e, e r i -> e o i", B as [out, r, E], A as [E, r, in])
            delta = torch.einsum("o r e, e r i -> e o i", b.reshape(b.shape[0], -1, E), a.reshape(E, -1, a.shape[1]))
            torch.testing.assert_close(base[f"{ex}.{param}"] + scale * delta, merged[f"{ex}.{param}"], rtol=0, atol=1e-6)
            assert not torch.equal(base[f"{ex}.{param}"], merged[f"{ex}.{param}"])


@pytest.mark.slow  # a vLLM engine (the module's `served`)
def test_export_serves_in_vllm(served):
    """The exported folder loads in vLLM CPU: its logprobs within the (fast) trainer's bound, and it generates."""
    from rollout.testing import max_abs_diff

    err = max_abs_diff(served["scores"], served["trainer_logprobs"])
    print(f"[export] vLLM CPU (bitwise) vs fast trainer: max |dlogp| {err:.2e}")
    assert err <= FP32_LOGPROB_TOL and len(served["samples"][0].completion_ids) == 4


@pytest.mark.slow  # a vLLM engine (the module's `served`)
def test_export_serves_bitwise_in_vllm(served):
    """run.numerics=bitwise on the exported folder: vLLM CPU's logprobs are the bitwise trainer's, bit for bit;
    the fast trainer's differ, so the equality is the mode's."""
    assert served["scores"] == served["bitwise_trainer_logprobs"]
    assert served["bitwise_trainer_logprobs"] != served["trainer_logprobs"]


def test_export_in_bf16_and_in_shards(exported_one, tmp_path):
    out = export_policy(exported_one["run"], tmp_path / "bf16", dtype="bfloat16", shard_bytes=1 << 16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    tensors = {}
    for s in shards:
        tensors.update(load_file(str(out / s)))
    full = load_file(str(exported_one["out"] / "model.safetensors"))
    assert tensors.keys() == full.keys() and all(tensors[n].dtype == torch.bfloat16 for n in tensors)
    assert all(torch.equal(tensors[n], full[n].to(torch.bfloat16)) for n in full)
    assert json.loads((out / "config.json").read_text()).get("dtype", json.loads(
        (out / "config.json").read_text()).get("torch_dtype")) == "bfloat16"


@pytest.mark.parametrize("how, match", [
    ("truncated", "is truncated"),
    ("no_metadata", "unreadable"),
    ("unfinished", "incomplete"),
])
def test_a_damaged_checkpoint_is_refused_naming_it(exported_one, tmp_path, how, match):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(exported_one["run"], run)
    damage_checkpoint(run / "checkpoints" / "step_000002", how)
    with pytest.raises(ExportError, match=match):
        export_policy(run, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["run"]


def test_bad_arguments_are_refused_before_any_work(exported_one, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (dict(run=tmp_path, out=tmp_path / "o"), "config.yaml"),
        (dict(run=exported_one["run"], out=tmp_path / "full"), "not an empty folder"),
        (dict(run=exported_one["run"], out=tmp_path / "o", step=7), r"no checkpoint of step 7.*steps \[2\]"),
        (dict(run=exported_one["run"], out=tmp_path / "o", dtype="int8"), "--dtype"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ExportError, match=match):
            export_policy(kwargs.pop("run"), kwargs.pop("out"), **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_cli_exports_and_refuses_with_status_2(exported_one, tmp_path):
    cli = [sys.executable, "-m", "rl.cli", "export", "--run", str(exported_one["run"])]
    ok = subprocess.run(cli + ["--step", "2", "--out", str(tmp_path / "p")], capture_output=True, text=True,
                        cwd=ROOT, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert Path(ok.stdout.strip()) == tmp_path / "p" and (tmp_path / "p" / "model.safetensors").is_file()
    bad = subprocess.run(cli + ["--out", str(tmp_path / "p")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "not an empty folder" in bad.stderr
