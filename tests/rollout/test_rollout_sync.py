"""CPU: the weight-sync seam (rollout/sync.py): transport selection, the metadata plan of a streamed
update, the streamed translation to on-disk names, and the config keys that choose them. The CUDA
IPC transfer itself runs in tests/rollout/test_rollout_sync_gpu.py (H200)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

from rl import config
from rollout.sync import resolve
from rollout.weights import CheckpointSpec, plan_metadata, to_checkpoint_names


@pytest.mark.parametrize("mode, colocated, on_gpu, same_gpu, want", [
    ("auto", True, True, True, "ipc"),
    ("auto", True, False, True, "files"),
    ("auto", False, True, False, "files"),  # nccl is opt-in until it has run on two GPUs
    ("ipc", True, True, True, "ipc"),
    ("nccl", False, True, False, "nccl"),
    ("nccl", True, True, False, "nccl"),  # colocated bundles, but each side with its own GPU
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


def test_config_takes_nccl_for_separate_gpus():
    cfg = config.load("configs/h200_rl.yaml", ["ray.placement=disaggregated", "rollout.weight_sync=nccl"])
    assert config.resolve_weight_sync(cfg) == "nccl"


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


def test_kernel_format_plan_keeps_each_layers_experts_whole(ckpt):
    _, spec, state, disk = ckpt
    plan = plan_metadata(spec, _metas(state), kernel_experts=True)
    groups = spec.expert_groups
    assert groups
    for prefix, g in groups.items():
        assert plan.pop(f"{prefix}.w13_weight") == ((g.num_experts, 2 * g.intermediate, g.hidden), "bfloat16")
        assert plan.pop(f"{prefix}.w2_weight") == ((g.num_experts, g.hidden, g.intermediate), "bfloat16")
    # everything else exactly as on disk, every expert tensor accounted for by the fused ones
    assert plan == {n: (tuple(t.shape), "bfloat16") for n, t in disk.items() if ".experts." not in n}


def test_kernel_format_stream_is_the_trainers_fused_tensors(ckpt):
    from rollout.weights import is_fused_experts, is_kernel_expert_name

    _, spec, state, disk = ckpt
    out = dict(to_checkpoint_names(spec, state.items(), kernel_experts=True))
    for prefix, g in spec.expert_groups.items():
        w13, w2 = out[f"{prefix}.w13_weight"], out[f"{prefix}.w2_weight"]
        assert w13.data_ptr() == state[f"{prefix}.gate_up_proj"].data_ptr()  # the tensor itself, no copy
        for e in range(g.num_experts):  # gate rows then up rows, as vLLM's w13 and megamoe read them
            assert torch.equal(w13[e, :g.intermediate], disk[g.name(e, g.gate)])
            assert torch.equal(w13[e, g.intermediate:], disk[g.name(e, g.up)])
            assert torch.equal(w2[e], disk[g.name(e, g.down)])
    assert {n for n in out if is_kernel_expert_name(n)} == {f"{p}.{s}" for p in spec.expert_groups
                                                           for s in ("w13_weight", "w2_weight")}
    assert {n for n in state if is_fused_experts(spec, n)} == {f"{p}.{k}" for p in spec.expert_groups
                                                              for k in ("gate_up_proj", "down_proj")}


class _FakeLLM:
    """vLLM's LLM as the streamed protocol sees it: records the calls, describes its parameters
    (RolloutWorker's megamoe_engine_params)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        if method == "megamoe_receive_kernel_chunk":
            return [{"map_s": 0.0}]
        return [self.engine if method == "megamoe_engine_params" else None]

    def init_weight_transfer_engine(self, request):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def finish_weight_update(self):
        self.calls.append("finish")

    def reset_prefix_cache(self):
        self.calls.append("reset")


def _protocol_worker(spec, engine_params, weight_sync="ipc", tensor_parallel_size=1):
    """A RolloutWorker's streamed-update protocol over a fake engine (the real methods, no vLLM)."""
    from rollout.worker import RolloutWorker

    w = object.__new__(RolloutWorker)
    w.__dict__.update(weight_sync=weight_sync, moe_impl="megamoe", tensor_parallel_size=tensor_parallel_size,
                      sync_format="auto",
                      spec=spec, _plan=None, _received=set(), _updating=False, _session=False,
                      _engine_params=None, _kernel_names={}, _last_plan=None, _asleep=set(), sleep_mode=False, _seconds={},
                      _transfer_group=None, _ipc_initialized=False,
                      _weights_broken=None, llm=_FakeLLM(engine_params))
    return w


QWEN3_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
"""vLLM's Qwen3MoeForCausalLM.packed_modules_mapping (vLLM 0.26 and 0.32)."""
BLOCKED = ["model.layers.0.self_attn.attn: (test) a layer that computes from its weights after loading"]


def _expert_params(spec, below="routed_experts"):
    return {f"{p}.{below}.{s}": (shape, "bfloat16") for p, g in spec.expert_groups.items()
            for s, shape in (("w13_weight", (g.num_experts, 2 * g.intermediate, g.hidden)),
                             ("w2_weight", (g.num_experts, g.hidden, g.intermediate)))}


def _vllm_params(spec, below="routed_experts"):
    """The parameters vLLM's Qwen3-MoE holds for this checkpoint at tensor_parallel_size 1: q/k/v
    packed into qkv_proj (rows q, k, v), each layer's experts fused below its experts module, the
    rest under the checkpoint's names."""
    params = _expert_params(spec, below)
    for name, shape in spec.shapes.items():
        if ".experts." in name:
            continue
        for shard in QWEN3_PACKED["qkv_proj"]:
            if f".{shard}." in name:
                name = name.replace(shard, "qkv_proj")
                rows = params.get(name, ((0,), None))[0][0]
                shape = (rows + shape[0],) + tuple(shape[1:])
        params[name] = (tuple(shape), "bfloat16")
    return params


def _engine_params(spec, below="routed_experts", blockers=BLOCKED, whole=False):
    """megamoe_engine_params of a megamoe engine: by default one that keeps checkpoint format for the
    non-expert weights (a blocker) and lists only its expert parameters; whole: every parameter."""
    experts = _expert_params(spec, below)
    return {"params": _vllm_params(spec, below) if whole else experts, "experts": sorted(experts),
            "packed": QWEN3_PACKED, "blockers": list(blockers)}


def _chunk(names, plan):
    return {"transport": "ipc", "names": names, "shapes": [list(plan[n][0]) for n in names], "dtype_names": [plan[n][1] for n in names],
            "tensor_sizes": [0] * len(names), "ipc_handles": {}}


def test_streamed_update_sends_kernel_experts_first_to_the_engines_own_parameters(ckpt):
    from rollout import adapter

    _, spec, state, _ = ckpt
    w = _protocol_worker(spec, _engine_params(spec))
    init = ["init"] if adapter.ipc_init_info() is not None else []  # vLLM 0.32's IPC handshake, once per engine
    for sync in range(2):
        info = w.plan_weight_update(_metas(state), start=True)  # plan and start: one call
        assert info.format == "experts" and info.tensors == len(w._plan) and w._updating
        assert BLOCKED[0] in info.why["kernel"] and info.layout is None
        kernel = [n for n in w._plan if n.endswith(("w13_weight", "w2_weight"))]
        rest = [n for n in w._plan if n not in kernel]
        # plan names map to the engine's parameters below each experts module
        assert all(w._kernel_names[n] == n.rsplit(".", 1)[0] + ".routed_experts." + n.rsplit(".", 1)[1]
                   for n in kernel)
        with pytest.raises(RuntimeError, match="update is in progress"):
            w.generate(["a prompt"])
        assert w.update_weight_chunk(_chunk(kernel, w._plan)) is None and w._updating
        done = w.update_weight_chunk(_chunk(rest, w._plan))  # the last planned tensors end the update
        assert not w._updating and done["tensors"] == len(w._kernel_names) + len(rest)
        # the engine's time per phase of this update, one entry per kind of engine call it made
        assert set(done["seconds"]) == {"wake", "reset_prefix_cache", "kernel", "kernel_map", "session_start",
                                        "reload", "session_finish"} and all(v >= 0 for v in done["seconds"].values())
        # the prefix cache is emptied as the update starts (nothing samples until it ends)
        assert w.llm.calls == ["megamoe_engine_params"] * (sync == 0) + [
            "reset", "megamoe_receive_kernel_chunk", *(init if sync == 0 else []), "start",
            "megamoe_update_weights", "finish"]
        w.llm.calls.clear()
        with pytest.raises(RuntimeError, match="no update started"):
            w.finish_weight_update()


def test_an_aborted_update_leaves_the_engine_as_it_was_or_broken_once_a_chunk_arrived(ckpt):
    _, spec, state, _ = ckpt
    w = _protocol_worker(spec, _engine_params(spec))
    w.abort_weight_update("nothing started")  # no update: nothing to end
    assert not w._updating and w._weights_broken is None
    w.plan_weight_update(_metas(state), start=True)
    w.abort_weight_update("the trainer refused it")
    assert not w._updating and w._weights_broken is None and w._plan is None
    w._refuse_while_updating("sample")  # serves its previous weights
    assert "start" not in w.llm.calls and "megamoe_receive_kernel_chunk" not in w.llm.calls

    w.plan_weight_update(_metas(state), start=True)
    kernel = [n for n in w._plan if n.endswith(("w13_weight", "w2_weight"))]
    rest = [n for n in w._plan if n not in kernel]
    w.update_weight_chunk(_chunk(kernel, w._plan))
    w.update_weight_chunk(_chunk(rest[:1], w._plan))  # vLLM's session open
    w.abort_weight_update("the trainer's stream failed")
    assert not w._updating and "aborted by the trainer: the trainer's stream failed" in w._weights_broken
    assert w.llm.calls.count("start") == w.llm.calls.count("finish") == 1  # vLLM's session ended
    with pytest.raises(RuntimeError, match="refusing to sample: .*aborted by the trainer"):
        w.generate(["a prompt"])
    w.plan_weight_update(_metas(state), start=True)  # a complete update repairs it
    w.update_weight_chunk(_chunk(kernel, w._plan))
    assert w.update_weight_chunk(_chunk(rest, w._plan))["tensors"] == len(kernel) + len(rest)
    assert w._weights_broken is None


@pytest.mark.parametrize("order, match", [
    ("mixed", "mixes kernel-format"),
    ("kernel_last", "must come first"),
    ("missing", "never arrived"),
])
def test_streamed_update_out_of_protocol_breaks_the_engine_until_a_complete_one(ckpt, order, match):
    _, spec, state, _ = ckpt
    w = _protocol_worker(spec, _engine_params(spec))
    w.plan_weight_update(_metas(state))
    kernel = [n for n in w._plan if n.endswith(("w13_weight", "w2_weight"))]
    rest = [n for n in w._plan if n not in kernel]
    w.start_weight_update()
    with pytest.raises(RuntimeError, match=match):
        if order == "mixed":
            w.update_weight_chunk(_chunk(kernel[:1] + rest[:1], w._plan))
        elif order == "kernel_last":
            w.update_weight_chunk(_chunk(rest, w._plan))
            w.update_weight_chunk(_chunk(kernel, w._plan))
        else:
            w.update_weight_chunk(_chunk(kernel, w._plan))
            w.finish_weight_update()
    assert w._weights_broken and not w._updating
    assert w.llm.calls.count("start") == w.llm.calls.count("finish")  # vLLM's session never left open


def _edit_experts(engine, edit):
    params = edit(engine["params"])
    return {**engine, "params": params, "experts": sorted(params)}


@pytest.mark.parametrize("edit, match", [
    (lambda p: {k.replace(".experts.", ".elsewhere."): v for k, v in p.items()}, "found none"),
    (lambda p: {**p, **{k.replace("routed_experts", "other"): v for k, v in p.items()}}, "expected one"),
    (lambda p: {k: ((1,) + v[0][1:], v[1]) for k, v in p.items()}, "the update brings"),
])
def test_kernel_plan_refuses_engine_parameters_that_do_not_fit(ckpt, edit, match):
    _, spec, state, _ = ckpt
    w = _protocol_worker(spec, _edit_experts(_engine_params(spec), edit))
    with pytest.raises(ValueError, match=match):
        w.plan_weight_update(_metas(state))
    assert w._plan is None and w.llm.calls == ["megamoe_engine_params"]  # nothing else happened


class _CheckedTrainer:
    """What rollout.sync.send_ipc asks of a trainer before any byte moves (one rank)."""

    rank = 0

    def __init__(self, metas, bad=()):
        self.metas, self.bad = metas, list(bad)

    def sync_dtype(self, dtype):
        return dtype

    def nonfinite_weights(self, dtype):
        return self.bad

    def weight_metadata(self, dtype):
        return self.metas

    def iter_device_weights(self, select=None, names=None):
        raise AssertionError("a refused sync must not read the weights")


@pytest.mark.parametrize("case, match", [
    ("nonfinite", "hold NaN/Inf in bfloat16"),
    ("shape", "model.layers.0.self_attn.o_proj.weight"),
    ("bucket", "rollout.ipc_bucket_bytes"),
])
def test_ipc_sync_refuses_before_the_engine_starts_an_update(ckpt, case, match):
    from rollout.sync import LocalClient, send_ipc

    _, spec, state, _ = ckpt
    metas = _metas(state)
    if case == "shape":
        metas = [(n, [s[0] + 1] + s[1:] if n == "model.layers.0.self_attn.o_proj.weight" else s, d)
                 for n, s, d in metas]
    trainer = _CheckedTrainer(metas, bad=["model.layers.1.mlp.experts.down_proj"] if case == "nonfinite" else ())
    w = _protocol_worker(spec, _engine_params(spec))
    with pytest.raises(ValueError, match=match):
        send_ipc(trainer, LocalClient(w), model_dir=str(spec.model_dir), dtype="bfloat16",
                 bucket_bytes=1024 if case == "bucket" else 1 << 30)
    # the engines' update, started while the trainer checked, is aborted: nothing applied, nothing broken
    assert not w._updating and w._weights_broken is None
    assert "start" not in w.llm.calls and not any("receive" in c for c in w.llm.calls)


def test_engine_reuses_a_plan_only_for_the_same_update(ckpt):
    _, spec, state, _ = ckpt
    w = _protocol_worker(spec, _engine_params(spec))
    first = w.plan_weight_update(_metas(state))
    calls = list(w.llm.calls)
    assert w.plan_weight_update(_metas(state)) == first and w.llm.calls == calls
    bad = [(n, [s[0] + 1] + s[1:] if n.endswith("o_proj.weight") else s, d) for n, s, d in _metas(state)]
    with pytest.raises(ValueError, match="o_proj.weight"):
        w.plan_weight_update(bad)
    with pytest.raises(ValueError, match="o_proj.weight"):  # the refused one was not remembered
        w.plan_weight_update(bad)
    assert w.plan_weight_update(_metas(state)) == first


# -- kernel format: every tensor as the engine's own parameter (rollout/kernel_format.py) -------------

def _vllm_tensor(spec, disk, name):
    """What vLLM holds in parameter `name` after loading the checkpoint (`_vllm_params`' layout), from
    the checkpoint's own tensors on disk."""
    if name.endswith("qkv_proj.weight"):
        return torch.cat([disk[name.replace("qkv_proj", s)] for s in QWEN3_PACKED["qkv_proj"]])
    prefix, below, kind = name.rsplit(".", 2) if ".experts." in name else (None, None, None)
    if kind in ("w13_weight", "w2_weight"):
        g = spec.expert_groups[prefix]
        if kind == "w2_weight":
            return torch.stack([disk[g.name(e, g.down)] for e in range(g.num_experts)])
        return torch.stack([torch.cat([disk[g.name(e, g.gate)], disk[g.name(e, g.up)]]) for e in range(g.num_experts)])
    return disk[name]


def test_kernel_layout_packs_q_k_v_into_qkv_and_fills_every_engine_parameter(ckpt):
    from rollout.kernel_format import kernel_layout

    _, spec, state, disk = ckpt
    plan = plan_metadata(spec, _metas(state), kernel_experts=True)
    engine = _vllm_params(spec)
    layout = kernel_layout(plan, engine, QWEN3_PACKED)
    assert sorted(n for n, *_ in layout) == sorted(engine)  # every engine parameter, once
    for name, shape, dtype, parts in layout:
        assert (shape, dtype) == engine[name], name
        if name.endswith("qkv_proj.weight"):
            assert parts == [name.replace("qkv_proj", s) for s in ("q_proj", "k_proj", "v_proj")]
        elif ".experts." in name:
            assert parts == [name.replace(".routed_experts", "")]
        else:
            assert parts == [name]
    assert sum(len(p) for *_, p in layout) == len(plan)  # every update tensor lands somewhere


@pytest.mark.parametrize("edit, match", [
    (lambda e: {k: v for k, v in e.items() if "layers.1.self_attn.qkv_proj" not in k}, "no shard of|does not have"),
    (lambda e: {**e, "model.layers.0.mlp.shared.weight": ((4, 4), "bfloat16")}, "get nothing"),
    (lambda e: {k.replace("o_proj", "out_proj"): v for k, v in e.items()}, "no parameter of that name"),
    (lambda e: {k: ((v[0][0] + 8,) + v[0][1:], v[1]) if "qkv_proj" in k else v for k, v in e.items()}, "rows"),
    (lambda e: {k: (v[0][:1] + (v[0][1] + 1,), v[1]) if k.endswith("o_proj.weight") else v for k, v in e.items()},
     "o_proj.weight' is"),
    (lambda e: {k: (v[0], "float32") if k.endswith("norm.weight") else v for k, v in e.items()}, "is float32"),
])
def test_kernel_layout_refuses_an_engine_it_cannot_fill_naming_the_parameter(ckpt, edit, match):
    from rollout.kernel_format import kernel_layout

    _, spec, state, _ = ckpt
    plan = plan_metadata(spec, _metas(state), kernel_experts=True)
    with pytest.raises(ValueError, match=match):
        kernel_layout(plan, edit(_vllm_params(spec)), QWEN3_PACKED)


def test_kernel_layout_takes_a_padded_vocabulary_but_no_partial_shards(ckpt):
    from rollout.kernel_format import kernel_layout, kernel_targets

    _, spec, state, _ = ckpt
    plan = plan_metadata(spec, _metas(state), kernel_experts=True)
    engine = _vllm_params(spec)
    rows, hidden = engine["model.embed_tokens.weight"][0]
    padded = {**engine, "model.embed_tokens.weight": ((rows + 64, hidden), "bfloat16")}
    got = {n: shape for n, shape, _, _ in kernel_layout(plan, padded, QWEN3_PACKED)}
    assert got["model.embed_tokens.weight"] == (rows, hidden)  # the leading rows; the padding stays
    without_v = [n for n in plan if not n.endswith("v_proj.weight")]
    with pytest.raises(ValueError, match=r"shards \[0, 1\] of 3"):
        kernel_targets(without_v, engine, QWEN3_PACKED)


class _KernelFakeLLM(_FakeLLM):
    """An engine that takes kernel-format chunks: what each parameter would receive, read from the
    (CPU) buffer the trainer packed, at the offsets the chunk's update info gives."""

    def __init__(self, engine, buffer):
        super().__init__(engine)
        self.buffer, self.received = buffer, {}

    def init_weight_transfer_engine(self, request):
        self.calls.append("init")

    def collective_rpc(self, method, args=()):
        if method == "megamoe_receive_kernel_chunk":
            import pickle

            info, at = pickle.loads(args[0]), 0
            for name, shape, dtype, size in zip(info["names"], info["shapes"], info["dtype_names"],
                                                info["tensor_sizes"]):
                self.received[name] = self.buffer[at:at + size].view(getattr(torch, dtype)).view(shape).clone()
                at += size
        return super().collective_rpc(method, args)


@pytest.fixture
def kernel_engine(ckpt, monkeypatch):
    """(an engine taking every tensor in kernel format, a bucket as large as its largest parameter
    (a w13): several chunks per sync), with IPCBuffer's packing over a CPU tensor (no CUDA here)."""
    from rollout import sync

    _, spec, _, _ = ckpt
    buf = object.__new__(sync.IPCBuffer)
    buf.__dict__.update(nbytes=1 << 20, tensor=torch.empty(1 << 20, dtype=torch.uint8), handle={},
                        multi_rank=False)
    monkeypatch.setattr(sync, "ipc_buffer", lambda nbytes: buf)
    w = _protocol_worker(spec, None)
    w.llm = _KernelFakeLLM(_engine_params(spec, blockers=(), whole=True), buf.tensor)
    return w, max(math.prod(shape) * 2 for shape, _ in _vllm_params(spec).values())


def test_kernel_format_sync_gives_each_engine_parameter_its_loaded_value_without_vllms_reload(ckpt, kernel_engine):
    from rollout.sync import LocalClient, send_ipc

    _, spec, state, disk = ckpt
    w, bucket = kernel_engine
    with pytest.raises(ValueError, match="rollout.ipc_bucket_bytes: tensor .* is 65536 bytes"):  # before any chunk
        send_ipc(_StreamTrainer(state), LocalClient(w), model_dir=str(spec.model_dir), dtype="bfloat16",
                 bucket_bytes=bucket - 2)
    assert "megamoe_receive_kernel_chunk" not in w.llm.calls and not w._updating and w._weights_broken is None
    w.llm.calls.clear()
    out = send_ipc(_StreamTrainer(state), LocalClient(w), model_dir=str(spec.model_dir), dtype="bfloat16",
                   bucket_bytes=bucket)
    assert out.format == "kernel" and out.why == {} and out.chunks > 1
    got = w.llm.received
    assert sorted(got) == sorted(_vllm_params(spec))
    for name, t in got.items():  # bit for bit what vLLM's loader makes of the checkpoint, in bf16
        assert t.dtype == torch.bfloat16 and torch.equal(t, _vllm_tensor(spec, disk, name).to(torch.bfloat16)), name
    # no vLLM update session (its layer-wise reload): the prefix cache reset as it starts, then the chunks
    assert w.llm.calls == ["reset"] + ["megamoe_receive_kernel_chunk"] * out.chunks and not w._updating
    assert out.sent_bytes == out.bytes == sum(t.numel() * 2 for t in got.values())


@pytest.mark.parametrize("fmt, engine, match", [
    ("kernel", dict(), "sync_format: 'kernel' cannot load into this engine: 1 layer"),
    ("experts", dict(below="routed_experts"), None),
    ("bogus", dict(), "sync_format: expected one of"),
])
def test_an_asked_format_is_taken_or_refused_naming_why(ckpt, fmt, engine, match):
    _, spec, state, _ = ckpt
    w = _protocol_worker(spec, _engine_params(spec, **engine))
    w.sync_format = fmt
    if match is None:
        assert w.plan_weight_update(_metas(state)).format == fmt
        return
    with pytest.raises(ValueError, match=match):
        w.plan_weight_update(_metas(state))
    assert w._plan is None


def test_auto_says_why_it_left_kernel_format(ckpt):
    _, spec, state, _ = ckpt
    engine = _engine_params(spec, blockers=(), whole=True)
    engine["params"]["model.layers.0.mlp.shared_expert_gate.weight"] = ((1, 4), "bfloat16")  # nothing fills it
    w = _protocol_worker(spec, engine)
    info = w.plan_weight_update(_metas(state))
    assert info.format == "experts" and "shared_expert_gate" in info.why["kernel"]
    w.sync_format = "kernel"
    with pytest.raises(ValueError, match="get nothing"):
        w.plan_weight_update(_metas(state))


# -- nccl: what the CPU can check of the separate-GPU path (its run needs two GPUs) ------------------

def test_nccl_world_puts_the_trainer_first_then_each_engines_workers():
    from records.weights import EngineAnswer
    from rollout.sync_nccl import nccl_world

    def answer(workers):
        return EngineAnswer(format="checkpoint", layout=None, why={}, bytes=1, workers=workers)

    assert nccl_world([answer(1)]) == (2, [1])
    assert nccl_world([answer(2), answer(1), answer(4)]) == (8, [1, 3, 4])


def test_nccl_stream_metadata_is_the_checkpoint_stream_in_order(ckpt):
    from rollout.sync_nccl import checkpoint_metadata

    _, spec, state, disk = ckpt
    got = checkpoint_metadata(spec, _metas(state, "bfloat16"))
    want = [(n, list(t.shape), "bfloat16") for n, t in to_checkpoint_names(spec, state.items())]
    assert got == want
    assert sorted(n for n, _, _ in got) == sorted(disk)  # every on-disk tensor once, per expert


class _NcclFakeLLM(_FakeLLM):
    """The engine's side of an NCCL sync: its init handshake and receive calls, recorded."""

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request["init_info"]["master_port"], request["init_info"]["rank_offset"]))


