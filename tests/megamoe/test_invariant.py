"""megamoe.invariant, the batch-invariant linear and attention of numerics="bitwise": the invariances bit
for bit, the values against fp64 (megamoe.testing.INVARIANT_TOL)."""

from __future__ import annotations

import pytest
import torch

from megamoe import invariant
from megamoe.testing import INVARIANT_TOL, attention_ground_truth, max_rel_err


@pytest.mark.parametrize("K,N", [(64, 96), (1024, 200), (48, 1)])
def test_linear_rows_are_batch_invariant_and_match_fp64(K, N):
    g = torch.Generator().manual_seed(K + N)
    x = torch.randn(150, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    full = invariant.linear(x, w, b)
    for M, off in [(1, 0), (1, 77), (3, 5), (31, 40), (33, 0), (64, 86)]:
        assert torch.equal(invariant.linear(x[off:off + M], w, b), full[off:off + M]), (M, off)
    assert torch.equal(invariant.linear(x.view(10, 15, K), w, b), full.view(10, 15, N))
    assert max_rel_err(full, x.double() @ w.double().t() + b.double()) < INVARIANT_TOL
    assert invariant.linear(x[:0], w).shape == (0, N)


def test_linear_parts_equal_the_separate_linears():
    # part sizes that are no multiple of COLS (the case where a fused weight differs: measured at K=2880)
    g = torch.Generator().manual_seed(1)
    K, sizes = 2880, [66, 34, 100]
    x = torch.randn(9, K, generator=g)
    w = torch.randn(sum(sizes), K, generator=g)
    b = torch.randn(sum(sizes), generator=g)
    fused = invariant.linear_parts(x, w, sizes, b)
    separate = torch.cat([invariant.linear(x, wp, bp) for wp, bp in zip(w.split(sizes), b.split(sizes))], -1)
    assert torch.equal(fused, separate)
    with pytest.raises(ValueError, match="sizes"):
        invariant.linear_parts(x, w, [1, 2])


def test_linear_refuses_a_mis_shaped_weight():
    with pytest.raises(ValueError, match=r"w_NK: expected a 2-D \[N, K=8\]"):
        invariant.linear(torch.randn(2, 8), torch.randn(4, 7))


@pytest.mark.parametrize("L,h,g,D,E", [(70, 4, 2, 32, 32), (33, 2, 1, 64, 16), (1, 3, 3, 8, 8)])
def test_attention_query_rows_are_invariant_and_match_fp64(L, h, g, D, E):
    gen = torch.Generator().manual_seed(L * h)
    q, k, v = torch.randn(L, h, D, generator=gen), torch.randn(L, g, D, generator=gen), torch.randn(L, g, E, generator=gen)
    scale = D ** -0.5
    pos = torch.arange(L)
    full = invariant.causal_attention(q, k, v, pos, scale)
    assert full.shape == (L, h, E)
    for i in sorted({0, 1, 31, 32, 33, L - 1} & set(range(L))):  # decode: one query against its cache
        assert torch.equal(invariant.causal_attention(q[i:i + 1], k[:i + 1], v[:i + 1], pos[i:i + 1], scale),
                           full[i:i + 1]), i
    if L > 40:  # a chunk of a prefill, against the keys computed so far
        assert torch.equal(invariant.causal_attention(q[10:40], k[:40], v[:40], pos[10:40], scale), full[10:40])
    assert max_rel_err(full, attention_ground_truth(q, k, v, pos, scale)) < INVARIANT_TOL


def test_attention_refuses_bad_shapes_and_positions():
    q, k = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="h a multiple of g"):
        invariant.causal_attention(torch.randn(4, 3, 8), k, k, torch.arange(4), 1.0)
    with pytest.raises(ValueError, match=r"q_pos_Q: expected one position per query"):
        invariant.causal_attention(q, k, k, torch.arange(3), 1.0)
    with pytest.raises(ValueError, match=r"q_pos_Q: expected positions in \[0, L=4\)"):
        invariant.causal_attention(q, k, k, torch.arange(1, 5), 1.0)
