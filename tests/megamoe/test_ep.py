"""Expert parallel over 2 processes against the single-process ground truth: gloo on CPU, and NCCL
on 2 GPUs (`multigpu`, skipped with the reason on machines without them).

    .venv/bin/python -m pytest -q tests/megamoe/test_ep.py

One module-scoped spawn of W=2 processes per backend runs every case in one process group (good cases,
bad-input cases, then a good case again, which shows that no bad input left a rank behind); the
workers save their outputs and gradients, and the tests below compare them, in this process, with
`moe_ground_truth` on all ranks' tokens together: forward and every gradient (x and topk_weights
on the token's rank, the w13 and w2 shards on their owner).
"""

from __future__ import annotations

import dataclasses
import datetime
import re

import pytest
import torch
import torch.distributed as dist

from megamoe.ep import ep_a2a_moe, ep_moe_unfused
from megamoe.ref import moe_ground_truth
from megamoe.testing import (TOLERANCES, MoEProblem, assert_close, make_problem, run_processes,
                             weight_grad_condition)

WORLD = 2
MAX_TOKENS = 16
SPAWN_TIMEOUT_S = 150   # the whole spawn; a hang fails the module instead of blocking the suite
COLLECTIVE_TIMEOUT_S = 60  # any one collective
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRAD_NAMES = ("x", "w13", "w2", "topk_weights")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    tokens: tuple[int, ...]      # T of each rank
    H: int = 24
    I: int = 12  # noqa: E741
    E: int = 4
    k: int = 2
    routing: str = "random"      # "random", or "rank0-only" / "rank1-only": every slot on that rank's experts
    drop_frac: float = 0.0
    dead_token: int | None = None  # global index of a token whose slots are all -1
    dtype: str = "fp32"
    entry: str = "ep_moe_unfused"
    grad: bool = True
    seed: int = 0

    @property
    def L(self):
        return self.E // WORLD

    def problem(self) -> MoEProblem:
        T = sum(self.tokens)
        p = make_problem(T, self.H, self.I, self.E, self.k, dtype=DTYPES[self.dtype], seed=self.seed,
                         drop_frac=self.drop_frac)
        if self.routing != "random":
            owner = int(self.routing[len("rank")])
            g = torch.Generator().manual_seed(self.seed + 1)
            ids = torch.argsort(torch.rand(T, self.L, generator=g), dim=1)[:, :self.k] + owner * self.L
            p.topk_ids.copy_(torch.where(p.topk_ids < 0, -1, ids))
        if self.dead_token is not None:
            p.topk_ids[self.dead_token] = -1
        return p

    def upstream(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + 2)
        return torch.randn(sum(self.tokens), self.H, generator=g).to(DTYPES[self.dtype])

    def tokens_of(self, rank: int) -> slice:
        start = sum(self.tokens[:rank])
        return slice(start, start + self.tokens[rank])

    def experts_of(self, rank: int) -> slice:
        return slice(rank * self.L, (rank + 1) * self.L)


GOOD = [
    Case("T6+5-H24-I12-E4-k2-unfused", (6, 5)),
    Case("T6+5-H24-I12-E4-k2-fused-reference", (6, 5), entry="ep_a2a_moe-reference"),
    Case("T6+5-H24-I12-E4-k2-fused-megamoe", (6, 5), entry="ep_a2a_moe-megamoe"),
    Case("T7+4-H20-I8-E6-k3-drop-dead-token", (7, 4), H=20, I=8, E=6, k=3, drop_frac=0.3, dead_token=8, seed=1),
    Case("T5+6-E4-k2-rank0-gets-every-token", (5, 6), routing="rank0-only", seed=2),
    Case("T5+6-E4-k2-rank1-gets-every-token-and-drops", (5, 6), routing="rank1-only", drop_frac=0.25, seed=3),
    Case("T0+7-E4-k2-rank0-has-no-tokens", (0, 7), seed=4),
    Case("T9+3-H36-I20-E8-k1", (9, 3), H=36, I=20, E=8, k=1, seed=5),
    Case("T16+16-E6-k3-max-tokens", (MAX_TOKENS, MAX_TOKENS), E=6, k=3, seed=6),
    Case("T4+3-E4-k2-all-slots-dropped", (4, 3), drop_frac=1.0, seed=7),
    Case("T6+5-E4-k2-no-grad", (6, 5), grad=False, seed=8),
    Case("T14+11-H40-I16-E4-k2-bf16", (14, 11), H=40, I=16, dtype="bf16", seed=9),
]
AFTER_ERRORS = "after-errors"  # GOOD[0] run again after every bad case


