"""Host (Python) time of megamoe's launch path with the Triton launches replaced by no-ops, on any
machine: what the wrappers around the kernels cost per call, apart from the GPU and from Triton's
own launch binding.

    python benchmarks/host_overhead.py

Runs the Triton launchers on CPU tensors (TRITON_INTERPRET=1 only to let them accept CPU tensors;
no kernel runs). Wall time per call, mean of 500 after 20 warm-up calls. The last two rows time a
training step through the public op (the registered op, its autograd, the backward op, gradient
accumulation), with the backend forced to the Triton launchers, against the same launchers called
directly: what the autograd layers cost on the host (on the H200 machine: ≈ 0.5–1 ms per step,
benchmarks/device/host_path.py). Both include the (gate, up) zero fill, a real memset on CPU.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from megamoe import fused  # noqa: E402
from megamoe.contract import check_moe_inputs  # noqa: E402
from megamoe.moe import fused_moe  # noqa: E402
from megamoe.kernels import moe_kernels  # noqa: E402
from megamoe.testing import make_problem  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def per_call_us(fn, n: int = 500) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    moe_kernels._moe_persistent_kernel = _NoLaunch()
    moe_kernels._moe_bwd_dw_kernel = _NoLaunch()
    moe_kernels._gather_token_rows_kernel = _NoLaunch()
    T, H, I, E, k = 64, 256, 128, 16, 8  # noqa: E741  (sizes do not matter: nothing is computed)
    p = make_problem(T, H, I, E, k, seed=1)
    p.topk_ids = p.topk_ids.contiguous()  # the raw launcher row below indexes it as a dense array
    dy = torch.randn(T, H)
    _, gu = fused.fused_moe_fwd(*p.args(), backend="triton", check=False, save_gu=True)
    cfg = fused.config_for(p.x)
    rows = [
        ("fused_moe_fwd (inference)", lambda: fused.fused_moe_fwd(*p.args(), backend="triton", check=False)),
        ("fused_moe_fwd, saving (gate, up)",
         lambda: fused.fused_moe_fwd(*p.args(), backend="triton", check=False, save_gu=True)),
        ("fused_moe_bwd, from (gate, up)", lambda: fused.fused_moe_bwd(dy, *p.args(), backend="triton", gu=gu)),
        ("  of which launch_persistent (forward)",
         lambda: fused.launch_persistent(False, *p.args(), None, T, H, I, E, k, cfg)),
        ("  of which check_moe_inputs", lambda: check_moe_inputs(*p.args(), check_ids=False)),
    ]
    leaves = [t.clone().requires_grad_(True) for t in (p.x, p.w13, p.w2, p.topk_weights)]

    def step():
        for t in leaves:
            t.grad = None
        fused_moe(*leaves, p.topk_ids, check_ids=False).backward(dy)

    def direct():
        _, g = fused.fused_moe_fwd(*p.args(), check=False, save_gu=True)
        fused.fused_moe_bwd(dy, *p.args(), gu=g)

    rows += [("training step, public op + autograd", step), ("training step, direct fwd + bwd calls", direct)]
    fused.op.pick_backend = lambda x, backend: "triton"  # the public op on CPU tensors would pick "torch"
    print(f"torch {torch.__version__} | {os.cpu_count()} CPUs | launches replaced by no-ops")
    for name, fn in rows:
        print(f"{name:42s} {per_call_us(fn):6.0f} us")


if __name__ == "__main__":
    main()
