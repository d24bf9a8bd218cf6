"""What `megamoe-rl consistency` relies on, without an engine: the megamoe MoE block (batch-invariant
router logits -> megamoe.route -> megamoe experts) is deterministic and batch invariant; the shared
mismatch / per-layer metrics; bad input refused before any engine starts.

    .venv/bin/python -m pytest -q tests/rl/test_consistency_invariance.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import megamoe
from megamoe.router import router_logits
from megamoe.testing import TOLERANCES, assert_close

# (T_max, H, I, E, k): the tiny model's MoE shape, and an odd one (non-power-of-two H and I, k=3).
BLOCK_SHAPES = [pytest.param(64, 64, 32, 8, 2, id="H64-I32-E8-k2"),
                pytest.param(64, 96, 48, 13, 3, id="H96-I48-E13-k3")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _block_weights(H, I, E, dtype, device, seed=3):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype).to(device)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype).to(device)
    wr = (torch.randn(E, H, generator=g) / H**0.5).to(dtype).to(device)
    return w13, w2, wr


def moe_block(x_TH, w13, w2, wr, k):
    """One MoE layer exactly as both sides compute it with megamoe: rollout/adapter.py's MegaMoEGate +
    MegaMoEMethod and trainer/experts.py's Fp32Router + megamoe experts."""
    weights, ids = megamoe.route(router_logits(x_TH, wr), k, "softmax", renormalize=True)
    return megamoe.fused_moe(x_TH, w13, w2, weights, ids, impl="megamoe")