@dataclasses.dataclass(frozen=True)
class Bad:
    id: str
    exc: str         # exception type name expected on every rank
    pattern: str     # regex the message must match on every rank (names the argument and the expectation)


BAD = [
    Bad("H-differs-across-ranks", "ValueError",
        r"x: the hidden size H: expected the same value on every rank, got \[24, 28\]"),
    Bad("num_experts-differs-across-ranks", "ValueError",
        r"num_experts: expected the same value on every rank, got \[4, 6\]"),
    Bad("W-does-not-divide-E", "ValueError", r"num_experts: expected a multiple of the world size W=2, got 5"),
    Bad("shard-of-wrong-size-on-rank1", "ValueError",
        r"w13, w2: expected E/W=2 local experts on every rank \(num_experts=4, W=2\), got \[1\] on rank\(s\) \[1\]"),
    Bad("too-many-tokens-on-rank1", "ValueError",
        rf"x: expected at most max_tokens_per_rank={MAX_TOKENS} tokens per rank, got T=\[{MAX_TOKENS + 1}\] on rank\(s\) \[1\]"),
    Bad("id-out-of-range-on-rank0", "ValueError",
        r"rank 0: ValueError: topk_ids: expected global expert ids in \[-1, num_experts=4\), got min 0, max 4"),
    Bad("bad-w2-shape-on-rank1", "ValueError", r"rank 1: ValueError: w2: expected shape \[E=2, H=24, I=12\]"),
    Bad("int-x-on-both-ranks", "TypeError",
        r"rank 0: TypeError: x: expected a floating dtype.*; rank 1: TypeError: x: expected a floating dtype"),
    Bad("requires_grad-differs-across-ranks", "ValueError",
        r"x: expected requires_grad to agree on every rank \(the backward runs collectives\), got \[True, False\]"),
    Bad("dtype-differs-across-ranks", "ValueError",
        r"x: expected the same dtype on every rank, got \['torch.float32', 'torch.bfloat16'\]"),
    Bad("k-differs-across-ranks", "ValueError", r"topk_ids: top-k k: expected the same value on every rank, got \[2, 1\]"),
    Bad("impl-differs-across-ranks", "ValueError",
        r"impl: expected the same on every rank, got \['reference', 'megamoe'\]"),
    Bad("unknown-impl", "ValueError", r"rank 0: ValueError: impl: expected one of \('megamoe', 'reference'\), got 'triton'"),
]


# --- worker side (runs in the spawned processes) --------------------------------------------------

def _entry(name: str):
    if name == "ep_moe_unfused":
        return ep_moe_unfused
    impl = name.removeprefix("ep_a2a_moe-")
    return lambda *a, **kw: ep_a2a_moe(*a, impl=impl, **kw)


def _run_good(case: Case, rank: int, device: torch.device) -> dict:
    p, gy = case.problem(), case.upstream()
    tok, exp = case.tokens_of(rank), case.experts_of(rank)
    mine = MoEProblem(p.x[tok], p.w13[exp], p.w2[exp], p.topk_weights[tok], p.topk_ids[tok])
    leaves = MoEProblem(*(t.to(device) for t in mine.args())).leaves(case.grad)
    with torch.set_grad_enabled(case.grad):
        y = _entry(case.entry)(*leaves.args(), num_experts=case.E, max_tokens_per_rank=MAX_TOKENS)
    out = {"y": y.detach()}
    if case.grad:
        grads = torch.autograd.grad(y, (leaves.x, leaves.w13, leaves.w2, leaves.topk_weights), gy[tok].to(device))
        out |= dict(zip(GRAD_NAMES, grads))
    return {name: t.cpu() for name, t in out.items()}


