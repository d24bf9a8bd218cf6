"""The unfused `reference` path against the fp32 ground truth, and the ground truth against hand loops.

    .venv/bin/python -m pytest -q tests/megamoe/test_ref.py

`megamoe.ref.moe_unfused` (also reached as `megamoe.fused_moe(..., impl="reference")`) is what every
other comparison in the project trusts, so it is checked here forward and for every gradient (x,
w13, w2, topk_weights) against `moe_ground_truth` on seeded random inputs, in fp32 and bf16, over
the edge cases of CONVENTIONS.md. The ground truth is in turn checked against per-token loops in
float64 written out by hand, and its gradients with torch.autograd.gradcheck.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import megamoe
from megamoe.ref import moe_ground_truth, moe_unfused
from megamoe.testing import TOLERANCES, assert_close, make_problem, weight_grad_condition

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Case:
    T: int
    H: int
    I: int  # noqa: E741  (the legend's name)
    E: int
    k: int
    routing: str = "random"      # make_problem's routing
    drop_frac: float = 0.0       # fraction of slots set to -1
    dead_token: int | None = None  # a token whose slots are all -1
    dup_ids: bool = False        # every other token sends both of its first two slots to one expert
    seed: int = 0

    def problem(self, dtype: torch.dtype):
        p = make_problem(self.T, self.H, self.I, self.E, self.k, dtype=dtype, seed=self.seed,
                         routing=self.routing, drop_frac=self.drop_frac)
        if self.dead_token is not None:
            p.topk_ids[self.dead_token] = -1
        if self.dup_ids:
            p.topk_ids[::2, 1] = p.topk_ids[::2, 0]
        return p


CASES = {
    "T1-H32-I16-E4-k1": Case(1, 32, 16, 4, 1),
    "T1-H32-I16-E4-k3": Case(1, 32, 16, 4, 3),
    "T63-H100-I40-E6-k3": Case(63, 100, 40, 6, 3),
    "T17-H52-I20-E5-k1": Case(17, 52, 20, 5, 1, seed=1),
    "T128-H64-I32-E8-k2": Case(128, 64, 32, 8, 2, seed=2),
    "T33-H40-I20-E7-k2-empty-experts": Case(33, 40, 20, 7, 2, routing="skip_odd", seed=3),
    "T20-H36-I12-E4-k1-one-expert": Case(20, 36, 12, 4, 1, routing="one_expert", seed=4),
    "T20-H36-I12-E5-k3-one-expert": Case(20, 36, 12, 5, 3, routing="one_expert", seed=5),
    "T31-H44-I28-E6-k3-drop-dead-token": Case(31, 44, 28, 6, 3, drop_frac=0.3, dead_token=5, seed=6),
    "T12-H24-I8-E3-k2-dup-ids": Case(12, 24, 8, 3, 2, dup_ids=True, seed=7),
    "T8-H20-I12-E1-k1-single-expert": Case(8, 20, 12, 1, 1, seed=8),
    "T10-H24-I16-E3-k3-k-equals-E": Case(10, 24, 16, 3, 3, seed=9),
}

ENTRIES = {
    "moe_unfused": moe_unfused,
    "fused_moe-reference": lambda *a: megamoe.fused_moe(*a, impl="reference"),
}

PARAMS = [pytest.param(entry, case, dtype, id=f"{entry}-{cid}-{dname}")
          for entry in ENTRIES for cid, case in CASES.items() for dname, dtype in DTYPES.items()]

GRAD_NAMES = ("x", "w13", "w2", "topk_weights")


def _forward_backward(fn, leaves, gy):
    y = fn(*leaves.args())
    grads = torch.autograd.grad(y, (leaves.x, leaves.w13, leaves.w2, leaves.topk_weights), gy)
    return y, dict(zip(GRAD_NAMES, grads))


@pytest.mark.parametrize("entry,case,dtype", PARAMS)
def test_reference_matches_ground_truth(entry, case, dtype):
    _check_against_ground_truth(entry, case, dtype, "cpu")


# On CUDA the reference takes torch._grouped_mm (Hopper, bf16, 16-byte aligned sizes: the H64-I32
# case) or the per-expert loop (the others); the ground truth stays on the CPU.
GPU_CASES = ("T128-H64-I32-E8-k2", "T63-H100-I40-E6-k3", "T33-H40-I20-E7-k2-empty-experts",
             "T31-H44-I28-E6-k3-drop-dead-token")


@pytest.mark.gpu
@pytest.mark.parametrize("entry,case,dtype", [pytest.param("moe_unfused", CASES[cid], dtype, id=f"{cid}-{dname}")
                                              for cid in GPU_CASES for dname, dtype in DTYPES.items()])
def test_reference_matches_ground_truth_cuda(entry, case, dtype, monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _check_against_ground_truth(entry, case, dtype, "cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    aligned = dtype == torch.bfloat16 and case.H % 8 == 0 and case.I % 8 == 0
    assert bool(calls) == (hopper and aligned), f"torch._grouped_mm called {len(calls)} times"


def _check_against_ground_truth(entry, case, dtype, device):
    p = case.problem(dtype)
    gy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(100 + case.seed)).to(dtype)
    on_device = megamoe.testing.MoEProblem(*(t.to(device) for t in p.args()))
    y, grads = _forward_backward(ENTRIES[entry], on_device.leaves(), gy.to(device))
    y, grads = y.cpu(), {name: g.cpu() for name, g in grads.items()}

    # The truth sees the same (possibly bf16-rounded) values as fp32 leaves, so its gradients are
    # not rounded back to bf16.
    truth_in = megamoe.testing.MoEProblem(*(t.float() if t.is_floating_point() else t for t in p.args()))
    y_ref, grads_ref = _forward_backward(moe_ground_truth, truth_in.leaves(), gy.float())

    tol = TOLERANCES[dtype]
    assert y.dtype == dtype
    assert_close(f"{entry} y", y, y_ref, tol)
    for name in GRAD_NAMES:
        assert grads[name].dtype == getattr(p, name).dtype, name
        kappa = weight_grad_condition(gy.float(), truth_in) if name == "topk_weights" else 1.0
        assert_close(f"{entry} d{name} (tol x kappa {kappa:.2f})", grads[name], grads_ref[name], tol * kappa)

    # Exact structure the contract implies, whatever the rounding.
    dropped = p.topk_ids < 0
    assert torch.all(grads["topk_weights"][dropped] == 0), "a -1 slot's weight got a gradient"
    dead = dropped.all(dim=1)
    assert torch.all(y[dead] == 0) and torch.all(grads["x"][dead] == 0), "a token with no expert moved"
    used = torch.zeros(case.E, dtype=torch.bool)
    used[p.topk_ids[~dropped]] = True
    assert torch.all(grads["w13"][~used] == 0) and torch.all(grads["w2"][~used] == 0), \
        "an expert that received no token got a weight gradient"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("T,drop_frac", [pytest.param(0, 0.0, id="T0"),
                                         pytest.param(6, 1.0, id="T6-all-slots-dropped")])
def test_reference_without_any_routed_slot(entry, T, drop_frac, dtype, device):
    """No slot reaches an expert: y is exactly zero and every gradient exists and is exactly zero
    (a missing weight gradient would desynchronise FSDP's reduce-scatter across ranks)."""
    p = make_problem(T, 24, 8, 3, 2, seed=11, drop_frac=drop_frac, dtype=dtype, device=device).leaves()
    y = ENTRIES[entry](*p.args())
    assert y.shape == (T, 24) and torch.all(y == 0)
    gy = torch.randn(T, 24, generator=torch.Generator().manual_seed(12)).to(device, dtype)
    grads = torch.autograd.grad(y, (p.x, p.w13, p.w2, p.topk_weights), gy)
    for name, g, leaf in zip(GRAD_NAMES, grads, (p.x, p.w13, p.w2, p.topk_weights)):
        assert g.shape == leaf.shape and torch.all(g == 0), name


# --- The ground truth itself, against per-token loops written out by hand in float64 ---------------

def _silu_parts(g: float) -> tuple[float, float]:
    """silu(g) and its derivative sigma(g) * (1 + g * (1 - sigma(g)))."""
    sig = 1.0 / (1.0 + math.exp(-g))
    return g * sig, sig * (1.0 + g * (1.0 - sig))


def _hand_moe(x, w13, w2, tw, ids, dy):
    """Forward and backward of the contract for plain nested lists of Python floats (float64).

    y[t][h] = sum_j w[t][j] * sum_i W2[e][h][i] * silu(G[e][i].x[t]) * (U[e][i].x[t]),  e = ids[t][j]
    Returns y, dx, dw13, dw2, dw for the upstream gradient dy.
    """
    T, H, E = len(x), len(x[0]), len(w13)
    I = len(w2[0][0])  # noqa: E741
    k = len(ids[0])
    y = [[0.0] * H for _ in range(T)]
    dx = [[0.0] * H for _ in range(T)]
    dw13 = [[[0.0] * H for _ in range(2 * I)] for _ in range(E)]
    dw2 = [[[0.0] * I for _ in range(H)] for _ in range(E)]
    dw = [[0.0] * k for _ in range(T)]
    for t in range(T):
        for j, e in enumerate(ids[t]):
            if e < 0:
                continue
            g = [sum(w13[e][i][h] * x[t][h] for h in range(H)) for i in range(I)]
            u = [sum(w13[e][I + i][h] * x[t][h] for h in range(H)) for i in range(I)]
            silu = [_silu_parts(gi) for gi in g]
            act = [silu[i][0] * u[i] for i in range(I)]
            out = [sum(w2[e][h][i] * act[i] for i in range(I)) for h in range(H)]
            for h in range(H):
                y[t][h] += tw[t][j] * out[h]
            dw[t][j] = sum(dy[t][h] * out[h] for h in range(H))
            d_out = [tw[t][j] * dy[t][h] for h in range(H)]
            d_act = [sum(w2[e][h][i] * d_out[h] for h in range(H)) for i in range(I)]
            for h in range(H):
                for i in range(I):
                    dw2[e][h][i] += d_out[h] * act[i]
            for i in range(I):
                d_g = d_act[i] * u[i] * silu[i][1]
                d_u = d_act[i] * silu[i][0]
                for h in range(H):
                    dw13[e][i][h] += d_g * x[t][h]
                    dw13[e][I + i][h] += d_u * x[t][h]
                    dx[t][h] += d_g * w13[e][i][h] + d_u * w13[e][I + i][h]
    return y, dx, dw13, dw2, dw


# The ground truth computed in float64 agrees with the hand loops to float64 rounding.
F64_TOL = 1e-12


def test_ground_truth_matches_hand_loops():
    """T=4, H=5, I=3, E=3, k=2: a dropped slot, a token with both slots on one expert, expert 2 used
    by a single slot. Forward and every gradient of moe_ground_truth (fp32 and float64 compute)
    against the hand loops; the inputs are fp32 values, exact in float64."""
    p = make_problem(4, 5, 3, 3, 2, seed=21)
    p.topk_ids.copy_(torch.tensor([[0, 1], [1, -1], [0, 0], [2, 1]]))
    dy = torch.randn(4, 5, generator=torch.Generator().manual_seed(22))
    hand = [torch.tensor(v, dtype=torch.float64)
            for v in _hand_moe(*(t.tolist() for t in p.args()), dy.tolist())]
    for dtype, tol in ((torch.float64, F64_TOL), (torch.float32, TOLERANCES[torch.float32])):
        leaves = p.leaves()
        y = moe_ground_truth(*leaves.args(), dtype=dtype)
        assert y.dtype == dtype
        grads = torch.autograd.grad(y, (leaves.x, leaves.w13, leaves.w2, leaves.topk_weights), dy.to(dtype))
        assert_close(f"ground truth ({dtype}) y vs hand loops", y, hand[0], tol)
        for name, g, ref in zip(GRAD_NAMES, grads, hand[1:]):
            # The fp32 leaves get their gradients rounded to fp32, so float64 compute is held to fp32.
            assert_close(f"ground truth ({dtype}) d{name} vs hand loops", g, ref, TOLERANCES[torch.float32])
    assert hand[4][1][1] == 0.0, "the hand loops give the dropped slot a weight gradient"
