"""Packed micro-batches (trainer/packing.py): the same logprobs, loss and gradients as right-padded ones, and no
attention across a sequence boundary.

    .venv/bin/python -m pytest -q tests/trainer/test_trainer_packing.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.testing import rel_err
from trainer import packing
from trainer.batch import collate, train_rows
from trainer.config import ConfigError, TrainerWorkerConfig
from trainer.testing import make_batch
from trainer.worker import TrainerWorker

# fp32 on CPU, packed vs padded: the same math, other GEMM shapes (one row of T tokens vs [b, L] rows), so
# only the summation order of the dense GEMMs and the attention differs. Measured 2026-12-07 (2-core x86): gradients
# rel err <= 7.1e-7, weights after one step <= 8.9e-7. Bound: 1e-5 (the contract's fp32 tolerance, >= 11x margin).
FP32_TOL = 1e-5
BASE = {"fsdp": False, "lr": 1e-3, "micro_batch_size": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rl.make_model import make_model

    return make_model(tmp_path_factory.mktemp("packing") / "qwen3", arch="qwen3_moe", seed=4)


@pytest.fixture(scope="module")
def worker(model_dir):
    w = TrainerWorker(0, 1, "127.0.0.1", 0, str(model_dir), "megamoe", BASE)
    yield w
    w.close()


def _seqs(batch, w):
    return train_rows(batch, vocab_size=w.vocab_size, max_seq_len=512, truncate=False)[0]


def test_packed_forward_and_gradients_equal_padded(worker):
    batch = make_batch(6, seed=3, prompt_len=(2, 9), completion_len=(1, 9))
    seqs = _seqs(batch, worker)
    grads, logps = {}, {}
    for name, mb in (("padded", collate(seqs, worker.pad_id, worker.device)),
                     ("packed", packing.collate_packed(seqs, worker.pad_id, worker.device))):
        worker.model.zero_grad(set_to_none=True)
        lp = worker._completion_logprobs(mb)
        (lp * mb.mask * mb.advantages[:, None]).sum().backward()
        logps[name] = lp[mb.mask]
        grads[name] = {n: p.grad.clone() for n, p in worker.model.named_parameters()}
    assert packing.collate_packed(seqs, 0, worker.device).input_ids.shape == (1, sum(
        len(s.prompt) + len(s.completion) for s in seqs))
    d = float((logps["packed"] - logps["padded"]).detach().abs().max())
    assert d < FP32_TOL, d
    errs = {n: rel_err(grads["packed"][n], grads["padded"][n]) for n in grads["padded"]}
    worst = max(errs, key=errs.get)
    assert errs[worst] < FP32_TOL, (worst, errs[worst])
    worker.model.zero_grad(set_to_none=True)


def test_a_packed_step_equals_a_padded_step(model_dir):
    batch = make_batch(8, seed=5, prompt_len=(2, 9), completion_len=(1, 9))
    out = {}
    for name, extra in (("padded", {}), ("packed", {"packing": True, "token_budget": 40})):
        w = TrainerWorker(0, 1, "127.0.0.1", 0, str(model_dir), "megamoe", {**BASE, **extra})
        m = w.train_step(batch)
        out[name] = (m, dict(w.export_weights()))
        w.close()
    (mp, wp), (mq, wq) = out["padded"], out["packed"]
    assert abs(mq["loss"] - mp["loss"]) <= FP32_TOL * abs(mp["loss"]) and mq["tokens"] == mp["tokens"]
    assert abs(mq["grad_norm"] - mp["grad_norm"]) <= FP32_TOL * mp["grad_norm"]
    errs = {n: rel_err(wq[n], wp[n]) for n in wp}
    assert max(errs.values()) < FP32_TOL, max(errs.items(), key=lambda kv: kv[1])


def test_no_attention_across_sequence_boundaries(worker):
    """Perturb the middle sequence's tokens: the logits of the sequences before and after it, in the same packed
    row, stay bit for bit the same (causal masking alone would protect only the one before)."""
    batch = make_batch(3, seed=6, prompt_len=(3, 6), completion_len=(3, 6))
    seqs = _seqs(batch, worker)
    mb = packing.collate_packed(seqs, worker.pad_id, worker.device)
    lens = [len(s.prompt) + len(s.completion) for s in seqs]
    ids2 = mb.input_ids.clone()
    g = torch.Generator().manual_seed(0)
    ids2[0, lens[0]:lens[0] + lens[1]] = torch.randint(3, 500, (lens[1],), generator=g)
    assert not torch.equal(ids2, mb.input_ids)
    with torch.no_grad():
        a = worker.model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits[0]
        b = worker.model(input_ids=ids2, position_ids=mb.position_ids).logits[0]
    first, third = slice(0, lens[0]), slice(lens[0] + lens[1], sum(lens))
    assert torch.equal(a[first], b[first]) and torch.equal(a[third], b[third])
    assert not torch.equal(a[lens[0]:lens[0] + lens[1]], b[lens[0]:lens[0] + lens[1]])


def test_pack_respects_the_budget_and_every_rank_runs_the_same_count():
    from trainer.batch import Seq

    seqs = [Seq(i, [5] * p, [6] * c, [0.0] * c, 0.0) for i, (p, c) in enumerate(
        [(3, 2), (4, 4), (10, 10), (2, 1), (1, 1), (5, 5), (30, 3)])]
    groups = packing.pack(seqs, 12)
    assert [[s.index for s in g] for g in groups] == [[0], [1], [2], [3, 4], [5], [6]]  # in order: 5 | 8 | 20 | 3+2 | 10 | 33 tokens
    assert all(sum(len(s.prompt) + len(s.completion) for s in g) <= 12 or len(g) == 1 for g in groups)
    per_rank = [packing.packed_groups(seqs, 2, r, 12) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    assert sorted(s.index for g in per_rank[0] + per_rank[1] for s in g) == list(range(7))
    assert packing.padding_fraction(groups, packed=True) == 0.0
    assert packing.padding_fraction([seqs[:2]], packed=False) == pytest.approx(1 - 13 / 16)


def test_packing_refusals():
    with pytest.raises(ConfigError, match="packing"):
        TrainerWorkerConfig.from_dict({"packing": True, "numerics": "bitwise"})
    with pytest.raises(ConfigError, match="packing"):
        TrainerWorkerConfig.from_dict({"packing": True, "routing_metrics": True})
    with pytest.raises(ConfigError, match="token_budget"):
        TrainerWorkerConfig.from_dict({"packing": True, "token_budget": 1})


def test_packed_rows_keep_the_loss_mask_of_multi_turn_episodes(worker):
    """Environment tokens of a multi-turn episode (loss_mask 0) stay out of the loss in a packed row exactly
    as in a padded one (a packed collate that set every completion token broke this)."""
    batch = make_batch(4, seed=5, prompt_len=(2, 6), completion_len=(4, 9))
    g = torch.Generator().manual_seed(7)
    batch = dataclasses.replace(batch, loss_mask=[[int(b) for b in (torch.rand(len(c), generator=g) < 0.6).tolist()]
                                                  for c in batch.completion_ids])
    seqs = _seqs(batch, worker)
    padded = collate(seqs, worker.pad_id, worker.device)
    packed = packing.collate_packed(seqs, worker.pad_id, worker.device)
    assert any(0 in m for m in batch.loss_mask) and any(1 in m for m in batch.loss_mask)
    assert torch.equal(packed.mask, padded.mask[:, : packed.mask.shape[1]])
    assert int(packed.mask.sum()) == sum(sum(m) for m in batch.loss_mask)


def test_packed_backward_allocates_the_rows_size_not_once_per_sequence(tmp_path):
    """The packed path picks each sequence's rows from the one row by index: the backward allocates the row's
    [T, V] gradient, not [sequences, T, V] (a gather from the row expanded per sequence did that: on an H100 the
    30B LoRA config's first step asked for 70.98 GiB there, 8192 tokens x Qwen3's vocabulary). Measured here as
    the largest allocation any single op makes in the backward (torch.profiler's self CPU memory), against two
    [T, V] fp32 tensors; the old way allocated sequences x that."""
    from torch.profiler import ProfilerActivity, profile

    from rl.make_model import make_model

    V = 4096
    w = TrainerWorker(0, 1, "127.0.0.1", 0, str(make_model(tmp_path / "m", vocab=V, seed=6)), "megamoe", BASE)
    try:
        batch = make_batch(12, vocab=V, seed=5, prompt_len=(8, 12), completion_len=(40, 40))
        seqs = _seqs(batch, w)
        mb = packing.collate_packed(seqs, w.pad_id, w.device)
        n, T = len(seqs), mb.input_ids.shape[1]
        lp = w._completion_logprobs(mb)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            (lp * mb.mask * mb.advantages[:, None]).sum().backward()
        biggest = max(e.self_cpu_memory_usage for e in prof.events())
        assert biggest <= 2 * T * V * 4 < n * T * V * 4, (biggest, T, V, n)
    finally:
        w.close()
