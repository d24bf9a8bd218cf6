"""CPU: the weight-sync seam (rollout/sync.py): transport selection, the metadata plan of a streamed
update, the streamed translation to on-disk names, and the config keys that choose them. The CUDA
IPC transfer itself runs in tests/test_rollout_sync_gpu.py (H200)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl import config
from rollout.sync import resolve
from rollout.weights import CheckpointSpec, plan_metadata, to_checkpoint_names


@pytest.mark.parametrize("mode, colocated, on_gpu, same_gpu, want", [
    ("auto", True, True, True, "ipc"),
    ("auto", True, False, True, "files"),
    ("auto", False, True, False, "files"),
    ("ipc", True, True, True, "ipc"),
    ("files", True, True, True, "files"),
    ("files", False, False, False, "files"),
])
def test_resolve_picks_the_transport(mode, colocated, on_gpu, same_gpu, want):
    assert resolve(mode, colocated=colocated, on_gpu=on_gpu, same_gpu=same_gpu) == want


@pytest.mark.parametrize("mode, colocated, on_gpu, same_gpu, match", [
    ("ipc", True, False, True, "needs CUDA GPUs"),
    ("nccl", True, False, True, "needs CUDA GPUs"),
    ("ipc", False, True, False, "same GPU"),
    ("ipc", True, True, False, "same GPU"),
    ("nccl", True, True, True, "different GPUs"),
    ("nccl", False, True, False, "not provided"),
    ("shm", True, True, True, "expected one of"),
])
def test_resolve_refuses_what_the_placement_cannot_run(mode, colocated, on_gpu, same_gpu, match):
    with pytest.raises(ValueError, match=match) as e:
        resolve(mode, colocated=colocated, on_gpu=on_gpu, same_gpu=same_gpu)
    assert "rollout.weight_sync" in str(e.value) and repr(mode) in str(e.value)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.weight_sync=ipc"], "rollout.weight_sync: 'ipc' needs CUDA"),
    (["rollout.weight_sync=nccl"], "rollout.weight_sync: 'nccl' needs CUDA"),
    (["rollout.sleep_level=1"], "rollout.sleep_level"),
    (["rollout.sleep_level=3"], "rollout.sleep_level"),
    (["rollout.ipc_bucket_bytes=10"], "rollout.ipc_bucket_bytes"),
])
def test_config_refuses_bad_sync_settings_on_cpu(overrides, match):
    with pytest.raises(config.ConfigError, match=match):
        config.load("configs/tiny.yaml", overrides)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.weight_sync=nccl"], "different GPUs"),
    (["ray.placement=disaggregated", "rollout.weight_sync=ipc"], "same GPU"),
    (["rollout.gpus_per_worker=1", "rollout.weight_sync=ipc"], "same GPU"),
])
def test_config_refuses_bad_sync_settings_on_gpu_placements(overrides, match):
    with pytest.raises(config.ConfigError, match=match):
        config.load("configs/h200_rl.yaml", overrides)


def test_config_auto_resolves_per_placement():
    assert config.resolve_weight_sync(config.load("configs/tiny.yaml")) == "files"
    assert config.resolve_weight_sync(config.load("configs/h200_rl.yaml")) == "ipc"
    assert config.resolve_weight_sync(config.load("configs/qwen3_30b_a3b_8gpu.yaml")) == "files"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from rl.make_model import make_model

    d = make_model(tmp_path_factory.mktemp("sync") / "m", arch="qwen3_moe", seed=5)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return d, CheckpointSpec.from_dir(d), model.state_dict(), load_file(str(d / "model.safetensors"))


def _metas(state, dtype="bfloat16"):
    return [(n, list(t.shape), dtype) for n, t in state.items()]


def test_plan_metadata_lists_every_disk_tensor_once(ckpt):
    _, spec, state, disk = ckpt
    plan = plan_metadata(spec, _metas(state))
    assert set(plan) == set(disk)
    assert all(plan[n] == (tuple(disk[n].shape), "bfloat16") for n in disk)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m[:-1], "missing"),
    (lambda m: m + [("model.extra.weight", [2, 2], "bfloat16")], "unexpected tensor"),
    (lambda m: [(n, [s[0] + 1] + s[1:], d) if ".experts.down_proj" in n else (n, s, d) for n, s, d in m], "expected shape"),
    (lambda m: [(n, s, "int8" if i == 0 else d) for i, (n, s, d) in enumerate(m)], "floating dtype"),
    (lambda m: [(n, s, "float99") for n, s, d in m], "torch dtype name"),
])
def test_plan_metadata_refuses_bad_updates_naming_the_tensor(ckpt, edit, match):
    _, spec, state, _ = ckpt
    with pytest.raises((ValueError, TypeError), match=match):
        plan_metadata(spec, edit(_metas(state)))


def test_streamed_translation_equals_the_disk_tensors_as_views(ckpt):
    _, spec, state, disk = ckpt
    out = list(to_checkpoint_names(spec, state.items()))
    assert sorted(n for n, _ in out) == sorted(disk)
    fused = {t.untyped_storage().data_ptr() for n, t in state.items() if n.endswith("gate_up_proj")}
    for name, t in out:
        assert torch.equal(t, disk[name]), name
        if ".experts." in name and (name.endswith("gate_proj.weight") or name.endswith("up_proj.weight")):
            assert t.untyped_storage().data_ptr() in fused  # a view of the fused tensor, no copy
