"""The megamoe implementation: Triton kernels (interpreter on CPU, compiled on GPU) and the CPU
torch implementation, forward and every gradient against the fp32 ground truth; batch invariance,
determinism, CUDA graphs, NaN isolation, the torch.library op, and its refusals."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import megamoe
from megamoe.fused import fused_moe_bwd, fused_moe_fwd
from megamoe.kernels.moe_kernels import _decode_ticket
from megamoe.ref import moe_ground_truth
from megamoe.testing import TOLERANCES, assert_close, make_problem


@triton.jit
def _decode_all(out_ptr, n, R, LAG, n1, n2, GT: tl.constexpr, BLOCK: tl.constexpr):
    """(kind, tile, column block) of tickets [0, n): the persistent kernel's own decoder."""
    t = tl.arange(0, BLOCK)
    kind, tile, sub = _decode_ticket(t, R, LAG, n1, n2, GT)
    m = t < n
    tl.store(out_ptr + 3 * t, kind, mask=m)
    tl.store(out_ptr + 3 * t + 1, tile, mask=m)
    tl.store(out_ptr + 3 * t + 2, sub, mask=m)


# (T, H, I, E, k, routing, drop_frac)
EDGE_CASES = [
    pytest.param(1, 32, 16, 4, 2, "random", 0.0, id="T1-H32-I16-E4-k2"),
    pytest.param(19, 40, 24, 5, 1, "random", 0.0, id="T19-H40-I24-E5-k1"),
    pytest.param(23, 36, 20, 6, 3, "random", 0.0, id="T23-H36-I20-E6-k3"),
    pytest.param(17, 20, 12, 7, 2, "skip_odd", 0.0, id="T17-E7-empty-experts"),
    pytest.param(21, 24, 16, 5, 3, "one_expert", 0.0, id="T21-E5-all-on-one"),
    pytest.param(25, 32, 16, 6, 3, "random", 0.3, id="T25-k3-drop30"),
]
# the fp32 partial dots of d(topk_weights) summed in another order (see _check_all)
DTW_ORDER_TOL = 1e-6

GPU_CASES = EDGE_CASES + [
    pytest.param(1, 2048, 768, 128, 8, "random", 0.0, id="T1-qwen3"),
    pytest.param(333, 1000, 300, 13, 3, "random", 0.1, id="T333-H1000-I300-E13-k3-drop"),
    pytest.param(517, 512, 192, 64, 8, "random", 0.0, id="T517-E64-k8"),
    pytest.param(300, 256, 128, 9, 2, "one_expert", 0.0, id="T300-all-on-one"),
    # DeepSeek-V3's expert count (the interpreter checks its metadata only: a whole forward and
    # backward at E=256 takes about a minute there)
    pytest.param(129, 256, 128, 256, 8, "random", 0.0, id="T129-E256-k8"),
]


def _check_all(p, dtype, backend, tol):
    ref = p.leaves()
    y_ref = moe_ground_truth(*ref.args())
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(7)).to(y_ref.device)
    y_ref.backward(g)
    y = fused_moe_fwd(*p.args(), backend=backend)
    dx, dw13, dw2, dtw = fused_moe_bwd(g.to(dtype), *p.args(), backend=backend)
    assert y.dtype == dtype and dx.dtype == dtype and dw13.dtype == dtype
    assert_close("y", y, y_ref, tol)
    for name, got in (("x", dx), ("w13", dw13), ("w2", dw2), ("topk_weights", dtw)):
        assert_close(f"d{name}", got, getattr(ref, name).grad, tol, allow_zero_ref=False)
    # the training path: the forward saves (gate, up), the backward reads it instead of recomputing
    # GEMM1; same y bits, the same dx / dw bits (both round (gate, up) to the input dtype)
    y_s, gu = fused_moe_fwd(*p.args(), backend=backend, save_gu=True)
    assert torch.equal(y_s, y), "saving (gate, up) changed y"
    saved = fused_moe_bwd(g.to(dtype), *p.args(), backend=backend, gu=gu)
    for name, a, b in zip(("dx", "dw13", "dw2"), saved, (dx, dw13, dw2)):
        assert torch.equal(a, b), f"{name}: the backward from saved (gate, up) differs from the recomputing one"
    # d(topk_weights) is an fp32 sum over each column block's products, which the compiled GPU kernel
    # reduces in a layout-dependent order that differs between its two variants (H200, 2026-12-01:
    # not bitwise, dx/dw13/dw2 bitwise); the same values summed in another order stay within
    # DTW_ORDER_TOL
    assert_close("dtopk_weights saved vs recomputed", saved[3], dtw, DTW_ORDER_TOL)
    return y, dx


