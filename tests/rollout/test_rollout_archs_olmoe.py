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


import pytest
import torch

from test_rollout_archs import LOGPROB_TOL_FP32, ROOT, check_grpo_steps, train_tiny

pytestmark = pytest.mark.slow  # a `megamoe-rl train` run

TINY_OLMOE = ROOT / "configs" / "tiny_olmoe.yaml"


@pytest.fixture(scope="module")
def olmoe_run(tmp_path_factory, ray_cluster):
    """`megamoe-rl train --config configs/tiny_olmoe.yaml` for two steps (test_rollout_archs.train_tiny)."""
    run_dir = tmp_path_factory.mktemp("olmoe_grpo") / "run"
    return train_tiny(TINY_OLMOE, run_dir, ray=ray_cluster), run_dir


def test_olmoe_trains_grpo_steps_with_megamoe_on_both_sides(olmoe_run):
    from safetensors.torch import load_file

    proc, run_dir = olmoe_run
    check_grpo_steps(proc, run_dir, "olmoe", "OlmoeForCausalLM", lambda step: LOGPROB_TOL_FP32, "olmoe")
    base = load_file(str(run_dir / "model" / "model.safetensors"))
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert base.keys() == final.keys()
    changed = [k for k in base if not torch.equal(base[k], final[k])]
    assert any(".mlp.experts." in k for k in changed) and any(".mlp.gate." in k for k in changed), changed

