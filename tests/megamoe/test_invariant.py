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
    # parts of odd sizes at K=2880, where a column's place among the N changes its rounding
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


def test_batched_attention_is_each_sequence_alone_and_never_reads_past_a_query():
    """Sequences of lengths 1..70 in one call (vLLM's mixed decode + prefill batch), keys past each one's
    length NaN: every query's row bitwise its sequence's causal_attention."""
    gen = torch.Generator().manual_seed(4)
    h, g, D, lens = 4, 2, 32, [1, 33, 70, 5]
    R, L = len(lens), max(lens)
    k, v = torch.randn(R, L, g, D, generator=gen), torch.randn(R, L, g, D, generator=gen)
    for r, n in enumerate(lens):
        k[r, n:], v[r, n:] = float("nan"), float("nan")
    # request r brings its last q_len[r] positions (a decode step is 1, a prefill chunk more)
    q_len = [1, 33, 7, 2]
    q = torch.randn(sum(q_len), h, D, generator=gen)
    seq = torch.repeat_interleave(torch.arange(R), torch.tensor(q_len))
    pos = torch.cat([torch.arange(n - ql, n) for n, ql in zip(lens, q_len)])
    out = invariant.batched_causal_attention(q, k, v, seq, pos, 0.2, lengths_R=torch.tensor(lens))
    assert not out.isnan().any()
    start = 0
    for r, (n, ql) in enumerate(zip(lens, q_len)):
        alone = invariant.causal_attention(q[start:start + ql], k[r, :n], v[r, :n], pos[start:start + ql], 0.2)
        assert torch.equal(out[start:start + ql], alone), r
        start += ql
    with pytest.raises(ValueError, match=r"q_pos_Q: expected positions in \[0, L="):
        invariant.batched_causal_attention(q, k, v, seq, pos + 1, 0.2, lengths_R=torch.tensor(lens))


