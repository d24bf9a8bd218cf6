"""The CPU-runnable benchmark tools run and print what they claim (their numbers are recorded in
benchmarks/RESULTS.md; here only that they work, so they do not rot between GPU sessions)."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.smoke
def test_profile_step_lists_the_step_on_cpu():
    out = _run("benchmarks/device/profile_step.py", "--shape", "tiny", "--tokens", "16")
    assert re.search(r"tiny T=16 megamoe on cpu: \d+ events, span [\d.]+ ms", out), out
    # the training forward and its backward node, in that order
    assert "megamoe::fused_moe_train" in out and "GeneratedBackwardFor_megamoe_fused_moe_train" in out, out
    assert out.index("megamoe::fused_moe_train") < out.index("GeneratedBackwardFor_megamoe_fused_moe_train"), out


@pytest.mark.smoke
def test_host_overhead_times_each_wrapper():
    out = _run("benchmarks/host_overhead.py")
    for name in ("fused_moe_fwd (inference)", "fused_moe_fwd, saving (gate, up)", "fused_moe_bwd, from (gate, up)",
                 "training step, public op + autograd", "training step, direct fwd + bwd calls"):
        assert re.search(re.escape(name) + r"\s+\d+ us", out), out


def test_bench_memory_reports_both_paths():
    out = _run("benchmarks/bench_memory.py", "--shapes", "qwen3", "--tokens", "8", "--dtype", "float32")
    # Qwen3 in fp32: megamoe saves exactly k * 2I fp32 per token = 8 * 1536 * 4 bytes = 48 KiB
    assert re.search(r"\| qwen3 \(128, 2048, 768, 8\) \| 8 \| 48\.0 KiB \| [\d.]+ KiB \| 0\.\d\d \|", out), out


def test_host_path_imports_and_refuses_without_a_gpu():
    """host_path.py runs on a GPU only; here its imports and its refusal (the numbers are in RESULTS.md)."""
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without a GPU")
    proc = subprocess.run([sys.executable, "benchmarks/device/host_path.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "host_path.py needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
    # a config change naming no KernelConfig field is refused before the GPU check, naming the flag
    proc = subprocess.run([sys.executable, "benchmarks/device/host_path.py", "--set", "tma=False"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--set: expected FIELD=VALUE" in proc.stderr and "'tma=False'" in proc.stderr, \
        proc.stderr[-2000:]


def test_ep_diag_runs_every_step_on_gloo():
    """ep_diag.py --cpu: two gloo processes, the kernels under the interpreter (the conftest sets
    TRITON_INTERPRET=1, the subprocess inherits it); every step reports the single-process op's bits."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the --cpu run needs the Triton interpreter (CPU machines; conftest sets it)")
    out = _run("benchmarks/device/ep_diag.py", "--cpu", "--timeout", "200")
    for rank, peer in ((0, 2.0), (1, 1.0)):
        assert f"[rank {rank} " in out and re.search(rf"\[rank {rank} .*\] p2p: own result buffer holds \[{peer}\]", out), out
        for step, epoch in (("fwd1", 1), ("fwd", 2)):
            assert re.search(rf"\[rank {rank} .*\] {step}: kernel done, err \[0, 0\], epoch {epoch}", out), out
            assert re.search(rf"\[rank {rank} .*\] {step}: equal True", out), out
        assert re.search(rf"\[rank {rank} .*\] bwd: y equal True; dx, dw13, dw2, dtw equal \[True, True, True, True\]",
                         out), out
    assert "FAILED" not in out, out


