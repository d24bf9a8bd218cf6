"""`megamoe-rl consistency` end to end on vLLM CPU: outputs, the per-layer zero-difference property of
megamoe on both sides (fp32 and bf16), and the end-to-end comparison with stock on both sides.

Two runs for the whole module (engines dominate: ~25 s each on 2 cores): a tiny OLMoE
(`make-model --arch olmoe`: top-k softmax without renormalisation) in fp32 with every
implementation, through the CLI; a 4-layer Qwen3-MoE in bf16 with megamoe and stock, through the
library (the report keeps the per-token Δlogp lists). The two families route differently
(renormalised or not), and each has megamoe's MoE layers bitwise equal on both sides.

    .venv/bin/python -m pytest -q tests/rl/test_consistency.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

IMPLS = ("megamoe", "reference", "stock")

pytestmark = pytest.mark.slow  # two consistency runs, vLLM engines (the module's fixtures)


def _config(tmp_path, dtype, model, *, prompts, n, max_tokens):
    """A consistency config; `model` is model.make's arguments, or a checkpoint path (model.path)."""
    import yaml

    cfg = tmp_path / f"cons_{dtype}.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"make": model, "dtype": dtype} if isinstance(model, dict) else {"path": str(model), "dtype": dtype},
        "rollout": {"n": n, "temperature": 1.0, "max_tokens": max_tokens, "max_model_len": 64,
                    "kv_cache_bytes": 64 << 20},
        "trainer": {"max_seq_len": 64, "micro_batch_size": 64},
        "data": {"task": "digit", "task_size": 256},
        "run": {"out_dir": str(tmp_path / "run"), "seed": 0, "prompts_per_step": prompts},
    }))
    return str(cfg)


@pytest.fixture(scope="module")
def fp32_cli(tmp_path_factory):
    """The command as a user runs it: the tiny OLMoE (a `megamoe-rl make-model --arch olmoe` folder as
    model.path), fp32, every implementation."""
    import contextlib
    import io

    from rl.cli import main
    from rl.make_model import make_model

    tmp = tmp_path_factory.mktemp("cons_fp32")
    model = make_model(tmp / "olmoe", arch="olmoe", layers=2, hidden=64, experts=8, topk=2, intermediate=32)
    cfg = _config(tmp, "float32", model, prompts=8, n=4, max_tokens=4)
    out = tmp / "out"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["consistency", "--config", cfg, "--impls", ",".join(IMPLS), "--out", str(out)])
    assert code == 0
    return out, buf.getvalue(), json.loads((out / "consistency.json").read_text())


@pytest.fixture(scope="module")
def bf16_report(tmp_path_factory):
    """4 MoE layers, k=4 of 16 experts, bf16: megamoe and stock, ~1000 completion tokens."""
    from rl import config as C
    from rl.consistency import format_table, prepare, run

    tmp = tmp_path_factory.mktemp("cons_bf16")
    cfg = C.load(_config(tmp, "bfloat16", {"layers": 4, "hidden": 128, "experts": 16, "topk": 4, "intermediate": 64},
                         prompts=16, n=8, max_tokens=8))
    report = run(prepare(cfg, impls=("megamoe", "stock"), out_dir=tmp / "out", device="cpu"))
    print(format_table(report))
    return report


def _pair(report, sampler, trainer):
    (p,) = [p for p in report["pairs"] if p["sampler"] == sampler and p["trainer"] == trainer]
    return p


# -- the command's outputs -------------------------------------------------------------------------

def test_outputs_table_json_and_plots(fp32_cli):
    out, stdout, report = fp32_cli
    assert "end to end" in stdout and "per MoE layer" in stdout
    for s in IMPLS:
        for t in IMPLS:
            assert any(line.split()[:2] == [s, t] for line in stdout.splitlines()), f"no table row for {s}/{t}"
    meta = report["meta"]
    assert meta["dtype"] == "float32" and meta["impls"] == list(IMPLS) and meta["moe_layers"] == 2
    assert meta["completion_tokens"] > 0 and meta["moe_layer_tokens"] > meta["completion_tokens"]
    assert len(report["pairs"]) == 9
    for p in report["pairs"]:
        for k, v in p["metrics"].items():
            assert isinstance(v, float) and math.isfinite(v), f"{p['sampler']}/{p['trainer']} {k} = {v!r}"
        assert len(p["layers"]) == 2
        for layer in p["layers"]:
            assert all(isinstance(v, float) and math.isfinite(v) for v in layer.values()), layer
    for name in ("dlogp_hist.png", "layers.png"):
        import matplotlib.image as mpimg
        import numpy as np

        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG"
        pixels = mpimg.imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and np.isfinite(pixels).all()
        assert pixels.std() > 0, f"{name} is blank"