def test_attention_and_linear_do_not_depend_on_the_thread_count():
    """vLLM CPU runs its worker on 1 torch thread, the trainer on the machine's (docs/BITWISE.md)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(50, 4, 32, generator=gen), torch.randn(50, 2, 32, generator=gen), torch.randn(50, 2, 32, generator=gen)
    x, w = torch.randn(70, 256, generator=gen), torch.randn(130, 256, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = invariant.causal_attention(q, k, v, torch.arange(50), 0.2), invariant.linear(x, w)
        torch.set_num_threads(max(2, threads))
        many = invariant.causal_attention(q, k, v, torch.arange(50), 0.2), invariant.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many))


def test_rms_norm_rows_are_invariant_and_match_fp64():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(23, 96, generator=g) * 3
    w = torch.randn(96, generator=g)
    full = invariant.rms_norm(x, w, 1e-6)
    for off, M in ((0, 1), (5, 7), (22, 1)):
        assert torch.equal(invariant.rms_norm(x[off:off + M], w, 1e-6), full[off:off + M])
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert max_rel_err(full, ref) < INVARIANT_TOL
    assert torch.equal(invariant.rms_norm(x, None, 1e-6), invariant.rms_norm(x, torch.ones(96), 1e-6))
    assert invariant.rms_norm(x[:0], w, 1e-6).shape == (0, 96)
    with pytest.raises(ValueError, match=r"w: expected a \[96\] weight, got \(95,\)"):
        invariant.rms_norm(x, w[:95], 1e-6)


def test_rope_cache_is_the_fp64_table_rounded_once():
    c = invariant.rope_cache(10000.0, 8, 50)
    assert c.shape == (50, 8) and c.dtype == torch.float32 and c.device.type == "cpu"
    p = torch.arange(50, dtype=torch.float64)[:, None]
    f = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert torch.equal(c, torch.cat([(p * f).cos(), (p * f).sin()], -1).float())
    assert torch.equal(c[0], torch.tensor([1.0] * 4 + [0.0] * 4))
    with pytest.raises(ValueError, match="even rotary_dim"):
        invariant.rope_cache(10000.0, 7, 50)


def test_log_softmax_rows_are_invariant():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(9, 300, generator=g) * 4
    full = invariant.log_softmax(x)
    assert torch.equal(invariant.log_softmax(x[3:4]), full[3:4])
    assert max_rel_err(full, torch.log_softmax(x.double(), -1)) < INVARIANT_TOL


@pytest.mark.parametrize("block_size", [16, 24, 64, 128])
def test_paged_attention_is_each_sequence_alone_at_any_page_size(block_size):
    """Keys and values on shuffled pages (vLLM's layout, NaN in the slots no sequence owns), decode queries
    and prefill chunks mixed: each query bitwise its sequence's causal_attention (one contiguous page)."""
    g_ = torch.Generator().manual_seed(13)
    h, gk, D, lens, q_lens = 4, 2, 16, [130, 7, 49, 64], [1, 7, 3, 64]
    n_pages = [-(-L // block_size) for L in lens]
    perm = torch.randperm(sum(n_pages) + 2, generator=g_)
    k = torch.full((len(perm), gk, block_size, D), float("nan"))
    v = torch.full((len(perm), gk, block_size, D), float("nan"))
    table = torch.zeros(len(lens), max(n_pages), dtype=torch.long)
    keys, vals, queries, seq, pos, start = [], [], [], [], [], 0
    for r, (L, ql, n) in enumerate(zip(lens, q_lens, n_pages)):
        table[r, :n] = perm[start:start + n]
        start += n
        kr, vr = torch.randn(L, gk, D, generator=g_), torch.randn(L, gk, D, generator=g_)
        for j in range(L):
            k[table[r, j // block_size], :, j % block_size] = kr[j]
            v[table[r, j // block_size], :, j % block_size] = vr[j]
        keys.append(kr), vals.append(vr)
        queries.append(torch.randn(ql, h, D, generator=g_))
        seq += [r] * ql
        pos += list(range(L - ql, L))
    q = torch.cat(queries)
    out = invariant.paged_causal_attention(q, k, v, table, torch.tensor(lens), torch.tensor(seq), torch.tensor(pos), 0.3)
    assert not out.isnan().any()
    row = 0
    for r, (L, ql) in enumerate(zip(lens, q_lens)):
        alone = invariant.causal_attention(queries[r], keys[r], vals[r], torch.arange(L - ql, L), 0.3)
        assert torch.equal(out[row:row + ql], alone), (block_size, r)
        row += ql


def test_gpu_kernels_come_from_the_registration_or_the_projects_one_entry_point(monkeypatch):
    """The CUDA kernels reach megamoe by registration (megamoe imports no vLLM): a registered object is
    what gpu_kernels() returns and one lacking an op is refused, naming it; with none registered, the one
    entry point of GPU_KERNELS_GROUP is loaded: pyproject.toml's, a module with the four ops; with no
    entry point, an ImportError naming the group."""
    import importlib.metadata as md
    import tomllib
    import types
    from pathlib import Path

    ops = {n: (lambda *a: None) for n in ("linear", "rms_norm", "log_softmax", "paged_attention")}
    monkeypatch.setattr(invariant, "_GPU_KERNELS", [])
    mine = types.SimpleNamespace(**ops)
    invariant.register_gpu_kernels(mine)
    assert invariant.gpu_kernels() is mine
    with pytest.raises(TypeError, match=r"lacks \['paged_attention'\]"):
        invariant.register_gpu_kernels(types.SimpleNamespace(**{**ops, "paged_attention": None}))
    assert invariant.gpu_kernels() is mine

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"][invariant.GPU_KERNELS_GROUP]
    assert len(declared) == 1, declared
    found = [md.EntryPoint(name, value, invariant.GPU_KERNELS_GROUP) for name, value in declared.items()]
    monkeypatch.setattr(md, "entry_points", lambda group: found if group == invariant.GPU_KERNELS_GROUP else [])
    monkeypatch.setattr(invariant, "_GPU_KERNELS", [])
    assert invariant.gpu_kernels() is found[0].load()
    monkeypatch.setattr(md, "entry_points", lambda group: [])
    monkeypatch.setattr(invariant, "_GPU_KERNELS", [])
    with pytest.raises(ImportError, match=r"expected one entry point in group 'megamoe.invariant_kernels'"):
        invariant.gpu_kernels()
