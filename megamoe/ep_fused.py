"""Expert-parallel forward in ONE persistent launch per rank (issue: expert parallel Mega MoE; the
plan is docs/EP_KERNEL_PLAN.md, this is its step 1).

Rank r of W holds experts [r*L, (r+1)*L) and its own tokens x [T, H] (T <= max_tokens). Every rank
owns an `EPWorkspace` of fixed-size buffers, one row per (source rank, source slot), TMK =
max_tokens * k rows per source:

    recv_x  [W*TMK, H]   token rows sent to this rank     recv_id int32 [W*TMK]  local expert id, -1: none
    recv_w  fp32 [W*TMK]  routing weights                  out     [W*TMK, H]     weighted expert output
    dsig, csig int64 [W]  signal pads (dispatch: entry s = source s's epoch; combine: entry d = owner d's)

and an int64 address table [6, W] of every rank's buffers. One launch of the persistent kernel
(`EP=True`, megamoe/kernels/moe_kernels.py) then: dispatches this rank's slots into every owner's
receive rows (store-to-peer; -1 ids for rows it does not send), release-stores its epoch into every
owner's dispatch pad; waits for every source's epoch; runs phases 0-2 of the single-GPU kernel over
the W*TMK received rows (K=1, L experts) into `out`; release-stores its epoch into every source's
combine pad; waits for every owner's epoch; sums each token's k rows, read from their owners' `out`,
in slot order in fp32. A token's y is therefore the single-GPU op's bits for the same tokens.

The grid is one program per SM unless `programs` says fewer (to leave SMs to a concurrent kernel):
programs take work tickets in order and never wait for work only a later program would take, so
the result is the same for any grid and a program that is not resident yet is never waited for.

No host clearing and no barrier per call: epochs grow by one per call (the kernel reads the last one
from the workspace and its last program out stores the new one) and a wait is satisfied by a pad
entry >= the epoch. A rank's next dispatch implies it finished its previous combine, so an
owner never overwrites rows a source is still reading. Every wait is bounded (`spin_max` polls, on
a GPU at least POLL_NS apart, so the default bound is at least a minute there: long enough for a
peer whose first call compiles the kernel while this rank's launch already waits); on time-out the
kernel records which pad entry it waited for, finishes the launch (the result is then garbage) and
the host raises naming the rank and the signal.

Backward (`ep_fused_moe`, differentiable; `ep_fused_moe_bwd`): not one launch. The token and dy
rows go to their experts' owners again by all_to_all over the workspace's group (the forward saves
only its inputs), each owner runs the single-GPU fused backward on its received slots (K = 1), and
each slot's dx row and d(topk_weights) come back by all_to_all; the token's rank sums its k dx rows
in slot order in fp32, as the single-GPU op does (across 2 CPU processes every gradient is that
op's bits, tests/megamoe/test_ep_fused_multiproc.py; not yet compared on GPUs).

Status. Workspaces: `linked_workspaces` (W ranks in one process; forward only),
`ep_workspace` (a process group: /dev/shm files on CPU, `torch.distributed._symmetric_memory` on
CUDA). Tested under the Triton interpreter on CPU, in one process (tests/megamoe/test_ep_fused.py) and
across 2 gloo processes sharing the /dev/shm workspaces (tests/megamoe/test_ep_fused_multiproc.py: y and every
gradient bitwise equal to the single-process op, uneven routing, a rank with no tokens, repeated
calls bitwise equal, bad input or differing requires_grad on one rank raised on both, a rank that
never arrives reported by the other as a time-out naming it), and compiled for sm_90
(benchmarks/device/compile_check.py, no stack). On one H200 (bf16) the single-process tests pass,
CUDA-graph capture and replay, the time-out path, and two ranks of one process running at the same
time on two streams included (benchmarks/RESULTS.md). Across two GPUs it has not run successfully
(the one run, without the timed waits, failed: benchmarks/RESULTS.md). The CUDA workspace path and the system-scope ordering between
devices are unverified. Not built: separate
communication and compute programs (every program takes dispatch, compute and combine tickets in
order), per-source readiness (the overlap), a one-launch backward. `megamoe.ep.ep_fused_moe`
(all_to_all around the single-GPU kernel) remains the EP path the trainer and rollout use.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.autograd.function import once_differentiable

from megamoe import alloc
from megamoe.contract import FLOAT_DTYPES, check_moe_inputs
from megamoe.ep import _check_everywhere, _check_local, check_global_ids, check_positive_ints
from megamoe.fused import (METADATA_ARGS, WEIGHT_ARGS, check_backend, combine_slots, config_for, grown_counters,
                           launch_device, persistent_setup, persistent_stages, weight_args)

_ADDRESS_ROWS = ("recv_x", "recv_id", "recv_w", "out", "dsig", "csig")  # the kernel's EP_* rows
# polls per wait before a time-out. On a GPU polls are at least POLL_NS apart (the kernel reads the
# GPU's clock), so the bound is at least 60 s there, whatever an atomic costs: enough for a peer
# that compiles the kernel (tens of seconds) before its first launch. Under the interpreter (no
# clock) a poll is a Python call (tens of microseconds), so about a minute.
SPIN_MAX = {"cuda": 60_000_000, "cpu": 1 << 21}
POLL_NS = {"cuda": 1000, "cpu": 0}
_ALIGN = 256


@dataclasses.dataclass
class EPWorkspace:
    rank: int
    world: int
    max_tokens: int
    k: int
    H: int
    dtype: torch.dtype
    device: torch.device
    recv_x: torch.Tensor
    recv_id: torch.Tensor
    recv_w: torch.Tensor
    out: torch.Tensor
    dsig: torch.Tensor
    csig: torch.Tensor
    err: torch.Tensor        # int32 [2]: time-out record (signal code, pad entry), 0 = none
    table: torch.Tensor      # int64 [6, W] addresses of every rank's buffers, as this process sees them
    epoch_dev: torch.Tensor  # int64 [1]: the last call's epoch, advanced by the kernel itself
    group: object = None     # the process group of `ep_workspace` (None: linked in one process)
    # the launches' counters (int32, grown outside graph capture, left zero by every launch): the
    # workspace's own, so an EP launch never shares them with another launch on the device (two
    # ranks of one process, or the single-GPU op on another stream, may run at the same time)
    ctr: torch.Tensor | None = None
    # what keeps the buffers the table points at alive (peer mappings, the symmetric-memory handle)
    keep: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def epoch(self) -> int:
        """The last call's epoch (reads the device: synchronises)."""
        return int(self.epoch_dev.item())


