"""Bad inputs to the MoE contract and to routing: the exception type, and a message that names the
argument and what was expected. Plus: the checks run before any compute.

    .venv/bin/python -m pytest -q tests/megamoe/test_contract.py
"""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

import megamoe
import megamoe.ref
from megamoe import check_moe_inputs, route
from megamoe.testing import make_problem

T, H, I, E, K = 5, 16, 8, 4, 2  # noqa: E741


def _good():
    return dict(zip(("x", "w13", "w2", "topk_weights", "topk_ids"), make_problem(T, H, I, E, K, seed=3).args()))


def _with(**changes):
    args = _good()
    for name, fn in changes.items():
        args[name] = fn(args[name])
    return args


# (changes to the good inputs, exception type, regex the message must match: argument + expectation)
BAD_MOE_INPUTS = [
    pytest.param(dict(x=lambda t: t[None]), ValueError, r"^x: expected 2 dimensions, got shape \(1, 5, 16\)",
                 id="x-rank3"),
    pytest.param(dict(w13=lambda t: t[0]), ValueError, r"^w13: expected 3 dimensions", id="w13-rank2"),
    pytest.param(dict(w2=lambda t: t.reshape(E * H, I)), ValueError, r"^w2: expected 3 dimensions", id="w2-rank2"),
    pytest.param(dict(topk_weights=lambda t: t.reshape(-1)), ValueError, r"^topk_weights: expected 2 dimensions",
                 id="topk_weights-rank1"),
    pytest.param(dict(topk_ids=lambda t: t[..., None]), ValueError, r"^topk_ids: expected 2 dimensions",
                 id="topk_ids-rank3"),
    pytest.param(dict(x=lambda t: torch.cat([t, t[:, :1]], 1)), ValueError,
                 r"^w13: expected shape \[E, 2I, H=17\] \(H of x\), got \(4, 16, 16\)", id="H-of-x-vs-w13"),
    pytest.param(dict(w13=lambda t: t[:, :-1]), ValueError, r"^w13: expected an even, positive .*2I, got 15",
                 id="w13-odd-2I"),
    pytest.param(dict(w2=lambda t: t[..., :-1]), ValueError,
                 r"^w2: expected shape \[E=4, H=16, I=8\] \(from w13 and x\), got \(4, 16, 7\)", id="I-of-w2-vs-2I-of-w13"),
    pytest.param(dict(w2=lambda t: t[:-1]), ValueError, r"^w2: expected shape \[E=4, H=16, I=8\].*got \(3, 16, 8\)",
                 id="E-of-w2-vs-w13"),
    pytest.param(dict(w2=lambda t: t.transpose(1, 2).contiguous()), ValueError,
                 r"^w2: expected shape \[E=4, H=16, I=8\].*got \(4, 8, 16\)", id="w2-transposed"),
    pytest.param(dict(topk_ids=lambda t: t[:-1]), ValueError, r"^topk_ids: expected shape \[T=5, k\] \(T of x\)",
                 id="T-of-topk_ids-vs-x"),
    pytest.param(dict(topk_weights=lambda t: t[:, :1]), ValueError,
                 r"^topk_weights: expected shape \[T=5, k=2\] \(as topk_ids\), got \(5, 1\)", id="k-of-weights-vs-ids"),
    pytest.param(dict(topk_weights=lambda t: t[:-1]), ValueError,
                 r"^topk_weights: expected shape \[T=5, k=2\].*got \(4, 2\)", id="T-of-weights-vs-ids"),
    pytest.param(dict(topk_ids=lambda t: t[:, :0], topk_weights=lambda t: t[:, :0]), ValueError,
                 r"^topk_ids: expected k >= 1 columns", id="k0"),
    pytest.param(dict(x=lambda t: t.to(torch.int32)), TypeError, r"^x: expected a floating dtype", id="x-int"),
    pytest.param(dict(x=lambda t: t.double(), w13=lambda t: t.double(), w2=lambda t: t.double()), TypeError,
                 r"^x: expected a floating dtype in \(torch.float32, torch.bfloat16, torch.float16\), got torch.float64",
                 id="x-float64"),
    pytest.param(dict(w13=lambda t: t.bfloat16()), TypeError,
                 r"^w13, w2: expected the dtype of x \(torch.float32\), got torch.bfloat16 and torch.float32",
                 id="w13-dtype-vs-x"),
    pytest.param(dict(w2=lambda t: t.to(torch.int64)), TypeError, r"^w2: expected a floating dtype", id="w2-int"),
    pytest.param(dict(topk_weights=lambda t: t.to(torch.int64)), TypeError, r"^topk_weights: expected a floating dtype",
                 id="topk_weights-int"),
    pytest.param(dict(topk_ids=lambda t: t.float()), TypeError,
                 r"^topk_ids: expected an integer dtype in \(torch.int32, torch.int64\), got torch.float32",
                 id="topk_ids-float"),
    pytest.param(dict(topk_ids=lambda t: t.to(torch.int16)), TypeError,
                 r"^topk_ids: expected an integer dtype.*got torch.int16", id="topk_ids-int16"),
    pytest.param(dict(x=lambda t: t.tolist()), TypeError, r"^x: expected a torch.Tensor, got list", id="x-list"),
    pytest.param(dict(w13=lambda t: t.to("meta")), ValueError,
                 r"^all tensors must be on one device, got x=cpu, w13=meta, w2=cpu", id="w13-other-device"),
    pytest.param(dict(topk_ids=lambda t: t.to("meta")), ValueError,
                 r"^all tensors must be on one device, .*topk_ids=meta", id="topk_ids-other-device"),
    pytest.param(dict(topk_ids=lambda t: torch.where(t == t.max(), E, t)), ValueError,
                 r"^topk_ids: expected ids in \[-1, E=4\), got min 0, max 4", id="id-equals-E"),
    pytest.param(dict(topk_ids=lambda t: torch.where(t == t.max(), -2, t)), ValueError,
                 r"^topk_ids: expected ids in \[-1, E=4\), got min -2", id="id-below-minus-1"),
]


