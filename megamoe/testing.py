"""Numerics helpers for tests and benchmarks: one `assert_close`, named tolerances, random inputs.

`rel_err(out, ref) = ||out - ref||_F / max(||ref||_F, abs_floor)`: scale-free, so one tolerance
per dtype holds across shapes. The floor only matters for references that are (almost) zero, which
`assert_close` refuses anyway unless told that zero is expected.
"""

from __future__ import annotations

import dataclasses

import torch

# Relative Frobenius error allowed against the fp32 ground truth (moe_ground_truth), per dtype of
# the implementation's inputs. Evidence (seeded inputs over the edge cases of tests/megamoe/test_ref.py,
# tests/megamoe/test_fused.py and tests/megamoe/test_ep.py, 2026-11-30):
# - fp32: implementations differ from the ground truth only by summation order. Worst seen on a
#   2-core x86 CPU: 1.6e-7 forward, 3.9e-7 gradients (reference, EP, torch backend, Triton
#   interpreter); on the H200 the Triton kernels use "ieee" fp32 dots (no TF32) and pass the same
#   bound. The issue asks for < 1e-5; we use that bound.
# - bf16: inputs rounded to bf16 and intermediates (the SwiGLU activation, per-slot rows) stored
#   in bf16: worst seen 4.7e-3 forward and 5.1e-3 gradients (CPU), about 2^-8 as expected for two
#   rounded intermediates. The d(topk_weights) gradient is one dot product over H per slot and can
#   cancel: 1.05e-2 seen at T=1, k=1 with a condition number of 14 (7e-4 relative to the size of
#   the terms); tests/megamoe/test_ref.py scales that one tolerance by the condition number. The issue asks
#   for < 1e-2; we use that bound.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}
ABS_FLOOR = 1e-12


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out64 - ref64).norm() / max(float(ref64.norm()), ABS_FLOOR))


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float,
                 *, allow_zero_ref: bool = False) -> float:
    """Assert rel_err(out, ref) <= tol; check shapes, NaN/Inf on both sides, and a non-zero ref.

    Prints the error and the margin (tol / err), so a test log shows how close each check came.
    """
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    for side, t in (("output", out), ("reference", ref)):
        bad = (~torch.isfinite(t.detach())).sum().item()
        if bad:
            raise AssertionError(f"{name}: {bad} non-finite values in the {side}")
    if not allow_zero_ref and ref.numel() and float(ref.detach().abs().max()) == 0.0:
        raise AssertionError(f"{name}: the reference is all zeros; the comparison would prove nothing")
    err = rel_err(out, ref)
    margin = tol / err if err > 0 else float("inf")
    print(f"[assert_close] {name}: rel_err={err:.3e} tol={tol:.1e} margin={margin:.1f}x")
    if not err <= tol:
        raise AssertionError(f"{name}: rel_err {err:.3e} > tol {tol:.1e}")
    return err


@dataclasses.dataclass
class MoEProblem:
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor

    def args(self):
        return self.x, self.w13, self.w2, self.topk_weights, self.topk_ids

    def leaves(self, requires_grad: bool = True) -> "MoEProblem":
        """Fresh leaf copies (for autograd), so two implementations never share .grad."""
        return MoEProblem(*(t.detach().clone().requires_grad_(requires_grad and t.is_floating_point())
                            for t in self.args()))