def test_compile_check_refuses_an_unknown_config_field():
    proc = subprocess.run([sys.executable, "benchmarks/device/compile_check.py", "--set", "BM=64", "nope=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode != 0 and "--set: expected FIELD=VALUE" in proc.stderr and "'nope=1'" in proc.stderr, \
        proc.stderr[-2000:]


def test_liger_warm_gives_each_worker_a_slice_and_together_every_config():
    """liger_warm.keep_slice over a module holding Triton autotuners (built here; nothing compiles):
    worker i keeps configurations i, i+n, ...; a worker past the end keeps one; the workers together
    keep every configuration, so the benchmark's autotune finds all of them compiled."""
    import types

    import triton
    import triton.language as tl

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "device"))
    from liger_warm import keep_slice

    def fresh():
        mod = types.ModuleType("fake_liger")

        def body(x_ptr, B: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, B), tl.zeros((B,), tl.float32))

        mod.five = triton.autotune([triton.Config({"B": 16 * (i + 1)}) for i in range(5)], key=[])(triton.jit(body))
        mod.two = triton.autotune([triton.Config({"B": 16 * (i + 1)}) for i in range(2)], key=[])(triton.jit(body))
        mod.not_a_kernel = [1, 2, 3]
        return mod

    n = 3
    kept = {"five": [], "two": []}
    for i in range(n):
        mod = fresh()
        assert keep_slice(mod, i, n) == {"five": len(range(i, 5, n)), "two": 1}
        kept["five"] += [c.kwargs["B"] for c in mod.five.configs]
        kept["two"] += [c.kwargs["B"] for c in mod.two.configs]
    assert sorted(kept["five"]) == [16, 32, 48, 64, 80]
    assert set(kept["two"]) == {16, 32}  # worker 2 of 3 keeps configuration 2 % 2 = 0 again


def test_bench_moe_rounds_go_round_robin_and_keep_every_median():
    """bench_moe.py --rounds: every (implementation, mode) timer once per round, in order, round
    after round, so the implementations meet the same drifts; each keeps all of its medians."""
    sys.path.insert(0, ROOT)
    from benchmarks.bench_moe import interleaved_ms

    calls, clock = [], iter(range(100))

    def timer(key):
        def run():
            calls.append(key)
            return float(next(clock))
        return run

    keys = [("megamoe", "fwd"), ("megamoe", "fb"), ("liger", "fwd"), ("liger", "fb")]
    out = interleaved_ms({k: timer(k) for k in keys}, 3)
    assert calls == keys * 3
    assert out == {k: [float(i), float(i + 4), float(i + 8)] for i, k in enumerate(keys)}
    with pytest.raises(ValueError, match="rounds: expected an int >= 1, got 0"):
        interleaved_ms({k: timer(k) for k in keys}, 0)


@pytest.mark.parametrize("rounds", [1, 2])
def test_bench_moe_rows_on_cpu(monkeypatch, rounds):
    """bench_shape end to end on a tiny shape on CPU (the torch backend; CUDA-event timing replaced
    by a call that returns a fixed time): each implementation's forward and forward+backward run
    `rounds` times and the table rows name both modes, with Liger's columns n/a when not installed."""
    sys.path.insert(0, ROOT)
    from benchmarks import bench_moe as bm

    calls = []

    def fake_time(fn, reps, warmup=0):
        calls.append(fn)
        fn()
        return 2.0

    make = bm.make_inputs
    monkeypatch.setitem(bm.SHAPES, "tiny", (4, 32, 16, 2))
    monkeypatch.setattr(bm, "make_inputs", lambda *a, **kw: make(*a, device="cpu", dtype=torch.float32))
    monkeypatch.setattr(bm, "time_ms", fake_time)
    monkeypatch.setattr(bm, "graph_ms", lambda fn, reps: fake_time(fn, reps))
    lines, records = [], []
    bm.bench_shape("tiny", 16, 1, ["megamoe", "reference"], 1e12, lines, records, rounds=rounds)
    assert len(calls) == 4 * rounds + 1  # (2 impls x 2 modes) per round + megamoe's graph forward (T <= 512)
    row = records[0]
    assert row["rounds"] == rounds and row["megamoe_fb_rounds_ms"] == [2.0] * rounds
    assert [ln.split("|")[0].split()[-1] for ln in lines] == ["fwd", "fb"]
    assert all("megamoe    2.000 ms" in ln and "1.00x vs reference" in ln for ln in lines), lines