def _layout(world: int, max_tokens: int, k: int, H: int, dtype: torch.dtype) -> tuple[dict, int]:
    """(name -> (byte offset, bytes, shape, dtype)), total bytes: one buffer per rank holds them all."""
    rows = world * max_tokens * k
    parts = {"recv_x": ((rows, H), dtype), "recv_id": ((rows,), torch.int32), "recv_w": ((rows,), torch.float32),
             "out": ((rows, H), dtype), "dsig": ((world,), torch.int64), "csig": ((world,), torch.int64)}
    layout, offset = {}, 0
    for name, (shape, dt) in parts.items():
        nbytes = dt.itemsize * math.prod(shape)
        layout[name] = (offset, nbytes, shape, dt)
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return layout, offset


def _workspace(rank: int, world: int, max_tokens: int, k: int, H: int, dtype: torch.dtype, mine: torch.Tensor,
               bases: list[int], keep: list, group=None) -> EPWorkspace:
    """Views of this rank's byte buffer `mine` and the address table from every rank's base address."""
    layout, _ = _layout(world, max_tokens, k, H, dtype)
    views = {name: mine[offset:offset + n].view(dt).view(shape) for name, (offset, n, shape, dt) in layout.items()}
    table = torch.tensor([[b + layout[name][0] for b in bases] for name in _ADDRESS_ROWS], dtype=torch.int64,
                         device=mine.device)
    return EPWorkspace(rank=rank, world=world, max_tokens=max_tokens, k=k, H=H, dtype=dtype, device=mine.device,
                       err=torch.zeros(2, dtype=torch.int32, device=mine.device), table=table, keep=keep + [mine],
                       epoch_dev=torch.zeros(1, dtype=torch.int64, device=mine.device),
                       group=group, **views)