class _StreamTrainer(_CheckedTrainer):
    def __init__(self, state, bad=()):
        super().__init__(None, bad)
        self.state = state

    def weight_metadata(self, dtype):
        return _metas(self.state, dtype or "float32")

    def iter_device_weights(self, select=None, names=None):
        if names is not None:
            return ((n, self.state[n]) for n in names)
        return ((n, t) for n, t in self.state.items() if select is None or select(n))


class _FailingStreamTrainer(_StreamTrainer):
    """A trainer whose weight stream raises after `after` tensors (a gather or cast failing mid-sync)."""

    def __init__(self, state, after):
        super().__init__(state)
        self.after = after

    def iter_device_weights(self, select=None, names=None):
        for i, pair in enumerate(super().iter_device_weights(select, names)):
            if i == self.after:
                raise RuntimeError("injected: CUDA out of memory while gathering")
            yield pair


@pytest.mark.parametrize("after, broken", [(0, False), (12, True)])
def test_ipc_sync_failing_mid_stream_aborts_the_engines_update(ckpt, kernel_engine, after, broken):
    """The trainer's stream fails after the engines started the update: before any chunk reached
    them they keep serving their previous weights; after one, they refuse to sample until a complete
    sync (and the next sync is accepted, not refused as overlapping an unfinished one)."""
    from rollout.sync import LocalClient, send_ipc

    _, spec, state, _ = ckpt
    w, bucket = kernel_engine
    with pytest.raises(RuntimeError, match="injected: CUDA out of memory"):
        send_ipc(_FailingStreamTrainer(state, after), LocalClient(w), model_dir=str(spec.model_dir),
                 dtype="bfloat16", bucket_bytes=bucket)
    assert not w._updating and ("megamoe_receive_kernel_chunk" in w.llm.calls) == broken
    assert (w._weights_broken is not None) == broken
    if broken:
        assert "aborted by the trainer: the trainer's stream failed: RuntimeError" in w._weights_broken
    out = send_ipc(_StreamTrainer(state), LocalClient(w), model_dir=str(spec.model_dir), dtype="bfloat16",
                   bucket_bytes=bucket)
    assert out.format == "kernel" and not w._updating and w._weights_broken is None


