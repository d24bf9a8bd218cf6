"""`megamoe.route` against an independent float64 computation: ids, weights, ties and gradients.

    .venv/bin/python -m pytest -q tests/test_routing.py

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


def route_f64(logits_TE: torch.Tensor, top_k: int, scoring: str, renormalize: bool):
    """Independent routing in float64: per-row Python top-k, ties to the lower expert index."""
    z = logits_TE.double()
    if scoring == "softmax":
        e = torch.exp(z - z.max(dim=-1, keepdim=True).values.detach())
        scores = e / e.sum(dim=-1, keepdim=True)
    else:
        scores = 1.0 / (1.0 + torch.exp(-z))
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
