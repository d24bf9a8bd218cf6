"""`megamoe.route` against an independent float64 computation: ids, weights, ties and gradients.

    .venv/bin/python -m pytest -q tests/megamoe/test_routing.py

The independent version computes the scores in float64 from the exact logit values, picks the
top-k by a Python sort on (-score, expert index), and renormalises by hand; its gradients come from
autograd through those float64 ops. `route` itself computes in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import pytest
import torch

from megamoe import route
from megamoe.testing import TOLERANCES, assert_close

LOGIT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def scores_f64(logits_TE: torch.Tensor, scoring: str) -> torch.Tensor:
    z = logits_TE.double()
    if scoring == "softmax":
        e = torch.exp(z - z.max(dim=-1, keepdim=True).values.detach())
        return e / e.sum(dim=-1, keepdim=True)
    return 1.0 / (1.0 + torch.exp(-z))


def route_f64(logits_TE: torch.Tensor, top_k: int, scoring: str, renormalize: bool):
    """Independent routing in float64: per-row Python top-k, ties to the lower expert index."""
    scores = scores_f64(logits_TE, scoring)
    rows = scores.detach().tolist()
    ids = torch.tensor([sorted(range(len(r)), key=lambda i: (-r[i], i))[:top_k] for r in rows],
                       dtype=torch.int64).reshape(-1, top_k)
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def _logits(T, E, dtype, seed):
    return (2.0 * torch.randn(T, E, generator=torch.Generator().manual_seed(seed))).to(dtype)


SHAPES = [
    pytest.param(1, 8, 1, id="T1-E8-k1"),
    pytest.param(37, 60, 2, id="T37-E60-k2"),
    pytest.param(64, 128, 8, id="T64-E128-k8"),
    pytest.param(33, 64, 8, id="T33-E64-k8-olmoe"),
    pytest.param(16, 6, 6, id="T16-E6-k6-all-experts"),
]
SCORINGS = [pytest.param(s, r, id=f"{s}{'-renorm' if r else ''}")
            for s in ("softmax", "sigmoid") for r in (False, True)]


@pytest.mark.parametrize("dname", list(LOGIT_DTYPES))
@pytest.mark.parametrize("scoring,renormalize", SCORINGS)
@pytest.mark.parametrize("T,E,k", SHAPES)
def test_route_matches_float64(T, E, k, scoring, renormalize, dname):
    """bf16 logits have ties (8-bit mantissa); fp32 scores of equal logits are equal, so the ids
    still match the float64 order with ties to the lower index."""
    logits = _logits(T, E, LOGIT_DTYPES[dname], seed=T * 1000 + E)
    w, ids = route(logits, k, scoring, renormalize)
    w_ref, ids_ref = route_f64(logits, k, scoring, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.shape == ids.shape == (T, k)
    assert torch.equal(ids, ids_ref)
    # route computes in fp32 from exactly representable logits: fp32 rounding only.
    assert_close(f"route weights ({dname} logits)", w, w_ref, TOLERANCES[torch.float32])
    assert torch.all(w[:, 1:] <= w[:, :-1]), "weights are not in descending order"
    if renormalize:
        assert_close("renormalised weight sums", w.sum(-1), torch.ones(T), TOLERANCES[torch.float32])


@pytest.mark.parametrize("dname", list(LOGIT_DTYPES))
@pytest.mark.parametrize("scoring,renormalize", SCORINGS)
def test_route_gradients_match_float64(scoring, renormalize, dname):
    """d(loss)/d(logits) for a seeded random upstream gradient on the weights, against autograd
    through the float64 version. Gradients reach the logits in the logits' dtype."""
    T, E, k = 23, 12, 3
    dtype = LOGIT_DTYPES[dname]
    logits = _logits(T, E, dtype, seed=5).requires_grad_()
    logits64 = logits.detach().double().requires_grad_()
    gw = torch.randn(T, k, generator=torch.Generator().manual_seed(6))
    w, ids = route(logits, k, scoring, renormalize)
    w_ref, ids_ref = route_f64(logits64, k, scoring, renormalize)
    assert torch.equal(ids, ids_ref)
    (g,) = torch.autograd.grad(w, logits, gw)
    (g_ref,) = torch.autograd.grad(w_ref, logits64, gw.double())
    assert g.dtype == dtype
    # bf16 logits get a bf16 gradient: its rounding dominates there.
    assert_close(f"route d(logits) ({dname})", g, g_ref, TOLERANCES[dtype])

    picked = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    if scoring == "sigmoid" and not renormalize:
        # Each weight depends on its own logit only: the others get exactly nothing.
        assert torch.all(g[~picked] == 0)
    elif scoring == "softmax" and renormalize:
        # softmax renormalised over the top-k equals a softmax over the picked logits alone: the
        # others' gradient is zero up to rounding.
        assert float(g[~picked].abs().max()) <= 1e-6 * float(g.abs().max())
    elif scoring == "softmax":
        # Through the normaliser, every logit of a token gets a gradient.
        assert torch.all(g != 0)