def linked_workspaces(world: int, max_tokens: int, k: int, H: int, dtype: torch.dtype,
                      device: torch.device | str) -> list[EPWorkspace]:
    """`world` ranks' workspaces in this one process, each one's table pointing at all of them (what
    symmetric memory gives each process of a group). W = 1 is the single-process EP op."""
    check_positive_ints(world=world, max_tokens=max_tokens, k=k, H=H)
    _, nbytes = _layout(world, max_tokens, k, H, dtype)
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    bases = [b.data_ptr() for b in bufs]
    return [_workspace(r, world, max_tokens, k, H, dtype, bufs[r], bases, keep=bufs) for r in range(world)]


def ep_workspace(max_tokens: int, k: int, H: int, dtype: torch.dtype, device: torch.device | str,
                 group=None) -> EPWorkspace:
    """This rank's workspace for a torch.distributed group (collective: every rank calls it with the
    same sizes, which it exchanges first: a bad or differing one raises the same ValueError on every
    rank; allocate once, outside CUDA-graph capture, and reuse for every call and layer).
    CUDA: one `torch.distributed._symmetric_memory` allocation per rank, peers' addresses from the
    rendezvous handle (not yet run across two GPUs successfully: benchmarks/RESULTS.md). CPU: one
    file per rank in /dev/shm, mapped by every rank and unlinked once all have mapped it (the Triton
    interpreter then runs the same protocol across processes)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ep_workspace: torch.distributed is not initialised (call init_process_group first)")
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _agree_on_sizes(group, max_tokens=max_tokens, k=k, H=H, dtype=dtype)
    device = torch.device(device)
    _, nbytes = _layout(world, max_tokens, k, H, dtype)
    if device.type == "cuda":
        import torch.distributed._symmetric_memory as symm_mem
        mine = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(mine, group.group_name)
        mine.zero_()  # the signal pads start at epoch 0 on every rank before any rank's first call
        torch.cuda.synchronize(device)
        dist.barrier(group)
        return _workspace(rank, world, max_tokens, k, H, dtype, mine, list(handle.buffer_ptrs), keep=[handle],
                          group=group)
    if device.type != "cpu":
        raise ValueError(f"device: expected cuda or cpu, got {device}")
    import os
    import uuid
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    path = f"/dev/shm/megamoe-ep-{token[0]}-{{}}"
    mine = torch.from_file(path.format(rank), shared=True, size=nbytes, dtype=torch.uint8)  # created, zeroed
    dist.barrier(group)
    peers = [mine if r == rank else torch.from_file(path.format(r), shared=True, size=nbytes, dtype=torch.uint8)
             for r in range(world)]
    dist.barrier(group)
    os.unlink(path.format(rank))  # every rank has mapped it: nothing is left behind in /dev/shm
    return _workspace(rank, world, max_tokens, k, H, dtype, mine, [p.data_ptr() for p in peers], keep=peers,
                      group=group)


_WS_FIELDS = ("error", "max_tokens", "k", "H", "dtype")


def _agree_on_sizes(group, max_tokens: int, k: int, H: int, dtype: torch.dtype) -> None:
    """Before any allocation: every rank's workspace arguments are checked and exchanged, and a bad
    or differing one raises the same ValueError on every rank (no rank left waiting in the
    rendezvous). The ranks address each other's buffers with one layout: sizes that differ would
    have them write past each other's buffers."""
    def local() -> dict[str, int]:
        check_positive_ints(max_tokens=max_tokens, k=k, H=H)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
        return dict(max_tokens=max_tokens, k=k, H=H, dtype=FLOAT_DTYPES.index(dtype))

    def across(meta: list[dict[str, int]]) -> str | None:
        for name in _WS_FIELDS[1:]:
            got = [m[name] for m in meta]
            if len(set(got)) > 1:
                shown = [str(FLOAT_DTYPES[g]) for g in got] if name == "dtype" else got
                return (f"{name}: expected the same value on every rank (the ranks address each other's buffers "
                        f"with one layout), got {shown} on ranks 0..{len(meta) - 1}")
        return None

    _check_everywhere(group, local, _WS_FIELDS, across, op="ep_workspace")