@pytest.fixture
def nccl_wire(monkeypatch):
    """The trainer's end of vLLM's NCCL protocol (rollout.sync_nccl's trainer_group and broadcast)
    replaced by recorders: the group rank 0 opens, what it broadcasts. The engine's side is the real
    RolloutWorker building vLLM's init and update info (rollout.adapter) over a fake LLM."""
    from rollout import sync_nccl

    sent, groups = [], []
    monkeypatch.setattr(sync_nccl, "trainer_group", lambda a, p, ws: groups.append((p, ws)) or f"group{len(groups)}")
    monkeypatch.setattr(sync_nccl, "broadcast", lambda g, stream, dt, b, n: sent.append(
        (g, [(name, t.to(dt) if dt else t) for name, t in stream])))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(sync_nccl, "_NCCL", {})
    return sent, groups


def test_nccl_sync_joins_once_then_streams_the_checkpoint_to_every_engine(ckpt, nccl_wire):
    from rollout.sync import LocalClient
    from rollout.sync_nccl import send_nccl

    _, spec, state, disk = ckpt
    sent, groups = nccl_wire
    engines = [_protocol_worker(spec, None, "nccl", tensor_parallel_size=tp) for tp in (1, 2)]
    for w in engines:
        w.llm = _NcclFakeLLM(None)
    trainer = _StreamTrainer(state)
    out = send_nccl(trainer, LocalClient(*engines), model_dir=str(spec.model_dir), dtype="bfloat16")
    (port, world), = groups
    assert world == 4  # the trainer, then engine 0's one worker, then engine 1's two
    assert [c for c in engines[0].llm.calls if isinstance(c, tuple)] == [("init", port, 1)]
    assert [c for c in engines[1].llm.calls if isinstance(c, tuple)] == [("init", port, 2)]
    (group, tensors), = sent
    assert group == "group1"
    # what rank 0 broadcast is the checkpoint, per expert, cast to the sampler's dtype, bit for bit
    assert sorted(n for n, _ in tensors) == sorted(disk)
    for name, t in tensors:
        assert t.dtype == torch.bfloat16 and torch.equal(t, disk[name].to(torch.bfloat16)), name
    for w in engines:  # the engines' protocol: one update through vLLM's session, then reset
        assert [c for c in w.llm.calls if not isinstance(c, tuple)] == ["reset", "start", "megamoe_update_weights",
                                                                         "finish"]
        assert not w._updating and w._weights_broken is None
    assert out.format == "checkpoint" and out.bytes == sum(t.numel() * 2 for _, t in tensors)
    assert {"check", "plan", "join", "send", "finish"} <= set(out.seconds)

    send_nccl(trainer, LocalClient(*engines), model_dir=str(spec.model_dir), dtype="bfloat16")
    assert len(groups) == 1 and sent[1][0] == "group1"  # the group is kept between syncs

    # a restarted engine (never joined) and a sync to a subset: a new group each time, never a stale one
    engines[1] = _protocol_worker(spec, None, "nccl", tensor_parallel_size=2)
    engines[1].llm = _NcclFakeLLM(None)
    send_nccl(trainer, LocalClient(*engines), model_dir=str(spec.model_dir), dtype="bfloat16")
    assert len(groups) == 2 and groups[1][1] == 4 and sent[2][0] == "group2"
    send_nccl(trainer, LocalClient(engines[0]), model_dir=str(spec.model_dir), dtype="bfloat16")
    assert len(groups) == 3 and groups[2][1] == 2


