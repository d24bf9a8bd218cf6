"""The vLLM hook's custom ops (rollout/moe_method.py): torch's opcheck (schema, fake tensors, dynamic-shape
tracing), the values they compute (megamoe.fused_moe and megamoe.route called directly, bitwise), and a
torch.compile'd caller with fullgraph=True that calls them as opaque nodes, counted on every call. No engine.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/rollout/test_rollout_ops.py
"""

from __future__ import annotations

import pytest
import torch

import megamoe
from megamoe.contract import clamped_swiglu
from megamoe.moe import dense_mlp
from rollout import moe_method as M

T, H, I, E, K = 7, 64, 32, 8, 2
# fp32 experts (GEMMs over H=64 and I=32) against an fp64 loop over tokens and chosen experts, outputs up to
# ~5 in magnitude: measured max 1.2e-6 over both impls and both routings (torch 2.13 CPU, 2026-12-05).
FP64_TOL = 1e-5


def _inputs(seed: int = 0, biases: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    logits = torch.randn(T, E, generator=g)
    b13 = torch.randn(E, 2 * I, generator=g) if biases else None
    b2 = torch.randn(E, H, generator=g) if biases else None
    return x, w13, w2, logits, b13, b2


ROUTINGS = {
    "softmax_top2": dict(top_k=K, scoring="softmax", renormalize=True),
    # DeepSeek-V3's: sigmoid scores, a score-correction bias, 4 groups of which 2 are kept
    "grouped_sigmoid": dict(top_k=K, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2),
}


def _route_kwargs(name: str) -> dict:
    kw = dict(ROUTINGS[name])
    if name == "grouped_sigmoid":
        kw["e_score_correction_bias"] = torch.randn(E, generator=torch.Generator().manual_seed(9))
    return kw


@pytest.mark.parametrize("impl,biases", [("megamoe", False), ("megamoe", True), ("reference", True)])
def test_ops_pass_opcheck(impl, biases):
    x, w13, w2, logits, b13, b2 = _inputs(biases=biases)
    act = M.activation_fields(clamped_swiglu(1.702, 7.0) if biases else None)
    tw, ids = megamoe.route(logits, K, "softmax", True)
    torch.library.opcheck(M.routed_experts_op, (x, w13, w2, tw, ids, impl, b13, b2, *act))
    for name in ROUTINGS:
        kw = _route_kwargs(name)
        torch.library.opcheck(M.routed_experts_from_logits_op,
                              (x, w13, w2, logits, impl, kw["top_k"], kw["scoring"], kw["renormalize"],
                               kw.get("e_score_correction_bias"), kw.get("n_group", 1), kw.get("topk_group", 1),
                               b13, b2, *act))
    torch.library.opcheck(M.shared_experts_op, (x, w13[0], w2[0], impl))


def test_fake_implementations_give_the_real_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w13, w2, logits, *_ = _inputs()
    tw, ids = megamoe.route(logits, K, "softmax", True)
    real = M.routed_experts_op(x, w13, w2, tw, ids, "megamoe")
    with FakeTensorMode() as mode:
        fx, fw13, fw2, flogits, ftw, fids = (mode.from_tensor(t) for t in (x, w13, w2, logits, tw, ids))
        fakes = [M.routed_experts_op(fx, fw13, fw2, ftw, fids, "megamoe"),
                 M.routed_experts_from_logits_op(fx, fw13, fw2, flogits, "megamoe", K, "softmax", True),
                 M.shared_experts_op(fx, fw13[0], fw2[0], "megamoe")]
    for fake in fakes:
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.parametrize("impl", ["megamoe", "reference"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_ops_compute_megamoe_route_and_fused_moe_bitwise(impl, routing):
    x, w13, w2, logits, b13, b2 = _inputs(seed=1, biases=True)
    act = clamped_swiglu(1.702, 7.0)
    kw = _route_kwargs(routing)
    tw, ids = megamoe.route(logits, **kw)
    want = megamoe.fused_moe(x, w13, w2, tw, ids, impl, b13=b13, b2=b2, activation=act)
    got = M.routed_experts_from_logits(x, w13, w2, logits, impl, **kw, b13_E2I=b13, b2_EH=b2, activation=act)
    assert torch.equal(got, want)
    assert torch.equal(M.routed_experts(x, w13, w2, tw, ids, impl, b13_E2I=b13, b2_EH=b2, activation=act), want)
    assert torch.equal(M.shared_experts(x, w13[0], w2[0], impl), dense_mlp(x, w13[0], w2[0], impl))
    # and the ground truth: fp64 per token, per chosen expert
    x64, w13_64, w2_64 = x.double(), w13.double(), w2.double()
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(tw.shape[1]):
            e = int(ids[t, j])
            gu = w13_64[e] @ x64[t] + b13[e].double()
            gate, up = gu[:I].clamp(max=act.limit), gu[I:].clamp(-act.limit, act.limit)
            h = gate * torch.sigmoid(act.alpha * gate) * (up + 1)
            ref[t] += tw[t, j].double() * (w2_64[e] @ h + b2[e].double())
    assert (got.double() - ref).abs().max().item() <= FP64_TOL


def test_compiled_caller_calls_the_ops_opaquely_and_counts_each_call():
    """Dynamo traces a caller with fullgraph=True (no graph break): the ops are single nodes of the graph,
    run with real tensors on every call, so the counter counts compiled calls too, with the eager bits."""
    x, w13, w2, logits, *_ = _inputs(seed=2)

    def moe_block(x, logits):
        y = M.routed_experts_from_logits(x * 2.0, w13, w2, logits, "megamoe", top_k=K, scoring="softmax",
                                         renormalize=True)
        return y + M.shared_experts(x, w13[0], w2[0], "megamoe")

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(moe_block, fullgraph=True, backend=backend, dynamic=True)
    M.reset_moe_calls()
    outs = [compiled(x[:n], logits[:n]) for n in (T, T - 2, T)]
    assert M.moe_calls() == {"megamoe": 3}
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert targets.count("megamoe_rollout.routed_experts_from_logits.default") == len(graphs) >= 1, targets
    assert not any("fused_moe" in t or "sort" in t for t in targets), targets  # nothing of the op was traced
    M.reset_moe_calls()
    for n, out in zip((T, T - 2, T), outs):
        assert torch.equal(out, moe_block(x[:n], logits[:n]))
    assert M.moe_calls() == {"megamoe": 3}