def _check_workspace(x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, ws: EPWorkspace, programs: int | None) -> dict:
    """This rank's checks against its workspace (and its launch's program count)."""
    if programs is not None:
        check_positive_ints(programs=programs)
    T, H = x_TH.shape
    k = topk_ids_Tk.shape[1]
    if T > ws.max_tokens:
        raise ValueError(f"x: expected at most max_tokens={ws.max_tokens} tokens (the workspace's rows), got T={T}")
    if (H, k, x_TH.dtype, x_TH.device) != (ws.H, ws.k, ws.dtype, ws.device):
        raise ValueError(f"x, topk_ids: expected H={ws.H}, k={ws.k}, dtype {ws.dtype} on {ws.device} (the "
                         f"workspace's), got H={H}, k={k}, {x_TH.dtype} on {x_TH.device}")
    return {}


def _checked(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws: EPWorkspace, num_experts: int,
             check: bool, programs: int | None):
    """The checks before a launch; with check and a group workspace, ep.py's checks (ids and
    requires_grad flags included) and the workspace's, the same verdict on every rank."""
    exchanged = check and ws.group is not None
    if exchanged:
        _check_everywhere(ws.group, lambda: _check_local(
            x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, num_experts, ws.max_tokens, "megamoe", True)
            | _check_workspace(x_TH, topk_ids_Tk, ws, programs))
    s = check_moe_inputs(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, check_ids=False)
    W = ws.world
    check_positive_ints(num_experts=num_experts)
    if num_experts != s.E * W:
        raise ValueError(f"num_experts: expected L * W = {s.E} * {W} = {s.E * W} (w13 holds L={s.E} experts, "
                         f"the workspace {W} ranks), got {num_experts!r}")
    if not exchanged:
        _check_workspace(x_TH, topk_ids_Tk, ws, programs)
        if check:
            check_global_ids(topk_ids_Tk, num_experts)
    check_backend(x_TH, "triton")
    return s


def ep_fused_moe_fwd(x_TH: torch.Tensor, w13_L2IH: torch.Tensor, w2_LHI: torch.Tensor,
                     topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor, ws: EPWorkspace, *,
                     num_experts: int, check: bool = True, spin_max: int | None = None,
                     programs: int | None = None) -> torch.Tensor:
    """This rank's y [T, H] for its tokens (x, global top-k ids, weights) and its L experts (w13, w2),
    in one persistent launch that dispatches, computes and combines (module docstring). Every rank of
    the workspace's world calls it, once per epoch. Not differentiable: `ep_fused_moe` is.

    check=True: before the launch, the expert-id range and (group workspace) the same error on every
    rank after one exchange of the ranks' sizes, so no rank launches and waits for one that will
    not; after it, the time-out records (raises naming the rank and the signal; with a group
    workspace the records are exchanged, so every rank raises the same error). These synchronise.
    check=False (CUDA-graph capture): only the shape checks, nothing synchronises; call
    `ep_check(ws)` after the replay to learn of a time-out.

    programs: persistent programs per rank (default: one per SM). Fewer leave SMs free for a kernel
    that runs concurrently; the result does not depend on it, and a program that is not resident
    yet is never waited for (tests/megamoe/test_ep_fused.py runs them one after another)."""
    s = _checked(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws, num_experts, check, programs)
    return _launch(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws, s, check, spin_max, programs)