# -- per layer: megamoe on both sides contributes exactly nothing -----------------------------------

def _assert_layers_bitwise(report, impl):
    p = _pair(report, impl, impl)
    for i, layer in enumerate(p["layers"]):
        assert layer["moe/routing_agreement"] == 1.0, f"layer {i}: routing differs: {layer}"
        assert layer["moe/router_logits_max_abs_diff"] == 0.0, f"layer {i}: router logits differ: {layer}"
        assert layer["moe/out_bitwise_equal"] == 1.0 and layer["moe/out_rel_diff"] == 0.0, \
            f"layer {i}: MoE outputs of sampler and trainer differ: {layer}"


def _assert_probe_sees_differences(report):
    # Not vacuous: the same probe reports a difference where the two sides run different MoE kernels.
    # Which pairs differ depends on the CPU's fp32 GEMM kernels: on a 2-core AMD EPYC, stock/stock and
    # megamoe/stock (every layer); on a 2-core Intel Xeon with AMX (2026-12-03, OLMoE fp32), stock/stock
    # (1.4e-7 relative) while megamoe's sampler and transformers' experts gave the same bits. So some
    # layer of those pairs must differ, and every differing layer must say so consistently.
    layers = [(pair, layer) for pair in (("stock", "stock"), ("megamoe", "stock"))
              for layer in _pair(report, *pair)["layers"]]
    differing = [(pair, layer) for pair, layer in layers if layer["moe/out_bitwise_equal"] == 0.0]
    assert differing, f"no layer of stock/stock or megamoe/stock differs: {layers}"
    assert all(layer["moe/out_rel_diff"] > 0.0 for _, layer in differing), differing


def test_megamoe_layers_bitwise_fp32(fp32_cli):
    _, _, report = fp32_cli
    _assert_layers_bitwise(report, "megamoe")
    _assert_probe_sees_differences(report)


def test_reference_layers_share_routing_fp32(fp32_cli):
    """reference routes like megamoe (the same router logits and megamoe.route), so its routing is
    identical on both sides; its expert GEMMs are plain full-size matmuls, whose rounding depends on
    the thread count (vLLM's CPU worker runs 1 thread, this process more), so its outputs agree only
    to rounding (seen: 0 or up to 2.2e-8 relative in fp32, run to run), not bitwise."""
    _, _, report = fp32_cli
    for i, layer in enumerate(_pair(report, "reference", "reference")["layers"]):
        assert layer["moe/routing_agreement"] == 1.0 and layer["moe/router_logits_max_abs_diff"] == 0.0, (i, layer)
        assert layer["moe/out_rel_diff"] <= 1e-6, (i, layer)


def test_olmoe_sampler_on_megamoe_matches_transformers_fp32(fp32_cli):
    """The fp32 run is OLMoE's: vLLM with megamoe (routing without renormalisation) against
    transformers' own OLMoE (the stock trainer side), end to end, within the fp32 logprob bound of
    tests/rollout/test_rollout.py (1e-4; measured 4.8e-7 on a 2-core x86 CPU)."""
    _, _, report = fp32_cli
    config = json.loads((Path(report["meta"]["model_dir"]) / "config.json").read_text())
    assert config["architectures"] == ["OlmoeForCausalLM"] and config["norm_topk_prob"] is False
    metrics = _pair(report, "megamoe", "stock")["metrics"]
    print(f"OLMoE fp32: vLLM megamoe vs transformers max |dlogp| {metrics['mismatch/abs_logp_diff_max']:.2e}")
    assert metrics["mismatch/abs_logp_diff_max"] <= 1e-4, metrics


def test_megamoe_layers_bitwise_bf16(bf16_report):
    _assert_layers_bitwise(bf16_report, "megamoe")
    _assert_probe_sees_differences(bf16_report)


# -- end to end --------------------------------------------------------------------------------------

