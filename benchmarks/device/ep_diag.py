"""Step-by-step check of the one-launch EP forward on 2 GPUs, every step printed with its rank and time.

    python3 benchmarks/device/ep_diag.py [--steps p2p,fwd1,fwd,bwd] [--spin 262144] [--timeout 90]
    TRITON_INTERPRET=1 python benchmarks/device/ep_diag.py --cpu    # gloo, fp32, the Triton interpreter

Each rank (one process per GPU, NCCL) prints: the symmetric-memory workspace and its address table;
a P2P check (each rank writes a pattern into its peer's result buffer through the rendezvous
handle, or on --cpu through its mapping of the peer's /dev/shm file, then reads what its peer wrote
into its own); then `ep_fused_moe_fwd` with one program per
rank and with the default grid, its time-out record and the largest difference from the single-GPU
op; then one `ep_fused_moe` backward against `fused_moe_bwd`. A rank stuck longer than --timeout
seconds dumps every thread's Python stack and exits, so a hang shows where it is.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

H, I, E, K, T_MAX = 24, 16, 6, 3, 12  # noqa: E741  (the shapes of tests/megamoe/test_ep_fused_multiproc.py)


def _say(rank, t0, msg):
    print(f"[rank {rank} +{time.monotonic() - t0:6.2f}s] {msg}", flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank, store, args):
    from megamoe.ep_fused import ep_check, ep_fused_moe, ep_fused_moe_fwd, ep_workspace
    from megamoe.fused import fused_moe_bwd, fused_moe_fwd
    from megamoe.testing import make_problem

    t0 = time.monotonic()
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.cpu:
        torch.set_num_threads(1)
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timeout)
        _say(rank, t0, "init (gloo)")
    else:
        device, dtype = torch.device("cuda", rank), torch.bfloat16
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2, device_id=device,
                                timeout=timeout)
        _say(rank, t0, f"init (nccl); peer access {torch.cuda.can_device_access_peer(rank, 1 - rank)}")
    ws = ep_workspace(T_MAX, K, H, dtype, device)
    _say(rank, t0, f"workspace: table {[[hex(a) for a in row] for row in ws.table.tolist()]}")
    steps = args.steps.split(",")
    if "p2p" in steps:
        n = ws.out.numel()
        off = ws.out.storage_offset() * ws.out.element_size()  # bytes into the rank's buffer
        if args.cpu:  # keep: every rank's mapped file (by rank), then this rank's
            peer = ws.keep[1 - rank][off:off + n * ws.out.element_size()].view(dtype)
        else:  # keep: the rendezvous handle
            peer = ws.keep[0].get_buffer(1 - rank, (n,), dtype, off // ws.out.element_size())
        peer.copy_(torch.full((n,), float(rank + 1), device=device, dtype=dtype))
        _sync(device)
        dist.barrier()
        seen = ws.out.flatten().unique().tolist()
        _say(rank, t0, f"p2p: own result buffer holds {seen} (peer wrote {float(2 - rank)})")
        ws.out.zero_()
        _sync(device)
        dist.barrier()
    L = E // 2
    p = make_problem(21, H, I, E, K, seed=40, dtype=dtype, device=device)
    toks = slice(0, 9) if rank == 0 else slice(9, 21)
    mine = slice(rank * L, (rank + 1) * L)
    args_r = (p.x[toks], p.w13[mine], p.w2[mine], p.topk_weights[toks], p.topk_ids[toks])
    ref = fused_moe_fwd(p.x, p.w13, p.w2, p.topk_weights, p.topk_ids, backend="triton")[toks]
    _sync(device)
    _say(rank, t0, "reference done")
    for step, programs in (("fwd1", 1), ("fwd", None)):
        if step not in steps:
            continue
        try:
            y = ep_fused_moe_fwd(*args_r, ws, num_experts=E, check=False, spin_max=args.spin, programs=programs)
            _sync(device)
            _say(rank, t0, f"{step}: kernel done, err {ws.err.tolist()}, epoch {ws.epoch}, dsig {ws.dsig.tolist()} "
                           f"csig {ws.csig.tolist()}")
            ep_check(ws, args.spin)
            _say(rank, t0, f"{step}: equal {torch.equal(y, ref)}, max |diff| {float((y.float() - ref.float()).abs().max())}")
        except Exception:  # noqa: BLE001
            _say(rank, t0, f"{step} FAILED\n{traceback.format_exc()}")
        dist.barrier()
    if "bwd" in steps:
        try:
            g = torch.Generator().manual_seed(7)
            dy = torch.randn(21, H, generator=g).to(device, dtype)
            leaves = [t.clone().requires_grad_() for t in args_r[:4]]
            y = ep_fused_moe(*leaves, args_r[4], ws, num_experts=E)
            y.backward(dy[toks])
            want = fused_moe_bwd(dy, p.x, p.w13, p.w2, p.topk_weights, p.topk_ids, backend="triton")
            got = [leaf.grad for leaf in leaves]
            same = [torch.equal(a, b) for a, b in zip(got, (want[0][toks], want[1][mine], want[2][mine], want[3][toks]))]
            _say(rank, t0, f"bwd: y equal {torch.equal(y.detach(), ref)}; dx, dw13, dw2, dtw equal {same}")
        except Exception:  # noqa: BLE001
            _say(rank, t0, f"bwd FAILED\n{traceback.format_exc()}")
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="p2p,fwd1,fwd,bwd")
    ap.add_argument("--spin", type=int, default=1 << 18)
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--cpu", action="store_true", help="gloo and the Triton interpreter (set TRITON_INTERPRET=1)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(os.path.join(d, "store"), args), nprocs=2)


if __name__ == "__main__":
    main()