def _launch(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws: EPWorkspace, s, check: bool,
            spin_max: int | None, programs: int | None) -> torch.Tensor:
    from megamoe.kernels.moe_kernels import CTR_SLOTS, _moe_persistent_kernel

    W = ws.world
    spin_max = SPIN_MAX[x_TH.device.type] if spin_max is None else spin_max
    x, w13, w2 = x_TH.contiguous(), w13_L2IH.contiguous(), w2_LHI.contiguous()
    tw, ids = topk_weights_Tk.float().contiguous(), topk_ids_Tk.contiguous()
    L, H, I = s.E, s.H, s.I  # noqa: E741
    TMK = ws.max_tokens * ws.k
    N = W * TMK  # received rows, source-major: the single-GPU kernel's slots with K = 1
    cfg = config_for(x)

    def counters(r_max: int) -> torch.Tensor:
        ws.ctr = grown_counters(ws.ctr, x.device, r_max)
        return ws.ctr

    setup = persistent_setup(N, L, H, I, x.dtype, x.device, cfg, False, ep=True, programs=programs,
                             counters=counters, poll_ns=POLL_NS[x.device.type])
    act = alloc.empty(N, I, dtype=x.dtype, device=x.device)
    y = alloc.empty(s.T, H, dtype=x.dtype, device=x.device)
    ctr = setup.ctr
    # phases 0-2 run over the received rows as the single-GPU launch's slots (K = 1); the arguments
    # this forward does not read (dy, the backward's, the trace pointer) get one of its own tensors
    with launch_device(x.device):
        _moe_persistent_kernel[(setup.programs,)](
            x_ptr=ws.recv_x, w13_ptr=w13, w2_ptr=w2, tw_ptr=ws.recv_w, ids_ptr=ws.recv_id, dy_ptr=ws.recv_x,
            b13_ptr=ws.recv_x, b2_ptr=ws.recv_x, ALPHA=0.0, LIMIT=0.0,  # EP: silu experts without biases
            **dict(zip(WEIGHT_ARGS, weight_args(w13, w2, setup.consts, False, False))),
            **dict(zip(METADATA_ARGS, setup.meta)),
            act_ptr=act, hw_ptr=act, gu_ptr=act, dtw_part_ptr=ws.recv_w, dtw_ptr=ws.recv_w, slot_out_ptr=ws.out,
            out_ptr=y, ctr_ptr=ctr, tile_done_ptr=ctr[CTR_SLOTS.value:],
            ep_ptr=ws.table, ep_err_ptr=ws.err, ep_epoch_ptr=ws.epoch_dev, xs_ptr=x, ids_src_ptr=ids, tw_src_ptr=tw,
            y_ptr=y, trace_ptr=ids,
            T=N, N=N, E=L, H=H, I=I, K=1, LAG=setup.lag, R_MAX=setup.r_max, NB=setup.nb,
            RANK=ws.rank, W=W, TS=s.T, SK=s.k, TMK=TMK, SPIN_MAX=spin_max,
            **setup.consts, num_warps=cfg.num_warps, num_stages=persistent_stages(cfg, False))
    if check:
        _check_after(ws, spin_max)
    return y


def _check_after(ws: EPWorkspace, spin_max: int) -> None:
    """check=True, after the launch: with a group workspace every rank's time-out record is
    exchanged and every rank raises the same error (a rank raising alone would leave its peers
    waiting in the next collective, e.g. the backward's all_to_all); without a group, `ep_check`."""
    if ws.group is None:
        ep_check(ws, spin_max)
        return
    import torch.distributed as dist

    mine = torch.cat([ws.err.long(), ws.epoch_dev, torch.full_like(ws.epoch_dev, spin_max)])
    records = [torch.empty_like(mine) for _ in range(ws.world)]
    dist.all_gather(records, mine, group=ws.group)
    ws.err.zero_()
    failed = [(r, *rec.tolist()) for r, rec in enumerate(records) if int(rec[0])]
    if failed:
        raise RuntimeError("ep_fused_moe_fwd: " + "; ".join(_timeout_text(*f) for f in failed) +
                           "; the call's output is invalid on every rank (raised on every rank of the group)")


def _timeout_text(rank: int, code: int, entry: int, epoch: int, spin_max: int | None) -> str:
    polls = f"after {spin_max} polls " if spin_max is not None else ""
    return (f"rank {rank} timed out {polls}waiting for the {'dispatch' if code == 1 else 'combine'} signal of "
            f"rank {entry} (epoch {epoch})")