@pytest.mark.parametrize("case, match", [
    ("nonfinite", "hold NaN/Inf in bfloat16"),
    ("kernel", "kernel-format tensors"),
    ("bucket", "rollout.ipc_bucket_bytes"),
])
def test_nccl_sync_refuses_before_any_group_or_update(ckpt, nccl_wire, case, match):
    from rollout.sync import LocalClient
    from rollout.sync_nccl import send_nccl

    _, spec, state, _ = ckpt
    sent, groups = nccl_wire
    w = _protocol_worker(spec, _engine_params(spec), "ipc" if case == "kernel" else "nccl")
    w.llm = _NcclFakeLLM(_engine_params(spec))
    trainer = _StreamTrainer(state, bad=["model.layers.0.mlp.gate.weight"] if case == "nonfinite" else ())
    with pytest.raises(ValueError, match=match):
        send_nccl(trainer, LocalClient(w), model_dir=str(spec.model_dir), dtype="bfloat16",
                  bucket_bytes=1024 if case == "bucket" else 1 << 30)
    assert not groups and not sent and not w._updating and w._weights_broken is None
    assert not [c for c in w.llm.calls if c not in ("megamoe_engine_params", "reset")]


# -- vLLM's wire, built on the engine's side for the vLLM that runs (rollout/vllm_surface.py) --------