def make_problem(T: int, H: int, I: int, E: int, k: int, *, dtype=torch.float32, device="cpu",  # noqa: E741
                 seed: int = 0, routing: str = "random", drop_frac: float = 0.0) -> MoEProblem:
    """Seeded random MoE inputs, scaled so activations stay O(1).

    routing: "random" (distinct experts per token, uniform), "one_expert" (every slot of every
    token on expert 0 ... k-1 shifted so expert 0 gets all tokens), "skip_odd" (odd experts get
    no token). drop_frac: fraction of slots set to -1.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    if routing == "random":
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
    elif routing == "one_expert":
        ids = (torch.arange(k)[None, :].expand(T, k) + 0) % E
    elif routing == "skip_odd":
        even = torch.arange(0, E, 2)
        if k > even.numel():
            raise ValueError(f"k={k} > number of even experts {even.numel()}")
        ids = even[torch.argsort(torch.rand(T, even.numel(), generator=g), dim=1)[:, :k]]
    else:
        raise ValueError(f"routing: unknown {routing!r}")
    weights = torch.rand(T, k, generator=g) + 0.1
    if drop_frac > 0:
        drop = torch.rand(T, k, generator=g) < drop_frac
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    return MoEProblem(x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype),
                      weights.to(device, torch.float32), ids.to(device, torch.int64))


def weight_grad_condition(dy_TH: torch.Tensor, truth: MoEProblem, tokens: slice = slice(None)) -> float:
    """Condition number of the topk_weights gradient: ||sum_h |dy*out|||_F / ||sum_h dy*out||_F.

    d topk_weights[t,j] = <dy[t], out[t,j]> (out: slot j's expert output) is one dot product over H
    per slot. Rounding the slot outputs (bf16) perturbs it relative to sum_h |dy*out|, not to the
    result, which cancellation can make much smaller (T1-k1-bf16: kappa 14). Tests scale that
    gradient's tolerance by kappa >= 1, so the check stays scale-free without hiding real errors (a
    wrong or missing slot is off by O(1), far above tol * kappa). `tokens` selects a rank's rows.
    """
    from megamoe.ref import moe_ground_truth

    exact, magnitude = [], []
    with torch.no_grad():
        for j in range(truth.topk_ids.shape[1]):
            one_hot = torch.zeros_like(truth.topk_weights)
            one_hot[:, j] = 1.0
            prod = dy_TH[tokens] * moe_ground_truth(truth.x, truth.w13, truth.w2, one_hot, truth.topk_ids)[tokens]
            exact.append(prod.sum(-1))
            magnitude.append(prod.abs().sum(-1))
    return max(1.0, float(torch.stack(magnitude).norm() / max(float(torch.stack(exact).norm()), 1e-30)))


def saved_for_backward_bytes(fn, *inputs: torch.Tensor, detail: list | None = None) -> tuple[int, int]:
    """Bytes that autograd keeps alive between `fn(*inputs)` and its backward: (in storages other
    than the inputs', in all saved storages). Measured with saved-tensor hooks at storage level (a
    saved view keeps its whole storage alive; a storage saved twice counts once), so it is the
    backward's activation memory whatever the device, without an allocator. `detail` (a list)
    receives (shape, dtype, storage bytes, is an input's storage) per saved storage."""
    inputs_at = {t.untyped_storage().data_ptr() for t in inputs}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in saved and detail is not None:
            detail.append((tuple(t.shape), t.dtype, storage.nbytes(), storage.data_ptr() in inputs_at))
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(n for p, n in saved.items() if p not in inputs_at), sum(saved.values())


def run_processes(worker, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """Spawn `nprocs` processes running worker(rank, *args) and wait for all of them; past
    `timeout_s` terminate them and raise (a hung rank fails the caller instead of blocking it)."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.terminate()
            raise RuntimeError(f"the {nprocs} {what} processes did not finish within {timeout_s}s (a rank hung?)")


INVARIANT_TOL = 2e-6
"""megamoe.invariant's fp32 linear and attention (and the trainer's gradients around them) against fp64:
the error relative to the largest |value| (`max_rel_err`). Measured at most 4e-7 (tests/megamoe/
test_invariant.py, tests/trainer/test_trainer_bitwise.py); a dot product of K fp32 terms is within about
K * 6e-8 of exact in the worst case, far less for random signs."""


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (ref in fp64)."""
    return float((out.double() - ref).abs().max() / ref.abs().max())


def attention_ground_truth(q_QhD, k_LgD, v_LgE, q_pos_Q, scale: float) -> torch.Tensor:
    """fp64 causal softmax attention of one sequence (query i sees keys 0..q_pos[i]), [Q, h, E]."""
    h, g = q_QhD.shape[1], k_LgD.shape[1]
    k = k_LgD.double().repeat_interleave(h // g, 1)
    v = v_LgE.double().repeat_interleave(h // g, 1)
    s = torch.einsum("qhd,khd->hqk", q_QhD.double(), k) * scale
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos_Q[:, None], float("-inf"))
    return torch.einsum("hqk,khe->qhe", s.softmax(-1), v)