def ep_fused_moe_bwd(dy_TH: torch.Tensor, x_TH: torch.Tensor, w13_L2IH: torch.Tensor, w2_LHI: torch.Tensor,
                     topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor, *, num_experts: int, group
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [T,H], dw13 [L,2I,H], dw2 [L,H,I], d(topk_weights) [T,k]) of `ep_fused_moe` for upstream dy:
    dx and d(topk_weights) for this rank's tokens, dw13 and dw2 for its experts. Collective over
    `group`: the token rows and dy rows go to their experts' owners again (all_to_all; the forward
    saved only its inputs), each owner runs the single-GPU fused backward on its received slots
    (K = 1: one row per slot, so a slot's dx and d(topk_weights) are exactly the single-GPU op's
    per-slot values and its weight gradients sum its experts' rows), and each slot's dx row and
    d(topk_weights) go back to the token's rank, which sums a token's k dx rows in slot order in fp32
    as the single-GPU op does. Exchanges counts on the host (synchronises; not graph-capturable)."""
    from megamoe.ep import _all_to_all, _exchange_counts, _plan
    from megamoe.fused import fused_moe_bwd

    W = torch.distributed.get_world_size(group)
    T, H = x_TH.shape
    k = topk_ids_Tk.shape[1]
    if tuple(dy_TH.shape) != (T, H):
        raise ValueError(f"dy: expected shape [T={T}, H={H}], got {tuple(dy_TH.shape)}")
    plan = _plan(topk_ids_Tk, num_experts // W, W)
    _exchange_counts(plan, group)

    def dispatch(t):
        return _all_to_all(t.index_select(0, plan.send_token_S), plan.send_rows, plan.recv_rows, group)

    x_R, dy_R, tw_R = dispatch(x_TH), dispatch(dy_TH.to(x_TH.dtype)), dispatch(topk_weights_Tk.float())
    lid_R = _all_to_all(plan.send_lid_Sk, plan.send_rows, plan.recv_rows, group)
    row_N, slot_N = (lid_R >= 0).nonzero(as_tuple=True)  # the sender's (token, slot) order
    dx_N, dw13, dw2, dtw_N = fused_moe_bwd(dy_R.index_select(0, row_N), x_R.index_select(0, row_N), w13_L2IH,
                                           w2_LHI, tw_R[row_N, slot_N][:, None], lid_R[row_N, slot_N][:, None],
                                           backend="triton")
    dx_M = _all_to_all(dx_N, plan.recv_slots, plan.send_slots, group)
    dtw_M = _all_to_all(dtw_N.reshape(-1), plan.recv_slots, plan.send_slots, group)
    dx_slots = torch.zeros(T * k, H, dtype=x_TH.dtype, device=x_TH.device).index_copy_(0, plan.result_slot_M, dx_M)
    dtw = torch.zeros(T * k, dtype=torch.float32, device=x_TH.device).index_copy_(0, plan.result_slot_M, dtw_M)
    # a token's k slot rows summed in slot order in fp32: the single-GPU op's combine
    return (combine_slots(dx_slots, topk_ids_Tk, x_TH.dtype), dw13, dw2,
            dtw.view(T, k).to(topk_weights_Tk.dtype))


class _EPFusedMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws, s, num_experts, check, spin_max,
                programs):
        y = _launch(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws, s, check, spin_max, programs)
        ctx.save_for_backward(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk)
        ctx.group, ctx.num_experts = ws.group, num_experts
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_TH):
        grads = ep_fused_moe_bwd(dy_TH, *ctx.saved_tensors, num_experts=ctx.num_experts, group=ctx.group)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)),) + (None,) * 7


def ep_fused_moe(x_TH: torch.Tensor, w13_L2IH: torch.Tensor, w2_LHI: torch.Tensor, topk_weights_Tk: torch.Tensor,
                 topk_ids_Tk: torch.Tensor, ws: EPWorkspace, *, num_experts: int, check: bool = True,
                 spin_max: int | None = None, programs: int | None = None) -> torch.Tensor:
    """`ep_fused_moe_fwd`, differentiable w.r.t. x, w13, w2 and topk_weights (backward:
    `ep_fused_moe_bwd`, collective over the workspace's group, so every rank's requires_grad flags
    must agree: check=True verifies it before the launch; with check=False a mismatch surfaces only
    as the backward's collectives failing after the process group's time-out). Saves only the
    inputs."""
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (x_TH, w13_L2IH, w2_LHI, topk_weights_Tk))
    if train and ws.group is None:
        raise ValueError("ws: the backward exchanges rows over a process group; this workspace has none "
                         "(linked_workspaces); use ep_workspace(..., group) or call under torch.no_grad()")
    s = _checked(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws, num_experts, check, programs)
    if not train:
        return _launch(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws, s, check, spin_max, programs)
    return _EPFusedMoE.apply(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, ws, s, num_experts, check,
                             spin_max, programs)


def ep_check(ws: EPWorkspace, spin_max: int | None = None) -> None:
    """Raise if a wait of an earlier call on this workspace timed out (then that call's output, and
    any later one's, is invalid), and clear the record. One small copy from the device."""
    code, entry = ws.err.tolist()
    if code:
        ws.err.zero_()
        raise RuntimeError(f"ep_fused_moe_fwd: {_timeout_text(ws.rank, code, entry, ws.epoch, spin_max)}; its "
                           "output is invalid")
