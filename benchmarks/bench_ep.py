"""Times expert-parallel MoE over W ranks: megamoe EP (all_to_all, one-launch) vs unfused EP vs compute only.

    python benchmarks/bench_ep.py                                   # all GPUs of this host, NCCL
    python benchmarks/bench_ep.py --shapes qwen3 --tokens 4096 --reps 20 --out $OUT/bench_ep.md
    python benchmarks/bench_ep.py --cpu --world 2 --shapes tiny --tokens 64 --reps 2   # gloo smoke run (--warmup 0: quicker)

One process per rank (torch.multiprocessing, spawn), each with T tokens and E/W experts, bf16 on
GPUs (fp32 on CPU). Per shape and T, forward and forward+backward, median over --reps of the
slowest rank (each repetition ends with a barrier, so every rank waits for the slowest):

- `megamoe EP`: `megamoe.ep.ep_a2a_moe` — all_to_all dispatch (NCCL all_to_all_single), the
  persistent megamoe kernel on the received rows, all_to_all combine.
- `one-launch EP`: `megamoe.ep_fused.ep_fused_moe` — dispatch, GEMMs and combine in one persistent
  launch per rank over a workspace in symmetric memory (allocated once per shape and T, outside the
  timing; calls unchecked, a time-out is looked for once after the timing); its backward is
  all_to_all around the single-GPU fused backward. On --cpu it runs under the Triton interpreter.
- `unfused EP`: `megamoe.ep.ep_moe_unfused` — the same exchanges around the unfused grouped GEMMs.
- `compute only`: the local work with no exchange: `megamoe.fused_moe` on W*T tokens routed
  uniformly to this rank's E/W experts with the same k (the rows a rank computes when routing is
  uniform), i.e. the time the overlap of communication with compute could reach.
- dispatch+combine bytes per rank (bf16 rows that leave the rank; T*min(k, W)*(W-1)/W*H*2 each way
  for uniform routing) and the GB/s they imply over the whole EP step.

FLOPs per rank: 6*T*k*H*I forward, x3 forward+backward.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = {  # name: (E, H, I, k)
    "qwen3": (128, 2048, 768, 8),      # Qwen3-30B-A3B
    "dsv3": (256, 7168, 2048, 8),      # DeepSeek-V3 (all routed experts; E/W per rank)
    "tiny": (8, 64, 32, 2),            # CPU smoke runs
}


def _inputs(E, H, I, k, T, L, rank, device, dtype, seed=0):  # noqa: E741
    from megamoe.routing import route

    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w13 = (torch.randn(L, 2 * I, H, generator=g) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(L, H, I, generator=g) / I ** 0.5).to(device, dtype)
    tw, ids = route(torch.randn(T, E, generator=g).to(device), k, renormalize=True)
    return x, w13, w2, tw, ids


def _time(fn, reps, warmup, device, group) -> list[float]:
    """Seconds per call on this rank after `warmup` untimed calls, each call closed by a barrier (so: the
    slowest rank's time)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)
        out.append(time.perf_counter() - t0)
    return out


def _worker(rank, world, backend, store_path, args, out_dir):
    from megamoe import ep_fused as one_launch
    from megamoe.ep import ep_a2a_moe, ep_moe_unfused
    from megamoe.moe import fused_moe
    from megamoe.routing import route

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lines = []
    for name in args.shapes:
        E, H, I, k = SHAPES[name]  # noqa: E741
        if E % world:
            lines.append(f"| {name} | – | skipped: E={E} is not divisible by W={world} |")
            continue
        L = E // world
        for T in args.tokens:
            x, w13, w2, tw, ids = _inputs(E, H, I, k, T, L, rank, device, dtype)
            kw = dict(num_experts=E, max_tokens_per_rank=T, check_ids=False)
            # compute only: W*T tokens over this rank's L experts, k slots each (uniform routing)
            xc = torch.randn(world * T, H, device=device).to(dtype)
            twc, idsc = route(torch.randn(world * T, L, device=device), min(k, L), renormalize=True)
            leaves = [t.detach().clone().requires_grad_(True) for t in (x, w13, w2)] + [tw.clone().requires_grad_(True)]
            dy = torch.randn_like(x)

            def fb(fn):
                def run():
                    for t in leaves:
                        t.grad = None
                    fn(*leaves, ids, **kw).backward(dy)
                return run

            ws = one_launch.ep_workspace(T, k, H, dtype, device)
            kw1 = dict(num_experts=E, check=False, programs=args.programs)
            runs = {
                ("megamoe EP", "fwd"): lambda: ep_a2a_moe(x, w13, w2, tw, ids, impl="megamoe", **kw),
                ("one-launch EP", "fwd"): lambda: one_launch.ep_fused_moe(x, w13, w2, tw, ids, ws, **kw1),
                ("unfused EP", "fwd"): lambda: ep_moe_unfused(x, w13, w2, tw, ids, **kw),
                ("compute only", "fwd"): lambda: fused_moe(xc, w13, w2, twc, idsc, impl="megamoe", check_ids=False),
            }
            if not args.no_backward:
                runs[("megamoe EP", "fwd+bwd")] = fb(lambda *a, **k_: ep_a2a_moe(*a, impl="megamoe", **k_))
                runs[("unfused EP", "fwd+bwd")] = fb(ep_moe_unfused)
                runs[("one-launch EP", "fwd+bwd")] = fb(lambda *a, **k_: one_launch.ep_fused_moe(*a, ws, **kw1))
            times = {}
            for (impl, mode), fn in runs.items():
                times[(impl, mode)] = _time(fn, args.reps, args.warmup, device, None)
                if rank == 0:  # as measured, so a run cut by a time limit keeps what it measured
                    print(f"  {name} T={T} {impl} {mode}: {statistics.median(times[(impl, mode)]) * 1e3:.3f} ms",
                          flush=True)
            one_launch.ep_check(ws)  # a wait that timed out in any timed call raises here
            del ws
            if rank == 0:
                flops = 6.0 * T * k * H * I
                moved = 2 * T * min(k, world) * (world - 1) / world * H * torch.finfo(dtype).bits / 8
                for mode in ("fwd", "fwd+bwd"):
                    got = {impl: statistics.median(v) for (impl, m), v in times.items() if m == mode}
                    if not got:
                        continue
                    f = flops * (3 if mode == "fwd+bwd" else 1)
                    cells = "; ".join(f"{impl} {s * 1e3:.3f} ms ({f / s / 1e12:.0f} TF/s)" for impl, s in got.items())
                    parts = []
                    for impl in ("megamoe EP", "one-launch EP"):
                        extra = f"{impl}: {got['unfused EP'] / got[impl]:.2f}x vs unfused"
                        if "compute only" in got:
                            extra += f", {got[impl] / got['compute only']:.2f}x compute-only"
                        if mode == "fwd":
                            extra += f", {moved / got[impl] / 1e9:.1f} GB/s dispatch+combine"
                        parts.append(extra)
                    extra = "; ".join(parts)
                    lines.append(f"| {name} (E={E}, H={H}, I={I}, k={k}) | T={T} {mode} | {cells} | {extra} |")
            dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "lines.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3", "dsv3"], choices=sorted(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[128, 4096, 16384], help="tokens per rank")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before the timed ones (0: a smoke run)")
    p.add_argument("--world", type=int, default=None, help="ranks (default: every CUDA GPU; 2 with --cpu)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU processes (a smoke run of the mechanics)")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--programs", type=int, default=None,
                   help="one-launch EP: persistent programs per rank (default one per SM; fewer leave SMs free)")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args()
    if args.reps < 1:
        p.error(f"--reps: expected >= 1, got {args.reps}")
    if args.warmup < 0:
        p.error(f"--warmup: expected >= 0, got {args.warmup}")
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens: expected positive counts, got {args.tokens}")
    backend = "gloo" if args.cpu else "nccl"
    if args.cpu:  # the one-launch EP kernel runs under the Triton interpreter on CPU (workers inherit it)
        os.environ["TRITON_INTERPRET"] = "1"
    world = args.world or (2 if args.cpu else torch.cuda.device_count())
    if world < 2:
        p.error(f"--world: expected >= 2 ranks, got {world} (GPUs visible: {torch.cuda.device_count()})")
    if backend == "nccl" and world > torch.cuda.device_count():
        p.error(f"--world: {world} ranks need {world} GPUs, this host has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, backend, os.path.join(tmp, "store"), args, tmp), nprocs=world,
                           start_method="spawn", join=True)
        lines = open(os.path.join(tmp, "lines.txt")).read().splitlines()
    where = (f"{world}x {torch.cuda.get_device_name()} (NCCL)" if backend == "nccl"
             else f"{world} CPU processes (gloo), {os.cpu_count()} cores")
    text = "\n".join([f"# bench_ep: {where} | torch {torch.__version__} | {datetime.date.today().isoformat()} | "
                      f"median of {args.reps}, slowest rank", "",
                      "| shape | T per rank, mode | times per rank | ratios |", "|---|---|---|---|", *lines])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