@pytest.mark.parametrize("T,H,I,E,k,routing,drop", EDGE_CASES)
def test_triton_interpreter_fp32(T, H, I, E, k, routing, drop, nan_fill):  # noqa: E741
    """The Triton kernels themselves, on CPU under TRITON_INTERPRET=1 (one program, fp32)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")
    p = make_problem(T, H, I, E, k, routing=routing, drop_frac=drop, seed=T)
    _check_all(p, torch.float32, "triton", TOLERANCES[torch.float32])


LAUNCH_OUTPUTS = ("y", "gu", "y (inference)", "dx", "dw13", "dw2", "dtw", "dx (recompute)", "dw13 (recompute)",
                  "dw2 (recompute)", "dtw (recompute)")


def _launch_outputs(p, g, **changes):
    """Every output of the persistent launches (forward with and without (gate, up), backward reading
    it and recomputing GEMM1), with the default config of p's dtype and device changed by `changes`."""
    from megamoe import fused
    x = p.args()[0]
    fused.set_config(dataclasses.replace(fused.default_config(x.dtype, x.device), **changes))
    try:
        y, gu = fused_moe_fwd(*p.args(), backend="triton", save_gu=True)
        return (y, gu, fused_moe_fwd(*p.args(), backend="triton"),
                *fused_moe_bwd(g, *p.args(), backend="triton", gu=gu), *fused_moe_bwd(g, *p.args(), backend="triton"))
    finally:
        fused.set_config(None)


@pytest.mark.slow  # many persistent launches in the interpreter
def test_triton_interpreter_result_does_not_depend_on_the_program_count(nan_fill):
    """The persistent launches give the same bits with 1, 2, 3 or 5 programs. The interpreter runs
    program p only after program p-1 has finished, the extreme case of programs that are not yet
    resident (another kernel holding SMs): no program ever waits for work that only a later
    program would take."""
    from megamoe.fused import counter_buffers
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")
    # H = 20: two GEMM2 column blocks of 16, the second partial (the interpreter's time grows with H)
    p = make_problem(23, 20, 20, 6, 3, seed=4, drop_frac=0.2)
    g = torch.randn(23, 20, generator=torch.Generator().manual_seed(2))
    results = {n: _launch_outputs(p, g, programs=n) for n in (1, 2, 3, 5)}
    for n in (2, 3, 5):
        assert all(torch.equal(a, b) for a, b in zip(results[n], results[1])), f"{n} programs differ from 1"
    assert all(int(buf.abs().sum()) == 0 for buf in counter_buffers())


@pytest.mark.slow
def test_triton_interpreter_result_does_not_depend_on_the_ticket_order(nan_fill):
    """Tiles grouped 1, 2, 3 or 8 at a time in the ticket order (GT), with the smallest and a large
    phase-2 lag and two programs: the items run in other orders, every output keeps its bits."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")
    # I = 40: 3 column blocks of 16; H = 20: 2 (the interpreter's time grows with H)
    p = make_problem(37, 20, 40, 5, 3, seed=8, drop_frac=0.2)
    g = torch.randn(37, 20, generator=torch.Generator().manual_seed(5))
    results = {(gt, lag): _launch_outputs(p, g, group_tiles=gt, lag=lag, programs=2)
               for gt, lag in ((1, None), (2, 1), (3, None), (8, 1), (8, 7))}
    for key, res in results.items():
        assert all(torch.equal(a, b) for a, b in zip(res, results[1, None])), f"(GT, lag) = {key} differs"


def test_ticket_order_visits_every_item_once_after_what_it_waits_for():
    """The kernel's _decode_ticket, run for every ticket of a few shapes (under the interpreter):
    every (kind, tile, column block) exactly once; a tile's phase-2 items after all its phase-1
    items; inside a unit, column block by column block over the unit's tiles."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")
    for R, LAG, n1, n2, GT in ((8, 1, 3, 2, 4), (12, 2, 2, 5, 3), (6, 9, 1, 1, 2), (5, 3, 4, 2, 1), (16, 1, 6, 8, 8),
                               (8, 0, 3, 2, 4), (5, 0, 4, 2, 1)):  # (a negative LAG breaks the order: KernelConfig refuses it)
        n = R * (n1 + n2) + 3
        out = torch.zeros(n, 3, dtype=torch.int32)
        _decode_all[(1,)](out, n, R, LAG, n1, n2, GT=GT, BLOCK=triton.next_power_of_2(n))
        order = [tuple(r) for r in out.tolist()]
        items = order[:R * (n1 + n2)]
        assert sorted(items) == sorted([(1, r, c) for r in range(R) for c in range(n1)] +
                                       [(2, r, c) for r in range(R) for c in range(n2)])
        assert order[R * (n1 + n2):] == [(3, 0, 0), (3, 1, 0), (3, 2, 0)]
        pos = {it: i for i, it in enumerate(items)}
        for r in range(R):
            assert max(pos[1, r, c] for c in range(n1)) < min(pos[2, r, c] for c in range(n2))
        assert items[:GT * n1] == [(1, r, c) for c in range(n1) for r in range(GT)]


# The Triton kernels on either device: the interpreter on CPU, compiled on a GPU (the GPU stages select `gpu`).
KERNEL_DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _skip_unless_kernels_run_on(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU case runs the kernels under the Triton interpreter (TRITON_INTERPRET=1 is not set)")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_kernel_leaves_its_workspace_as_found(device, nan_fill):
    """Every counter (tickets, phase counts, per-tile counts) is zero again after a forward and a
    backward launch, so the next call and a CUDA-graph replay need no host-side clearing; a second
    call gives the same bits."""
    from megamoe.fused import counter_buffers
    _skip_unless_kernels_run_on(device)
    p = make_problem(29, 24, 16, 5, 3, routing="random", drop_frac=0.2, seed=11, device=device)
    g = torch.randn(29, 24, generator=torch.Generator().manual_seed(1)).to(device)
    y1, b1 = fused_moe_fwd(*p.args(), backend="triton"), fused_moe_bwd(g, *p.args(), backend="triton")
    bufs = counter_buffers(device)
    assert bufs and all(int(b.abs().sum()) == 0 for b in bufs)
    y2, b2 = fused_moe_fwd(*p.args(), backend="triton"), fused_moe_bwd(g, *p.args(), backend="triton")
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(b1, b2))


