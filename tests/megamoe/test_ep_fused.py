"""The expert-parallel persistent launch (megamoe/ep_fused.py: dispatch, compute and combine in one
launch per rank), under the Triton interpreter on CPU (fp32, one program) and on a GPU when there
is one. W = 1 runs the whole protocol (store-to-peer through the address table, signal pads and
epochs, the combine reading the owner's rows) with the rank as its own peer; W = 2 in one process
with only rank 0 running exercises the time-out path. Every case is compared with the single-GPU
op on the same tokens, which the fused EP op must equal bitwise (same tiles, same reduction order).
"""

from __future__ import annotations

import os

import pytest
import torch

from megamoe.ep_fused import ep_check, ep_fused_moe, ep_fused_moe_fwd, linked_workspaces
from megamoe.fused import fused_moe_fwd
from megamoe.testing import make_problem

from test_fused import EDGE_CASES  # noqa: E402  (tests/ is on the path: no package)


def _device_and_dtype():
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1 (conftest sets it on CPU machines)")
    return "cpu", torch.float32


@pytest.mark.parametrize("T,H,I,E,k,routing,drop", EDGE_CASES)
def test_one_rank_equals_the_single_gpu_op(T, H, I, E, k, routing, drop, nan_fill):  # noqa: E741
    device, dtype = _device_and_dtype()
    p = make_problem(T, H, I, E, k, seed=11, dtype=dtype, device=device, routing=routing, drop_frac=drop)
    (ws,) = linked_workspaces(1, T + 3, k, H, dtype, device)  # rows past this call's T*k stay unused
    y = ep_fused_moe_fwd(*p.args(), ws, num_experts=E)
    ref = fused_moe_fwd(*p.args(), backend="triton")
    assert torch.equal(y, ref), float((y.float() - ref.float()).abs().max())
    # the protocol ran: this rank's epoch in both of its pads, ids of unsent rows -1
    assert ws.dsig.tolist() == [1] and ws.csig.tolist() == [1]
    assert (ws.recv_id[T * k:] == -1).all()


def test_repeated_calls_with_changing_batches(nan_fill):
    """Epochs advance without clearing; a shorter batch after a longer one does not see the longer
    one's rows; the workspace's counters are left zero for the next call."""
    device, dtype = _device_and_dtype()
    H, I, E, k = 24, 16, 6, 2  # noqa: E741
    (ws,) = linked_workspaces(1, 20, k, H, dtype, device)
    for n, T in enumerate((20, 3, 17, 20)):
        p = make_problem(T, H, I, E, k, seed=100 + n, dtype=dtype, device=device, drop_frac=0.2)
        y = ep_fused_moe_fwd(*p.args(), ws, num_experts=E)
        assert torch.equal(y, fused_moe_fwd(*p.args(), backend="triton")), f"call {n} (T={T})"
        assert ws.epoch == n + 1 and ws.dsig.tolist() == [n + 1] and ws.csig.tolist() == [n + 1]
    assert int(ws.ctr.abs().sum()) == 0


@pytest.mark.parametrize("drop", [0.0, 0.25])
def test_rank_1_of_2_whose_peer_sends_nothing(drop, nan_fill):
    """Rank 1 of 2 in one process, its tokens routed only to its own experts [L, 2L); rank 0 is
    simulated as a peer that sent no rows (-1 ids in its receive rows) and whose signals already
    arrived. Exercises the rank offsets (rows RANK*TMK + slot, table column RANK, local ids
    gid - RANK*L) that a one-rank run cannot tell from zero."""
    device, dtype = _device_and_dtype()
    T, H, I, L, k = 9, 24, 16, 4, 3  # noqa: E741
    ws0, ws1 = linked_workspaces(2, 11, k, H, dtype, device)
    p = make_problem(T, H, I, L, k, seed=21, dtype=dtype, device=device, drop_frac=drop)
    gids = torch.where(p.topk_ids >= 0, p.topk_ids + L, p.topk_ids)
    # what rank 0's dispatch of no rows would leave at rank 1: -1 ids in its rows, its epoch in the pads
    ws1.recv_id[: 11 * k] = -1
    ws1.dsig[0] = ws1.csig[0] = ws1.epoch + 1
    y = ep_fused_moe_fwd(p.x, p.w13, p.w2, p.topk_weights, gids, ws1, num_experts=2 * L)
    assert torch.equal(y, fused_moe_fwd(*p.args(), backend="triton"))
    # it signalled both ranks' pads at its own entry
    assert ws1.dsig.tolist() == [1, 1] and ws0.dsig.tolist() == [0, 1] and ws0.csig.tolist() == [0, 1]