def test_bench_moe_graph_rows_on_cpu(monkeypatch):
    """--graph: each implementation's forward also timed as a replayed graph, once per round, in a
    third row; one whose capture fails gets n/a there with the reason in its record, and the other
    rows stay."""
    sys.path.insert(0, ROOT)
    from benchmarks import bench_moe as bm

    graphed = []

    def fake_graph(fn, reps):
        graphed.append(fn)
        if len(graphed) == 2:  # the reference's forward (megamoe's comes first in the round)
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return 1.0

    make = bm.make_inputs
    monkeypatch.setitem(bm.SHAPES, "tiny", (4, 32, 16, 2))
    monkeypatch.setattr(bm, "make_inputs", lambda *a, **kw: make(*a, device="cpu", dtype=torch.float32))
    monkeypatch.setattr(bm, "time_ms", lambda fn, reps, warmup=0: (fn(), 2.0)[1])
    monkeypatch.setattr(bm, "graph_ms", fake_graph)
    lines, records = [], []
    bm.bench_shape("tiny", 1024, 1, ["megamoe", "reference"], 1e12, lines, records, rounds=2, graph=True)
    assert len(graphed) == 3  # megamoe in both rounds, the reference once (not retried after failing)
    row = records[0]
    assert row["megamoe_graph_rounds_ms"] == [1.0, 1.0] and row["megamoe_graph_ms"] == 1.0
    assert row["reference_graph_ms"] is None
    assert row["reference_graph_note"] == "RuntimeError: operation not permitted when stream is capturing"
    assert [ln.split("|")[0].split()[-1] for ln in lines] == ["fwd", "fb", "graph"]
    assert "megamoe    1.000 ms" in lines[2] and "reference      n/a" in lines[2] and "vs reference" not in lines[2]
    assert "2.000 ms" in lines[0] and "1.00x vs reference" in lines[0]
    # at decode sizes the floor comparison reuses megamoe's graph time instead of timing it again
    graphed.clear()
    bm.bench_shape("tiny", 16, 1, ["megamoe"], 1e12, lines, records, rounds=1, graph=True)
    assert len(graphed) == 1 and records[-1]["megamoe_graph_fwd_ms"] == records[-1]["megamoe_graph_ms"] == 1.0


def test_step_breakdown_reports_the_sync_share(tmp_path):
    """benchmarks/step_breakdown.py on seeded random step times: per-step rows and the share of the
    steps after the first, against the same sums made here."""
    import json
    import random

    rng = random.Random(7)
    rows = []
    for step in range(1, 6):
        rollout, train, sync = rng.uniform(0.2, 0.5), rng.uniform(0.1, 0.3), rng.uniform(0.01, 0.05)
        rows.append({"step": step, "time/step_s": rollout + train + sync + 0.01, "time/rollout_s": rollout,
                     "time/train_s": train, "time/weight_sync_s": sync,
                     "time/weight_sync/check_s": sync / 4, "time/weight_sync/send_s": sync / 2, "reward/mean": 0.5})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _run("benchmarks/step_breakdown.py", str(path))
    later = rows[1:]
    share = 100 * sum(r["time/weight_sync_s"] for r in later) / sum(r["time/step_s"] for r in later)
    assert f"sync {share:.1f} % of their total" in out, out
    assert "median of steps 2-5" in out and "other 0.010 s" in out, out
    r = rows[2]
    assert (f"3 | {r['time/step_s']:.3f} | {r['time/rollout_s']:.3f} | {r['time/train_s']:.3f} | "
            f"{1e3 * r['time/weight_sync_s']:.1f} | {100 * r['time/weight_sync_s'] / r['time/step_s']:.1f} | "
            f"{250 * r['time/weight_sync_s']:.1f} {500 * r['time/weight_sync_s']:.1f}") in out, out


def test_bench_async_dry_run_resolves_each_lags_config():
    """bench_async.py's train commands as `megamoe-rl train --dry-run` (no Ray): every override it adds
    is a key of the config tree today, and each lag gets its run.max_async_steps."""
    import yaml

    out = _run("benchmarks/bench_async.py", "--dry-run", "--lags", "0", "2", "--set", "rollout.n=2")
    parts = re.split(r"^# k=(\d+)$", out, flags=re.M)[1:]
    cfgs = {int(k): yaml.safe_load(text) for k, text in zip(parts[::2], parts[1::2])}
    assert sorted(cfgs) == [0, 2], out
    for k, cfg in cfgs.items():
        assert cfg["run"]["max_async_steps"] == k and cfg["ray"]["placement"] == "disaggregated"
        assert cfg["rollout"]["n"] == 2 and cfg["run"]["steps"] == 30