def _tma_vs_pointers(p, g):
    """Every output of the persistent launches with the weights read through TMA descriptors and
    through pointers: the same bits (same values into the same tiles, same dots)."""
    from megamoe import fused
    x, w13, w2 = p.args()[:3]
    base = fused.default_config(x.dtype, x.device)
    for tma in (True, False):  # the case reaches the path it names
        assert fused.weights_through_tma(dataclasses.replace(base, tma_weights=tma), w13, w2) == tma
    via_tma, via_pointers = _launch_outputs(p, g, tma_weights=True), _launch_outputs(p, g, tma_weights=False)
    for name, a, b in zip(LAUNCH_OUTPUTS, via_tma, via_pointers):
        assert torch.equal(a, b), f"{name}: TMA weight loads differ from pointer loads"


@pytest.mark.parametrize("T,H,I,E,k,routing,drop", [EDGE_CASES[2], EDGE_CASES[5]])
def test_triton_interpreter_tma_weight_loads_equal_pointer_loads(T, H, I, E, k, routing, drop, nan_fill):  # noqa: E741
    """I and H not multiples of the tiles: the descriptors' per-expert bounds zero-fill what the
    pointer loads mask."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")
    p = make_problem(T, H, I, E, k, routing=routing, drop_frac=drop, seed=T)
    _tma_vs_pointers(p, torch.randn(T, H, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("T,H,I,E,k,routing,drop", [
    EDGE_CASES[3],
    # 2 x 41 slots on experts 0, 2, 4 (the interpreter's K block is 16): whole blocks, partial ones
    pytest.param(41, 40, 24, 6, 2, "skip_odd", 0.0, id="T41-E6-whole-and-partial-blocks"),
])
def test_triton_interpreter_dw_tma_loads_equal_pointer_loads(T, H, I, E, k, routing, drop, nan_fill):  # noqa: E741
    """The weight-gradient kernel's TMA path (an expert's whole K blocks through the host's
    descriptors over all rows, its last partial block by masked pointer loads) gives the bits of the
    pointer-only path: expert row counts below, at and above the K block and not multiples of it,
    experts with no rows, H and I not multiples of the tiles. (The ground-truth tests run the
    default, TMA; this one also runs the pointer path.)"""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")
    from megamoe import fused
    p = make_problem(T, H, I, E, k, routing=routing, drop_frac=drop, seed=T)
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    N = T * k
    operands = (torch.empty(N, 2 * I), torch.empty(N, I), torch.empty(N, H), torch.empty(N, H))
    base = fused.default_config(torch.float32, torch.device("cpu"))
    for tma in (True, False):  # the case reaches the path it names
        assert fused.dw_through_tma(dataclasses.replace(base, dw_tma=tma), operands) == tma
    ids = p.topk_ids
    counts = torch.bincount(ids[ids >= 0].flatten(), minlength=E)
    assert (counts == 0).any() and (counts % base.BKR != 0).any(), counts
    if T == 41:  # the case that reads whole blocks through the descriptors
        assert (counts >= base.BKR).any(), counts
    via_tma, via_pointers = _launch_outputs(p, g, dw_tma=True), _launch_outputs(p, g, dw_tma=False)
    for name, a, b in zip(LAUNCH_OUTPUTS, via_tma, via_pointers):
        assert torch.equal(a, b), f"{name}: weight-gradient TMA loads differ from pointer loads"


def test_dw_tma_only_where_the_hardware_can_address_the_rows():
    from megamoe import fused
    cfg = fused.KernelConfig()
    t = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt)  # noqa: E731
    assert fused.dw_through_tma(cfg, (t(9, 48), t(9, 24), t(9, 40), t(9, 40)))
    assert not fused.dw_through_tma(cfg, (t(9, 40), t(9, 20), t(9, 40), t(9, 40))), "I * 2 bytes not a multiple of 16"
    assert not fused.dw_through_tma(cfg, (t(9, 48), t(9, 24), t(9, 36), t(9, 36))), "H * 2 bytes not a multiple of 16"
    assert fused.dw_through_tma(cfg, (t(9, 40, dt=torch.float32), t(9, 20, dt=torch.float32), t(9, 36, dt=torch.float32),
                               t(9, 36, dt=torch.float32)))
    shifted = t(9 * 40 + 4)[4:].view(9, 40)  # base 8 bytes past an aligned one
    assert not fused.dw_through_tma(cfg, (t(9, 48), t(9, 24), shifted, t(9, 40))), "base not 16-byte aligned"
    assert not fused.dw_through_tma(fused.KernelConfig(dw_tma=False), (t(9, 48), t(9, 24), t(9, 40), t(9, 40)))
    assert not fused.default_config(torch.float32, torch.device("cuda")).dw_tma


@pytest.mark.parametrize("field,value,expected", [
    ("BM", 48, "power of two >= 16"), ("BKR", 8, "power of two >= 16"), ("bwd_BN1", 0, "power of two >= 16"),
    ("BT", 12, "power of two"), ("BLK", -4, "power of two"), ("BR", 2.0, "power of two"),
    ("num_warps", 64, "power of two <= 32"), ("dw_warps", 3, "power of two <= 32"),
    ("num_stages", 0, "int >= 1"), ("bwd_stages", 0, "int >= 1 or None"), ("lag", -1, "int >= 0 or None"),
    ("programs", -1, "int >= 1 or None"), ("group_tiles", True, "int >= 1"), ("dw_tma", 1, "a bool"),
    ("small_stages", 0, "int >= 1 or None"), ("small_tokens", None, "int >= 0"),
    ("recompute_stages", 0, "int >= 1 or None"),
])
def test_kernel_config_refuses_what_the_kernels_cannot_run(field, value, expected):
    from megamoe import fused
    with pytest.raises(ValueError, match=rf"KernelConfig\.{field}: expected .*{re.escape(expected)}.*got {re.escape(repr(value))}"):
        fused.KernelConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"KernelConfig\.{field}"):  # and through replace (set_config's users)
        dataclasses.replace(fused.KernelConfig(), **{field: value})


def test_every_default_config_is_valid():
    from megamoe import fused
    for dev in ("cpu", "cuda"):
        for dt in (torch.float32, torch.bfloat16):
            cfg = fused.default_config(dt, torch.device(dev))
            assert dataclasses.replace(cfg) == cfg
    fused.KernelConfig(bwd_stages=None, recompute_stages=None, small_stages=None, programs=None,
                       lag=None)  # the optional fields' None
    fused.KernelConfig(lag=0)  # phase-2 items right after their unit's phase-1 items (the ticket-order test)


def test_backward_pipeline_stages_follow_the_config():
    from megamoe import fused
    cfg = fused.KernelConfig(num_stages=3)
    assert (fused.persistent_stages(cfg, False), fused.persistent_stages(cfg, True)) == (3, 3)
    cfg = fused.KernelConfig(num_stages=3, bwd_stages=4)
    assert (fused.persistent_stages(cfg, False), fused.persistent_stages(cfg, True)) == (3, 4)
    assert fused.persistent_stages(cfg, True, recompute=True) == 4  # recompute_stages None: bwd_stages
    # the backward that recomputes GEMM1 (no saved (gate, up)) alone takes recompute_stages
    cfg = fused.KernelConfig(num_stages=2, bwd_stages=4, recompute_stages=3)
    assert [fused.persistent_stages(cfg, True, recompute=r) for r in (False, True)] == [4, 3]
    assert fused.persistent_stages(cfg, False, 16384, recompute=True) == 2


def test_bf16_cuda_stages_per_triton_version(monkeypatch):
    """The one setting chosen per Triton version (megamoe/fused/config.py says why): on Triton 3.6
    every bf16 CUDA launch keeps the stages the H200 measurements ran (backward 4, both with and
    without saved (gate, up)); from 3.7 on, the backward that recomputes GEMM1 takes 3 (with 4 it
    spills on 3.7.1, compile_check.py), the one reading saved (gate, up) keeps 4."""
    from megamoe import fused
    from megamoe.fused import config
    cuda = torch.device("cuda")
    for version, recompute in (((3, 6), 4), ((3, 7), 3), ((4, 0), 3)):
        monkeypatch.setattr(config, "TRITON_VERSION", version)
        bf16 = fused.default_config(torch.bfloat16, cuda)
        assert [fused.persistent_stages(bf16, True, recompute=r) for r in (False, True)] == [4, recompute], version
        fp32 = fused.default_config(torch.float32, cuda)  # fp32 and the interpreter's: one config on every version
        assert fp32 == dataclasses.replace(fp32, recompute_stages=None), version
        assert fused.default_config(torch.float32, torch.device("cpu")).recompute_stages is None
    monkeypatch.setattr(config, "TRITON_VERSION", (3, 6))  # exactly the config the H200 measured (RESULTS.md)
    assert fused.default_config(torch.bfloat16, cuda) == fused.KernelConfig(bwd_stages=4, BT=8, small_stages=4)


def test_the_launcher_gives_the_recomputing_backward_its_stages(monkeypatch):
    """launch_persistent asks for recompute_stages for the backward without saved (gate, up) only
    (the interpreter ignores stages, so the launcher's question is what is checked)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")
    from megamoe import fused
    from megamoe.fused import launch
    asked = []

    def stages(cfg, is_bwd, T=None, recompute=False):
        asked.append((is_bwd, recompute, fused.persistent_stages(cfg, is_bwd, T, recompute=recompute)))
        return asked[-1][2]

    monkeypatch.setattr(launch, "persistent_stages", stages)
    p = make_problem(8, 16, 16, 4, 2, seed=3)
    gen = torch.Generator().manual_seed(4)
    g, gu = torch.randn(8, 16, generator=gen), torch.randn(8 * 2, 2 * 16, generator=gen)  # only launched, not checked
    fused.set_config(dataclasses.replace(fused.default_config(g.dtype, g.device), num_stages=2, bwd_stages=3,
                                         recompute_stages=4))
    try:
        fused_moe_bwd(g, *p.args(), backend="triton", gu=gu)
        fused_moe_bwd(g, *p.args(), backend="triton")
    finally:
        fused.set_config(None)
    assert asked == [(True, False, 3), (True, True, 4)]


def test_forward_pipeline_stages_at_small_T():
    """small_stages applies to the forward at T <= small_tokens only: not to larger T, not to the
    backward, not without a T (the EP launch); the bf16 CUDA default uses 4 there, fp32 none."""
    from megamoe import fused
    cfg = fused.KernelConfig(num_stages=3, bwd_stages=2, small_stages=4, small_tokens=512)
    assert [fused.persistent_stages(cfg, False, T) for T in (1, 512, 513, 16384, None)] == [4, 4, 3, 3, 3]
    assert [fused.persistent_stages(cfg, True, T) for T in (1, 16384)] == [2, 2]
    assert fused.persistent_stages(fused.KernelConfig(num_stages=3), False, 1) == 3  # small_stages None
    bf16 = fused.default_config(torch.bfloat16, torch.device("cuda"))
    assert [fused.persistent_stages(bf16, False, T) for T in (64, 4096, 4097)] == [4, 4, 3]
    assert fused.default_config(torch.float32, torch.device("cuda")).small_stages is None


def test_the_raw_launcher_refuses_strided_inputs():
    """The kernel indexes its inputs as dense arrays. The public wrappers make them contiguous; a
    direct call of the launcher with a strided one (topk ids sliced from a sort, as routing returns
    them) raises before launching instead of reading the wrong experts (a benchmark tool did, once)."""
    from megamoe import fused
    p = make_problem(9, 16, 16, 4, 2, seed=3)
    x, w13, w2, tw, ids = p.args()
    strided = torch.sort(torch.rand(9, 4, generator=torch.Generator().manual_seed(0)), dim=1).indices[:, :2]
    assert not strided.is_contiguous()
    cfg = fused.default_config(x.dtype, x.device)
    for name, args in (("topk_ids", (x, w13, w2, tw, strided)), ("x", (x.t().contiguous().t(), w13, w2, tw, ids)),
                       ("topk_weights", (x, w13, w2, tw.t().contiguous().t(), ids))):
        with pytest.raises(ValueError, match=f"launch_persistent: {name} must be contiguous"):
            fused.launch_persistent(False, *args, None, 9, 16, 16, 4, 2, cfg)
    # the public forward takes the strided ids and gives the contiguous copy's bits
    assert torch.equal(fused_moe_fwd(x, w13, w2, tw, strided, backend="torch"),
                       fused_moe_fwd(x, w13, w2, tw, strided.contiguous(), backend="torch"))


def test_tma_weights_only_where_the_hardware_can_address_the_rows():
    from megamoe import fused
    cfg = fused.KernelConfig()
    w = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt)  # noqa: E731
    assert fused.weights_through_tma(cfg, w(4, 2 * 24, 40), w(4, 40, 24))
    assert not fused.weights_through_tma(cfg, w(4, 2 * 24, 36), w(4, 36, 24)), "H * 2 bytes not a multiple of 16"
    assert not fused.weights_through_tma(cfg, w(4, 2 * 20, 40), w(4, 40, 20)), "I * 2 bytes not a multiple of 16"
    assert fused.weights_through_tma(cfg, w(4, 2 * 20, 36, dt=torch.float32), w(4, 36, 20, dt=torch.float32))
    shifted = w(4 * 48 * 40 + 4)[4:].view(4, 48, 40)  # base 8 bytes past an aligned one
    assert not fused.weights_through_tma(cfg, shifted, w(4, 40, 24)), "base not 16-byte aligned"
    assert not fused.weights_through_tma(fused.KernelConfig(tma_weights=False), w(4, 48, 40), w(4, 40, 24))
    assert not fused.default_config(torch.float32, torch.device("cuda")).tma_weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,H,I,E,k,routing,drop", EDGE_CASES)
