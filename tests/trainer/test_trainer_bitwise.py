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


def test_rms_norm_module_forward_and_gradients():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 48, generator=gen)
    w = torch.nn.Parameter(torch.randn(48, generator=gen))
    norm = bitwise.InvariantRMSNorm(w, 1e-5)
    xl = x.clone().requires_grad_(True)
    y = norm(xl)
    assert torch.equal(y.detach(), invariant.rms_norm(x, w.detach(), 1e-5))
    dy = torch.randn(y.shape, generator=gen)
    (y * dy).sum().backward()
    x64, w64 = x.double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ((x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64) * dy.double()).sum().backward()
    assert max_rel_err(xl.grad, x64.grad) < INVARIANT_TOL and max_rel_err(w.grad, w64.grad) < INVARIANT_TOL


def test_log_softmax_gradient_matches_fp64():
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 3, 50, generator=gen) * 3).requires_grad_(True)
    y = bitwise.log_softmax(x)
    assert torch.equal(y.detach(), invariant.log_softmax(x.detach()))
    dy = torch.randn(y.shape, generator=gen)
    (y * dy).sum().backward()
    x64 = x.detach().double().requires_grad_(True)
    (torch.log_softmax(x64, -1) * dy.double()).sum().backward()
    assert max_rel_err(x.grad, x64.grad) < INVARIANT_TOL


def test_install_replaces_norms_and_rotary_with_the_shared_table(tmp_path):
    """A tiny Qwen3-MoE: every RMSNorm (input, post-attention, q/k, final) and the rotary replaced; the
    rotary's cos/sin are rope_cache's rows, within fp32 rounding of transformers' own."""
    from rl.make_model import make_model
    from trainer.model import load_model

    model_dir = make_model(tmp_path / "m", layers=2)
    stock = load_model(model_dir, "megamoe")
    model = load_model(model_dir, "megamoe", numerics="bitwise")
    norms = [m for m in model.modules() if isinstance(m, bitwise.InvariantRMSNorm)]
    assert len(norms) == 2 * 4 + 1
    assert not [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")
                and not isinstance(m, bitwise.InvariantRMSNorm)]
    rot = model.model.rotary_emb
    assert isinstance(rot, bitwise.InvariantRotary)
    x, pos = torch.zeros(1, 1, 4), torch.arange(40)[None]
    cos, sin = rot(x, pos)
    table = invariant.rope_cache(rot.base, rot.dim, rot.max_positions)[:40]
    half = rot.dim // 2
    assert torch.equal(cos[0, :, :half], table[:, :half]) and torch.equal(sin[0, :, half:], table[:, half:])
    ref_cos, ref_sin = stock.model.rotary_emb(x, pos)
    assert (cos - ref_cos).abs().max() < 1e-5 and (sin - ref_sin).abs().max() < 1e-5
    with pytest.raises(ValueError, match="position_ids: expected positions < max_position_embeddings"):
        rot(x, torch.tensor([[rot.max_positions]]))
