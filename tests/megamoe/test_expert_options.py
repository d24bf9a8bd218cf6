"""The contract's expert options: per-expert biases (b13 [E, 2I], b2 [E, H]) and the activation
(silu, or gpt-oss's clamped SwiGLU), in every implementation: the reference path, the CPU torch
backend, the Triton kernels (interpreter on CPU, compiled on the H200). Forward and every gradient,
the biases' included, against the fp32 ground truth over the edge cases of test_fused.py; the
training path's saved (gate, up) giving the recomputing backward's bits; batch invariance, CUDA-graph
replay and NaN isolation with the options on; the torch.library ops; the refusals."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

import megamoe
from megamoe.contract import SWIGLU, Activation, clamped_swiglu
from megamoe.fused import fused_moe_bwd, fused_moe_fwd
from megamoe.ref import moe_ground_truth
from megamoe.testing import TOLERANCES, assert_close, make_problem
from test_fused import EDGE_CASES as FUSED_EDGE_CASES

# The clamped SwiGLU's gradient jumps at its limit: a (gate, up) value within a rounding error of it
# falls on one side in one implementation and on the other in the ground truth (one such value moved
# dx by 8e-4 relative on the H200 in fp32, 2026-12-03). So the clamped cases draw x, w13 and b13 on a
# dyadic grid (small integers times a power of two, exact in bf16) on which every implementation's
# GEMM1 is exact in fp32: all sides see the same (gate, up) bits and take the same clamp decisions,
# and the limit lies halfway between two grid values. The ground truth also rounds (gate, up) to the
# input dtype before the activation (round_gate_up), as the implementations' backward does.
# (On general data the unfused reference's bf16 clamped gradients were up to 1.1e-1 off the ground
# truth, megamoe's up to 1.9e-2; on the grid all stay within the bf16 tolerance: worst 5.7e-3.)
CLAMPED = "clamped"  # OPTIONS' marker: dyadic x, w13, b13 and clamped_swiglu(1.702, a limit between grid values)
OPTIONS = {
    "bias-silu": (True, SWIGLU),
    "bias-clamped": (True, CLAMPED),
    "clamped": (False, CLAMPED),
}

# test_fused.py's edge cases (T=1, odd sizes, empty experts, every slot on one expert, -1 slots)
EDGE_CASES = FUSED_EDGE_CASES
GPU_CASES = EDGE_CASES + [
    pytest.param(333, 1000, 300, 13, 3, "random", 0.1, id="T333-H1000-I300-E13-k3-drop"),
    pytest.param(517, 512, 192, 32, 4, "random", 0.0, id="T517-E32-k4"),
    pytest.param(64, 2880, 2880, 32, 4, "random", 0.0, id="T64-gpt-oss-20b"),
]
# d(topk_weights) summed in another order by the two backward variants (test_fused.DTW_ORDER_TOL)
DTW_ORDER_TOL = 1e-6


GPT_OSS = clamped_swiglu(alpha=1.702, limit=1.5)  # where only the bits matter (invariance, replay, NaN)


def _biases(E, H, I, dtype, device, seed):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    return ((0.5 * torch.randn(E, 2 * I, generator=g)).to(device, dtype),
            (0.5 * torch.randn(E, H, generator=g)).to(device, dtype))


def _inputs(T, H, I, E, k, routing, drop, dtype, device, bias):  # noqa: E741
    p = make_problem(T, H, I, E, k, routing=routing, drop_frac=drop, seed=T, dtype=dtype, device=device)
    b13, b2 = _biases(E, H, I, dtype, device, seed=T + 1) if bias else (None, None)
    return p, b13, b2


def _dyadic(p, b13, seed):
    """p and b13 with x, w13 and b13 redrawn on a dyadic grid (see the note above CLAMPED):
    x in {-2..2}, w13 and b13 integers times q = 2^-ceil(log2(2 sqrt(H))), so (gate, up) are exact
    multiples of q with a standard deviation in (0.5, 1]; returns (p, b13, the activation with
    gpt-oss's alpha and a limit of about 1.5 standard deviations, halfway between two multiples)."""
    g = torch.Generator().manual_seed(seed)
    H = p.x.shape[1]
    q = 2.0 ** -math.ceil(math.log2(2 * math.sqrt(H)))
    x = torch.randint(-2, 3, p.x.shape, generator=g).to(p.x.device, p.x.dtype)
    w13 = (torch.randint(-2, 3, p.w13.shape, generator=g) * q).to(p.w13.device, p.w13.dtype)
    if b13 is not None:
        b13 = (torch.randint(-16, 17, b13.shape, generator=g) * q).to(b13.device, b13.dtype)
    limit = (round(1.5 * 2 * math.sqrt(H)) + 0.5) * q
    return dataclasses.replace(p, x=x, w13=w13), b13, clamped_swiglu(alpha=1.702, limit=limit)


def _case(T, H, I, E, k, routing, drop, dtype, device, option):  # noqa: E741
    """(problem, b13, b2, activation) of an OPTIONS entry."""
    bias, act = OPTIONS[option]
    p, b13, b2 = _inputs(T, H, I, E, k, routing, drop, dtype, device, bias)
    if act == CLAMPED:
        p, b13, act = _dyadic(p, b13, seed=T + 2)
    return p, b13, b2, act


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def _check(p, b13, b2, act, dtype, backend, tol):
    """Forward and every gradient against the fp32 ground truth; the training path's bits."""
    ref = p.leaves()
    rb13, rb2 = _leaf(b13), _leaf(b2)
    y_ref = moe_ground_truth(*ref.args(), b13_E2I=rb13, b2_EH=rb2, activation=act, round_gate_up=dtype)
    if act.name != SWIGLU.name:  # the case reaches both sides of every clamp
        x, w13 = p.x.float(), p.w13.float()
        gu = torch.einsum("th,eih->tei", x, w13) + (b13.float()[None] if b13 is not None else 0)
        I = w13.shape[1] // 2  # noqa: E741
        gate, up = gu[..., :I], gu[..., I:]
        for name, frac in (("gate > limit", (gate > act.limit).float().mean()),
                           ("|up| > limit", (up.abs() > act.limit).float().mean())):
            assert 0.02 < float(frac) < 0.5, f"{name}: {float(frac):.3f} of the values (the case must clamp some)"
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(7)).to(y_ref.device)
    y_ref.backward(g)
    kw = dict(b13=b13, b2=b2, activation=act, backend=backend)
    y = fused_moe_fwd(*p.args(), **kw)
    grads = fused_moe_bwd(g.to(dtype), *p.args(), **kw)
    assert len(grads) == (6 if b13 is not None else 4)
    assert_close("y", y, y_ref, tol)
    names = ("x", "w13", "w2", "topk_weights")
    wants = [getattr(ref, n).grad for n in names] + ([rb13.grad, rb2.grad] if b13 is not None else [])
    for name, got, want in zip(names + ("b13", "b2"), grads, wants):
        assert got.dtype == (dtype if name != "topk_weights" else p.topk_weights.dtype), name
        assert_close(f"d{name}", got, want, tol)
    y_s, gu = fused_moe_fwd(*p.args(), **kw, save_gu=True)
    assert torch.equal(y_s, y), "saving (gate, up) changed y"
    saved = fused_moe_bwd(g.to(dtype), *p.args(), **kw, gu=gu)
    for i, name in enumerate(("dx", "dw13", "dw2", "dtopk_weights", "db13", "db2")[:len(grads)]):
        if name == "dtopk_weights":
            assert_close("dtopk_weights saved vs recomputed", saved[i], grads[i], DTW_ORDER_TOL)
        else:
            assert torch.equal(saved[i], grads[i]), f"{name}: the backward from saved (gate, up) differs"


