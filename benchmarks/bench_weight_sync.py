"""Weight sync, trainer -> colocated vLLM engine, on one GPU: CUDA IPC (vLLM's weight-transfer
engine) against safetensors files in /dev/shm, in one process, on the same trainer and engine.

    python benchmarks/bench_weight_sync.py [--models h200_rl qwen3_dims] [--reps 5] [--out FILE]

Models (random init, bf16 on the wire): h200_rl = configs/h200_rl.yaml's model (8 layers, H=1024,
E=64, k=8, I=512); qwen3_dims = 8 layers with Qwen3-30B-A3B's layer dims (H=2048, E=128, I=768,
k=8). The trainer is a one-rank FSDP2 TrainerWorker (fp32 master weights); the engine a
RolloutWorker (megamoe, eager: the sync does not depend on CUDA graphs). Each mode is timed `reps`
times after one warm-up (files: once, it is ~100x slower); GB/s = bytes on the wire / seconds.
Phases: rollout.sync.send_ipc's, each the median over the timed syncs; the warm-up sync's time is
listed apart (the engine maps the trainer's IPC buffer once, at its first kernel-format chunk).
Three IPC layouts (records.weights.FORMATS): `ipc/kernel` (every tensor as the engine's own parameter,
copied in place, no vLLM reload; what `auto` picks for moe_impl megamoe on CUDA), `ipc/experts` (the
routed experts so, the rest through vLLM's layer-wise reload) and `ipc/checkpoint` (everything, each
expert's tensors included, through vLLM's reload, as moe_impl stock needs). Memory: the trainer's
torch peak over its resting allocation during a sync (its IPC buffer is kept for the run:
rollout/sync.py IPCBuffer), the engine's torch peak, and the device's used memory after each sync
(flat when nothing leaks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "h200_rl": dict(layers=8, hidden=1024, experts=64, topk=8, intermediate=512),
    "qwen3_dims": dict(layers=8, hidden=2048, experts=128, topk=8, intermediate=768),
}
GiB = 2**30


def header() -> str:
    import subprocess

    import torch
    import triton
    import vllm

    try:
        git = ["git", "-C", str(Path(__file__).parent)]
        commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
        if subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                          text=True).stdout.strip():
            commit += "+uncommitted changes"  # the tree it ran on is not that commit's
    except OSError:
        commit = "?"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (f"# bench_weight_sync {time.strftime('%Y-%m-%d')} | {gpu} | CUDA {torch.version.cuda} | torch "
            f"{torch.__version__} | triton {triton.__version__} | vllm {vllm.__version__} | commit {commit}")


def bench_model(name: str, dims: dict, reps: int, bucket_bytes: int, root: Path) -> list[dict]:
    import torch

    from rl.make_model import make_model
    from rollout.sync import push_ipc_local
    from rollout.testing import gpu_engine_kwargs
    from rollout.worker import RolloutWorker
    from trainer.testing import free_port
    from trainer.worker import TrainerWorker

    t0 = time.perf_counter()
    model_dir = make_model(root / name, arch="qwen3_moe", seed=0, **dims)
    print(f"  {name}: model made in {time.perf_counter() - t0:.1f} s", flush=True)
    trainer = TrainerWorker(0, 1, "127.0.0.1", free_port(), str(model_dir), "megamoe",
                            {"dtype": "bfloat16", "device": "cuda"})
    engine = RolloutWorker(model_dir, "megamoe", dtype="bfloat16", seed=0, max_model_len=256,
                           kv_cache_memory_bytes=2 * GiB, enforce_eager=True, weight_sync="ipc",
                           **gpu_engine_kwargs())
    rows = []
    try:
        engine.generate(["warm up"], 1, {"temperature": 0.0, "max_tokens": 4})
        for fmt in ("kernel", "experts", "checkpoint"):
            engine.sync_format = fmt
            first = push_ipc_local(trainer, [engine], model_dir=str(model_dir), dtype="bfloat16",
                                   bucket_bytes=bucket_bytes)
            times, infos, used = [], [], []
            rest = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            engine.gpu_memory(reset_peak=True)
            for _ in range(reps):
                info = push_ipc_local(trainer, [engine], model_dir=str(model_dir), dtype="bfloat16",
                                      bucket_bytes=bucket_bytes)
                times.append(info.seconds["total"])
                infos.append(info)
                # device memory after each sync (every process on the GPU): flat = nothing leaks per sync
                used.append(round(engine.gpu_memory()["device_used_bytes"] / GiB, 3))
            trainer_extra = torch.cuda.max_memory_allocated() - rest
            eng = engine.gpu_memory()
            nbytes = infos[0].bytes
            med = statistics.median(times)
            rows.append({"model": name, "mode": f"ipc/{fmt}", "bytes": nbytes,
                         "seconds": med, "min_s": min(times), "gb_per_s": nbytes / med / 1e9,
                         # rollout.sync.send_ipc's phases, each the median over the syncs
                         "phases_ms": {k: 1e3 * statistics.median(i.seconds[k] for i in infos)
                                       for k in infos[0].seconds if k != "total"},
                         "chunks": infos[0].chunks, "format": infos[0].format,
                         # the warm-up sync: the engine maps the trainer's buffer at the first kernel chunk
                         "first_ms": 1e3 * first.seconds["total"],
                         "first_map_ms": 1e3 * first.seconds.get("engine_kernel_map", 0.0),
                         "trainer_peak_extra_gib": trainer_extra / GiB,
                         "trainer_reserved_gib": torch.cuda.memory_reserved() / GiB,
                         "engine_torch_peak_gib": eng["torch_peak_allocated_bytes"] / GiB,
                         "device_used_gib_per_sync": used, "bucket_bytes": bucket_bytes})
        engine.sync_format = "auto"
        t0 = time.perf_counter()
        named = trainer.export_weights("bfloat16")
        t_export = time.perf_counter() - t0
        info = engine.update_weights(named)
        secs = time.perf_counter() - t0
        del named
        rows.append({"model": name, "mode": "files", "bytes": info["bytes"], "seconds": secs, "min_s": secs,
                     "gb_per_s": info["bytes"] / secs / 1e9, "export_s": t_export,
                     **{k: v for k, v in info.items() if k.endswith("_s")}})
    finally:
        engine.close()
        trainer.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", default=None, help="also write the table and the JSON rows here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_weight_sync: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    lines = [header()]
    print(lines[0], flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
        for name in args.models:
            rows += bench_model(name, MODELS[name], args.reps, args.bucket_bytes, Path(tmp))
    by = {(r["model"], r["mode"]): r for r in rows}
    lines.append("model | mode | GB | s per sync | GB/s | vs files | notes")
    for r in rows:
        files = by.get((r["model"], "files"))
        ipc = r["mode"].startswith("ipc")
        ratio = f"{files['seconds'] / r['seconds']:.0f}x" if files and ipc else "-"
        notes = (", ".join(f"{k} {v:.1f}" for k, v in r.get("phases_ms", {}).items()) +
                 f" ms ({r['chunks']} chunks); warm-up sync {r['first_ms']:.1f} ms (buffer mapping "
                 f"{r['first_map_ms']:.1f}); trainer +{r['trainer_peak_extra_gib']:.2f} GiB"
                 f", engine torch peak {r['engine_torch_peak_gib']:.2f} GiB; device used after each sync "
                 f"{r['device_used_gib_per_sync']} GiB" if ipc else
                 ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k.endswith("_s") and k not in ("min_s",)))
        lines.append(f"{r['model']} | {r['mode']} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.3f} | "
                     f"{r['gb_per_s']:.1f} | {ratio} | {notes}")
    print("\n".join(lines[1:]))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n\n" + json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