def test_a_rank_that_never_arrives_raises_instead_of_hanging(nan_fill):
    """Two ranks' workspaces in one process, only rank 0 launched: its waits for rank 1's dispatch
    (and combine) signals time out; the error names the rank and the signal. The workspace stays
    usable: the single-GPU op and a one-rank EP call still give the right answer afterwards."""
    device, dtype = _device_and_dtype()
    H, I, L, k = 16, 16, 3, 2  # noqa: E741
    ws0, _ = linked_workspaces(2, 8, k, H, dtype, device)
    p = make_problem(8, H, I, L, k, seed=5, dtype=dtype, device=device)
    g = make_problem(8, H, I, 2 * L, k, seed=6, dtype=dtype, device=device)  # global ids over both ranks
    args = (p.x, p.w13, p.w2, g.topk_weights, g.topk_ids)
    for _ in range(2):  # the record is cleared after it is reported: the second call reports afresh
        with pytest.raises(RuntimeError, match=r"rank 0 timed out after 64 polls waiting for the dispatch "
                                               r"signal of rank 1"):
            ep_fused_moe_fwd(*args, ws0, num_experts=2 * L, spin_max=64)
    (ws,) = linked_workspaces(1, 8, k, H, dtype, device)
    y = ep_fused_moe_fwd(*p.args(), ws, num_experts=L)
    assert torch.equal(y, fused_moe_fwd(*p.args(), backend="triton"))


def test_bad_input_is_refused_before_the_launch():
    device, dtype = _device_and_dtype()
    p = make_problem(6, 16, 8, 4, 2, seed=1, dtype=dtype, device=device)
    (ws,) = linked_workspaces(1, 5, 2, 16, dtype, device)
    with pytest.raises(ValueError, match=r"x: expected at most max_tokens=5 tokens .* got T=6"):
        ep_fused_moe_fwd(*p.args(), ws, num_experts=4)
    (ws,) = linked_workspaces(1, 6, 2, 16, dtype, device)
    with pytest.raises(ValueError, match=r"num_experts: expected L \* W = 4 \* 1 = 4"):
        ep_fused_moe_fwd(*p.args(), ws, num_experts=8)
    bad = p.topk_ids.clone()
    bad[0, 0] = 4
    with pytest.raises(ValueError, match=r"topk_ids: expected global expert ids in \[-1, num_experts=4\)"):
        ep_fused_moe_fwd(p.x, p.w13, p.w2, p.topk_weights, bad, ws, num_experts=4)
    (ws3,) = linked_workspaces(1, 6, 3, 16, dtype, device)
    with pytest.raises(ValueError, match=r"expected H=16, k=3"):
        ep_fused_moe_fwd(*p.args(), ws3, num_experts=4)
    assert ws.epoch == 0 and ws3.epoch == 0 and ws.dsig.tolist() == [0]  # nothing launched


@pytest.mark.parametrize("programs", [2, 3])
def test_fewer_or_more_programs_give_the_same_bits(programs, nan_fill):
    """`programs` sizes the grid (e.g. to leave SMs to a concurrent kernel). Under the interpreter
    program p starts only after program p-1 has finished, so this also shows that no program waits
    for one that is not resident yet."""
    device, dtype = _device_and_dtype()
    p = make_problem(19, 24, 16, 5, 3, seed=7, dtype=dtype, device=device, drop_frac=0.2)
    (ws,) = linked_workspaces(1, 19, 3, 24, dtype, device)
    y = ep_fused_moe_fwd(*p.args(), ws, num_experts=5, programs=programs)
    assert torch.equal(y, fused_moe_fwd(*p.args(), backend="triton"))
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=r"programs: expected a positive int, got"):
            ep_fused_moe_fwd(*p.args(), ws, num_experts=5, programs=bad)
    assert ws.epoch == 1  # the refused calls launched nothing


def test_differentiable_call_needs_a_group_workspace():
    """`ep_fused_moe` without grad is the forward; with grad on an in-process workspace (no group
    for the backward's exchanges) it is refused before the launch."""
    device, dtype = _device_and_dtype()
    p = make_problem(7, 16, 8, 4, 2, seed=2, dtype=dtype, device=device)
    (ws,) = linked_workspaces(1, 7, 2, 16, dtype, device)
    with torch.no_grad():
        y = ep_fused_moe(*p.leaves().args(), ws, num_experts=4)
    assert torch.equal(y, fused_moe_fwd(*p.args(), backend="triton")) and ws.epoch == 1
    with pytest.raises(ValueError, match=r"ws: the backward exchanges rows over a process group"):
        ep_fused_moe(*p.leaves().args(), ws, num_experts=4)
    assert ws.epoch == 1  # nothing launched