def _interpreter():
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("T,H,I,E,k,routing,drop", EDGE_CASES)
def test_triton_interpreter_fp32(T, H, I, E, k, routing, drop, option, nan_fill):  # noqa: E741
    _interpreter()
    p, b13, b2, act = _case(T, H, I, E, k, routing, drop, torch.float32, "cpu", option)
    _check(p, b13, b2, act, torch.float32, "triton", TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("T,H,I,E,k,routing,drop", EDGE_CASES)
def test_torch_backend(T, H, I, E, k, routing, drop, option, dtype, nan_fill):  # noqa: E741
    p, b13, b2, act = _case(T, H, I, E, k, routing, drop, dtype, "cpu", option)
    _check(p, b13, b2, act, dtype, "torch", TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_reference_and_public_autograd(option, dtype):
    """`fused_moe(..., impl="reference")` (plain autograd) and `impl="megamoe"` (the registered op's
    autograd) against the ground truth; the op's gradients are fused_moe_bwd's bits."""
    p, b13, b2, act = _case(25, 32, 16, 6, 3, "random", 0.3, dtype, "cpu", option)
    bias = b13 is not None
    ref = p.leaves()
    rb = (_leaf(b13), _leaf(b2))
    y_ref = moe_ground_truth(*ref.args(), b13_E2I=rb[0], b2_EH=rb[1], activation=act, round_gate_up=dtype)
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3))
    y_ref.backward(g)
    for impl in megamoe.IMPLS:
        leaves, lb = p.leaves(), (_leaf(b13), _leaf(b2))
        y = megamoe.fused_moe(*leaves.args(), impl=impl, b13=lb[0], b2=lb[1], activation=act)
        y.backward(g.to(dtype))
        assert_close(f"{impl} y", y, y_ref, TOLERANCES[dtype])
        pairs = [("x", leaves.x, ref.x), ("w13", leaves.w13, ref.w13), ("w2", leaves.w2, ref.w2),
                 ("topk_weights", leaves.topk_weights, ref.topk_weights)]
        if bias:
            pairs += [("b13", lb[0], rb[0]), ("b2", lb[1], rb[1])]
        for name, got, want in pairs:
            assert_close(f"{impl} d{name}", got.grad, want.grad, TOLERANCES[dtype])
        if impl == "megamoe":
            bwd = fused_moe_bwd(g.to(dtype), *p.args(), b13=b13, b2=b2, activation=act)
            for (name, got, _), want in zip(pairs, bwd):
                assert torch.equal(got.grad, want), f"the op's d{name} differs from fused_moe_bwd's"