def test_torch_backend(T, H, I, E, k, routing, drop, dtype, nan_fill):  # noqa: E741
    p = make_problem(T, H, I, E, k, routing=routing, drop_frac=drop, seed=T, dtype=dtype)
    _check_all(p, dtype, "torch", TOLERANCES[dtype])


def test_dropped_token_gets_exact_zero():
    p = make_problem(6, 24, 16, 4, 2, seed=3)
    p.topk_ids[2] = -1
    y = fused_moe_fwd(*p.args(), backend="torch")
    dx, *_ = fused_moe_bwd(torch.randn_like(y), *p.args(), backend="torch")
    assert torch.equal(y[2], torch.zeros_like(y[2])) and torch.equal(dx[2], torch.zeros_like(dx[2]))
    assert y[1].abs().max() > 0


def _batch_invariance(device, dtype, backend, sizes):
    big = make_problem(max(sizes), 64 if device == "cpu" else 512, 32 if device == "cpu" else 256,
                       8 if device == "cpu" else 16, 2 if device == "cpu" else 4, seed=11,
                       dtype=dtype, device=device)
    full = fused_moe_fwd(*big.args(), backend=backend)
    for n in sizes:
        for start in (0, max(sizes) - n):
            part = fused_moe_fwd(big.x[start:start + n], big.w13, big.w2, big.topk_weights[start:start + n],
                                 big.topk_ids[start:start + n], backend=backend)
            assert torch.equal(part, full[start:start + n]), f"rows {start}:{start + n} differ from the full batch"
    again = fused_moe_fwd(*big.args(), backend=backend)
    assert torch.equal(again, full), "two runs differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_batch_invariant_and_deterministic(dtype):
    _batch_invariance("cpu", dtype, "torch", [1, 7, 64])