def test_unchecked_call_reports_its_time_out_later(nan_fill):
    """check=False (what CUDA-graph capture needs) does not synchronise: the time-out is recorded on
    the device and `ep_check` raises it afterwards, once."""
    device, dtype = _device_and_dtype()
    H, I, L, k = 16, 16, 3, 2  # noqa: E741
    ws0, _ = linked_workspaces(2, 8, k, H, dtype, device)
    g = make_problem(8, H, I, 2 * L, k, seed=6, dtype=dtype, device=device)
    ep_fused_moe_fwd(g.x, g.w13[:L], g.w2[:L], g.topk_weights, g.topk_ids, ws0, num_experts=2 * L, check=False,
                     spin_max=64)
    assert ws0.epoch == 1  # the kernel advanced its own epoch
    with pytest.raises(RuntimeError, match=r"rank 0 timed out waiting for the dispatch signal of rank 1"):
        ep_check(ws0)
    ep_check(ws0)  # reported once


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_advances_the_epoch_and_matches_eager():
    if not torch.cuda.is_available():
        pytest.skip("needs 1 CUDA GPU")
    T, H, I, E, k = 64, 128, 64, 8, 2  # noqa: E741
    (ws,) = linked_workspaces(1, T, k, H, torch.bfloat16, "cuda")
    p = make_problem(T, H, I, E, k, seed=1, dtype=torch.bfloat16, device="cuda")
    static = [t.clone() for t in p.args()]
    ep_fused_moe_fwd(*static, ws, num_experts=E)  # warm-up: compiles, sizes the counter workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ep_fused_moe_fwd(*static, ws, num_experts=E, check=False)
    for n in range(5):
        q = make_problem(T, H, I, E, k, seed=10 + n, dtype=torch.bfloat16, device="cuda")
        for dst, src in zip(static, q.args()):
            dst.copy_(src)
        graph.replay()
        ep_check(ws)
        assert torch.equal(y, fused_moe_fwd(*q.args(), backend="triton")), n
    assert ws.epoch == 1 + 5  # the warm-up call and the replays (capture records the launch, runs nothing)


SPIN_5S = 5_000_000  # polls, at least 1 us apart on a GPU: a failure here fails in seconds, not minutes
TWO_RANK_CASES = [  # (T of rank 0, T of rank 1, routing, drop fraction)
    (37, 40, "random", 0.0),
    (40, 9, "rank0-only", 0.0),   # rank 1 receives no rows
    (0, 33, "random", 0.2),       # rank 0 has no tokens
    (25, 1, "random", 0.3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [8, 60])
def test_gpu_two_ranks_on_two_streams_equal_the_single_gpu_op(programs):
    """Two ranks of one process on one GPU, each rank's launch on its own stream, running at the same
    time (2 x `programs` programs fit on the GPU's SMs; rank 1 starts ~10 ms late behind a sleep, so
    rank 0 really waits for it): dispatch into the other rank's buffers, the signal pads and the
    combine reading the other's results, across concurrent kernels on real hardware. Each rank's y
    must equal the single-GPU op's rows bitwise, over four epochs on the same workspaces.

    Both ranks' inputs are fresh allocations, so both launches use one compiled kernel (a slice at an
    odd row offset would specialise a second one), and the sleep kernel is loaded before: in one
    process, a kernel loaded for the first time (CUDA lazy loading) while the other rank's launch
    spins waited for that launch, which then timed out (seen on the H200, 2026-12-01). One rank per
    process, as `ep_workspace` is used, does not share a context with its peer."""
    if not torch.cuda.is_available():
        pytest.skip("needs 1 CUDA GPU")
    torch.cuda._sleep(1)
    H, I, E, k = 64, 48, 8, 3  # noqa: E741
    L = E // 2
    wss = linked_workspaces(2, 40, k, H, torch.bfloat16, "cuda")
    streams = [torch.cuda.Stream() for _ in wss]
    for n, (t0, t1, routing, drop) in enumerate(TWO_RANK_CASES):
        p = make_problem(t0 + t1, H, I, E, k, seed=300 + n, dtype=torch.bfloat16, device="cuda", drop_frac=drop)
        ids = torch.where(p.topk_ids >= 0, p.topk_ids % L, p.topk_ids) if routing == "rank0-only" else p.topk_ids
        ref = fused_moe_fwd(p.x, p.w13, p.w2, p.topk_weights, ids, backend="triton")
        torch.cuda.synchronize()
        ys = []
        for r, (ws, stream) in enumerate(zip(wss, streams)):
            toks, mine = (slice(0, t0), slice(t0, t0 + t1))[r], slice(r * L, (r + 1) * L)
            with torch.cuda.stream(stream):
                if r == 1:
                    torch.cuda._sleep(20_000_000)  # ~10 ms of GPU clock cycles
                args = [t.clone() for t in (p.x[toks], p.w13[mine], p.w2[mine], p.topk_weights[toks], ids[toks])]
                ys.append((toks, ep_fused_moe_fwd(*args, ws, num_experts=E, check=False, programs=programs,
                                                  spin_max=SPIN_5S)))
        torch.cuda.synchronize()
        for ws in wss:
            ep_check(ws)
        for r, (toks, y) in enumerate(ys):
            assert torch.equal(y, ref[toks]), f"case {n} rank {r}: max |diff| {float((y.float() - ref[toks].float()).abs().max())}"
    assert [ws.epoch for ws in wss] == [len(TWO_RANK_CASES)] * 2
    assert all(int(ws.ctr.abs().sum()) == 0 for ws in wss)  # each launch left its own counters zero
