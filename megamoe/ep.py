"""Expert parallelism: the MoE contract over the W ranks of a torch.distributed process group.

    ep_a2a_moe(x[T,H], w13[L,2I,H], w2[L,H,I], topk_weights[T,k], topk_ids[T,k],
                 *, num_experts=E, max_tokens_per_rank=..., group=None, impl="megamoe") -> y[T,H]
    ep_moe_unfused(...same...)  the unfused EP baseline: all_to_all -> grouped GEMM -> all_to_all

Each rank passes its own tokens (x, topk_weights, topk_ids with GLOBAL expert ids in [-1, E)) and
its shard of the experts: rank r owns experts [r*L, (r+1)*L). Each rank gets back y for its own
tokens: what `megamoe.fused_moe` would return for those tokens if all ranks' tokens and all E
experts were in one process. Differentiable: dx and d(topk_weights) come back to the token's rank,
dw13 and dw2 stay with the expert's owner. Every rank must run the backward through y (it runs
collectives), as with any collective in a backward.

Shape legend: T tokens of this rank, H hidden, I expert intermediate, E experts in all, k top-k,
W world size (ranks in `group`), L = E/W experts per rank, S rows this rank sends (one per (token,
destination rank) pair), R rows it receives, N expert slots it computes (received (row, slot)
pairs whose expert it owns), M slot results that come back to it (its tokens' valid slots).

How (this is the all_to_all path; it runs on CPU with gloo and, through the same calls, on CUDA
with NCCL's all_to_all_single):
0. check: each rank checks its own inputs without raising, then the ranks all_gather a small
   metadata tensor (sizes, flags, an error code) and check one another (the same sizes everywhere,
   W divides E, T <= max_tokens_per_rank). Every rank reaches the same verdict and raises the same
   error, so none is left waiting in a collective.
1. dispatch: exchange per-rank row and slot counts (all_to_all), then the token rows (each sent
   once per destination rank, even if several of its slots go there) with their slots' local
   expert ids (-1 for slots owned elsewhere).
2. expert compute: the received (row, slot) pairs become N rows of a k=1 problem with weight 1,
   computed by `megamoe.fused_moe(impl=...)`: the unweighted expert output of each slot, in x's
   dtype (as the single-process paths round it).
3. combine: the slot outputs go back to the token's rank (all_to_all), which adds w[t,j] * out[t,j]
   over j = 0..k-1 in slot order in fp32, like the single-process combine: deterministic, and a
   token's result does not depend on which rank computed which slot.
The backward mirrors it: slot-output gradients travel to the experts' owners, the local expert
backward runs there, each received row's slot gradients are summed in slot order, and the rows
travel back and are summed per token over the ranks in rank order, in fp32. No sum depends on
float atomics, so forward and backward are bitwise deterministic, on CUDA too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megamoe import alloc
from megamoe.contract import FLOAT_DTYPES, IMPLS, check_impl, check_moe_inputs

ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --- checks: local, then exchanged so that every rank raises together ---------------------------

_OK, _VALUE_ERROR, _TYPE_ERROR, _OTHER_ERROR = 0, 1, 2, 3
_ERROR_TYPES = {_VALUE_ERROR: ValueError, _TYPE_ERROR: TypeError, _OTHER_ERROR: RuntimeError}
# Header of the metadata every rank contributes (int64); a rank whose local check failed sends
# its error code and zeros for the sizes.
_FIELDS = ("error", "T", "H", "I", "L", "k", "E", "dtype", "max_tokens", "impl",
           "grad_x", "grad_w13", "grad_w2", "grad_topk_weights")
_MSG_BYTES = 1024


def _comm_device(group) -> torch.device:
    """Where the group's collectives take tensors: CPU for gloo, the current GPU for NCCL."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_positive_ints(**values) -> None:
    """ValueError naming the first argument that is not a positive int (bools refused)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_global_ids(topk_ids_Tk: torch.Tensor, num_experts: int) -> None:
    """Global expert ids in [-1, num_experts) (synchronises on a GPU)."""
    if topk_ids_Tk.numel():
        lo, hi = int(topk_ids_Tk.min()), int(topk_ids_Tk.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_ids: expected global expert ids in [-1, num_experts={num_experts}), "
                             f"got min {lo}, max {hi}")


def _check_local(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, num_experts, max_tokens_per_rank,
                 impl, check_ids) -> dict[str, int]:
    """This rank's own checks; raises TypeError/ValueError naming the argument."""
    check_impl(impl)
    check_positive_ints(num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank)
    # The shard is a complete MoE problem of L experts; only the id range differs (global ids).
    s = check_moe_inputs(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, check_ids=False)
    if check_ids:
        check_global_ids(topk_ids_Tk, num_experts)
    if impl == "megamoe":
        import megamoe.fused  # noqa: F401  (an implementation that cannot run fails here, on every rank)
    grad = torch.is_grad_enabled()
    return dict(T=s.T, H=s.H, I=s.I, L=s.E, k=s.k, E=num_experts, dtype=FLOAT_DTYPES.index(x_TH.dtype),
                max_tokens=max_tokens_per_rank, impl=IMPLS.index(impl),
                grad_x=grad and x_TH.requires_grad, grad_w13=grad and w13_L2IH.requires_grad,
                grad_w2=grad and w2_LHI.requires_grad, grad_topk_weights=grad and topk_weights_Tk.requires_grad)