def test_opcheck():
    p = make_problem(9, 24, 16, 5, 2, seed=5, drop_frac=0.2)
    args = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in p.args())
    torch.library.opcheck(torch.ops.megamoe.fused_moe.default, args)
    g = torch.randn(9, 24)
    torch.library.opcheck(torch.ops.megamoe.fused_moe_bwd.default, (g,) + tuple(p.args()))
    torch.library.opcheck(torch.ops.megamoe.fused_moe_train.default, args)
    _, gu = fused_moe_fwd(*p.args(), save_gu=True)
    torch.library.opcheck(torch.ops.megamoe.fused_moe_bwd.default, (g,) + tuple(p.args()) + (gu,))


def test_saved_gu_rejected_when_it_does_not_match():
    p = make_problem(9, 24, 16, 5, 2, seed=5)
    _, gu = fused_moe_fwd(*p.args(), save_gu=True)
    g = torch.randn(9, 24)
    for bad in (gu[:-1], gu.double(), gu[:, :16]):
        with pytest.raises(ValueError, match="gu: expected"):
            fused_moe_bwd(g, *p.args(), gu=bad)


def test_autograd_saves_gu_only_when_training():
    """With grad enabled the public op runs the training forward (saves (gate, up)); under no_grad the
    inference op (nothing saved); y is the same either way."""
    p = make_problem(13, 24, 16, 5, 2, seed=9)
    leaves = p.leaves()
    y_train = megamoe.fused_moe(*leaves.args(), impl="megamoe")
    assert y_train.grad_fn is not None and "fused_moe_train" in type(y_train.grad_fn).__name__.lower() + \
        str(y_train.grad_fn.name()).lower(), y_train.grad_fn.name()
    with torch.no_grad():
        y_inf = megamoe.fused_moe(*leaves.args(), impl="megamoe")
    assert torch.equal(y_train.detach(), y_inf)
    # (gate, up) is not differentiable, so autograd never materialises a zero gradient of its size
    y_op, gu = torch.ops.megamoe.fused_moe_train(*leaves.args())
    assert y_op.requires_grad and not gu.requires_grad