def _check_block_invariance(T_max, H, I, E, k, dtype, device, sizes=(1, 7, 64)):  # noqa: E741
    w13, w2, wr = _block_weights(H, I, E, dtype, device)
    x = torch.randn(T_max, H, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
    full = moe_block(x, w13, w2, wr, k)
    assert float(full.abs().max()) > 0, "an all-zero output would make the comparison vacuous"
    for n in sizes:
        for start in sorted({0, (T_max - n) // 2, T_max - n}):
            part = moe_block(x[start:start + n], w13, w2, wr, k)
            diff = (part.double() - full[start:start + n].double()).abs().max().item()
            assert torch.equal(part, full[start:start + n]), \
                f"tokens {start}:{start + n} computed in a batch of {n}: max diff {diff:.3e} vs the batch of {T_max}"
    for run in range(2):
        assert torch.equal(moe_block(x, w13, w2, wr, k), full), f"repeated run {run + 1} differs"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T_max,H,I,E,k", BLOCK_SHAPES)
def test_megamoe_block_batch_invariant_and_deterministic_cpu(T_max, H, I, E, k, dtype):  # noqa: E741
    """A token's MoE output is bitwise the same alone, in a batch of 7, in a batch of 64, run after run."""
    _check_block_invariance(T_max, H, I, E, k, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_megamoe_block_batch_invariant_and_deterministic_gpu(dtype):
    """The same on CUDA (the Triton kernel), at the H200 consistency run's MoE shape."""
    _check_block_invariance(512, 1024, 512, 64, 8, dtype, "cuda", sizes=(1, 7, 64, 333))


def test_megamoe_block_thread_count_invariant_large_batch_cpu():
    """Large batches: a token's output must not depend on the thread count (sampler and trainer differ)."""
    T, H, I, E, k = 5220, 64, 32, 8, 2  # ~1300 rows per expert: 1300 * 32 > ATen's grain of 32768
    w13, w2, wr = _block_weights(H, I, E, torch.float32, "cpu")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe_block(x, w13, w2, wr, k)
        torch.set_num_threads(2)
        two = moe_block(x, w13, w2, wr, k)
    finally:
        torch.set_num_threads(before)
    rows = int((one != two).any(dim=1).sum())
    assert rows == 0, f"{rows} of {T} tokens differ between 1 and 2 threads"


# -- the shared router-logits function ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_router_logits_batch_invariant_fp32_and_close_to_linear(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 96, generator=g).to(dtype)
    w = torch.randn(13, 96, generator=g).to(dtype)
    full = router_logits(x, w)
    assert full.dtype == torch.float32 and full.shape == (100, 13)
    for n, start in ((1, 0), (1, 99), (7, 40), (64, 36), (33, 10)):
        assert torch.equal(router_logits(x[start:start + n], w), full[start:start + n]), f"rows {start}:{start + n}"
    assert_close("router_logits", full, torch.nn.functional.linear(x.double(), w.double()).float(),
                 TOLERANCES[torch.float32])


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "router-bias"])
def test_router_logits_gradients_and_opcheck(with_bias):
    """With gpt-oss's router bias too: added in fp32 after the blocked product, its gradient the column sum."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g, requires_grad=True)
    w = torch.randn(8, 64, generator=g, requires_grad=True)
    b = torch.randn(8, generator=g, requires_grad=True) if with_bias else None
    args = (x, w, b) if with_bias else (x, w)
    torch.library.opcheck(torch.ops.megamoe.router_logits.default, args)
    dy = torch.randn(37, 8, generator=g)
    y = router_logits(*args)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if with_bias else None
    want = torch.nn.functional.linear(x64, w64, b64)
    want.backward(dy.double())
    assert_close("y", y.detach(), want.detach().float(), TOLERANCES[torch.float32])
    assert_close("dx", x.grad, x64.grad, TOLERANCES[torch.float32])
    assert_close("dw", w.grad, w64.grad, TOLERANCES[torch.float32])
    if with_bias:
        assert_close("db", b.grad, b64.grad, TOLERANCES[torch.float32])
        full = router_logits(x.detach(), w.detach(), b.detach())
        for n, start in ((1, 0), (7, 30), (33, 4)):
            assert torch.equal(router_logits(x.detach()[start:start + n], w.detach(), b.detach()), full[start:start + n])


def test_router_logits_refuses_bad_input():
    with pytest.raises(ValueError, match=r"w: expected shape \[E, H=64\]"):
        router_logits(torch.randn(3, 64), torch.randn(8, 32))
    with pytest.raises(ValueError, match="x: expected a 2-D tensor"):
        router_logits(torch.randn(2, 3, 64), torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"^b: expected shape \[E=8\] \(one per expert\), got \(7,\)"):
        router_logits(torch.randn(3, 64), torch.randn(8, 64), torch.randn(7))


# -- the metrics both `train` and `consistency` report ------------------------------------------

def test_mismatch_metrics_new_keys_by_hand():
    from rl.metrics import MISMATCH_KEYS, mismatch_metrics

    t = [[math.log(0.5), math.log(0.2)], [math.log(0.9)]]
    s = [[math.log(0.4), math.log(0.2)], [math.log(0.9) - 5e-4]]
    m = mismatch_metrics(t, s)
    assert set(MISMATCH_KEYS) <= set(m)
    assert m["mismatch/abs_prob_diff_max"] == pytest.approx(0.1, rel=1e-9)
    dp3 = 0.9 - 0.9 * math.exp(-5e-4)
    assert m["mismatch/abs_prob_diff_mean"] == pytest.approx((0.1 + 0.0 + dp3) / 3, rel=1e-9)
    assert m["mismatch/logp_diff_gt_1e-3_frac"] == pytest.approx(1 / 3)  # log(0.5/0.4) only
    pt = [0.5, 0.2, 0.9]
    ps = [0.4, 0.2, 0.9 * math.exp(-5e-4)]
    mt, ms = sum(pt) / 3, sum(ps) / 3
    cov = sum((a - mt) * (b - ms) for a, b in zip(pt, ps))
    r = cov / math.sqrt(sum((a - mt) ** 2 for a in pt) * sum((b - ms) ** 2 for b in ps))
    assert m["mismatch/prob_pearson"] == pytest.approx(r, rel=1e-9)
    assert m["mismatch/prob_pearson"] < 1.0


def test_mismatch_metrics_identical_and_degenerate():
    from rl.metrics import mismatch_metrics

    same = mismatch_metrics([[-0.1, -2.0, -0.7]], [[-0.1, -2.0, -0.7]])
    assert same["mismatch/k3_kl"] == 0.0 and same["mismatch/abs_prob_diff_max"] == 0.0
    assert same["mismatch/logp_diff_gt_1e-3_frac"] == 0.0
    assert same["mismatch/prob_pearson"] == pytest.approx(1.0, abs=1e-12)
    flat = mismatch_metrics([[-0.5, -0.5]], [[-0.5, -0.4]])
    assert math.isnan(flat["mismatch/prob_pearson"]), "no variance on one side: the correlation is undefined"


def test_moe_layer_metrics():
    from rl.metrics import moe_layer_metrics, relative_difference, routing_agreement

    ids_a = torch.tensor([[0, 3], [1, 2], [5, 4], [6, 7]])
    ids_b = torch.tensor([[3, 0], [1, 2], [5, 6], [6, 7]])  # slot order differs in row 0: same set
    assert routing_agreement(ids_a, ids_b) == pytest.approx(0.75)
    y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    y2 = y.clone()
    y2[0, 0] += 1e-3
    m = moe_layer_metrics({"logits": torch.zeros(4, 8), "ids": ids_a, "out": y2},
                          {"logits": torch.zeros(4, 8), "ids": ids_b, "out": y})
    assert m["moe/out_bitwise_equal"] == 0.0 and m["moe/out_max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert m["moe/out_rel_diff"] == pytest.approx(1e-3 / float(y.double().norm()), rel=1e-3)
    same = moe_layer_metrics({"logits": torch.ones(4, 8), "ids": ids_a, "out": y},
                             {"logits": torch.ones(4, 8), "ids": ids_a, "out": y.clone()})
    assert same["moe/out_bitwise_equal"] == 1.0 and same["moe/out_rel_diff"] == 0.0
    with pytest.raises(ValueError, match="reference is all zeros"):
        relative_difference(y, torch.zeros_like(y))


# -- bad input: refused before any engine starts ------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rl.make_model import make_model

    return make_model(tmp_path_factory.mktemp("cons_bad") / "tiny", layers=1)


@pytest.fixture
def no_engine(monkeypatch):
    """Any engine start fails the test: the errors must come first."""
    from rl import consistency

    def refuse(*a, **k):
        raise AssertionError("an engine was started before the input was checked")

    monkeypatch.setattr(consistency, "_start_engine", refuse)


def _cli(args, capsys):
    from rl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["consistency", *args])
    assert e.value.code == 2
    return capsys.readouterr().err


def _config(tmp_path, model_dir, prompts, **rollout):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in prompts))
    cfg = tmp_path / "cfg.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir)},
        "rollout": {"max_tokens": 4, "max_model_len": 64, "kv_cache_bytes": 64 << 20, **rollout},
        "trainer": {"max_seq_len": 64},
        "data": {"path": str(data)},
        "run": {"out_dir": str(tmp_path / "run"), "prompts_per_step": len(prompts)},
    }))
    return str(cfg)


def test_unknown_impl_is_refused(tmp_path, tiny, capsys, no_engine):
    err = _cli(["--config", _config(tmp_path, tiny, ["1 + 2 ="]), "--impls", "megamoe,fused"], capsys)
    assert "--impls: unknown implementation(s) ['fused']" in err and "'megamoe', 'reference', 'stock'" in err
    err = _cli(["--config", _config(tmp_path, tiny, ["1 + 2 ="]), "--impls", "megamoe,,stock"], capsys)
    assert "--impls: expected a comma-separated list" in err


def test_checkpoint_with_a_missing_tensor_is_refused(tmp_path, tiny, capsys, no_engine):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    state = load_file(broken / "model.safetensors")
    name = next(k for k in state if k.endswith("mlp.gate.weight"))
    del state[name]
    save_file(state, broken / "model.safetensors")
    err = _cli(["--config", _config(tmp_path, broken, ["1 + 2 ="])], capsys)
    assert "the checkpoint does not load" in err and name in err and "missing" in err


def test_unreadable_checkpoint_is_refused(tmp_path, tiny, capsys, no_engine):
    import shutil

    broken = tmp_path / "garbage"
    shutil.copytree(tiny, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    err = _cli(["--config", _config(tmp_path, broken, ["1 + 2 ="])], capsys)
    assert f"model {str(broken)!r}" in err and "the checkpoint does not load" in err


def test_architecture_the_trainer_cannot_load_is_refused(tmp_path, tiny, capsys, no_engine):
    import shutil

    other = tmp_path / "llama"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (other / "config.json").write_text(json.dumps(cfg))
    err = _cli(["--config", _config(tmp_path, other, ["1 + 2 ="])], capsys)
    assert "model_type 'llama' cannot be loaded by the trainer" in err


def test_prompt_longer_than_the_context_is_refused(tmp_path, tiny, capsys, no_engine):
    long = "the cat sat on the mat and " * 12
    err = _cli(["--config", _config(tmp_path, tiny, ["1 + 2 =", long])], capsys)
    assert "prompt 1 (" in err and "rollout.max_tokens=4" in err and "<= rollout.max_model_len=64" in err


def test_top_p_below_one_is_refused(tmp_path, tiny, capsys, no_engine):
    err = _cli(["--config", _config(tmp_path, tiny, ["1 + 2 ="], top_p=0.9)], capsys)
    assert "rollout.top_p: expected 1.0" in err


def test_help_lists_consistency_and_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from rl.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    from rl.cli import build_parser

    assert "consistency" in build_parser().format_help()