def _check_across_ranks(meta: list[dict[str, int]]) -> str | None:
    """The checks that need every rank's sizes; the same verdict on every rank."""
    W = len(meta)

    def per_rank(field):
        return [m[field] for m in meta]

    for field, what in (("E", "num_experts"), ("H", "x: the hidden size H"), ("I", "w13: the intermediate size I"),
                        ("k", "topk_ids: top-k k"), ("max_tokens", "max_tokens_per_rank")):
        if len(set(per_rank(field))) > 1:
            return f"{what}: expected the same value on every rank, got {per_rank(field)} on ranks 0..{W - 1}"
    if len(set(per_rank("dtype"))) > 1:
        return (f"x: expected the same dtype on every rank, got "
                f"{[str(FLOAT_DTYPES[d]) for d in per_rank('dtype')]} on ranks 0..{W - 1}")
    if len(set(per_rank("impl"))) > 1:
        return f"impl: expected the same on every rank, got {[IMPLS[i] for i in per_rank('impl')]} on ranks 0..{W - 1}"
    E = meta[0]["E"]
    if E % W:
        return f"num_experts: expected a multiple of the world size W={W}, got {E}"
    bad = [r for r, m in enumerate(meta) if m["L"] != E // W]
    if bad:
        return (f"w13, w2: expected E/W={E // W} local experts on every rank (num_experts={E}, W={W}), "
                f"got {[meta[r]['L'] for r in bad]} on rank(s) {bad}")
    over = [r for r, m in enumerate(meta) if m["T"] > m["max_tokens"]]
    if over:
        return (f"x: expected at most max_tokens_per_rank={meta[0]['max_tokens']} tokens per rank, "
                f"got T={[meta[r]['T'] for r in over]} on rank(s) {over}")
    for field in ("grad_x", "grad_w13", "grad_w2", "grad_topk_weights"):
        if len(set(per_rank(field))) > 1:
            name = field.removeprefix("grad_")
            return (f"{name}: expected requires_grad to agree on every rank (the backward runs collectives), "
                    f"got {[bool(v) for v in per_rank(field)]} on ranks 0..{W - 1}")
    return None


def _check_everywhere(group, local: Callable[[], dict[str, int]], fields: tuple[str, ...] = _FIELDS,
                      across: Callable[[list[dict[str, int]]], str | None] = _check_across_ranks,
                      op: str = "ep_a2a_moe") -> dict[str, int]:
    """Run this rank's checks (`local`: the values of `fields` but "error"), exchange the results,
    run `across` on every rank's, and raise the same error on every rank, naming `op`."""
    device = _comm_device(group)
    W = dist.get_world_size(group)
    try:
        mine = dict(error=_OK, **local())
        message = ""
    except Exception as exc:  # noqa: BLE001  (whatever it is, the other ranks must hear of it)
        code = _TYPE_ERROR if isinstance(exc, TypeError) else _VALUE_ERROR if isinstance(exc, ValueError) \
            else _OTHER_ERROR
        mine = dict.fromkeys(fields, 0) | dict(error=code)
        message = f"{type(exc).__name__}: {exc}"
    header = torch.tensor([int(mine[f]) for f in fields], dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(W)]
    dist.all_gather(headers, header, group=group)
    meta = [dict(zip(fields, h.tolist())) for h in headers]

    failed = [r for r, m in enumerate(meta) if m["error"] != _OK]
    if failed:
        # Only now, and on every rank alike, the failing ranks' messages are exchanged.
        raw = message.encode()[:_MSG_BYTES]
        buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8, device=device)
        buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        bufs = [torch.empty_like(buf) for _ in range(W)]
        dist.all_gather(bufs, buf, group=group)
        texts = [bytes(b.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for b in bufs]
        raise _ERROR_TYPES[meta[failed[0]]["error"]](
            f"{op}: invalid input on " + "; ".join(f"rank {r}: {texts[r]}" for r in failed)
            + " (raised on every rank of the group)")
    problem = across(meta)
    if problem:
        raise ValueError(f"{op}: {problem} (raised on every rank of the group)")
    return meta[dist.get_rank(group)]


# --- routing plan and communication ---------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    """Who sends what to whom. Rows and slots to one destination are ordered by (token, slot)."""
    send_token_S: torch.Tensor     # token index of each row this rank sends, grouped by destination
    send_lid_Sk: torch.Tensor      # per sent row, each slot's local expert id there, or -1
    send_rows: list[int]           # [W] rows to each rank
    send_slots: list[int]          # [W] slots to each rank (= slot results that come back from it)
    result_slot_M: torch.Tensor    # flat slot index t*k+j of each slot result as it arrives back
    recv_rows: list[int] | None = None   # [W] rows from each rank (filled in by the count exchange)
    recv_slots: list[int] | None = None  # [W] slots from each rank


def _plan(topk_ids_Tk: torch.Tensor, L: int, W: int) -> _Plan:
    T, k = topk_ids_Tk.shape
    ids = topk_ids_Tk.long()
    valid = ids >= 0
    dest_Tk = torch.where(valid, ids.div(L, rounding_mode="floor"), W)  # W: the sink of -1 slots
    goes_TW = torch.zeros(T, W + 1, dtype=torch.bool, device=ids.device).scatter_(1, dest_Tk, True)[:, :W]
    dest_S, send_token_S = goes_TW.t().nonzero(as_tuple=True)  # destination-major, tokens ascending
    on_dest = dest_Tk.index_select(0, send_token_S) == dest_S[:, None]
    send_lid_Sk = torch.where(on_dest, ids.index_select(0, send_token_S) - dest_S[:, None] * L, -1)
    flat_dest = dest_Tk.reshape(-1)
    # A stable sort by destination keeps (token, slot) order within each destination, the order in
    # which the destination computes and returns them.
    result_slot_M = torch.sort(flat_dest, stable=True).indices[: int(valid.sum())]
    return _Plan(send_token_S=send_token_S, send_lid_Sk=send_lid_Sk,
                 send_rows=goes_TW.sum(0).tolist(),
                 send_slots=torch.bincount(flat_dest, minlength=W + 1)[:W].tolist(),
                 result_slot_M=result_slot_M)


def _all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    recv = alloc.empty(sum(recv_counts), *send.shape[1:], dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_counts,
                           input_split_sizes=send_counts, group=group)
    return recv


def _exchange_counts(plan: _Plan, group) -> None:
    W = dist.get_world_size(group)
    device = _comm_device(group)
    send = torch.tensor([plan.send_rows, plan.send_slots], dtype=torch.int64).t().contiguous().to(device)
    recv = _all_to_all(send, [1] * W, [1] * W, group).cpu()
    plan.recv_rows, plan.recv_slots = recv[:, 0].tolist(), recv[:, 1].tolist()


# --- forward and backward -------------------------------------------------------------------------

@dataclasses.dataclass
class _Saved:
    """What the backward needs: the local expert graph and the slot outputs back at the token rank."""
    x_NH: torch.Tensor             # leaves of the local graph: the slot rows, this rank's weights
    w13: torch.Tensor
    w2: torch.Tensor
    out_NH: torch.Tensor           # this rank's expert outputs (graph root)
    row_N: torch.Tensor            # received row and slot of each computed slot
    slot_N: torch.Tensor
    R: int                         # rows received
    out_TkH: torch.Tensor          # slot outputs of this rank's tokens, x dtype, zero for -1 slots


def _expert_fn(impl: str) -> ExpertFn:
    from megamoe.moe import fused_moe

    def experts(x_NH, w13, w2, w_N1, lid_N1):
        return fused_moe(x_NH, w13, w2, w_N1, lid_N1, impl=impl, check_ids=False)
    return experts


def ep_moe_fwd(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, plan: _Plan, experts: ExpertFn, group,
               *, keep_graph: bool) -> tuple[torch.Tensor, _Saved]:
    """dispatch -> local experts -> combine; returns y[T,H] and what the backward needs."""
    T, H = x_TH.shape
    k = topk_weights_Tk.shape[1]
    x_recv_RH = _all_to_all(x_TH.index_select(0, plan.send_token_S), plan.send_rows, plan.recv_rows, group)
    lid_recv_Rk = _all_to_all(plan.send_lid_Sk, plan.send_rows, plan.recv_rows, group)

    row_N, slot_N = (lid_recv_Rk >= 0).nonzero(as_tuple=True)  # (row, slot) order = the sender's order
    with torch.set_grad_enabled(keep_graph):
        # The slot rows are the graph's leaf, so the backward sums a row's slots itself, in slot order.
        x_NH = x_recv_RH.index_select(0, row_N).requires_grad_(keep_graph)
        w13 = w13_L2IH.detach().requires_grad_(keep_graph)
        w2 = w2_LHI.detach().requires_grad_(keep_graph)
        ones_N1 = torch.ones(row_N.numel(), 1, dtype=torch.float32, device=x_TH.device)
        out_NH = experts(x_NH, w13, w2, ones_N1, lid_recv_Rk[row_N, slot_N][:, None])

    out_MH = _all_to_all(out_NH.detach(), plan.recv_slots, plan.send_slots, group)
    out_TkH = torch.zeros(T * k, H, dtype=x_TH.dtype, device=x_TH.device)
    out_TkH = out_TkH.index_copy_(0, plan.result_slot_M, out_MH).view(T, k, H)
    y_TH = torch.zeros(T, H, dtype=torch.float32, device=x_TH.device)
    tw = topk_weights_Tk.float()
    for j in range(k):  # slot order, fp32, as the single-process combine: deterministic
        y_TH += tw[:, j, None] * out_TkH[:, j].float()
    return y_TH.to(x_TH.dtype), _Saved(x_NH, w13, w2, out_NH, row_N, slot_N, x_recv_RH.shape[0], out_TkH)


def ep_moe_bwd(dy_TH, topk_weights_Tk, saved: _Saved, plan: _Plan, group, needs: tuple[bool, bool, bool, bool]):
    """Gradients for (x, w13, w2, topk_weights); None where not needed. Collective: every rank calls it."""
    T, k, H = saved.out_TkH.shape
    dy = dy_TH.float()
    dtw = None
    if needs[3]:
        dtw = (saved.out_TkH.float() * dy[:, None, :]).sum(-1).to(topk_weights_Tk.dtype)
    dx = dw13 = dw2 = None
    if any(needs[:3]):
        dout_TkH = (topk_weights_Tk.float()[:, :, None] * dy[:, None, :]).to(saved.out_TkH.dtype)
        dout_MH = dout_TkH.reshape(T * k, H).index_select(0, plan.result_slot_M)
        dout_NH = _all_to_all(dout_MH, plan.send_slots, plan.recv_slots, group)
        leaves = (saved.x_NH, saved.w13, saved.w2)
        wanted = [leaf for leaf, need in zip(leaves, needs[:3]) if need]
        if saved.out_NH.requires_grad:
            grads = torch.autograd.grad(saved.out_NH, wanted, dout_NH, allow_unused=True, materialize_grads=True)
        else:  # an implementation that returns a constant for zero rows: nothing flows back
            grads = [torch.zeros_like(leaf) for leaf in wanted]
        got = dict(zip([id(t) for t in wanted], grads))
        dx_NH, dw13, dw2 = (got.get(id(leaf)) for leaf in leaves)
        if needs[0]:
            # Sums in a fixed order, one pass per slot and then per source rank: each pass adds to
            # distinct rows, so no float atomics decide the order on CUDA (bitwise deterministic).
            dx_RH = torch.zeros(saved.R, H, dtype=torch.float32, device=dy.device)
            for j in range(k):
                of_j = saved.slot_N == j
                dx_RH.index_add_(0, saved.row_N[of_j], dx_NH[of_j].float())
            dx_SH = _all_to_all(dx_RH.to(saved.out_TkH.dtype), plan.recv_rows, plan.send_rows, group)
            dx32 = torch.zeros(T, H, dtype=torch.float32, device=dy.device)
            start = 0
            for n in plan.send_rows:
                dx32.index_add_(0, plan.send_token_S[start:start + n], dx_SH[start:start + n].float())
                start += n
            dx = dx32.to(saved.out_TkH.dtype)
    return dx, dw13, dw2, dtw


class _EPMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, plan, experts, group):
        y_TH, saved = ep_moe_fwd(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, plan, experts, group, keep_graph=True)
        ctx.saved, ctx.plan, ctx.group = saved, plan, group
        ctx.save_for_backward(topk_weights_Tk)
        return y_TH

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_TH):
        (topk_weights_Tk,) = ctx.saved_tensors
        grads = ep_moe_bwd(dy_TH, topk_weights_Tk, ctx.saved, ctx.plan, ctx.group, tuple(ctx.needs_input_grad[:4]))
        ctx.saved = None
        return (*grads, None, None, None)