@pytest.mark.parametrize("scoring,renormalize", SCORINGS)
def test_route_gradcheck_float64(scoring, renormalize):
    """torch.autograd.gradcheck with float64 logits. `route` computes in fp32 (by contract), so the
    finite-difference step and tolerances are fp32-sized: eps 1e-3 keeps the rounding error of the
    difference quotient near 6e-8 / 1e-3 ~ 1e-4 relative, and the logits are spaced >= 0.25 apart so
    no perturbation changes the top-k choice."""
    T, E, k = 4, 7, 3
    g = torch.Generator().manual_seed(7)
    logits = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).double() * 0.25 - 0.75
    logits += 0.01 * torch.rand(T, E, generator=g, dtype=torch.float64)

    def weights(z):
        return route(z, k, scoring, renormalize)[0]

    assert torch.autograd.gradcheck(weights, (logits.requires_grad_(),), eps=1e-3, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("E", [5, 8, 16, 67, 128, 256])
def test_route_ties_go_to_the_lower_index(E, device):
    """Documented behaviour: equal scores are ordered by expert index, lower first.

    torch.topk does not guarantee this (on CPU, torch 2.13, all-equal logits with E=5, k=1 pick
    expert 2); route uses a stable sort, so the choice does not depend on E, k or the backend.
    Ties are common with bf16 router logits.
    """
    k = min(4, E)
    g = torch.Generator().manual_seed(E)
    equal = torch.zeros(1, E, device=device)
    three_levels = torch.randint(0, 3, (64, E), generator=g).float()  # many ties per row
    for scoring in ("softmax", "sigmoid"):
        w, ids = route(equal, k, scoring)
        assert ids.tolist() == [list(range(k))], scoring
        assert torch.all(w == w[0, 0])
        w, ids = route(equal, k, scoring, renormalize=True)
        assert torch.allclose(w.cpu(), torch.full((1, k), 1.0 / k))
        _, ids = route(three_levels.to(device), k, scoring)
        _, ids_ref = route_f64(three_levels, k, scoring, False)
        ids = ids.cpu()
        assert torch.equal(ids, ids_ref), scoring


# -- DeepSeek-V3 style: score-correction bias, group-limited top-k, routed scaling factor ----------------

def route_grouped_f64(logits_TE, top_k, scoring, renormalize, bias_E, n_group, topk_group, scale):
    """Independent DeepSeek-V3 routing in float64, one row at a time in plain Python: choice scores
    s + bias; a group's score is the sum of its two best choice scores (with a bias) or its best one
    (without); the topk_group best groups (ties to the lower group) keep their experts; the top-k of
    those by choice score (ties to the lower id); weights are the unbiased s, renormalised, scaled."""
    scores = scores_f64(logits_TE, scoring)
    E = scores.shape[1]
    size = E // n_group
    b = [0.0] * E if bias_E is None else bias_E.double().tolist()
    ids = []
    for row in scores.detach().tolist():
        c = [row[i] + b[i] for i in range(E)]
        group_score = []
        for g in range(n_group):
            members = sorted(c[g * size:(g + 1) * size], reverse=True)
            group_score.append(members[0] + members[1] if bias_E is not None else members[0])
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        allowed = [i for i in range(E) if i // size in kept]
        ids.append(sorted(allowed, key=lambda i: (-c[i], i))[:top_k])
    ids = torch.tensor(ids, dtype=torch.int64).reshape(-1, top_k)
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * scale, ids


def _bias(E, seed):
    # DeepSeek-V3's trained biases are of the order of the scores' spread; 0.1 moves choices here.
    return 0.1 * torch.randn(E, generator=torch.Generator().manual_seed(seed))


GROUPED = [
    pytest.param(37, 64, 8, 8, 4, True, 2.5, id="T37-E64-k8-g8-tg4-bias-dsv3"),
    pytest.param(16, 64, 6, 1, 1, True, 2.446, id="T16-E64-k6-g1-bias-moonlight"),
    pytest.param(23, 60, 3, 6, 2, True, 1.0, id="T23-E60-k3-g6-tg2-bias"),
    pytest.param(23, 60, 3, 6, 2, False, 16.0, id="T23-E60-k3-g6-tg2-nobias-dsv2"),
    pytest.param(1, 8, 1, 4, 1, True, 1.5, id="T1-E8-k1-g4-tg1-bias"),
    pytest.param(9, 16, 8, 4, 2, True, 1.0, id="T9-E16-k8-g4-tg2-every-kept-expert"),
]


@pytest.mark.parametrize("scoring,renormalize", [pytest.param("sigmoid", True, id="sigmoid-renorm"),
                                                 pytest.param("sigmoid", False, id="sigmoid"),
                                                 pytest.param("softmax", False, id="softmax")])
@pytest.mark.parametrize("T,E,k,n_group,topk_group,with_bias,scale", GROUPED)
def test_grouped_route_matches_float64(T, E, k, n_group, topk_group, with_bias, scale, scoring, renormalize):
    """fp32 logits (seeded, continuous: ties have probability ~0) against the float64 loop."""
    logits = _logits(T, E, torch.float32, seed=T * 100 + E + n_group)
    bias = _bias(E, seed=E + topk_group) if with_bias else None
    kw = dict(e_score_correction_bias=bias, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
    w, ids = route(logits, k, scoring, renormalize, **kw)
    w_ref, ids_ref = route_grouped_f64(logits, k, scoring, renormalize, bias, n_group, topk_group, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (T, k)
    assert torch.equal(ids, ids_ref)
    assert_close("grouped route weights", w, w_ref, TOLERANCES[torch.float32])
    if with_bias:
        # The bias must have changed some choice, or this case does not test it.
        _, ids_unbiased = route(logits, k, scoring, renormalize, **(kw | dict(e_score_correction_bias=None)))
        assert not torch.equal(ids, ids_unbiased) or T == 1
    if topk_group < n_group:
        size = E // n_group
        assert torch.all(torch.tensor([len(set(r)) for r in (ids // size).tolist()]) <= topk_group)


def test_grouped_route_gradients_match_float64():
    """d(loss)/d(logits) through sigmoid, bias-steered choice, renormalisation and scaling, against autograd
    through the float64 loop; the bias gets no gradient (it only steers the choice)."""
    T, E, k = 19, 32, 4
    logits = _logits(T, E, torch.float32, seed=31).requires_grad_()
    logits64 = logits.detach().double().requires_grad_()
    bias = _bias(E, seed=32).requires_grad_()
    gw = torch.randn(T, k, generator=torch.Generator().manual_seed(33))
    kw = dict(e_score_correction_bias=bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    w, ids = route(logits, k, "sigmoid", True, **kw)
    w_ref, ids_ref = route_grouped_f64(logits64, k, "sigmoid", True, bias.detach(), 4, 2, 2.5)
    assert torch.equal(ids, ids_ref)
    (g, gb) = torch.autograd.grad(w, (logits, bias), gw, allow_unused=True)
    (g_ref,) = torch.autograd.grad(w_ref, logits64, gw.double())
    assert gb is None
    assert_close("grouped route d(logits)", g, g_ref, TOLERANCES[torch.float32])
    picked = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    assert torch.all(g[~picked] == 0) and torch.all(g[picked] != 0)


def test_grouped_route_is_batch_invariant():
    """Each row routed alone gives bitwise the row of the batched call."""
    T, E, k = 29, 64, 8
    logits = _logits(T, E, torch.float32, seed=41)
    kw = dict(e_score_correction_bias=_bias(E, seed=42), n_group=8, topk_group=4, routed_scaling_factor=2.5)
    w, ids = route(logits, k, "sigmoid", True, **kw)
    for t in range(T):
        w1, ids1 = route(logits[t:t + 1], k, "sigmoid", True, **kw)
        assert torch.equal(ids1[0], ids[t]) and torch.equal(w1[0], w[t]), t


@pytest.mark.parametrize("E,k,n_group,topk_group,norm,scale", [
    pytest.param(64, 8, 8, 4, True, 2.5, id="E64-k8-g8-tg4-dsv3"),
    pytest.param(64, 6, 1, 1, True, 2.446, id="E64-k6-g1-moonlight"),
    pytest.param(16, 2, 4, 2, False, 1.5, id="E16-k2-g4-tg2-no-renorm"),
])
def test_route_matches_transformers_deepseek_v3_router(E, k, n_group, topk_group, norm, scale):
    """transformers' own DeepseekV3TopkRouter on seeded hidden states, weight and bias: its logits fed to
    `route` give the same experts (it returns them unsorted: compared as sorted id lists) with the same
    weights per expert, to fp32 rounding."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    T, H = 41, 48
    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(E + k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) / H ** 0.5)
        router.e_score_correction_bias.copy_(0.1 * torch.randn(E, generator=g))
    x = torch.randn(T, H, generator=g)
    with torch.no_grad():
        logits, w_hf, ids_hf = router(x)
    w, ids = route(logits, k, "sigmoid", norm, e_score_correction_bias=router.e_score_correction_bias,
                   n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
    order = torch.argsort(ids_hf, dim=-1)
    ids_hf_sorted, w_hf_sorted = ids_hf.gather(1, order), w_hf.gather(1, order)
    order = torch.argsort(ids, dim=-1)
    assert torch.equal(ids.gather(1, order), ids_hf_sorted)
    assert_close("route vs transformers DeepseekV3TopkRouter", w.gather(1, order), w_hf_sorted,
                 TOLERANCES[torch.float32])


def test_route_matches_vllm_grouped_topk():
    """vLLM 0.32's own grouped_topk (its native torch path, the one vLLM CPU runs) on the same logits and
    bias: same expert sets, same weights per expert to fp32 rounding."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    native = getattr(grouped_topk, "_torchdynamo_orig_callable", grouped_topk)  # skip compiling it here
    T, E, k = 37, 64, 8
    logits = _logits(T, E, torch.float32, seed=51)
    bias = _bias(E, seed=52)
    for kw in (dict(e_score_correction_bias=bias, num_expert_group=8, topk_group=4),
               dict(e_score_correction_bias=None, num_expert_group=8, topk_group=3)):
        w_v, ids_v = native(logits, logits, k, True, scoring_func="sigmoid", routed_scaling_factor=2.5, **kw)
        w, ids = route(logits, k, "sigmoid", True, e_score_correction_bias=kw["e_score_correction_bias"],
                       n_group=kw["num_expert_group"], topk_group=kw["topk_group"], routed_scaling_factor=2.5)
        ids_v = ids_v.long()
        ov, o = torch.argsort(ids_v, dim=-1), torch.argsort(ids, dim=-1)
        assert torch.equal(ids.gather(1, o), ids_v.gather(1, ov))
        assert_close("route vs vLLM grouped_topk", w.gather(1, o), w_v.gather(1, ov), TOLERANCES[torch.float32])


BAD_GROUPED = [
    pytest.param(dict(e_score_correction_bias=torch.ones(7)), ValueError,
                 r"^e_score_correction_bias: expected shape \[E=8\] \(one per expert\), got \(7,\)", id="bias-shape"),
    pytest.param(dict(e_score_correction_bias=torch.ones(1, 8)), ValueError,
                 r"^e_score_correction_bias: expected shape \[E=8\]", id="bias-2d"),
    pytest.param(dict(e_score_correction_bias=torch.ones(8, dtype=torch.int64)), TypeError,
                 r"^e_score_correction_bias: expected a floating dtype, got torch.int64", id="bias-int"),
    pytest.param(dict(e_score_correction_bias=[0.0] * 8), TypeError,
                 r"^e_score_correction_bias: expected a torch.Tensor or None, got list", id="bias-list"),
    pytest.param(dict(e_score_correction_bias=torch.full((8,), float("nan"))), ValueError,
                 r"^e_score_correction_bias: expected finite values", id="bias-nan"),
    pytest.param(dict(n_group=3), ValueError, r"^n_group: expected a divisor of E=8 .*, got 3", id="n_group-not-divisor"),
    pytest.param(dict(n_group=0), ValueError, r"^n_group: expected an int in \[1, E=8\], got 0", id="n_group-0"),
    pytest.param(dict(n_group=4, topk_group=5), ValueError,
                 r"^topk_group: expected an int in \[1, n_group=4\], got 5", id="topk_group-above-n_group"),
    pytest.param(dict(n_group=4, topk_group=0), ValueError, r"^topk_group: expected an int in \[1, n_group=4\], got 0",
                 id="topk_group-0"),
    pytest.param(dict(n_group=4, topk_group=1, top_k=3), ValueError,
                 r"^top_k: expected an int in \[1, topk_group\*E/n_group=1\*2=2\], got 3", id="top_k-above-kept"),
    pytest.param(dict(n_group=8, topk_group=4, e_score_correction_bias=torch.ones(8)), ValueError,
                 r"^n_group: expected E/n_group >= 2 with e_score_correction_bias", id="groups-of-one-with-bias"),
    pytest.param(dict(routed_scaling_factor=0.0), ValueError,
                 r"^routed_scaling_factor: expected a finite number > 0, got 0.0", id="scale-0"),
    pytest.param(dict(routed_scaling_factor=float("inf")), ValueError, r"^routed_scaling_factor: expected a finite",
                 id="scale-inf"),
    pytest.param(dict(routed_scaling_factor="2"), ValueError, r"^routed_scaling_factor: expected a finite number",
                 id="scale-str"),
]


@pytest.mark.parametrize("changes,exc,pattern", BAD_GROUPED)
def test_bad_grouped_route_input(changes, exc, pattern):
    args = dict(router_logits_TE=_logits(5, 8, torch.float32, seed=1), top_k=2, scoring="sigmoid") | changes
    with pytest.raises(exc, match=pattern):
        route(**args)
    route(router_logits_TE=args["router_logits_TE"], top_k=2, scoring="sigmoid",
          e_score_correction_bias=_bias(8, 2), n_group=4, topk_group=2, routed_scaling_factor=2.0)  # control


def test_route_reaches_no_aten_op_vllm_overrides():
    """A bitwise engine runs in vLLM's batch-invariant mode, which overrides aten's softmax, log-softmax, mean
    and bmm (and mm, addmm, matmul, linear on some GPUs); the trainer's process does not. route must take the
    same kernels in both, so none of those ops may run in it (forward and backward): each is overridden here
    by an impl that fails, as vLLM's mode would replace it."""
    overridden = ("softmax.int", "_softmax", "_log_softmax", "mean.dim", "bmm", "mm", "addmm", "matmul", "linear")
    reached = []
    lib = torch.library.Library("aten", "IMPL")
    try:
        for op in overridden:
            def fail(*args, _op=op, **kwargs):
                reached.append(_op)
                raise RuntimeError(f"route reached aten::{_op}")

            lib.impl(op, fail, "CPU")
        logits = _logits(37, 16, torch.float32, 3).requires_grad_(True)
        w, ids = route(logits, 4, "softmax", renormalize=True)
        (w * torch.arange(1.0, 5.0)).sum().backward()
    finally:
        lib._destroy()
    assert reached == []
    assert torch.isfinite(logits.grad).all()
