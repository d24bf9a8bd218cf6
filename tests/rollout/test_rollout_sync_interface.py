"""The weight sync's trainer-side interface (rollout/sync_interface.py) without an engine: the trainer
has what the Protocol names (trainer/ cannot import it, so nothing else would notice a rename), an
engine's answer is read once and refused when it is not one, and the one place a mode becomes a
sender.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_sync_interface.py
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from records.weights import EngineAnswer
from rollout.sync_interface import TrainerWeights


def test_the_trainer_worker_has_every_member_the_protocol_names():
    from trainer.worker import TrainerWorker

    methods = {n: f for n, f in vars(TrainerWeights).items() if callable(f) and not n.startswith("_")}
    assert set(methods) == {"sync_dtype", "weight_metadata", "nonfinite_weights", "iter_device_weights",
                            "export_weights"}
    for name, want in methods.items():
        have = getattr(TrainerWorker, name, None)
        assert callable(have), name
        # Ray adds `_ray_trace_ctx` to the methods of a class once any process-local ray.remote wrapped it
        # (another test file in the same pytest worker); it is Ray's, not the protocol's.
        params = [p for p in inspect.signature(have).parameters if p != "_ray_trace_ctx"]
        assert params == list(inspect.signature(want).parameters), name
    assert set(TrainerWeights.__annotations__) == {"rank"}
    assert "self.rank" in inspect.getsource(TrainerWorker.__init__)


def test_an_engines_answer_has_its_defaults():
    a = EngineAnswer(format="kernel", layout=[], why={}, bytes=64, tensors=3, workers=2, transfer_group="10.0.0.1:5")
    assert (a.format, a.bytes, a.tensors, a.workers, a.transfer_group) == ("kernel", 64, 3, 2, "10.0.0.1:5")
    assert EngineAnswer(format="checkpoint", layout=None, why={}, bytes=1).workers == 1


@pytest.mark.parametrize("answer, error, match", [
    ({"format": "kernel", "layout": [], "why": {}}, TypeError, "missing 1 required .*'bytes'"),
    ({"format": "packed", "layout": None, "why": {}, "bytes": 1}, ValueError, "format 'packed', expected one of"),
])
def test_an_answer_that_is_not_a_plan_is_refused_naming_what_is_wrong(answer, error, match):
    with pytest.raises(error, match=match):
        EngineAnswer(**answer)


def test_a_mode_becomes_its_sender_in_one_place():
    from rollout.sync import MODES, IpcSender, sender
    from rollout.sync_files import FilesSender
    from rollout.sync_nccl import NcclSender

    ipc = sender("ipc", model_dir="m", dtype="bfloat16", bucket_bytes=1 << 20)
    nccl = sender("nccl", model_dir="m", dtype=None, address="10.0.0.1")
    files = sender("files", model_dir="m", dtype="bfloat16")
    assert type(ipc) is IpcSender and (ipc.mode, ipc.bucket_bytes, ipc.dtype) == ("ipc", 1 << 20, "bfloat16")
    assert type(nccl) is NcclSender and (nccl.mode, nccl.address) == ("nccl", "10.0.0.1")
    assert type(files) is FilesSender and (files.mode, files.dtype) == ("files", "bfloat16")
    assert sorted(s.mode for s in (ipc, nccl, files)) == sorted(MODES)
    with pytest.raises(ValueError, match="mode: expected one of .*'files', 'ipc', 'nccl'.*got 'shm'"):
        sender("shm", model_dir="m", dtype=None)


class _FilesTrainer:
    """A trainer rank as FilesSender reads it: its export (rank 0 holds the tensors)."""

    def __init__(self, rank):
        self.rank, self.asked = rank, []

    def sync_dtype(self, dtype):
        return dtype or "float32"

    def export_weights(self, dtype):
        import torch

        self.asked.append(dtype)
        g = torch.Generator().manual_seed(3)
        return [("model.norm.weight", torch.randn(4, generator=g))] if self.rank == 0 else []


class _FilesEngine:
    """RolloutWorker.update_weights as a files sync sees it: its report, or a refusal."""

    def __init__(self, refuse=False):
        self.refuse, self.got = refuse, []

    def update_weights(self, named):
        if self.refuse:
            raise ValueError("weight update rejected by the vLLM worker, nothing applied: tensor 'x'")
        self.got.append([n for n, _ in named])
        return {"tensors": 1, "bytes": 16, "buckets": 1, "seconds": 0.5, "plan_s": 0.1, "pack_s": 0.1,
                "send_s": 0.1, "commit_s": 0.2, "worker_read_s": 0.05}


def test_the_files_sender_hands_rank_0s_export_to_every_engine_once():
    from rollout.sync_files import FilesSender
    from rollout.sync_interface import LocalClient

    engines = [_FilesEngine(), _FilesEngine()]
    rank0, rank1 = _FilesTrainer(0), _FilesTrainer(1)
    report = FilesSender(model_dir="m", dtype=None, bucket_bytes=1).send(rank0, LocalClient(*engines))
    assert [e.got for e in engines] == [[["model.norm.weight"]]] * 2 and rank0.asked == ["float32"]
    assert (report.bytes, report.sent_bytes, report.chunks, report.format) == (16, 32, 1, "checkpoint")
    assert {k: v for k, v in report.seconds.items() if k.startswith("engine_")} == {
        "engine_plan": 0.1, "engine_pack": 0.1, "engine_send": 0.1, "engine_commit": 0.2, "engine_worker_read": 0.05}
    assert {"export", "send", "total"} <= set(report.seconds)
    other = FilesSender(model_dir="m", dtype=None, bucket_bytes=1).send(rank1, None)  # exports (a collective), sends nothing
    assert rank1.asked == ["float32"] and (other.bytes, other.chunks) == (0, 0)
    refusing = [_FilesEngine(), _FilesEngine(refuse=True)]
    with pytest.raises(ValueError, match="nothing applied: tensor 'x'"):
        FilesSender(model_dir="m", dtype=None, bucket_bytes=1).send(_FilesTrainer(0), LocalClient(*refusing))
    assert refusing[0].got == [["model.norm.weight"]]  # engines are independent: the other one took it


def test_a_published_version_is_taken_later_by_each_engine_whole():
    """The pull model's files transport: rank 0's export made once (shared), each engine taking it
    through update_weights when it chooses; nccl refuses to publish, naming why (ipc's publication:
    tests/rollout/test_rollout_sync.py)."""
    from rollout.sync import sender
    from records.weights import Publication
    from rollout.sync_interface import LocalClient
    from rollout.worker import RolloutWorker

    shared = []

    class Client(LocalClient):
        def share(self, obj):
            shared.append(obj)
            return ("shared", len(shared))

    trainer = _FilesTrainer(0)
    pub = sender("files", model_dir="m", dtype="bfloat16").publish(trainer, Client(_FilesEngine()), version=3)
    assert pub == Publication(version=3, mode="files", payload=("shared", 1)) and trainer.asked == ["bfloat16"]
    assert [n for n, _ in shared[0]] == ["model.norm.weight"]
    assert sender("files", model_dir="m", dtype=None).publish(_FilesTrainer(1), None, version=3) is None

    w = object.__new__(RolloutWorker)
    w.update_weights = lambda named: {"tensors": 1, "got": named}
    assert w.take_weights(pub) == {"version": 3, "tensors": 1, "got": ("shared", 1)}
    w.weight_sync = "files"
    with pytest.raises(ValueError, match="mode 'ipc' needs a RolloutWorker built with weight_sync='ipc'"):
        w.take_weights(dataclasses.replace(pub, mode="ipc"))
    with pytest.raises(ValueError, match="mode 'nccl' cannot be taken"):
        w.take_weights(dataclasses.replace(pub, mode="nccl"))
    with pytest.raises(ValueError, match="'version' expected an int >= 0, got '3'"):
        w.take_weights(dataclasses.replace(pub, version="3"))
    with pytest.raises(TypeError, match="publication: expected a records.weights.Publication, got dict"):
        w.take_weights({"version": 3, "mode": "files", "payload": ("shared", 1)})  # the old wire form
    with pytest.raises(NotImplementedError, match="rollout.weight_sync='nccl': .* a broadcast, which needs trainer "
                                                  "rank 0 and every engine inside the same collective at once"):
        sender("nccl", model_dir="m", dtype=None).publish(trainer, None, version=3)


# The trainer's side of the sync: what a trainer process imports to run a sender (rl.cluster.TrainerHost
# unpickles the sender there). vLLM's wire format is built on the engine's side (rollout/adapter.py).
TRAINER_SIDE = ("rollout.sync", "rollout.sync_interface", "rollout.sync_stream", "rollout.sync_files",
                "rollout.sync_nccl", "rollout.weights", "rollout.kernel_format")


def _modules(package: str) -> list[str]:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    return sorted(f"{package}.{p.stem}" for p in (root / package).glob("*.py") if p.stem != "__init__")


def test_no_trainer_module_and_no_trainer_side_sync_module_imports_vllm_statically():
    """Every `import` statement of trainer/ and of the trainer's half of the sync: none names vLLM or
    rollout.adapter (which imports vLLM); rollout.sync_nccl's trainer end of vLLM's NCCL protocol is
    the one exception, inside its two functions (nccl only)."""
    import ast
    import importlib.util

    found = []
    for name in _modules("trainer") + list(TRAINER_SIDE):
        path = importlib.util.find_spec(name).origin
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            if any(n == "vllm" or n.startswith("vllm.") or n == "rollout.adapter" for n in names):
                found.append((name, node.lineno, names[0]))
    nccl = [f for f in found if f[0] == "rollout.sync_nccl"]
    assert [f for f in found if f[0] != "rollout.sync_nccl"] == [] and len(nccl) == 2, found
    assert all(n.startswith("vllm.distributed.weight_transfer.") for _, _, n in nccl), nccl


def test_importing_every_trainer_module_and_running_a_files_sync_loads_no_vllm():
    """In a fresh process: import every trainer module and the trainer's half of the sync, run a files
    sync and the checks of a streamed one, then vLLM must not be in sys.modules."""
    import json
    import subprocess
    import sys

    code = f"""
import importlib, json, sys
for m in {_modules("trainer") + list(TRAINER_SIDE)!r}:
    importlib.import_module(m)
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
from test_rollout_sync_interface import _FilesEngine, _FilesTrainer
from rollout.sync import sender
from rollout.sync_interface import LocalClient
sender("files", model_dir="m", dtype=None).send(_FilesTrainer(0), LocalClient(_FilesEngine()))
print(json.dumps(sorted(m for m in sys.modules if m == "vllm" or m.startswith(("vllm.", "rollout.adapter")))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