def _run_bad(case: Bad, rank: int, device: torch.device) -> None:
    good = GOOD[0]
    p = good.problem()
    tok, exp = good.tokens_of(rank), good.experts_of(rank)
    x, w13, w2, tw, ids = (t.to(device) for t in (p.x[tok], p.w13[exp], p.w2[exp], p.topk_weights[tok], p.topk_ids[tok]))
    kw = dict(num_experts=good.E, max_tokens_per_rank=MAX_TOKENS)
    entry = ep_moe_unfused
    if case.id == "H-differs-across-ranks" and rank == 1:
        x, w13, w2 = torch.cat([x, x[:, :4]], 1), torch.cat([w13, w13[..., :4]], 2), torch.cat([w2, w2[:, :4]], 1)
    elif case.id == "num_experts-differs-across-ranks" and rank == 1:
        kw["num_experts"] = 6
    elif case.id == "W-does-not-divide-E":
        kw["num_experts"] = 5
    elif case.id == "shard-of-wrong-size-on-rank1" and rank == 1:
        w13, w2 = w13[:1], w2[:1]
    elif case.id == "too-many-tokens-on-rank1" and rank == 1:
        x, tw, ids = (t.repeat(MAX_TOKENS, 1)[:MAX_TOKENS + 1] for t in (x, tw, ids))
    elif case.id == "id-out-of-range-on-rank0" and rank == 0:
        ids = torch.where(ids == ids.max(), good.E, ids)
    elif case.id == "bad-w2-shape-on-rank1" and rank == 1:
        w2 = w2[..., :-1]
    elif case.id == "int-x-on-both-ranks":
        x = x.to(torch.int32)
    elif case.id == "requires_grad-differs-across-ranks":
        x = x.clone().requires_grad_(rank == 0)
    elif case.id == "dtype-differs-across-ranks" and rank == 1:
        x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    elif case.id == "k-differs-across-ranks" and rank == 1:
        tw, ids = tw[:, :1], ids[:, :1]
    elif case.id == "impl-differs-across-ranks":
        entry = lambda *a, **k: ep_a2a_moe(*a, impl=("reference", "megamoe")[rank], **k)  # noqa: E731
    elif case.id == "unknown-impl":
        entry = lambda *a, **k: ep_a2a_moe(*a, impl="triton", **k)  # noqa: E731
    entry(x, w13, w2, tw, ids, **kw)


def _worker(rank: int, backend: str, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a small, shared machine
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    results: dict[str, dict] = {}

    def record(key, fn):
        try:
            results[key] = fn()
        except Exception as exc:  # noqa: BLE001  (the test in the parent judges it)
            results[key] = {"exc": (type(exc).__name__, str(exc))}

    for case in GOOD:
        record(case.id, lambda: _run_good(case, rank, device))
        # Determinism: the same call again gives the same bits.
        again = {}
        record("again", lambda: again.update(_run_good(case, rank, device)) or {})
        results[case.id]["repeat_bitwise_equal"] = bool(again) and all(
            torch.equal(v, again[k]) for k, v in results[case.id].items() if isinstance(v, torch.Tensor))
    for bad in BAD:
        record(bad.id, lambda: _run_bad(bad, rank, device) or {})
    record(AFTER_ERRORS, lambda: _run_good(GOOD[0], rank, device))
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


# --- test side ------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl", marks=pytest.mark.multigpu)])
def ep_results(request, tmp_path_factory):
    backend = request.param
    out = tmp_path_factory.mktemp(f"ep-{backend}")
    run_processes(_worker, (backend, str(out / "store"), str(out)), WORLD, SPAWN_TIMEOUT_S,
                  f"EP worker ({backend})")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _compare(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    if ref.numel() == 0 or not bool(ref.any()):
        # Nothing reached (no tokens, no expert work): exactly zero, not merely small.
        assert out.shape == ref.shape and not bool(out.any()), f"{name}: expected exact zeros"
        return
    assert_close(name, out, ref, tol)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GOOD])
