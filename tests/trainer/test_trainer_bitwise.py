"""trainer/bitwise.py: the trainer's InvariantLinear and attention function of numerics="bitwise": forward
bitwise megamoe.invariant's, every gradient against fp64 (megamoe.testing.INVARIANT_TOL)."""

from __future__ import annotations

import pytest
import torch

from megamoe import invariant
from megamoe.testing import INVARIANT_TOL, attention_ground_truth, max_rel_err
from trainer import bitwise


def test_invariant_linear_gradients_match_fp64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 40, generator=g)
    lin = bitwise.InvariantLinear(40, 24)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 40, generator=g))
        lin.bias.copy_(torch.randn(24, generator=g))
    dy = torch.randn(2, 7, 24, generator=g)
    xl = x.clone().requires_grad_(True)
    (lin(xl) * dy).sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, lin.weight, lin.bias))
    ((x64 @ w64.t() + b64) * dy.double()).sum().backward()
    for got, ref in ((xl.grad, x64.grad), (lin.weight.grad, w64.grad), (lin.bias.grad, b64.grad)):
        assert max_rel_err(got, ref) < INVARIANT_TOL


def test_trainer_attention_function_forward_and_gradients():
    """transformers' calling convention ([B, heads, T, D]), right padding, the last-T-of-L query layout;
    forward bitwise causal_attention per sequence, every gradient against fp64."""
    gen = torch.Generator().manual_seed(3)
    B, h, g, T, D = 2, 4, 2, 37, 16
    q, k, v = (torch.randn(B, n, T, D, generator=gen) for n in (h, g, g))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 30:] = 0
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = bitwise.invariant_attention(None, *leaves, mask, scaling=0.3)
    assert out.shape == (B, T, h, D)
    for b in range(B):
        assert torch.equal(out[b].detach(), invariant.causal_attention(q[b].transpose(0, 1), k[b].transpose(0, 1),
                                                                        v[b].transpose(0, 1), torch.arange(T), 0.3))
    dy = torch.randn(out.shape, generator=gen)
    (out * dy).sum().backward()
    for b in range(B):
        q64, k64, v64 = (t[b].transpose(0, 1).double().requires_grad_(True) for t in (q, k, v))
        ref = attention_ground_truth(q64, k64, v64, torch.arange(T), 0.3)
        ref.backward(dy[b].double())
        for got, r in zip(leaves, (q64, k64, v64)):
            assert max_rel_err(got.grad[b].transpose(0, 1), r.grad) < INVARIANT_TOL
    # the last query of a sequence against its keys (the decode shape the divergence tool replays)
    last, _ = bitwise.invariant_attention(None, q[:, :, -1:], k, v, None, scaling=0.3)
    assert torch.equal(last, out[:, -1:].detach())


def test_trainer_attention_refuses_left_padding_and_sinks():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attention_mask: expected right padding"):
        bitwise.invariant_attention(None, x, x, x, torch.tensor([[0, 1, 1, 1]]))
    with pytest.raises(NotImplementedError, match="sliding window or attention sinks"):
        bitwise.invariant_attention(None, x, x, x, None, s_aux=torch.zeros(2))
    with pytest.raises(NotImplementedError, match="attention dropout"):
        bitwise.invariant_attention(None, x, x, x, None, dropout=0.1)
