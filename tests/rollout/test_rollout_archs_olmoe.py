"""OLMoE end to end through the megamoe hook (`rl.make_model --arch olmoe`: top-k softmax without
renormalisation, q/k norms over the whole projection): a few GRPO steps of configs/tiny_olmoe.yaml,
vLLM CPU sampling and the FSDP2 trainer both on megamoe; every step's sampler logprobs (after the
weight pushes) against the trainer's. What backs this against an independent reference:
tests/rl/test_make_model.py (the trainer vs transformers' own OLMoE, and a renormalised routing that
must differ) and tests/rl/test_consistency.py (`megamoe-rl consistency` on the tiny OLMoE: every MoE
layer bitwise equal on both sides, vLLM vs transformers end to end). OLMoE checkpoints the hook must
refuse are in tests/rollout/test_rollout_archs.py.

A file of its own (as test_rollout_archs_deepseek.py and test_rollout_archs_gpt_oss.py): each family's
end-to-end run takes minutes on 2 cores, and `make test` (pytest-xdist, --dist loadfile) gives each
file to one worker, so the runs overlap instead of queueing in one file.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_archs_olmoe.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from test_rollout_archs import LOGPROB_TOL_FP32, ROOT

pytestmark = pytest.mark.slow  # a `megamoe-rl train` run

TINY_OLMOE = ROOT / "configs" / "tiny_olmoe.yaml"


@pytest.fixture(scope="module")
def olmoe_run(tmp_path_factory):
    """`megamoe-rl train --config configs/tiny_olmoe.yaml` for two steps, in a subprocess of its own
    session (Ray, one vLLM CPU engine, one FSDP2 trainer rank), sized as tests/rl/test_rl_loop.py's runs."""
    from test_rl_loop import RUN_TIMEOUT_S, SMALL

    run_dir = tmp_path_factory.mktemp("olmoe_grpo") / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "rl.cli", "train", "--config", str(TINY_OLMOE),
                           f"run.out_dir={run_dir}", *SMALL, "run.steps=2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, start_new_session=True)
    return proc, run_dir


def test_olmoe_trains_grpo_steps_with_megamoe_on_both_sides(olmoe_run):
    from safetensors.torch import load_file
    from test_rl_loop import STEP_KEYS, explain, numeric_finite

    from rl import config as C
    from rl.metrics import read_jsonl

    proc, run_dir = olmoe_run
    assert proc.returncode == 0, explain(proc)
    cfg = C.load(run_dir / "config.yaml")
    # A RolloutWorker starts only when every MoE layer of its engine is hooked with its moe_impl, a
    # trainer only when every block's experts and router run on it: both ran megamoe.
    assert (cfg.model.make.arch, cfg.rollout.moe_impl, cfg.trainer.moe_impl) == ("olmoe", "megamoe", "megamoe")
    assert json.loads((run_dir / "model" / "config.json").read_text())["architectures"] == ["OlmoeForCausalLM"]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2], explain(proc)
    for r in records:
        assert not numeric_finite(r, STEP_KEYS), (r["step"], r)
        assert r["train/optimizer_steps"] == r["step"] and r["train/grad_norm"] > 0, r  # one update per step
        # The trainer's logprobs of the sampled tokens vs the sampler's; at step 2 the sampler runs the
        # weights step 1 pushed to it.
        print(f"[olmoe grpo] step {r['step']}: max |dlogp| sampler vs trainer {r['mismatch/abs_logp_diff_max']:.2e}")
        assert r["mismatch/abs_logp_diff_max"] <= LOGPROB_TOL_FP32, r
    base = load_file(str(run_dir / "model" / "model.safetensors"))
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert base.keys() == final.keys()
    changed = [k for k in base if not torch.equal(base[k], final[k])]
    assert any(".mlp.experts." in k for k in changed) and any(".mlp.gate." in k for k in changed), changed