# bench_async.py's smallest run: one lag (k=1, the async path), 2 steps of 2 prompts x 2 samples, one
# `megamoe-rl train` (Ray, one vLLM CPU engine, one trainer rank).
@pytest.mark.smoke
@pytest.mark.slow
def test_bench_async_smallest_run_prints_its_row():
    out = _run("benchmarks/bench_async.py", "--steps", "2", "--warmup", "1", "--lags", "1", "--set", "rollout.n=2",
               "run.prompts_per_step=2", "rollout.max_tokens=2")
    assert "| k | steps/s | vs k=0 | trainer idle | rollout idle | reward last step | reward last 5 |" in out, out
    assert re.search(r"^\| 1 \| [\d.]+ \| 1\.00x \| -?\d+% \| -?\d+% \| [\d.-]+ \| [\d.-]+ \|$", out, re.M), out


# bench_replay.py's smallest run: a 1-layer model, 2 prompts x 2 samples of 2 tokens, the megamoe
# sampler only (one vLLM CPU engine, eager: torch.compile was most of this test's time), one rep per R3 setting.
@pytest.mark.smoke
@pytest.mark.slow
def test_bench_replay_smallest_run_prints_both_r3_rows():
    out = _run("benchmarks/bench_replay.py", "--layers", "1", "--hidden", "64", "--experts", "4", "--topk", "2",
               "--intermediate", "32", "--prompts", "2", "--n", "2", "--max-tokens", "2", "--micro-batch", "4",
               "--reps", "1", "--samplers", "megamoe", "--eager")
    assert "| sampler | R3 | routing agreement | k3 | max abs dlogp |" in out, out
    num = r"[\d.e+-]+"
    for r3 in ("off", "on"):
        assert re.search(rf"^\| megamoe \| {r3} \|( {num} \|){{8}}$", out, re.M), out


def test_bench_capture_host_prints_a_row_per_shape():
    out = _run("benchmarks/bench_capture_host.py", "--layers", "2", "3", "--requests", "4", "--steps", "5", "--reps", "1")
    assert "| layers | requests | host us per step (mean over the steps, median of reps) | take ms |" in out, out
    for layers in (2, 3):
        assert re.search(rf"^\| {layers} \| 4 \| [\d.]+ \| [\d.]+ \|$", out, re.M), out


def test_bench_moe_times_vllm_only_where_its_output_agrees(monkeypatch):
    """--impls vllm: vLLM's fused_experts (here a CPU stand-in with its signature) is checked against megamoe's
    output before it is timed, forward and graph only (no backward: n/a in the fb row); a stand-in with gate
    and up swapped (the layout mismatch the check is for) is not timed and its record says why."""
    sys.path.insert(0, ROOT)
    from benchmarks import bench_moe as bm
    from megamoe.ref import moe_unfused

    def standin(swap):
        def fused_experts(x, w1, w2, topk_weights, topk_ids):
            assert topk_ids.dtype == torch.int32
            if swap:
                half = w1.shape[1] // 2
                w1 = torch.cat([w1[:, half:], w1[:, :half]], dim=1)
            return moe_unfused(x, w1, w2, topk_weights, topk_ids.long(), check_ids=False)
        return fused_experts

    timed = []
    make = bm.make_inputs
    monkeypatch.setitem(bm.SHAPES, "tiny", (4, 32, 16, 2))
    monkeypatch.setattr(bm, "make_inputs", lambda *a, **kw: make(*a, device="cpu", dtype=torch.float32))
    monkeypatch.setattr(bm, "time_ms", lambda fn, reps, warmup=0: (timed.append(fn), fn(), 2.0)[2])
    monkeypatch.setattr(bm, "graph_ms", lambda fn, reps: (fn(), 1.0)[1])
    for swap in (False, True):
        monkeypatch.setattr(bm, "vllm_fn", lambda swap=swap: (standin(swap), None))
        lines, records = [], []
        timed.clear()
        bm.bench_shape("tiny", 16, 1, ["megamoe", "vllm"], 1e12, lines, records, graph=True)
        row = records[0]
        if not swap:
            assert row["vllm_max_abs_diff"] < 1e-5 and row["vllm_fwd_ms"] == 2.0 and row["vllm_graph_ms"] == 1.0
            assert row["vllm_fb_ms"] is None and len(timed) == 3  # megamoe fwd + fb, vllm fwd
            assert "1.00x vs vllm" in lines[0] and "vllm      n/a" in lines[1] and "1.00x vs vllm" in lines[2]
        else:
            assert row["vllm_fwd_ms"] is None and "output disagrees with megamoe's" in row["vllm_note"]
            assert len(timed) == 2 and "vs vllm" not in lines[0]
    monkeypatch.setattr(bm, "vllm_fn", lambda: (None, "not importable: ModuleNotFoundError: No module named 'vllm'"))
    lines, records = [], []
    bm.bench_shape("tiny", 16, 1, ["megamoe", "vllm"], 1e12, lines, records)
    assert records[0]["vllm_fwd_ms"] is None and records[0]["vllm_note"].startswith("not importable")