@pytest.mark.parametrize("entry", ["check_moe_inputs", "fused_moe-reference"])
@pytest.mark.parametrize("changes,exc,pattern", BAD_MOE_INPUTS)
def test_bad_moe_input(changes, exc, pattern, entry):
    args = _with(**changes)
    fn = check_moe_inputs if entry == "check_moe_inputs" else lambda *a: megamoe.fused_moe(*a, impl="reference")
    with pytest.raises(exc, match=pattern):
        fn(*args.values())


def test_good_moe_input_passes_and_reports_the_legend_sizes():
    """The control for the bad cases above: the unmodified inputs pass."""
    assert check_moe_inputs(*_good().values()) == megamoe.contract.MoEShape(T=T, H=H, I=I, E=E, k=K)


def test_check_ids_false_skips_only_the_id_range_check():
    """check_ids=False (for CUDA-graph capture) skips the one data-dependent check, nothing else."""
    args = _with(topk_ids=lambda t: torch.full_like(t, E))
    check_moe_inputs(*args.values(), check_ids=False)
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in"):
        check_moe_inputs(*args.values())
    bad_shape = _with(topk_ids=lambda t: torch.full_like(t, E)[:-1])
    with pytest.raises(ValueError, match=r"^topk_ids: expected shape"):
        check_moe_inputs(*bad_shape.values(), check_ids=False)


@pytest.mark.parametrize("impl", ["triton", "", None, "Reference", "stock"])
def test_unknown_impl(impl):
    with pytest.raises(ValueError, match=r"^impl: expected one of \('megamoe', 'reference'\), got " + re.escape(repr(impl))):
        megamoe.fused_moe(*_good().values(), impl=impl)


class _ComputeReached(AssertionError):
    pass


def _tripwire(*args, **kwargs):
    raise _ComputeReached("compute ran before the contract checks")


@pytest.mark.parametrize("impl", ["megamoe", "reference"])
@pytest.mark.parametrize("changes,exc,pattern", [
    pytest.param(dict(w2=lambda t: t[..., :-1]), ValueError, r"^w2: expected shape", id="bad-shape"),
    pytest.param(dict(topk_ids=lambda t: torch.where(t == t.max(), E, t)), ValueError, r"^topk_ids: expected ids",
                 id="bad-id"),
    pytest.param(dict(x=lambda t: t.bfloat16()), TypeError, r"^w13, w2: expected the dtype of x", id="bad-dtype"),
])
def test_checks_run_before_any_compute(impl, changes, exc, pattern, monkeypatch):
    """fused_moe raises the contract's error, never one from inside an implementation: the
    implementations are replaced by tripwires (megamoe.fused by a stand-in module, so this holds
    whether or not the fused kernel is installed)."""
    monkeypatch.setitem(sys.modules, "megamoe.fused", types.SimpleNamespace(megamoe_moe=_tripwire))
    monkeypatch.setattr(megamoe.ref, "moe_unfused", _tripwire)
    with pytest.raises(exc, match=pattern):
        megamoe.fused_moe(*_with(**changes).values(), impl=impl)
    with pytest.raises(_ComputeReached):  # the control: good inputs do reach the implementation
        megamoe.fused_moe(*_good().values(), impl=impl)