def _release(**fields):
    """rollout.vllm_surface.VLLM as another release would decide it (0.26: the packed flags in each update)."""
    import dataclasses

    from rollout.vllm_surface import VLLM

    return dataclasses.replace(VLLM, **fields)


def test_the_engine_builds_vllms_update_info_from_the_trainers_chunk_for_each_release(monkeypatch):
    import dataclasses

    from rollout import adapter
    from records.weights import PackedChunk, ipc_chunk, nccl_chunk, nccl_join
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo

    chunk = PackedChunk(names=["a.weight"], shapes=[[2, 3]], dtype_names=["bfloat16"], tensor_sizes=[12])
    ipc = ipc_chunk(chunk, {"gpu-uuid": ("rebuild", "args")})
    metas = [("a.weight", [2, 3], "bfloat16"), ("b.weight", [3], "bfloat16")]
    nccl, join = nccl_chunk(metas, 1 << 20, 2), nccl_join("10.0.0.1", 5000, 1, 3, 1 << 20, 2)
    packed = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
    meta = {"names": ["a.weight"], "shapes": [[2, 3]], "dtype_names": ["bfloat16"]}
    rendezvous = {"master_address": "10.0.0.1", "master_port": 5000, "rank_offset": 1, "world_size": 3}

    # the installed vLLM (0.32): the packed flags at init; its own dataclasses take what is built
    assert (adapter.VLLM.ipc_packed_at_init, adapter.VLLM.ipc_packed_in_update) == (True, False)
    assert (adapter.VLLM.nccl_packed_at_init, adapter.VLLM.nccl_packed_in_update) == (True, False)
    assert adapter.ipc_init_info() == {"packed": True}
    assert adapter.vllm_update_info(ipc) == {**meta, "tensor_sizes": [12], "ipc_handles": ipc["ipc_handles"]}
    assert adapter.vllm_update_info(nccl) == {"names": ["a.weight", "b.weight"], "shapes": [[2, 3], [3]],
                                              "dtype_names": ["bfloat16", "bfloat16"]}
    assert adapter.nccl_init_info(join) == {**rendezvous, **packed}
    for cls, info in ((IPCWeightTransferUpdateInfo, adapter.vllm_update_info(ipc)),
                      (NCCLWeightTransferUpdateInfo, adapter.vllm_update_info(nccl)),
                      (NCCLWeightTransferInitInfo, adapter.nccl_init_info(join))):
        assert set(info) <= {f.name for f in dataclasses.fields(cls)}, cls

    # vLLM 0.26 (the GPU machine's bundle, not installed here): the flags travel in each update
    monkeypatch.setattr(adapter, "VLLM", _release(ipc_packed_at_init=False, nccl_packed_at_init=False,
                                                  ipc_packed_in_update=True, nccl_packed_in_update=True))
    assert adapter.ipc_init_info() is None
    assert adapter.vllm_update_info(ipc) == {**meta, "tensor_sizes": [12], "ipc_handles": ipc["ipc_handles"],
                                             "packed": True}
    assert adapter.vllm_update_info(nccl)["packed_buffer_size_bytes"] == 1 << 20
    assert adapter.nccl_init_info(join) == rendezvous

    monkeypatch.setattr(adapter, "VLLM", _release(nccl_engine=False))
    with pytest.raises(NotImplementedError, match="no NCCL weight-transfer engine .*nccl_engine is False"):
        adapter.vllm_update_info(nccl)
    with pytest.raises(ValueError, match="'transport' expected 'ipc' or 'nccl', got 'shm'"):
        adapter.vllm_update_info({**ipc, "transport": "shm"})


