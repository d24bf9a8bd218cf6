"""The weight sync's trainer-side interface (rollout/sync_interface.py) without an engine: the trainer
has what the Protocol names (trainer/ cannot import it, so nothing else would notice a rename), an
engine's answer is read once and refused when it is not one, and the one place a mode becomes a
sender.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_sync_interface.py
"""

from __future__ import annotations

import inspect

import pytest

from rollout.sync_interface import EngineAnswer, TrainerWeights


def test_the_trainer_worker_has_every_member_the_protocol_names():
    from trainer.worker import TrainerWorker

    methods = {n: f for n, f in vars(TrainerWeights).items() if callable(f) and not n.startswith("_")}
    assert set(methods) == {"sync_dtype", "weight_metadata", "nonfinite_weights", "iter_device_weights"}
    for name, want in methods.items():
        have = getattr(TrainerWorker, name, None)
        assert callable(have), name
        # Ray adds `_ray_trace_ctx` to the methods of a class once any process-local ray.remote wrapped it
        # (another test file in the same pytest worker); it is Ray's, not the protocol's.
        params = [p for p in inspect.signature(have).parameters if p != "_ray_trace_ctx"]
        assert params == list(inspect.signature(want).parameters), name
    assert set(TrainerWeights.__annotations__) == {"rank"}
    assert "self.rank" in inspect.getsource(TrainerWorker.__init__)


def test_an_engines_answer_is_read_once_with_its_defaults():
    a = EngineAnswer.from_wire({"format": "kernel", "layout": [], "why": {}, "bytes": 64, "tensors": 3,
                                "workers": 2, "transfer_group": "10.0.0.1:5"})
    assert (a.format, a.bytes, a.tensors, a.workers, a.transfer_group) == ("kernel", 64, 3, 2, "10.0.0.1:5")
    assert EngineAnswer.from_wire({"format": "checkpoint", "layout": None, "why": {}, "bytes": 1}).workers == 1


@pytest.mark.parametrize("answer, match", [
    ({"format": "kernel", "layout": [], "why": {}}, r"lacks \['bytes'\]"),
    ({"format": "packed", "layout": None, "why": {}, "bytes": 1}, "format 'packed', expected one of"),
])
def test_an_answer_that_is_not_a_plan_is_refused_naming_what_is_wrong(answer, match):
    with pytest.raises(ValueError, match=match):
        EngineAnswer.from_wire(answer)


def test_a_mode_becomes_its_sender_in_one_place():
    from rollout.sync import IpcSender, sender
    from rollout.sync_nccl import NcclSender

    ipc = sender("ipc", model_dir="m", dtype="bfloat16", bucket_bytes=1 << 20)
    nccl = sender("nccl", model_dir="m", dtype=None, address="10.0.0.1")
    assert type(ipc) is IpcSender and (ipc.mode, ipc.bucket_bytes, ipc.dtype) == ("ipc", 1 << 20, "bfloat16")
    assert type(nccl) is NcclSender and (nccl.mode, nccl.address) == ("nccl", "10.0.0.1")
    with pytest.raises(ValueError, match="mode: expected one of .*'ipc', 'nccl'.*got 'files'"):
        sender("files", model_dir="m", dtype=None)
