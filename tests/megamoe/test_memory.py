"""Backward activation memory (issue: the Mega MoE kernel, "backward activation memory <= the
unfused path's"): what autograd keeps alive between forward and backward, measured with
saved-tensor hooks (megamoe.testing.saved_for_backward_bytes). The expected sizes come from the
shapes: the training path saves (gate, up), [T*k, 2I] in the input dtype, beyond the inputs."""

from __future__ import annotations

import pytest
import torch

from megamoe.moe import fused_moe
from megamoe.testing import make_problem, saved_for_backward_bytes

CASES = [  # T, H, I, E, k, drop fraction
    pytest.param(64, 256, 96, 8, 4, 0.0, id="T64-k4"),
    pytest.param(1, 48, 40, 5, 1, 0.0, id="T1-k1"),
    pytest.param(37, 64, 24, 7, 3, 0.3, id="T37-k3-drop"),
]


def _leaves(p):
    return [t.clone().requires_grad_(t.is_floating_point()) for t in p.args()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,H,I,E,k,drop", CASES)
def test_megamoe_saves_gate_up_only_and_less_than_reference(T, H, I, E, k, drop, dtype):  # noqa: E741
    p = make_problem(T, H, I, E, k, seed=3, dtype=dtype, drop_frac=drop)
    xs = _leaves(p)
    detail: list = []
    mega, mega_all = saved_for_backward_bytes(lambda *a: fused_moe(*a, impl="megamoe"), *xs, detail=detail)
    gu_bytes = T * k * 2 * I * torch.empty(0, dtype=dtype).element_size()
    assert mega == gu_bytes, (mega, gu_bytes, detail)
    inputs_bytes = sum(t.untyped_storage().nbytes() for t in xs)
    assert mega_all == gu_bytes + inputs_bytes, "the op should save exactly its inputs and (gate, up)"
    ref, _ = saved_for_backward_bytes(lambda *a: fused_moe(*a, impl="reference"), *_leaves(p))
    # the reference keeps at least its permuted x, gate/up, silu(gate) and activation per valid slot
    valid = int((p.topk_ids >= 0).sum())
    assert ref >= valid * (H + 4 * I) * torch.empty(0, dtype=dtype).element_size()
    assert mega <= ref


def test_inference_saves_nothing():
    p = make_problem(16, 32, 24, 4, 2, seed=4)
    with torch.no_grad():
        assert saved_for_backward_bytes(lambda *a: fused_moe(*a, impl="megamoe"), *_leaves(p)) == (0, 0)
    # inputs that need no grad: the op runs its inference path even with grad mode on
    assert saved_for_backward_bytes(lambda *a: fused_moe(*a, impl="megamoe"), *p.args()) == (0, 0)


def test_counts_a_storage_once_and_excludes_inputs():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x, w):
        h = x @ w            # saves x and w (inputs)
        return (h * h).sum() + (h[:2] * 3).exp().sum()  # saves h twice (one storage) and exp's output

    extra, total = saved_for_backward_bytes(fn, x, w)
    assert extra == 4 * 8 * 4 + 2 * 8 * 4      # h once, exp's output
    assert total == extra + x.untyped_storage().nbytes() + w.untyped_storage().nbytes()
