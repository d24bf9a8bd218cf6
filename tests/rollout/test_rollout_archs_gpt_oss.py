"""gpt-oss end to end through the megamoe hook (`rl.make_model --arch gpt_oss`: biased experts with the
clamped SwiGLU, gate/up interleaved in the checkpoint, a router bias, attention sinks, sliding-window and
full layers): two GRPO steps of configs/tiny_gpt_oss.yaml with megamoe on both sides (step 2 samples
from weights synced in place), then `megamoe-rl consistency` on the policy that run exported: every MoE
layer bitwise equal, routing agreement 1.0. The config.json settings vLLM's GptOss would compute
otherwise, and a quantized (mxfp4) checkpoint, are refused in tests/rollout/test_rollout_archs.py.

A file of its own: see tests/rollout/test_rollout_archs_olmoe.py.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_archs_gpt_oss.py
"""

from __future__ import annotations

import json

import pytest
import torch

from test_rollout_archs import LOGPROB_TOL_FP32, ROOT, check_grpo_steps, train_tiny

pytestmark = pytest.mark.slow  # a `megamoe-rl train` run, then `megamoe-rl consistency`

TINY_GPT_OSS = ROOT / "configs" / "tiny_gpt_oss.yaml"
# Tensors of every gpt-oss layer that the weight sync must carry (the experts and the sinks are the ones
# vLLM 0.32's own in-place reload of gpt-oss leaves at their old values: rollout/models.py).
GPT_OSS_TRAINED = (".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj",
                   ".mlp.experts.down_proj_bias", ".mlp.router.weight", ".mlp.router.bias", ".self_attn.sinks")


@pytest.fixture(scope="module")
def gpt_oss_run(tmp_path_factory, ray_cluster):
    """Two GRPO steps of configs/tiny_gpt_oss.yaml (a subprocess, as olmoe_run), then `megamoe-rl
    consistency` in this process on the policy the run exported (final/), megamoe on both sides (one engine)."""
    import contextlib
    import io

    from rl.cli import main

    root = tmp_path_factory.mktemp("gpt_oss")
    run_dir = root / "run"
    train = train_tiny(TINY_GPT_OSS, run_dir, ray=ray_cluster)
    if train.returncode != 0:
        return train, run_dir, None, ""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["consistency", "--config", str(TINY_GPT_OSS), f"model.path={run_dir / 'final'}", "model.make=null",
                     "--impls", "megamoe", "--prompts", "4", "--n", "2", "--out", str(root / "cons")])
    assert code == 0, buf.getvalue()[-3000:]
    return train, run_dir, json.loads((root / "cons" / "consistency.json").read_text()), buf.getvalue()


def test_gpt_oss_trains_grpo_steps_with_megamoe_on_both_sides(gpt_oss_run):
    """Step 2 samples from the weights step 1 pushed in place: the trainer scores those tokens with the
    updated weights, so stale experts or sinks in the engine would show here. Measured on a 2-core x86 CPU,
    fp32: max |dlogp| 4.8e-7 at both steps; with vLLM's own reload of gpt-oss instead (rollout/models.py's
    load_weights bypassed) step 2 measured 0.25."""
    from safetensors.torch import load_file

    proc, run_dir, _, _ = gpt_oss_run
    check_grpo_steps(proc, run_dir, "gpt_oss", "GptOssForCausalLM", lambda step: LOGPROB_TOL_FP32, "gpt-oss")
    base = load_file(str(run_dir / "model" / "model.safetensors"))
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert base.keys() == final.keys()
    changed = {k for k in base if not torch.equal(base[k], final[k])}
    missing = [f"model.layers.{i}{part}" for i in range(2) for part in GPT_OSS_TRAINED
               if f"model.layers.{i}{part}" not in changed]
    assert not missing, missing


def test_gpt_oss_consistency_every_moe_layer_bitwise(gpt_oss_run):
    """`megamoe-rl consistency` on the trained policy, megamoe on both sides: both MoE layers (biased
    experts, clamped SwiGLU, router bias) bitwise equal on the same hidden states, router logits equal,
    the same experts for every token. Measured end to end: max |dlogp| 4.8e-7 (fp32)."""
    proc, _, report, table = gpt_oss_run
    assert proc.returncode == 0 and report is not None
    (pair,) = report["pairs"]
    assert len(pair["layers"]) == 2 == report["meta"]["moe_layers"]
    for i, layer in enumerate(pair["layers"]):
        assert layer["moe/out_bitwise_equal"] and layer["moe/routing_agreement"] == 1.0, (i, layer)
        assert layer["moe/router_logits_max_abs_diff"] == 0.0, (i, layer)
    print(table)
    assert pair["metrics"]["mismatch/abs_logp_diff_max"] <= LOGPROB_TOL_FP32

