"""megamoe.router's Triton kernels (megamoe/kernels/router_kernels.py): fp32 router logits over fixed chunks
of H, the chunks' partial sums added in order, each row's bits independent of the batch. On CPU under the
Triton interpreter (fp32), on CUDA for real (fp32 and bf16 inputs). The torch path and the op's gradients:
tests/rl/test_consistency_invariance.py.

    .venv/bin/python -m pytest -q tests/megamoe/test_router.py
"""

from __future__ import annotations

import os

import pytest
import torch

from megamoe.router import BLOCKS, _logits_triton, router_logits, router_logits_fwd
from megamoe.testing import TOLERANCES, assert_close

# (T, H, E): a tile's worth, H and E not multiples of the blocks (H=100: one chunk, a partial BH block;
# E=70: three expert blocks, the last partial), T=1, one whole chunk (H=256), and three chunks, the last
# partial (H=600: the partial sums added by the second kernel).
SHAPES = [pytest.param(64, 64, 8, id="T64-H64-E8"), pytest.param(37, 100, 70, id="T37-H100-E70"),
          pytest.param(1, 96, 13, id="T1-H96-E13"), pytest.param(129, 256, 64, id="T129-H256-E64"),
          pytest.param(33, 600, 40, id="T33-H600-E40")]
SLICES = ((0, 1), (-1, 1), (3, 7), (0, 33), (5, 32))


def _interpreter_only():
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")


def _inputs(T, H, E, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    w = (torch.randn(E, H, generator=g) / H**0.5).to(dtype).to(device)
    return x, w


def _check_rows_invariant(x, w, full, backend):
    T = x.shape[0]
    for start, n in SLICES:
        start = start % T
        n = min(n, T - start)
        part = router_logits_fwd(x[start:start + n], w, backend=backend)
        assert torch.equal(part, full[start:start + n]), \
            (f"rows {start}:{start + n} alone differ from the batch of {T} "
             f"(max {float((part - full[start:start + n]).abs().max()):.3e})")


@pytest.mark.parametrize("T,H,E", SHAPES)
def test_triton_router_logits_interpreter(T, H, E):
    """Against fp64 x @ w.T; a row alone or in any slice gives its bits in the whole batch."""
    _interpreter_only()
    x, w = _inputs(T, H, E, torch.float32, "cpu")
    full = router_logits_fwd(x, w, backend="triton")
    assert full.dtype == torch.float32 and full.shape == (T, E)
    assert_close("logits", full, (x.double() @ w.double().t()).float(), TOLERANCES[torch.float32])
    _check_rows_invariant(x, w, full, "triton")
    # a strided view of x (every other row of a wider buffer) gives the contiguous rows' bits
    wide = torch.zeros(2 * T, H + 3)
    wide[::2, 1:H + 1] = x
    assert torch.equal(router_logits_fwd(wide[::2, 1:H + 1], w, backend="triton"), full)


def test_triton_router_logits_edge_cases_interpreter():
    _interpreter_only()
    x, w = _inputs(5, 64, 8, torch.float32, "cpu", seed=2)
    assert router_logits_fwd(x[:0], w, backend="triton").shape == (0, 8)
    b = torch.randn(8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(router_logits_fwd(x, w, b, backend="triton"), router_logits_fwd(x, w, backend="triton") + b)
    with pytest.raises(ValueError, match="runs fp32 only"):
        router_logits_fwd(x.bfloat16(), w.bfloat16(), backend="triton")
    with pytest.raises(ValueError, match="backend: expected 'triton' or 'torch'"):
        router_logits_fwd(x, w, backend="cuda")


def test_blocks_are_fixed_constants():
    """The block sizes are part of the bits both sides compute: one fixed set, powers of two >= 16 (tl.dot),
    a chunk a whole number of column steps."""
    assert set(BLOCKS) == {"BT", "BE", "BH", "CH"}
    assert all(v >= 16 and v & (v - 1) == 0 for v in BLOCKS.values())
    assert BLOCKS["CH"] % BLOCKS["BH"] == 0


def test_chunks_are_summed_in_order_interpreter():
    """With several chunks, each logit is the chunks' fp32 partial sums added in chunk order: the same bits
    as summing the one-chunk results of each column range (computed by the same kernel) in that order."""
    _interpreter_only()
    CH = BLOCKS["CH"]
    x, w = _inputs(19, 2 * CH + 40, 24, torch.float32, "cpu", seed=6)
    want = None
    for s in range(3):
        part = router_logits_fwd(x[:, s * CH:(s + 1) * CH].contiguous(), w[:, s * CH:(s + 1) * CH].contiguous(),
                                 backend="triton")
        want = part if want is None else want + part
    assert torch.equal(router_logits_fwd(x, w, backend="triton"), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("T,H,E", [pytest.param(4099, 1024, 64, id="T4099-H1024-E64"),
                                   pytest.param(2600, 2048, 128, id="T2600-H2048-E128"),
                                   pytest.param(333, 2880, 32, id="T333-H2880-E32")])
def test_triton_router_logits_gpu(T, H, E, dtype):
    """CUDA: within fp32 rounding of fp64 (IEEE fp32 multiply-adds, no TF32), rows invariant to the batch,
    and a CUDA-graph replay gives the same bits (T=333 at H=2880: 12 chunks, the sum kernel's unrolled loads)."""
    x, w = _inputs(T, H, E, dtype, "cuda", seed=4)
    full = router_logits(x, w)  # the public function: the Triton kernel on CUDA
    assert_close("logits", full, (x.double() @ w.double().t()).float(), TOLERANCES[torch.float32])
    _check_rows_invariant(x, w, full, None)
    for n in (1, 7, 64, 333):
        assert torch.equal(router_logits(x[-n:], w), full[-n:]), f"the last {n} rows alone"
    static = x[:128].clone()
    router_logits(static, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_logits(static, w)
    static.copy_(x[64:192])
    graph.replay()
    assert torch.equal(out, full[64:192])


@pytest.mark.gpu
@pytest.mark.parametrize("H,E", [pytest.param(1024, 64, id="H1024-E64"), pytest.param(2048, 128, id="H2048-E128"),
                                 pytest.param(7168, 256, id="H7168-E256")])
def test_row_and_expert_blocks_leave_the_bits_alone_gpu(H, E):
    """CUDA, bf16 x: the same logits, bit for bit, through other row / expert / column-step blocks with the
    chunk of CH columns kept (on the H200 with Triton 3.6 they were, 2026-12-04: benchmarks/RESULTS.md).
    Not relied on yet: this is what choosing the blocks by T (small for decode, large for training) would
    need, and it must hold on every GPU the project supports before that is done."""
    x, w = _inputs(1536, H, E, torch.bfloat16, "cuda", seed=8)
    want = router_logits_fwd(x, w, backend="triton")
    for bt, be, bh in ((32, 32, 64), (64, 64, 32), (64, 128, 32), (128, 64, 32)):
        got = _logits_triton(x, w, dict(BLOCKS, BT=bt, BE=be, BH=bh))
        assert torch.equal(got, want), f"blocks {bt}, {be}, {bh}"