def test_public_autograd_matches_fwd_bwd():
    p = make_problem(13, 24, 16, 5, 2, seed=9)
    leaves = p.leaves()
    y = megamoe.fused_moe(*leaves.args(), impl="megamoe")
    g = torch.randn_like(y)
    y.backward(g)
    dx, dw13, dw2, dtw = fused_moe_bwd(g, *p.args())
    assert torch.equal(leaves.x.grad, dx) and torch.equal(leaves.w13.grad, dw13)
    assert torch.equal(leaves.w2.grad, dw2) and torch.equal(leaves.topk_weights.grad, dtw)


GRAD_NAMES = ("x", "w13", "w2", "topk_weights")


def test_compiled_call_runs_the_registered_op_with_the_same_bits():
    """Under torch.compile the call is one graph holding the registered op (the inference op under
    no_grad, the training op with grad), and through aot_eager (the registered fake implementation
    and autograd) y and every gradient equal the eager call's bits."""
    p = make_problem(13, 24, 16, 5, 2, seed=9)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def f(*args):
        return megamoe.fused_moe(*args, check_ids=False)

    with torch.no_grad():
        y_c = torch.compile(f, backend=keep_graph, fullgraph=True)(*p.args())
    assert len(graphs) == 1 and "megamoe.fused_moe" in graphs[0] and "fused_moe_train" not in graphs[0], graphs
    assert torch.equal(y_c, f(*p.args()))
    a, b = p.leaves(), p.leaves()
    torch.compile(f, backend=keep_graph, fullgraph=True)(*a.args())
    assert len(graphs) == 2 and "megamoe.fused_moe_train" in graphs[1], graphs[1:]
    y_a = torch.compile(f, backend="aot_eager", fullgraph=True)(*a.args())
    y_b = f(*b.args())
    g = torch.randn_like(y_b)
    y_a.backward(g)
    y_b.backward(g)
    assert torch.equal(y_a, y_b) and all(torch.equal(getattr(a, n).grad, getattr(b, n).grad) for n in GRAD_NAMES)


def test_fake_tensors_go_through_the_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    p = make_problem(13, 24, 16, 5, 2, seed=9)
    with FakeTensorMode() as mode:
        y = megamoe.fused_moe(*(mode.from_tensor(t) for t in p.args()), check_ids=False)
    assert isinstance(y, FakeTensor) and tuple(y.shape) == (13, 24) and y.dtype == p.x.dtype