# --- routing ----------------------------------------------------------------------------------

def _logits(T=6, E=8):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(4))


def _poke(value):
    z = _logits()
    z[2, 5] = value
    return z


BAD_ROUTE_INPUTS = [
    pytest.param(dict(router_logits_TE=_poke(float("nan"))), ValueError,
                 r"^router_logits: expected finite values, got NaN/Inf in 1 token row\(s\)", id="nan-logit"),
    pytest.param(dict(router_logits_TE=_poke(float("inf"))), ValueError, r"^router_logits: expected finite values",
                 id="inf-logit"),
    pytest.param(dict(router_logits_TE=_poke(float("-inf"))), ValueError, r"^router_logits: expected finite values",
                 id="minus-inf-logit"),
    pytest.param(dict(router_logits_TE=_logits()[0]), ValueError, r"^router_logits: expected shape \[T, E\], got \(8,\)",
                 id="logits-rank1"),
    pytest.param(dict(router_logits_TE=_logits().to(torch.int64)), TypeError,
                 r"^router_logits: expected a floating dtype, got torch.int64", id="logits-int"),
    pytest.param(dict(router_logits_TE=_logits().numpy()), TypeError,
                 r"^router_logits: expected a torch.Tensor, got ndarray", id="logits-numpy"),
    pytest.param(dict(top_k=0), ValueError, r"^top_k: expected an int in \[1, E=8\], got 0", id="top_k-0"),
    pytest.param(dict(top_k=9), ValueError, r"^top_k: expected an int in \[1, E=8\], got 9", id="top_k-above-E"),
    pytest.param(dict(top_k=2.0), ValueError, r"^top_k: expected an int in \[1, E=8\], got 2.0", id="top_k-float"),
    pytest.param(dict(top_k=True), ValueError, r"^top_k: expected an int in \[1, E=8\], got True", id="top_k-bool"),
    pytest.param(dict(scoring="relu"), ValueError, r"^scoring: expected one of \('softmax', 'sigmoid'\), got 'relu'",
                 id="scoring-unknown"),
]


@pytest.mark.parametrize("changes,exc,pattern", BAD_ROUTE_INPUTS)
def test_bad_route_input(changes, exc, pattern):
    args = dict(router_logits_TE=_logits(), top_k=2, scoring="softmax") | changes
    with pytest.raises(exc, match=pattern):
        route(**args)
    route(**(args | dict(router_logits_TE=_logits(), top_k=2, scoring="softmax")))  # control


def test_route_check_finite_false_skips_the_scan():
    """check_finite=False (no host sync) lets a NaN row through: documented, not silently fixed."""
    w, _ = route(_poke(float("nan")), 2, check_finite=False)
    assert torch.isnan(w[2]).any() and torch.isfinite(w[[0, 1, 3, 4, 5]]).all()


def test_implementation_names_are_defined_once():
    """megamoe.contract defines the names; the configs' types and the hosts' checks use them,
    importing them costs no torch (`megamoe-rl train --dry-run` must not import it), and no module
    of the project spells the tuple again."""
    import ast
    import subprocess
    import sys
    import typing
    from pathlib import Path

    import rl.consistency
    import trainer.config
    from megamoe.contract import HOST_IMPLS, IMPLS, MEGAMOE, REFERENCE, STOCK

    assert IMPLS == (MEGAMOE, REFERENCE) and HOST_IMPLS == (MEGAMOE, REFERENCE, STOCK)
    assert typing.get_args(trainer.config.MoEImpl) == HOST_IMPLS
    assert rl.consistency.DEFAULT_IMPLS == HOST_IMPLS
    code = ("import sys, megamoe.contract, trainer.config, rl.config, rollout.plugin; "
            "print(sorted(m for m in ('torch', 'triton', 'vllm') if m in sys.modules))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    spelled = []
    for package in ("megamoe", "rollout", "trainer", "rl"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    words = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                    if {MEGAMOE, REFERENCE} <= words:
                        spelled.append(f"{path.relative_to(root)}:{node.lineno}")
    assert spelled == [], f"the implementation names spelled again (import them from megamoe.contract): {spelled}"
    for impl in IMPLS:
        assert megamoe.check_impl(impl) == impl
    with pytest.raises(ValueError, match="impl: expected one of"):
        megamoe.check_impl(STOCK)  # the hosts' own MoE is not an implementation of this library