def test_end_to_end_megamoe_not_worse_than_stock_bf16(bf16_report):
    """Per token, |Δlogp| and k3 with megamoe on both sides vs with stock on both sides.

    On CPU the two are close: vLLM's CPU router and transformers' compute bitwise-equal bf16 router
    logits, so stock routes identically on both sides too, and the end-to-end mismatch is dominated by
    attention, norms and the LM head (measured in docs/CONSISTENCY.md: over four seeds megamoe's k3 KL
    was 3-9% lower in three and 5% higher in one). "No larger" is therefore tested as "not
    significantly larger": the paired mean difference over the same tokens must stay below three
    standard errors. A megamoe path that actually diverged (wrong routing, wrong weights) fails it.
    """
    mm = _pair(bf16_report, "megamoe", "megamoe")
    ss = _pair(bf16_report, "stock", "stock")
    d_mm, d_ss = torch.tensor(mm["dlogp"], dtype=torch.float64), torch.tensor(ss["dlogp"], dtype=torch.float64)
    assert d_mm.numel() == d_ss.numel() >= 500
    for name, f in (("|Δlogp|", torch.abs), ("k3", lambda d: torch.expm1(d) - d)):
        diff = f(d_mm) - f(d_ss)
        se = float(diff.std() / diff.numel() ** 0.5)
        print(f"{name}: megamoe/megamoe {float(f(d_mm).mean()):.3e} stock/stock {float(f(d_ss).mean()):.3e} "
              f"paired diff {float(diff.mean()):+.3e} (3 SE = {3 * se:.3e})")
        assert float(diff.mean()) <= 3 * se, f"{name}: megamoe on both sides is significantly worse than stock"
    # the table's aggregates agree with the per-token lists they summarise
    assert mm["metrics"]["mismatch/abs_logp_diff_mean"] == pytest.approx(float(d_mm.abs().mean()), rel=1e-9)


def test_generation_and_scoring_agree(fp32_cli):
    """The sampler's logprobs while generating vs when scoring the same tokens (decode vs prefill)."""
    _, _, report = fp32_cli
    g = report["generation_vs_scoring"]["metrics"]
    assert g["mismatch/abs_logp_diff_max"] < 1e-4, g


@pytest.mark.gpu
def test_h200_shape_bf16_megamoe_layers_bitwise_and_end_to_end(tmp_path):
    """The issue's GPU measurement: 8 layers, H=1024, E=64, k=8, bf16, vLLM CUDA + the trainer on CUDA."""
    pytest.importorskip("vllm")
    from rl import config as C
    from rl.consistency import format_table, prepare, run
    from rollout.testing import gpu_engine_kwargs

    cfg = C.load(_config(tmp_path, "bfloat16", {"layers": 8, "hidden": 1024, "experts": 64, "topk": 8,
                                                 "intermediate": 512}, prompts=32, n=8, max_tokens=16),
                 ["rollout.max_model_len=128", "trainer.max_seq_len=128", f"rollout.kv_cache_bytes={1 << 30}",
                  f"rollout.engine_kwargs={json.dumps(gpu_engine_kwargs())}"])
    report = run(prepare(cfg, impls=("megamoe", "stock"), out_dir=tmp_path / "out", device="cuda"))
    print(format_table(report))
    _assert_layers_bitwise(report, "megamoe")
    mm, ss = _pair(report, "megamoe", "megamoe")["metrics"], _pair(report, "stock", "stock")["metrics"]
    assert mm["mismatch/k3_kl"] <= ss["mismatch/k3_kl"], (mm, ss)
    assert mm["mismatch/abs_logp_diff_mean"] <= ss["mismatch/abs_logp_diff_mean"], (mm, ss)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [{"layers": 4, "hidden": 256, "experts": 16, "topk": 2, "intermediate": 128},
                                   {"layers": 8, "hidden": 1024, "experts": 64, "topk": 8, "intermediate": 512}],
                         ids=["4x256", "8x1024"])
def test_h200_bitwise_end_to_end(tmp_path, shape):
    """run.numerics=bitwise on CUDA (bf16, vLLM's batch-invariant mode, the decode in CUDA graphs, T=0.8): every
    trainer logprob equals the sampler's while generating and when scoring, bit for bit."""
    pytest.importorskip("vllm")
    from rl import config as C
    from rl.consistency import format_table, prepare, run
    from rollout.testing import gpu_engine_kwargs

    cfg = C.load(_config(tmp_path, "bfloat16", shape, prompts=16, n=8, max_tokens=16),
                 ["run.numerics=bitwise", "rollout.temperature=0.8", "rollout.max_model_len=128",
                  "trainer.max_seq_len=128", f"rollout.kv_cache_bytes={1 << 30}",
                  f"rollout.engine_kwargs={json.dumps(gpu_engine_kwargs())}"])
    report = run(prepare(cfg, impls=("megamoe",), out_dir=tmp_path / "out", device="cuda"))
    print(format_table(report))
    (pair,) = report["pairs"]
    for name, metrics in (("scored", pair["metrics"]), ("while generating", report["trainer_vs_generation"]["metrics"]),
                          ("vLLM generating vs scoring", report["generation_vs_scoring"]["metrics"])):
        assert metrics["mismatch/abs_logp_diff_max"] == 0.0, (name, metrics)
        assert metrics["mismatch/k3_kl"] == 0.0, (name, metrics)
    _assert_layers_bitwise(report, "megamoe")