def test_zero_biases_give_the_bias_free_bits():
    """Biases of zero are added to the fp32 accumulators and change nothing: the bias path rounds
    where the plain path does."""
    p = make_problem(23, 36, 20, 6, 3, seed=4, drop_frac=0.2)
    z13, z2 = torch.zeros(6, 40), torch.zeros(6, 36)
    g = torch.randn(23, 36, generator=torch.Generator().manual_seed(1))
    backends = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    for backend in backends:
        assert torch.equal(fused_moe_fwd(*p.args(), b13=z13, b2=z2, backend=backend),
                           fused_moe_fwd(*p.args(), backend=backend)), backend
        with_b = fused_moe_bwd(g, *p.args(), b13=z13, b2=z2, backend=backend)
        for name, a, b in zip(("dx", "dw13", "dw2", "dtw"), with_b, fused_moe_bwd(g, *p.args(), backend=backend)):
            assert torch.equal(a, b), f"{backend} {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_batch_invariant_with_biases_and_clamped_activation(dtype):
    big, b13, b2 = _inputs(64, 64, 32, 8, 2, "random", 0.0, dtype, "cpu", True)
    full = fused_moe_fwd(*big.args(), b13=b13, b2=b2, activation=GPT_OSS, backend="torch")
    for n, start in ((1, 0), (7, 57), (33, 13)):
        part = fused_moe_fwd(big.x[start:start + n], big.w13, big.w2, big.topk_weights[start:start + n],
                             big.topk_ids[start:start + n], b13=b13, b2=b2, activation=GPT_OSS, backend="torch")
        assert torch.equal(part, full[start:start + n]), f"rows {start}:{start + n} differ from the full batch"


def test_opcheck_with_biases_and_clamped_activation():
    p, b13, b2 = _inputs(9, 24, 16, 5, 2, "random", 0.2, torch.float32, "cpu", True)
    fields = ("clamped_swiglu", GPT_OSS.alpha, GPT_OSS.limit)
    args = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in p.args()) + \
        (b13.clone().requires_grad_(), b2.clone().requires_grad_()) + fields
    torch.library.opcheck(torch.ops.megamoe.fused_moe.default, args)
    torch.library.opcheck(torch.ops.megamoe.fused_moe_train.default, args)
    _, gu = fused_moe_fwd(*p.args(), b13=b13, b2=b2, activation=GPT_OSS, save_gu=True)
    g = torch.randn(9, 24)
    torch.library.opcheck(torch.ops.megamoe.fused_moe_bwd.default, (g, *p.args(), gu, b13, b2, *fields))