def test_an_ipc_engine_on_a_release_reading_packed_per_update_makes_no_init_handshake(ckpt, monkeypatch):
    from rollout import adapter

    _, spec, state, _ = ckpt
    monkeypatch.setattr(adapter, "VLLM", _release(ipc_packed_at_init=False, ipc_packed_in_update=True))
    w = _protocol_worker(spec, _engine_params(spec))
    w.plan_weight_update(_metas(state), start=True)
    kernel = [n for n in w._plan if n.endswith(("w13_weight", "w2_weight"))]
    sent, rpc = [], w.llm.collective_rpc

    def recording_rpc(method, args=()):
        import pickle

        if method == "megamoe_update_weights":
            sent.append(pickle.loads(args[0]))
        return rpc(method, args)

    w.llm.collective_rpc = recording_rpc
    w.update_weight_chunk(_chunk(kernel, w._plan))
    w.update_weight_chunk(_chunk([n for n in w._plan if n not in kernel], w._plan))
    assert "init" not in w.llm.calls and "start" in w.llm.calls and w._weights_broken is None
    assert [info.get("packed") for info in sent] == [True] and "transport" not in sent[0]


def test_version_probes_live_in_one_module():
    """No rollout module but rollout/vllm_surface.py reads vLLM's version or probes it for a feature
    (a signature, an import that may fail); each reads the decision from rollout.vllm_surface.VLLM."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "rollout"
    found = []
    for path in sorted(root.glob("*.py")):
        if path.name in ("vllm_surface.py", "invariant_kernels.py"):  # the surface; a refusal, not a branch
            continue
        src = path.read_text()
        found += [(path.name, w) for w in ("__version__", "inspect.signature", "dataclasses.fields(IPC",
                                          "dataclasses.fields(NCCL", "startswith(\"0.") if w in src]
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Try) and any(getattr(h.type, "id", None) == "ImportError" for h in node.handlers):
                imports = [n for b in node.body for n in ast.walk(b) if isinstance(n, ast.ImportFrom)]
                found += [(path.name, f"try: from {n.module}") for n in imports if (n.module or "").startswith("vllm")]
    assert found == []


# -- ipc, published: the trainer packs version v once, each engine takes it later ----------------------

class _RegionFakeLLM(_FakeLLM):
    """An engine taking kernel-format chunks from a published buffer: what each parameter receives,
    read from the region the chunk's handle names ((buffer, offset, bytes): the CPU stand-in for a
    CUDA IPC handle of a view), as vLLM's worker reads it from byte 0 of the mapped view. `fail_at`:
    the chunk (counted from 0) whose copy raises, as a CUDA error would."""

    def __init__(self, engine, buffers, fail_at=None):
        super().__init__(engine)
        self.buffers, self.received, self.fail_at, self.chunks = buffers, {}, fail_at, 0

    def collective_rpc(self, method, args=()):
        if method == "megamoe_receive_kernel_chunk":
            import pickle

            info = pickle.loads(args[0])
            if self.chunks == self.fail_at:
                self.fail_at = None  # once
                raise RuntimeError("injected: CUDA error while copying a chunk")
            self.chunks += 1
            which, offset, nbytes = info["ipc_handles"]["region"]
            region, at = self.buffers[which][offset:offset + nbytes], 0
            assert sum(info["tensor_sizes"]) == nbytes
            for name, shape, dtype, size in zip(info["names"], info["shapes"], info["dtype_names"],
                                                info["tensor_sizes"]):
                self.received[name] = region[at:at + size].view(getattr(torch, dtype)).view(shape).clone()
                at += size
        return super().collective_rpc(method, args)


@pytest.fixture
def published(ckpt, monkeypatch):
    """(make_engine(fail_at=None) -> an engine taking every tensor in kernel format from published
    buffers, the bucket (several chunks per version), the trainer's buffers as made): the trainer's
    buffers on the CPU (no CUDA here), each region's handle naming (buffer, offset, bytes); this
    test's PublishedSlots fresh."""
    from rollout import sync

    _, spec, _, _ = ckpt
    buffers = []

    def new_buffer(nbytes):
        buf = object.__new__(sync.IPCBuffer)
        tensor = torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # not zeros: an unwritten byte shows
        which = len(buffers)
        buffers.append(tensor)
        buf.__dict__.update(nbytes=nbytes, tensor=tensor, handle={}, multi_rank=False,
                            region_handles=lambda regions: [{"region": (which, at, n)} for at, n in regions])
        return buf

    monkeypatch.setattr(sync, "new_ipc_buffer", new_buffer)
    monkeypatch.setattr(sync, "_PUBLISHED", {})

    def make_engine(fail_at=None):
        w = _protocol_worker(spec, None)
        w.llm = _RegionFakeLLM(_engine_params(spec, blockers=(), whole=True), buffers, fail_at)
        return w

    return make_engine, max(math.prod(shape) * 2 for shape, _ in _vllm_params(spec).values()), buffers


def _kernel_values(state, layout):
    """What each engine parameter of a kernel-format layout holds for the trainer's `state`: its
    trainer tensors concatenated along dim 0, in bf16 (the ground truth, from the state itself)."""
    return {name: torch.cat([state[p] for p in parts]).to(torch.bfloat16) for name, _, _, parts in layout}


def _publisher(spec, bucket, depth):
    from rollout.sync import sender

    return sender("ipc", model_dir=str(spec.model_dir), dtype="bfloat16", bucket_bytes=bucket, depth=depth)


def _trained_further(state, seed):
    """The trainer's state after another step: every tensor moved by seeded noise (fp32)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in state.items()}


def test_one_engine_takes_a_published_version_whole_from_the_trainers_buffer(ckpt, published):
    from rollout.sync_interface import LocalClient

    _, spec, state, disk = ckpt
    make_engine, bucket, _ = published
    w = make_engine()
    pub = _publisher(spec, bucket, depth=1).publish(_StreamTrainer(state), LocalClient(w), version=1)
    assert pub.mode == "ipc" and pub.version == 1 and pub.payload["format"] == "kernel"
    assert len(pub.payload["chunks"]) > 1 and pub.payload["engines"] == 1
    assert not w._updating and w.llm.received == {}  # publishing applies nothing: the engine plans, no more
    report = w.take_weights(pub)
    assert report["version"] == 1 and report["format"] == "kernel" and not w._updating
    assert report["tensors"] == len(_vllm_params(spec)) and w._weights_broken is None
    for name, t in w.llm.received.items():  # bit for bit what vLLM's loader makes of the checkpoint, in bf16
        assert torch.equal(t, _vllm_tensor(spec, disk, name).to(torch.bfloat16)), name


def test_a_version_that_fits_one_bucket_is_published_as_one_chunk(ckpt, published):
    """rollout.ipc_bucket_bytes larger than the whole update (configs/h200_rl.yaml's 2 GiB for a 1.66 GB model):
    the planned chunk is the update rounded up to MiB, more than its bytes; the published buffer holds it (a
    buffer sized by the bytes alone refused the chunk on an H100, 2026-12-07)."""
    from rollout.sync_interface import LocalClient

    _, spec, state, disk = ckpt
    make_engine, _, _ = published
    w = make_engine()
    pub = _publisher(spec, 1 << 30, depth=1).publish(_StreamTrainer(state), LocalClient(w), version=3)
    assert len(pub.payload["chunks"]) == 1
    assert w.take_weights(pub)["version"] == 3
    for name, t in w.llm.received.items():
        assert torch.equal(t, _vllm_tensor(spec, disk, name).to(torch.bfloat16)), name


def test_two_engines_each_take_exactly_their_version_after_the_trainer_trained_further(ckpt, published):
    """Lag 1: version 1 is published, the trainer trains and publishes version 2 into the other
    buffer before engine 0 took version 1; engine 0 still gets version 1 bit for bit, engine 1
    version 2, then engine 0 version 2. The engines' plan is asked once per update description."""
    from rollout import sync
    from rollout.sync_interface import LocalClient

    _, spec, state, _ = ckpt
    make_engine, bucket, _ = published
    w0, w1 = make_engine(), make_engine()
    asked = []

    class Client(LocalClient):
        def ask_plans(self, metas):
            asked.append(len(metas))
            return super().ask_plans(metas)

    client, sender = Client(w0, w1), _publisher(spec, bucket, depth=2)
    v1 = {n: t.clone() for n, t in state.items()}
    trainer = _StreamTrainer(v1)
    pub1 = sender.publish(trainer, client, version=1)
    v2 = _trained_further(v1, seed=11)
    trainer.state = v2
    pub2 = sender.publish(trainer, client, version=2)
    assert asked == [len(state)] and pub1.payload["engines"] == 2
    layout = pub1.payload["layout"]
    want1, want2 = _kernel_values(v1, layout), _kernel_values(v2, layout)
    assert any(not torch.equal(want1[n], want2[n]) for n in want1)  # the versions differ in bf16

    assert w0.take_weights(pub1)["version"] == 1
    assert w1.take_weights(pub2)["version"] == 2
    for w, want in ((w0, want1), (w1, want2)):
        assert sorted(w.llm.received) == sorted(want)
        for name, t in w.llm.received.items():
            assert torch.equal(t, want[name]), name
    reports = [w0.take_weights(pub2), w1.take_weights(pub2)]
    assert all(torch.equal(t, want2[n]) for n, t in w0.llm.received.items())
    sync.release(pub2, reports)
    with pytest.raises(ValueError, match="reports: version 1 was published for 2 engine"):
        sync.release(pub1, [None])
    sync.release(pub1, [None, {"version": 1}])  # None: an engine whose take failed no longer reads it
    sender.publish(trainer, client, version=3)  # both buffers free again


def test_a_publish_into_a_buffer_not_every_engine_took_is_refused_before_writing(ckpt, published):
    from rollout import sync
    from rollout.sync_interface import LocalClient

    _, spec, state, _ = ckpt
    make_engine, bucket, buffers = published
    w = make_engine()
    sender, trainer = _publisher(spec, bucket, depth=1), _StreamTrainer(state)
    pub1 = sender.publish(trainer, LocalClient(w), version=1)
    before = buffers[0].clone()
    trainer.state = _trained_further(state, seed=12)
    with pytest.raises(RuntimeError, match="cannot publish version 2: .* still holds version 1, which not every "
                                           "engine has taken"):
        sender.publish(trainer, LocalClient(w), version=2)
    assert len(buffers) == 1 and torch.equal(buffers[0], before)  # version 1's bytes untouched
    report = w.take_weights(pub1)
    with pytest.raises(ValueError, match=r"reports: releasing version 1, but engines reported taking \[2\]"):
        sync.release(pub1, [{**report, "version": 2}])
    sync.release(pub1, [report])
    with pytest.raises(ValueError, match="version: 1 is not published and held"):
        sync.release(pub1, [report])
    pub2 = sender.publish(trainer, LocalClient(w), version=2)
    assert not torch.equal(buffers[0], before) and w.take_weights(pub2)["version"] == 2


def test_a_nonfinite_version_is_refused_before_its_buffer_is_claimed(ckpt, published):
    from rollout.sync_interface import LocalClient

    _, spec, state, _ = ckpt
    make_engine, bucket, buffers = published
    w = make_engine()
    sender = _publisher(spec, bucket, depth=1)
    with pytest.raises(ValueError, match="hold NaN/Inf in bfloat16"):
        sender.publish(_StreamTrainer(state, bad=["model.norm.weight"]), LocalClient(w), version=1)
    assert buffers == [] and w.llm.calls == []  # nothing written, the engines not asked
    assert sender.publish(_StreamTrainer(state), LocalClient(w), version=1) is not None  # the slot is free


def _tamper(pub, case):
    chunks = [dict(c) for c in pub.payload["chunks"]]
    if case == "shape":  # a later chunk's tensors described with another shape of the same bytes
        last = chunks[-1]
        last["shapes"] = [list(reversed(s)) for s in last["shapes"]]
    elif case == "missing":  # the last chunk never published
        chunks = chunks[:-1]
    elif case == "size":
        last = chunks[-1]
        last["tensor_sizes"] = [s + 2 for s in last["tensor_sizes"]]
    payload = {**pub.payload, "chunks": chunks}
    if case == "format":  # packed in a format this engine does not plan
        payload["format"] = "checkpoint"
    return dataclasses.replace(pub, payload=payload)


@pytest.mark.parametrize("case, match", [
    ("shape", "planned .* got"),
    ("missing", "planned tensor.* in no chunk"),
    ("size", "bytes, its chunk says"),
    ("format", "packed in format 'checkpoint'"),
])
def test_a_refused_take_leaves_the_engines_weights_untouched(ckpt, published, case, match):
    """Every chunk of a publication is checked (and the engine's plan against its format) before
    the engine's update starts: a bad one is refused with nothing applied, not even the first chunk;
    the good publication is taken after."""
    from rollout.sync_interface import LocalClient

    _, spec, state, _ = ckpt
    make_engine, bucket, _ = published
    w = make_engine()
    pub = _publisher(spec, bucket, depth=1).publish(_StreamTrainer(state), LocalClient(w), version=1)
    with pytest.raises(ValueError, match=match):
        w.take_weights(_tamper(pub, case))
    assert w.llm.received == {} and "megamoe_receive_kernel_chunk" not in w.llm.calls
    assert not w._updating and w._weights_broken is None
    w._refuse_while_updating("sample")  # serves its previous weights
    assert w.take_weights(pub)["version"] == 1 and len(w.llm.received) == len(_vllm_params(spec))


def test_a_take_failing_while_applying_breaks_the_engine_until_a_complete_take(ckpt, published):
    from rollout.sync_interface import LocalClient

    _, spec, state, _ = ckpt
    make_engine, bucket, _ = published
    w = make_engine(fail_at=1)
    pub = _publisher(spec, bucket, depth=1).publish(_StreamTrainer(state), LocalClient(w), version=1)
    with pytest.raises(RuntimeError, match="injected: CUDA error"):
        w.take_weights(pub)
    assert not w._updating and "injected: CUDA error" in w._weights_broken
    with pytest.raises(RuntimeError, match="refusing to sample"):
        w._refuse_while_updating("sample")
    assert w.take_weights(pub)["version"] == 1 and w._weights_broken is None