def test_tune_moe_decode_rows_flag_changed_bits_and_failing_tiles(monkeypatch):
    """tune_moe.py --decode's table: the default config first, each variant with its time, its ratio to vLLM's
    fused_experts (here a stand-in, timed last) and whether its output is bitwise the default's; a variant the
    config refuses becomes an error row and the sweep goes on; the forced config is reset after each variant."""
    sys.path.insert(0, ROOT)
    from benchmarks import bench_moe as bm
    from benchmarks import tune_moe as tm
    from megamoe import fused
    from megamoe.ref import moe_unfused

    real_fwd = fused.fused_moe_fwd

    def fwd(x, w13, w2, tw, ids, check=True):
        y = real_fwd(x, w13, w2, tw, ids, check=check)
        return y + 1e-3 if fused.config_for(x).BM == 32 else y  # the BM=32 variant changes bits

    times = iter([2.0, 1.0, 4.0] * 2)
    make = bm.make_inputs
    monkeypatch.setitem(bm.SHAPES, "tiny", (4, 32, 16, 2))
    monkeypatch.setattr(bm, "make_inputs", lambda *a, **kw: make(*a[:5], dtype=torch.float32, device="cpu"))
    monkeypatch.setattr(tm, "make_inputs", bm.make_inputs)
    monkeypatch.setattr(fused, "fused_moe_fwd", fwd)
    monkeypatch.setattr(tm, "vllm_fn", lambda: (lambda x, w1, w2, tw, ids32: moe_unfused(x, w1, w2, tw, ids32.long(),
                                                                                        check_ids=False), None))
    rows = sum(tm.decode_sweep("tiny", [8, 16], 1, variants=[dict(BM=32), dict(BM=48)],
                               timer=lambda fn, reps: (fn(), next(times))[1], device="cpu"), [])
    assert [r["config"] for r in rows] == ["default", "BM=32", "BM=48", "vllm fused_experts"] * 2
    default, bm32, bm48, vllm = rows[:4]
    assert default["bitwise"] is True and bm32["bitwise"] is False and vllm["bitwise"] is None
    assert default["vs_vllm"] == 2.0 and bm32["vs_vllm"] == 4.0 and vllm["vs_vllm"] == 1.0
    assert "error" in bm48 and "BM" in bm48["error"]
    assert fused.config_for(torch.zeros(1)) == fused.default_config(torch.float32, torch.device("cpu"))
    monkeypatch.setattr(tm, "vllm_fn", lambda: (None, "not importable: no vllm"))
    rows = sum(tm.decode_sweep("tiny", [8], 1, variants=[], timer=lambda fn, reps: 1.0, device="cpu"), [])
    assert rows[-1] == {"T": 8, "config": "vllm fused_experts", "error": "not importable: no vllm"} and "vs_vllm" not in rows[0]
    # vLLM's output is checked as bench_moe checks it: gate and up swapped is not timed
    swapped = (lambda x, w1, w2, tw, ids32: moe_unfused(x, torch.cat([w1[:, w1.shape[1] // 2:], w1[:, :w1.shape[1] // 2]], 1),
                                                        w2, tw, ids32.long(), check_ids=False))
    monkeypatch.setattr(tm, "vllm_fn", lambda: (swapped, None))
    rows = sum(tm.decode_sweep("tiny", [8], 1, variants=[], timer=lambda fn, reps: 1.0, device="cpu"), [])
    assert "output disagrees with megamoe's" in rows[-1]["error"] and "vs_vllm" not in rows[0]