def test_nan_stays_in_its_token_with_biases():
    p, b13, b2 = _inputs(12, 32, 16, 4, 2, "random", 0.0, torch.float32, "cpu", True)
    p.x[5, 3] = float("nan")
    y = fused_moe_fwd(*p.args(), b13=b13, b2=b2, activation=GPT_OSS, backend="torch")
    assert (~torch.isfinite(y).all(dim=1)).tolist() == [i == 5 for i in range(12)]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(b13="zeros13"), ValueError, r"b13, b2: expected both expert biases or neither"),
    (dict(b2="zeros2"), ValueError, r"b13, b2: expected both expert biases or neither"),
    (dict(b13="zeros2", b2="zeros2"), ValueError, r"b13: expected shape \[5, 32\] \(\[E, 2I\]\), got \(5, 24\)"),
    (dict(b13="zeros13", b2="zeros13"), ValueError, r"b2: expected shape \[5, 24\] \(\[E, H\]\), got \(5, 32\)"),
    (dict(b13="bf16_13", b2="zeros2"), TypeError, r"b13: expected the dtype of x \(torch.float32\), got torch.bfloat16"),
    (dict(b13="list", b2="zeros2"), TypeError, r"b13: expected a torch.Tensor, got list"),
    (dict(activation="silu"), TypeError, r"activation: expected a megamoe.contract.Activation"),
])
def test_bad_options_are_refused_naming_the_argument(kwargs, error, match):
    p = make_problem(9, 24, 16, 5, 2, seed=5)
    values = {"zeros13": torch.zeros(5, 32), "zeros2": torch.zeros(5, 24), "bf16_13": torch.zeros(5, 32, dtype=torch.bfloat16),
              "list": [0.0] * 32, "silu": "silu"}
    kw = {k: values[v] for k, v in kwargs.items()}
    for impl in megamoe.IMPLS:
        with pytest.raises(error, match=match):
            megamoe.fused_moe(*p.args(), impl=impl, **kw)
    with pytest.raises(error, match=match):
        fused_moe_fwd(*p.args(), **kw)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="gelu"), r"activation.name: expected one of \('silu', 'clamped_swiglu'\), got 'gelu'"),
    (dict(name="silu", limit=7.0), r"activation: 'silu' takes no alpha or limit"),
    (dict(name="clamped_swiglu", alpha=1.702), r"activation.limit: expected a finite number > 0 .* got None"),
    (dict(name="clamped_swiglu", alpha=float("nan"), limit=7.0), r"activation.alpha: expected a finite number > 0"),
    (dict(name="clamped_swiglu", alpha=1.702, limit=-1.0), r"activation.limit: expected a finite number > 0 .* got -1.0"),
])
def test_bad_activation_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Activation(**kwargs)


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("T,H,I,E,k,routing,drop", GPU_CASES)
def test_gpu_against_ground_truth(T, H, I, E, k, routing, drop, option, dtype, nan_fill):  # noqa: E741
    p, b13, b2, act = _case(T, H, I, E, k, routing, drop, dtype, "cuda", option)
    _check(p, b13, b2, act, dtype, "triton", TOLERANCES[dtype])


@pytest.mark.gpu
def test_gpu_batch_invariant_with_options():
    big, b13, b2 = _inputs(4100, 512, 256, 16, 4, "random", 0.0, torch.bfloat16, "cuda", True)
    kw = dict(b13=b13, b2=b2, activation=GPT_OSS)
    full = fused_moe_fwd(*big.args(), **kw)
    for n in (1, 7, 512, 4096):
        for start in (0, 4100 - n):
            part = fused_moe_fwd(big.x[start:start + n], big.w13, big.w2, big.topk_weights[start:start + n],
                                 big.topk_ids[start:start + n], **kw)
            assert torch.equal(part, full[start:start + n]), f"rows {start}:{start + n} differ"
    assert torch.equal(fused_moe_fwd(*big.args(), **kw), full), "two runs differ"


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_options():
    p, b13, b2 = _inputs(256, 512, 256, 16, 4, "random", 0.0, torch.bfloat16, "cuda", True)
    static = [t.clone() for t in (*p.args(), b13, b2)]
    run = lambda ts: fused_moe_fwd(*ts[:5], b13=ts[5], b2=ts[6], activation=GPT_OSS, check=False)  # noqa: E731
    run(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static)
    for seed in range(3):
        q = make_problem(256, 512, 256, 16, 4, seed=100 + seed, dtype=torch.bfloat16, device="cuda")
        c13, c2 = _biases(16, 512, 256, torch.bfloat16, "cuda", seed=200 + seed)
        for dst, src in zip(static, (*q.args(), c13, c2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run([*q.args(), c13, c2])), f"replay {seed} differs from eager"


@pytest.mark.gpu
def test_gpu_nan_stays_in_its_token_with_options():
    p, b13, b2 = _inputs(300, 256, 128, 8, 2, "random", 0.0, torch.bfloat16, "cuda", True)
    p.x[17, 5] = float("nan")
    p.x[250, 0] = float("inf")
    y = fused_moe_fwd(*p.args(), b13=b13, b2=b2, activation=GPT_OSS)
    assert (~torch.isfinite(y).all(dim=1)).nonzero().flatten().tolist() == [17, 250]
