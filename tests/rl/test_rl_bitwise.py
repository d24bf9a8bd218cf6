"""run.numerics=bitwise end to end on vLLM CPU (fp32): the trainer's logprobs of the sampled tokens are the
logprobs vLLM reported while sampling them, bit for bit, in `megamoe-rl consistency` (here) and at every step of
`megamoe-rl train` with LoRA adapters, merged weights pushed to the engine between steps and after a rollout
restart: the end-to-end run of tests/rl/test_rl_loop.py (BITWISE_LORA; test_e2e_metrics_are_finite_every_step).

What makes the zeros non-vacuous: the same tokens scored by the trainer in numerics=fast (torch's sdpa and
GEMMs) differ from the sampler's; the sampler's engine only starts when every linear and attention layer
of its model runs the batch-invariant kernels (RolloutWorker's census); and the unit tests of the kernels
(tests/megamoe/test_invariant.py, tests/trainer/test_trainer_bitwise.py) check their values against fp64.
OLMoE and Mixtral sampled and scored bitwise, and a fast engine started after bitwise ones in one process:
tests/rl/test_divergence.py, on the engines of its bitwise op-by-op runs.

    .venv/bin/python -m pytest -q tests/rl/test_rl_bitwise.py
"""

from __future__ import annotations

import json

import pytest

from test_rl_loop import ROOT, TEMPERATURE  # TEMPERATURE 0.8, not 1: the sampler divides by a tensor, the trainer by a float

pytestmark = pytest.mark.slow  # a consistency run (one vLLM engine)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """`megamoe-rl consistency --impls megamoe` on configs/tiny.yaml's model with run.numerics=bitwise:
    8 prompts x 4 samples, 8 tokens each, generated in one batch."""
    import contextlib
    import io

    from rl.cli import main

    tmp = tmp_path_factory.mktemp("bitwise")
    out = tmp / "out"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["consistency", "--config", str(ROOT / "configs" / "tiny.yaml"), "--impls", "megamoe",
                     "--out", str(out), "--prompts", "8", "--n", "4", f"run.out_dir={tmp / 'run'}",
                     "run.numerics=bitwise", f"rollout.temperature={TEMPERATURE}", "rollout.max_tokens=8"])
    assert code == 0, buf.getvalue()
    return json.loads((out / "consistency.json").read_text()), buf.getvalue(), tmp


def test_consistency_bitwise_end_to_end(report):
    rep, table, _ = report
    print(table)
    assert "numerics=bitwise" in table
    assert rep["meta"]["numerics"] == "bitwise" and rep["meta"]["temperature"] == TEMPERATURE
    assert rep["meta"]["completion_tokens"] >= 8 * 4 * 2, rep["meta"]
    (pair,) = rep["pairs"]
    for name, metrics in (("scored", pair["metrics"]), ("while generating", rep["trainer_vs_generation"]["metrics"]),
                          ("vLLM generating vs scoring", rep["generation_vs_scoring"]["metrics"])):
        assert metrics["mismatch/abs_logp_diff_max"] == 0.0, (name, metrics)
        assert metrics["mismatch/k3_kl"] == 0.0, (name, metrics)
    for layer in pair["layers"]:
        assert layer["moe/out_bitwise_equal"] and layer["moe/routing_agreement"] == 1.0, layer


def test_trainer_scores_the_same_bits_in_any_batch_and_fast_numerics_do_not(report):
    """The report's sequences rescored by the trainer: bitwise in micro-batches of 1 and of 7 (other
    padding, other batch neighbours); numerics=fast differs from the sampler (the zeros above are the
    mode's doing)."""
    from trainer.model import load_model
    from trainer.probe import score

    rep, _, _ = report
    seqs = rep["sequences"]
    prompts, completions = [s["prompt_ids"] for s in seqs], [s["completion_ids"] for s in seqs]
    sampler = [s["sampler_logprobs"] for s in seqs]
    model_dir = rep["meta"]["model_dir"]
    bitwise = load_model(model_dir, "megamoe", numerics="bitwise").eval()
    for mb in (1, 7):
        got, _ = score(bitwise, prompts, completions, temperature=TEMPERATURE, micro_batch_size=mb)
        assert got == sampler, mb
    fast = load_model(model_dir, "megamoe", numerics="fast").eval()
    got, _ = score(fast, prompts, completions, temperature=TEMPERATURE, micro_batch_size=7)
    diff = max(abs(a - b) for g, s in zip(got, sampler) for a, b in zip(g, s))
    print(f"numerics=fast trainer vs bitwise sampler: max |dlogp| {diff:.2e}")
    assert diff > 0.0