def test_triton_backend_refused_without_gpu_or_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal; this machine has a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = make_problem(4, 16, 16, 3, 1)
    with pytest.raises(ValueError, match="backend='triton' needs a CUDA tensor"):
        fused_moe_fwd(*p.args(), backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pb = make_problem(4, 16, 16, 3, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="interpreter runs fp32 only"):
        fused_moe_fwd(*pb.args(), backend="triton")
    with pytest.raises(ValueError, match="backend: expected"):
        fused_moe_fwd(*p.args(), backend="cuda")


def test_nan_stays_in_its_token_cpu():
    p = make_problem(12, 32, 16, 4, 2, seed=2)
    p.x[5, 3] = float("nan")
    y = fused_moe_fwd(*p.args(), backend="torch")
    bad = ~torch.isfinite(y).all(dim=1)
    assert bad.tolist() == [i == 5 for i in range(12)]


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,H,I,E,k,routing,drop", GPU_CASES)
def test_gpu_against_ground_truth(T, H, I, E, k, routing, drop, dtype, nan_fill):  # noqa: E741
    p = make_problem(T, H, I, E, k, routing=routing, drop_frac=drop, seed=T, dtype=dtype, device="cuda")
    _check_all(p, dtype, "triton", TOLERANCES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_batch_invariant_and_deterministic(dtype):
    # 4100 > small_tokens: the full batch's forward runs with num_stages, the parts with small_stages
    _batch_invariance("cuda", dtype, "triton", [1, 7, 512, 4096, 4100])


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_matches_eager():
    dev = "cuda"
    p = make_problem(256, 512, 256, 16, 4, seed=1, dtype=torch.bfloat16, device=dev)
    static = [t.clone() for t in p.args()]
    fused_moe_fwd(*static, check=False)  # warm up: compile, allocate the counter workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_fwd(*static, check=False)
    for seed in range(5):
        q = make_problem(256, 512, 256, 16, 4, seed=100 + seed, dtype=torch.bfloat16, device=dev)
        for dst, src in zip(static, q.args()):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe_fwd(*q.args())), f"replay {seed} differs from eager"


@pytest.mark.gpu
def test_gpu_dw_tma_loads_equal_pointer_loads():
    """bf16 on the GPU: the weight gradients with whole K blocks through TMA descriptors (the
    default) equal the masked pointer loads bitwise, and so every other output of the launches."""
    from megamoe import fused
    p = make_problem(517, 512, 192, 64, 8, seed=5, dtype=torch.bfloat16, device="cuda")
    g = torch.randn(517, 512, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    assert fused.default_config(torch.bfloat16, g.device).dw_tma
    via_tma, via_pointers = _launch_outputs(p, g, dw_tma=True), _launch_outputs(p, g, dw_tma=False)
    for name, a, b in zip(LAUNCH_OUTPUTS, via_tma, via_pointers):
        assert torch.equal(a, b), f"{name}: weight-gradient TMA loads differ from pointer loads"


@pytest.mark.gpu
def test_gpu_repeated_calls_do_not_hang_and_agree():
    p = make_problem(1000, 512, 256, 32, 8, seed=4, dtype=torch.bfloat16, device="cuda")
    first = fused_moe_fwd(*p.args())
    for _ in range(200):
        y = fused_moe_fwd(*p.args())
    g = torch.randn_like(first)
    grads = fused_moe_bwd(g, *p.args())
    for _ in range(20):
        again = fused_moe_bwd(g, *p.args())
    torch.cuda.synchronize()
    assert torch.equal(y, first)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.gpu
def test_gpu_nan_stays_in_its_token():
    p = make_problem(300, 256, 128, 8, 2, seed=6, dtype=torch.bfloat16, device="cuda")
    p.x[17, 5] = float("nan")
    p.x[250, 0] = float("inf")
    y = fused_moe_fwd(*p.args())
    bad = (~torch.isfinite(y).all(dim=1)).nonzero().flatten().tolist()
    assert bad == [17, 250]


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k", [(517, 512, 192, 64, 8), (333, 1000, 200, 13, 3), (1, 2048, 768, 128, 8)])
def test_gpu_tma_weight_loads_equal_pointer_loads(T, H, I, E, k):  # noqa: E741
    p = make_problem(T, H, I, E, k, seed=T, drop_frac=0.1, dtype=torch.bfloat16, device="cuda")
    _tma_vs_pointers(p, torch.randn(T, H, device="cuda", dtype=torch.bfloat16))


# In a fresh process, with the kernels already loaded by the main thread: the op's backward as the
# first node that autograd's device thread runs, and the forward as the first CUDA work of a new
# Python thread. Neither thread has a CUDA context bound until something binds one; Triton encodes
# TMA descriptors before its launcher binds one, so before fused.launch_device the backward failed
# with "Failed to create tensor map descriptor: invalid device context"
# (results/2026-12-02-h200-host-path-tma.log; this test on the code before it: -fresh-threads.log).
_FRESH_THREADS = """
import threading, torch, megamoe
from megamoe.fused import fused_moe_bwd, fused_moe_fwd
from megamoe.testing import make_problem
p = make_problem(64, 2048, 768, 128, 8, seed=11, dtype=torch.bfloat16, device="cuda")
x, w13, w2, tw, ids = p.args()
dy = torch.randn(64, 2048, generator=torch.Generator().manual_seed(12)).to("cuda", torch.bfloat16)
# first on this thread: the kernels compiled and loaded (Triton's loader binds a context to the thread
# that loads; a thread that only launches them does not get one)
want_y, gu = fused_moe_fwd(x, w13, w2, tw, ids, save_gu=True)
want = fused_moe_bwd(dy, x, w13, w2, tw, ids, gu=gu)
leaves = [t.clone().requires_grad_(True) for t in (x, w13, w2, tw)]
y = megamoe.fused_moe(*leaves, ids, check_ids=False)
y.backward(dy)
got = []
t = threading.Thread(target=lambda: got.append(megamoe.fused_moe(x, w13, w2, tw, ids, check_ids=False)))
t.start(); t.join()
assert len(got) == 1 and torch.equal(got[0], want_y), "forward on a new thread differs"
assert torch.equal(y, want_y), "forward differs"
for name, leaf, w in zip(("dx", "dw13", "dw2", "dtopk_weights"), leaves, want):
    assert torch.equal(leaf.grad, w), name
print("fresh threads ok")
"""


@pytest.mark.gpu
def test_gpu_launches_from_threads_without_a_cuda_context():
    r = subprocess.run([sys.executable, "-c", _FRESH_THREADS], capture_output=True, text=True, timeout=400,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0 and "fresh threads ok" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


@pytest.mark.gpu
def test_gpu_opcheck():
    p = make_problem(64, 128, 64, 8, 2, seed=5, dtype=torch.bfloat16, device="cuda")
    args = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in p.args())
    torch.library.opcheck(torch.ops.megamoe.fused_moe.default, args)
    torch.library.opcheck(torch.ops.megamoe.fused_moe_train.default, args)
    g = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    _, gu = fused_moe_fwd(*p.args(), save_gu=True)
    torch.library.opcheck(torch.ops.megamoe.fused_moe_bwd.default, (g,) + tuple(p.args()) + (gu,))


@pytest.mark.parametrize("T,E,k,drop,routing,BM,BLK", [
    pytest.param(37, 5, 3, 0.2, "random", 16, 32, id="T37-E5-k3-drop-4blocks"),
    pytest.param(1, 4, 2, 0.0, "random", 16, 32, id="T1-E4-k2"),
    pytest.param(50, 7, 2, 0.5, "skip_odd", 16, 16, id="T50-E7-empty-experts-7blocks"),
    pytest.param(64, 128, 8, 0.0, "random", 32, 64, id="T64-E128-k8-8blocks"),
    pytest.param(40, 256, 8, 0.1, "random", 16, 64, id="T40-E256-k8-5blocks"),  # DeepSeek-V3's expert count
    pytest.param(20, 6, 2, 0.0, "one_expert", 16, 1024, id="T20-all-on-one-1block"),
])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_metadata_equals_torch_metadata(T, E, k, drop, routing, BM, BLK, device):
    """Phase 0 of the persistent kernel (block histograms and in-register sorts; interpreter on CPU,
    compiled on GPU) against the torch-op metadata: exact equality of every index output, over
    several blocks."""
    from megamoe.fused import config_for, launch_persistent, routing_metadata
    _skip_unless_kernels_run_on(device)
    p = make_problem(T, 16, 16, E, k, drop_frac=drop, routing=routing, seed=3, device=device)
    a = routing_metadata(p.topk_ids, E)
    cfg = dataclasses.replace(config_for(p.x), BM=BM, BLK=BLK)
    b = launch_persistent(False, p.x, p.w13, p.w2, p.topk_weights, p.topk_ids.contiguous(), None,
                               T, 16, 16, E, k, cfg)[4]
    b = {f: getattr(b, f).long().cpu() for f in ("sorted_slot", "inv_slot", "expert_start", "expert_count",
                                                   "tile_cum", "num_tiles")}
    for f in ("sorted_slot", "expert_start", "expert_count"):
        assert torch.equal(getattr(a, f).long().cpu(), b[f]), f
    tiles = (a.expert_count.long().cpu() + BM - 1) // BM
    assert torch.equal(torch.cumsum(tiles, 0), b["tile_cum"]) and int(b["num_tiles"]) == int(tiles.sum())
    ids = p.topk_ids.reshape(-1).cpu()
    valid = (ids >= 0).nonzero().flatten()
    # the inverse permutation, for every valid slot
    assert torch.equal(b["sorted_slot"][b["inv_slot"][valid]], valid)
    # and the tiles the kernel derives from tile_cum (tile r: expert = number of experts whose
    # cumulative tile count is <= r) cover every valid slot exactly once, each with its own expert
    seen = []
    for r in range(int(b["num_tiles"])):
        e = int((b["tile_cum"] <= r).sum())
        first = int(b["tile_cum"][e - 1]) if e > 0 else 0
        s = int(b["expert_start"][e]) + (r - first) * BM
        t = min(s + BM, int(b["expert_start"][e] + b["expert_count"][e]))
        assert 0 < t - s <= BM
        slots = b["sorted_slot"][s:t]
        assert bool((ids[slots] == e).all())
        seen.append(slots)
    seen = torch.cat(seen) if seen else torch.zeros(0, dtype=torch.long)
    assert torch.equal(torch.sort(seen).values, valid)