def test_ep_matches_single_process_ground_truth(case, ep_results):
    p, gy = case.problem(), case.upstream()
    truth = MoEProblem(*(t.float() if t.is_floating_point() else t for t in p.args())).leaves()
    y_ref = moe_ground_truth(*truth.args())
    leaves = (truth.x, truth.w13, truth.w2, truth.topk_weights)
    if y_ref.requires_grad:
        grads_ref = dict(zip(GRAD_NAMES, torch.autograd.grad(y_ref, leaves, gy.float())))
    else:  # no slot reaches an expert: the ground truth is a constant zero
        grads_ref = {name: torch.zeros_like(t) for name, t in zip(GRAD_NAMES, leaves)}
    tol = TOLERANCES[DTYPES[case.dtype]]

    for rank in range(WORLD):
        res = ep_results[rank][case.id]
        assert "exc" not in res, f"rank {rank} raised {res['exc']}"
        tok, exp = case.tokens_of(rank), case.experts_of(rank)
        assert res["y"].dtype == DTYPES[case.dtype]
        _compare(f"rank{rank} y", res["y"], y_ref[tok], tol)
        dead = (p.topk_ids[tok] < 0).all(dim=1)
        assert not bool(res["y"][dead].any()), "a token with every slot -1 got a non-zero output"
        assert res["repeat_bitwise_equal"], "a second identical call gave different bits"
        if not case.grad:
            assert set(res) == {"y", "repeat_bitwise_equal"}
            continue
        for name, ref in (("x", grads_ref["x"][tok]), ("topk_weights", grads_ref["topk_weights"][tok]),
                          ("w13", grads_ref["w13"][exp]), ("w2", grads_ref["w2"][exp])):
            kappa = weight_grad_condition(gy.float(), truth, tok) if name == "topk_weights" else 1.0
            assert res[name].dtype == getattr(p, name).dtype, name
            _compare(f"rank{rank} d{name} (tol x kappa {kappa:.2f})", res[name], ref, tol * kappa)
        assert not bool(res["x"][dead].any()), "a token with every slot -1 got an x gradient"
        assert not bool(res["topk_weights"][p.topk_ids[tok] < 0].any()), "a -1 slot's weight got a gradient"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in BAD])
def test_ep_bad_input_raises_on_every_rank(case, ep_results):
    for rank in range(WORLD):
        res = ep_results[rank][case.id]
        assert "exc" in res, f"rank {rank} did not raise"
        exc_type, message = res["exc"]
        assert exc_type == case.exc, f"rank {rank}: {exc_type}: {message}"
        assert re.search(case.pattern, message), f"rank {rank}: {message!r} does not match {case.pattern!r}"
        assert message.endswith("(raised on every rank of the group)"), message


def test_ep_group_still_in_sync_after_the_errors(ep_results):
    """After every bad case, the same good call as the first case gives the same bits on each rank."""
    for rank in range(WORLD):
        first, after = ep_results[rank][GOOD[0].id], ep_results[rank][AFTER_ERRORS]
        assert "exc" not in after, after
        for name in ("y", *GRAD_NAMES):
            assert torch.equal(first[name], after[name]), name


def test_ep_without_a_process_group_fails_at_once():
    assert not dist.is_initialized()
    p = make_problem(3, 8, 4, 2, 1)
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialised"):
        ep_moe_unfused(*p.args(), num_experts=2, max_tokens_per_rank=4)