# --- public functions -----------------------------------------------------------------------------

def _ep_moe(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, *, num_experts, max_tokens_per_rank, group,
            impl, check_ids, experts: ExpertFn | None = None) -> torch.Tensor:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ep_a2a_moe: torch.distributed is not initialised (call init_process_group first)")
    group = group if group is not None else dist.group.WORLD
    meta = _check_everywhere(group, lambda: _check_local(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk,
                                                         num_experts, max_tokens_per_rank, impl, check_ids))
    plan = _plan(topk_ids_Tk, meta["L"], dist.get_world_size(group))
    _exchange_counts(plan, group)
    experts = experts or _expert_fn(impl)
    if any(meta[f] for f in ("grad_x", "grad_w13", "grad_w2", "grad_topk_weights")):
        return _EPMoE.apply(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, plan, experts, group)
    return ep_moe_fwd(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, plan, experts, group, keep_graph=False)[0]


def ep_a2a_moe(x_TH: torch.Tensor, w13_L2IH: torch.Tensor, w2_LHI: torch.Tensor, topk_weights_Tk: torch.Tensor,
                 topk_ids_Tk: torch.Tensor, *, num_experts: int, max_tokens_per_rank: int, group=None,
                 impl: str = "megamoe", check_ids: bool = True) -> torch.Tensor:
    """Expert-parallel `fused_moe` for this rank's tokens; see the module docstring.

    x[T,H], topk_weights[T,k], topk_ids[T,k] (global expert ids, -1 = dropped slot) are this rank's
    tokens; w13[L,2I,H], w2[L,H,I] its experts [r*L, (r+1)*L) with L = num_experts / W. Returns
    y[T,H] in x's dtype. Local experts run through `megamoe.fused_moe(impl=impl)` (on CPU, and until
    the symmetric-memory kernel lands, behind the all_to_all dispatch and combine). Collective:
    every rank of `group` (default: the world) calls it with the same sizes, num_experts,
    max_tokens_per_rank, impl and requires_grad flags; any bad input raises on every rank.
    """
    return _ep_moe(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, num_experts=num_experts,
                   max_tokens_per_rank=max_tokens_per_rank, group=group, impl=impl, check_ids=check_ids)


def ep_moe_unfused(x_TH: torch.Tensor, w13_L2IH: torch.Tensor, w2_LHI: torch.Tensor, topk_weights_Tk: torch.Tensor,
                   topk_ids_Tk: torch.Tensor, *, num_experts: int, max_tokens_per_rank: int, group=None,
                   check_ids: bool = True) -> torch.Tensor:
    """The unfused EP baseline: all_to_all dispatch -> grouped GEMMs (megamoe.ref) -> all_to_all combine.

    Same arguments and result as `ep_a2a_moe`; this is the path a fused EP kernel is measured
    against (NCCL all_to_all_single on CUDA, gloo on CPU).
    """
    from megamoe.ref import moe_unfused

    def experts(x_NH, w13, w2, w_N1, lid_N1):
        return moe_unfused(x_NH, w13, w2, w_N1, lid_N1, check_ids=False)
    return _ep_moe(x_TH, w13_L2IH, w2_LHI, topk_weights_Tk, topk_ids_Tk, num_experts=num_experts,
                   max_tokens_per_rank=max_tokens_per_rank, group=group, impl="reference", check_ids=check_ids,
                   experts=experts)
