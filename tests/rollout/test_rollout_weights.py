"""rollout.weights without vLLM: naming (transformers fused vs on-disk per-expert), validation, transport.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_weights.py
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rollout.weights import CheckpointSpec, plan_update, read_buckets, write_buckets


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def ckpt(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from rl.make_model import make_model

    d = make_model(tmp_path_factory.mktemp("weights") / request.param, arch=request.param, seed=3)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return d, CheckpointSpec.from_dir(d), model.state_dict(), load_file(str(d / "model.safetensors"))


def test_spec_reads_the_per_expert_layout(ckpt):
    d, spec, _, disk = ckpt
    assert dict(spec.shapes) == {k: tuple(v.shape) for k, v in disk.items()}
    assert len(spec.expert_groups) == 2  # one per layer
    g = spec.expert_groups[sorted(spec.expert_groups)[0]]
    assert (g.num_experts, g.intermediate, g.hidden) == (8, 32, 64)
    assert (g.gate, g.up, g.down) == (("w1", "w3", "w2") if spec.architecture == "MixtralForCausalLM"
                                      else ("gate_proj", "up_proj", "down_proj"))


def test_transformers_names_translate_to_the_disk_tensors_exactly(ckpt):
    _, spec, state, disk = ckpt
    assert any(k.endswith(".mlp.experts.gate_up_proj") for k in state)  # transformers 5 fuses experts
    plan = plan_update(spec, state)
    assert [n for n, _ in plan] == list(spec.shapes)
    for name, t in plan:
        assert torch.equal(t, disk[name]), name


def test_disk_names_pass_through(ckpt):
    _, spec, _, disk = ckpt
    plan = dict(plan_update(spec, list(disk.items())))
    assert all(plan[k].data_ptr() == disk[k].data_ptr() for k in disk)  # no copies


def test_mixed_naming_is_accepted_but_duplicates_are_not(ckpt):
    _, spec, state, disk = ckpt
    prefix = sorted(spec.expert_groups)[0]
    g = spec.expert_groups[prefix]
    # Layer 0's down projections per expert (disk names), everything else in transformers names.
    mixed = {k: v for k, v in state.items() if not k.endswith(".experts.down_proj")}
    mixed.update({g.name(e, g.down): disk[g.name(e, g.down)] for e in range(g.num_experts)})
    with pytest.raises(ValueError, match="missing"):
        plan_update(spec, mixed)  # layer 1's down projections are in neither naming
    other = sorted(spec.expert_groups)[1]
    h = spec.expert_groups[other]
    mixed.update({h.name(e, h.down): disk[h.name(e, h.down)] for e in range(h.num_experts)})
    assert len(plan_update(spec, mixed)) == len(spec.shapes)
    in_memory = next(k for k in state if k.endswith(".experts.down_proj"))
    dup = {**mixed, in_memory: state[in_memory]}
    with pytest.raises(ValueError, match="duplicate"):
        plan_update(spec, dup)


def test_tied_lm_head_must_equal_the_embedding(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"],
                                                      "tie_word_embeddings": True}))
    emb = torch.randn(10, 4)
    save_file({"model.embed_tokens.weight": emb}, str(tmp_path / "model.safetensors"))
    spec = CheckpointSpec.from_dir(tmp_path)
    assert len(plan_update(spec, {"model.embed_tokens.weight": emb, "lm_head.weight": emb})) == 1
    with pytest.raises(ValueError, match="'lm_head.weight'.*different values"):
        plan_update(spec, {"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1})


@pytest.mark.parametrize("bad, match", [
    (lambda s: {**s, "model.layers.0.mlp.experts.gate_up_proj": 3}, "expected a torch.Tensor, got int"),
    (lambda s: {**s, "model.norm.weight": s["model.norm.weight"].long()}, "'model.norm.weight': expected a floating"),
    (lambda s: {**s, "model.norm.weight": s["model.norm.weight"][:-1]}, r"'model.norm.weight': expected shape \[64\]"),
    (lambda s: {**s, "model.layers.1.mlp.experts.down_proj": s["model.layers.1.mlp.experts.down_proj"].transpose(1, 2)},
     r"'model.layers.1.mlp.experts.down_proj': expected shape \[E=8, H=64, I=32\]"),
    (lambda s: {**s, "model.layers.0.mlp.experts.gate_up_proj": s["model.layers.0.mlp.experts.gate_up_proj"][:4]},
     r"'model.layers.0.mlp.experts.gate_up_proj': expected shape \[E=8, 2I=64, H=64\]"),
    (lambda s: {**s, "model.layers.9.self_attn.q_proj.weight": torch.zeros(2, 2)},
     "unexpected tensor 'model.layers.9.self_attn.q_proj.weight'"),
    (lambda s: {k: v for k, v in s.items() if k != "model.embed_tokens.weight"},
     "missing 1 of the checkpoint's .* tensors: 'model.embed_tokens.weight'"),
])
def test_bad_updates_name_the_tensor(ckpt, bad, match):
    _, spec, state, _ = ckpt
    with pytest.raises((TypeError, ValueError), match=match):
        plan_update(spec, bad(dict(state)))


def test_buckets_round_trip_bitwise(ckpt, tmp_path):
    _, spec, state, _ = ckpt
    plan = plan_update(spec, state)
    paths = write_buckets(plan, tmp_path, bucket_bytes=100_000)
    assert len(paths) > 1 and all(p.startswith(str(tmp_path)) for p in paths)
    back = dict(read_buckets(paths))
    assert sorted(back) == sorted(n for n, _ in plan)
    assert all(torch.equal(t, back[n]) and t.dtype == back[n].dtype for n, t in plan)
    with pytest.raises(ValueError, match="bucket_bytes"):
        write_buckets(plan, tmp_path, bucket_bytes=0)
    with pytest.raises(ValueError, match="weight bucket 1: expected the path of a file"):
        read_buckets([paths[0], str(tmp_path / "missing.safetensors")])


def test_bucket_folder_is_private_and_prefers_shared_memory():
    import os
    import shutil

    from rollout.weights import bucket_folder

    small, huge = bucket_folder(1 << 20), bucket_folder(1 << 60)  # huge: no tmpfs has room for it
    try:
        assert os.stat(small).st_mode & 0o777 == 0o700 and os.stat(huge).st_mode & 0o777 == 0o700
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            assert str(small).startswith("/dev/shm/")
        assert not str(huge).startswith("/dev/shm/")
    finally:
        shutil.rmtree(small)
        shutil.rmtree(huge)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_check_counts_exactly_and_ignores_fp32_overflow_of_the_sum(ckpt, dtype):
    # The check sums in fp32 first: one NaN or Inf anywhere is caught and counted; finite values whose
    # sum overflows fp32 (3e38 + 3e38) are not mistaken for bad ones.
    _, spec, state, _ = ckpt
    name = "model.embed_tokens.weight"
    big = torch.full_like(state[name], 3e38, dtype=dtype).float()
    plan_update(spec, {**state, name: big})  # accepted
    g = torch.Generator().manual_seed(3)
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(state[name].shape, generator=g).to(dtype)
        idx = torch.randperm(t.numel(), generator=g)[:3]
        t.view(-1)[idx] = bad_value
        with pytest.raises(ValueError, match=rf"'{name}': 3 non-finite value\(s\)"):
            plan_update(spec, {**state, name: t})


def test_bucket_folder_removes_folders_of_dead_writers():
    import os
    import shutil
    import subprocess

    from rollout.weights import bucket_folder

    first = bucket_folder(1 << 20)
    base = first.parent
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    orphan = base / f"megamoe-weights-{dead.pid}-x"
    mine = base / f"megamoe-weights-{os.getpid()}-y"
    orphan.mkdir()
    mine.mkdir()
    second = None
    try:
        second = bucket_folder(1 << 20)
        assert not orphan.exists() and mine.exists() and first.exists() and second.exists()
        assert second.name.startswith(f"megamoe-weights-{os.getpid()}-")
    finally:
        for f in (first, mine, orphan, second):
            if f is not None:
                shutil.rmtree(f, ignore_errors=True)
