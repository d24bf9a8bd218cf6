"""The persistent kernel's traced variant (benchmarks/device/trace_items.py) under the interpreter,
forward and backward launches: the same output bits as the untraced launch, one record per ticket, each ticket's kind what the
routing implies. Under the interpreter the "times" are ticket numbers (no clock), so the timing
itself is checked on a GPU only, by the tool's run (benchmarks/RESULTS.md)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megamoe.fused import fused_moe_fwd
from megamoe.testing import make_problem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "device"))

from trace_items import BWD_KINDS, KINDS, summarize, traced_launch  # noqa: E402


@pytest.mark.parametrize("is_bwd,programs", [(False, 1), (False, 3), (True, 3)], ids=["fwd-1", "fwd-3", "bwd-3"])
def test_traced_launch_records_every_ticket_and_keeps_the_bits(is_bwd, programs, nan_fill):
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test: runs on CPU machines (conftest sets TRITON_INTERPRET=1 there)")
    import dataclasses

    from megamoe import fused

    T, H, I, E, k = 29, 36, 40, 6, 3  # noqa: E741
    p = make_problem(T, H, I, E, k, seed=11, drop_frac=0.2, routing="skip_odd")  # experts 1, 3, 5: no rows
    x, w13, w2, tw, ids = p.args()
    cfg = dataclasses.replace(fused.default_config(x.dtype, x.device), programs=programs)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(12)) if is_bwd else None
    fused.set_config(cfg)
    try:
        if is_bwd:  # the training backward: reads the (gate, up) its forward saved
            gu = fused_moe_fwd(x, w13, w2, tw, ids, backend="triton", save_gu=True)[1]
            r = fused.launch_persistent(True, x, w13, w2, tw, ids, dy, T, H, I, E, k, cfg, gu=gu)
            plain = (r[0], r[3])  # dx, d(topk_weights)
        else:
            gu = None
            plain = (fused_moe_fwd(x, w13, w2, tw, ids, backend="triton"),)
        outs, ticks, layout = traced_launch(is_bwd, x, w13, w2, tw, ids, dy, gu, cfg)
    finally:
        fused.set_config(None)
    assert len(outs) == len(plain) and all(torch.equal(a, b) for a, b in zip(outs, plain))
    # the tool's untraced launch (its timing baseline) gives the same outputs and no records
    fused.set_config(cfg)
    try:
        untraced = traced_launch(is_bwd, x, w13, w2, tw, ids, dy, gu, cfg, traced=False)
    finally:
        fused.set_config(None)
    assert untraced[1:] == (None, None) and all(torch.equal(a, b) for a, b in zip(untraced[0], plain))

    n = ticks.shape[0]
    # every ticket taken once; no clock: start = after-wait = end = the ticket's number
    assert (ticks[:, 3] >= 0).all()
    for c in range(3):
        assert torch.equal(ticks[:, c], torch.arange(n)), c
    assert set((ticks[:, 3] // 16).tolist()) <= set(range(programs))
    code = ticks[:, 3] % 16

    # what the routing implies, counted here from ids (not from the kernel's metadata)
    per_expert = torch.bincount(ids[ids >= 0].flatten(), minlength=E)
    R = int(((per_expert + cfg.BM - 1) // cfg.BM).sum())
    n1, n2, P0, R_MAX = layout["n1"], layout["n2"], layout["P0"], layout["R_MAX"]
    assert (n1, n2) == (-(-I // (cfg.bwd_BN1 if is_bwd else cfg.BN1)), -(-H // cfg.BN2))
    assert n == P0 + R_MAX * (n1 + n2) + -(-T // cfg.BT)
    assert (code[:P0] == 0).all() and (code[P0:] != 0).all()
    counts = {c: int((code == c).sum()) for c in (1, 2, 3, 5, 6)}
    assert counts == {1: R * n1, 2: R * n2, 3: -(-T // cfg.BT), 5: (R_MAX - R) * n1, 6: (R_MAX - R) * n2}
    # combine tickets come last; every tile's GEMM2 tickets after all its GEMM1 tickets is the
    # ticket order's own test (test_fused.py); here: the summary adds up
    assert (code[-counts[3]:] == 3).all()
    kinds = BWD_KINDS if is_bwd else KINDS
    s = summarize(ticks, P0, kinds)
    # no clock: each ticket's work is 0 and the last metadata ticket "ends" at its own number
    assert s["metadata_steps"] == {"a": 0.0, "b": 0.0, "c": 0.0, "done": float(P0 - 1)}
    assert s["tickets"] == n and s["untaken"] == 0 and s["programs"] == len(set((ticks[:, 3] // 16).tolist()))
    assert {name: v["n"] for name, v in s["kinds"].items()} == {
        kinds[0]: P0, kinds[1]: R * n1, kinds[2]: R * n2, kinds[3]: counts[3],
        **({kinds[5]: counts[5], kinds[6]: counts[6]} if counts[5] else {})}
