"""Routing replay (R3) in the trainer's forward, every family: the sampler's experts are used even where the
trainer's own router would choose others, the combine weights are the trainer router's scores over them
(against a float64 hand computation), the router still gets gradients, and the metrics count agreement.
No engine, no Ray: the "sampler's" routing is the unperturbed model's own.

    .venv/bin/python -m pytest -q tests/trainer/test_trainer_replay.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.routing import route_weights
from trainer.experts import Fp32Router, block_router, moe_blocks
from trainer.model import load_model
from trainer.replay import NO_ROUTING, finish_routing, routing_replay, routing_sums

ARCHS = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
# Combine weights from the fp32 router logits vs float64 from the same logits: rounding of one softmax /
# sigmoid and a division in fp32; measured <= 1.2e-7 (2-core x86, 2026-12-06). Bound: 1e-5.
WEIGHTS_TOL = 1e-5
B, S = 2, 9


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from rl.make_model import make_model

    root = tmp_path_factory.mktemp("replay_models")
    # 16 experts, top-4: a perturbed router flips some but not all choices.
    return {arch: make_model(root / arch, arch=arch, layers=2, experts=16, topk=4, seed=3) for arch in ARCHS}


def _record(model):
    """Forward pre-hooks on every experts module and router: what the experts were called with."""
    seen = {"ids": [], "weights": [], "h": []}
    hooks = []
    for _, block in moe_blocks(model):
        def experts_hook(mod, args):
            ints = [a for a in args if isinstance(a, torch.Tensor) and not a.dtype.is_floating_point]
            floats = [a for a in args[1:] if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
            seen["ids"].append(ints[0].detach().clone())
            seen["weights"].append(floats[-1].detach().clone())

        def router_hook(mod, args):
            seen["h"].append(args[0].detach().reshape(-1, mod.hidden_dim).clone())

        hooks.append(block.experts.register_forward_pre_hook(experts_hook))
        hooks.append(block_router(block).register_forward_pre_hook(router_hook))
    return seen, hooks


def _forward(model, ids, mask):
    seen, hooks = _record(model)
    try:
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return out, seen


@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_forward_uses_the_samplers_experts(model_dirs, arch):
    torch.manual_seed(0)
    model = load_model(model_dirs[arch], "megamoe")
    V = model.config.vocab_size
    ids = torch.randint(3, V, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -2:] = 0  # right padding: no routing there
    with torch.no_grad():
        _, sampler = _forward(model, ids, mask)
    routed = torch.stack(sampler["ids"])  # [L, T, k]: the "sampler's" routing
    valid = mask.reshape(-1).bool()
    routed = torch.where(valid[None, :, None], routed, torch.full_like(routed, NO_ROUTING))
    routed[:, 3] = NO_ROUTING  # a real token without routing (prefix cache / preemption): the trainer routes it

    routers = [block_router(b) for _, b in moe_blocks(model)]
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn_like(r.weight) * r.weight.std() * 0.5)
        _, own = _forward(model, ids, mask)
    flipped = [(torch.sort(o, 1).values != torch.sort(s, 1).values).any(1)[valid].float().mean().item()
               for o, s in zip(own["ids"], sampler["ids"])]
    assert min(flipped) > 0, f"the perturbed router must choose other experts for some tokens, flipped {flipped}"

    model.zero_grad(set_to_none=True)
    with routing_replay(model, routed, valid, replay=True) as states:
        logits, used = _forward(model, ids, mask)
        logits[mask.bool()].float().pow(2).mean().backward()
    own_now = []
    for layer, r in enumerate(routers):
        rows = valid.clone()
        rows[3] = False
        assert torch.equal(used["ids"][layer][rows], routed[layer][rows]), f"layer {layer}: not the sampler's experts"
        with torch.no_grad():
            _, _, own_ids = r(used["h"][layer])  # the replay state is gone: the trainer's own top-k
        own_now.append(own_ids)
        assert torch.equal(used["ids"][layer][3], own_ids[3]), "a token without routing: the trainer's own top-k"
        # combine weights: the trainer router's scores at the replayed ids, float64 by hand
        h = used["h"][layer].double()
        logits64 = h @ r.weight.double().t() + (r.bias.double() if r.bias is not None else 0)
        scores = torch.softmax(logits64, -1) if r.scoring == "softmax" else torch.sigmoid(logits64)
        want = scores.gather(1, used["ids"][layer])
        if r.renormalize:
            want = want / want.sum(-1, keepdim=True)
        torch.testing.assert_close(used["weights"][layer].double(), want, atol=WEIGHTS_TOL, rtol=0)
        g = r.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, f"layer {layer}: no router gradient"
    sums = routing_sums(states)
    assert sums["routing_unrouted"] == 1.0 and sums["routing_replayed"] == valid.sum().item() - 1
    metrics = finish_routing(sums)
    for layer in range(len(routers)):
        same = (torch.sort(own_now[layer], 1).values == torch.sort(routed[layer], 1).values).all(1)
        rows = valid & (torch.arange(B * S) != 3)
        want_agree = same[rows].sum().item() / rows.sum().item()
        assert 0 < want_agree < 1 or layer > 0, "layer 0 must both agree and disagree somewhere (a test that can fail)"
        assert metrics[f"routing/agree_l{layer}"] == pytest.approx(want_agree, abs=1e-12)
    for r in routers:
        assert r.replay is None, "the replay state must be gone after the block"


def test_measuring_without_replay_changes_nothing(model_dirs):
    model = load_model(model_dirs["qwen3_moe"], "megamoe")
    torch.manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    with torch.no_grad():
        ref, seen = _forward(model, ids, mask)
        other = torch.stack(seen["ids"]).flip(-1).roll(1, dims=1)  # a different routing, only measured
        with routing_replay(model, other, mask.reshape(-1).bool(), replay=False) as states:
            out, _ = _forward(model, ids, mask)
    assert torch.equal(out, ref)
    assert finish_routing(routing_sums(states))["routing/replayed_tokens"] == 0


def test_route_weights_equal_routes_bitwise():
    torch.manual_seed(2)
    logits = torch.randn(37, 16)
    for scoring, renorm in (("softmax", True), ("softmax", False), ("sigmoid", True)):
        w, i = __import__("megamoe").route(logits, 4, scoring, renorm)
        assert torch.equal(route_weights(logits, i, scoring, renorm), w)


def test_bad_replay_input_is_refused(model_dirs):
    model = load_model(model_dirs["qwen3_moe"], "megamoe")
    L, k, E = 2, 4, 16
    valid = torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match="expected shape \\[L=2"):
        with routing_replay(model, torch.zeros(1, 5, k, dtype=torch.long), valid, True):
            pass
    with pytest.raises(ValueError, match="expected k=4"):
        with routing_replay(model, torch.zeros(L, 5, 3, dtype=torch.long), valid, True):
            pass
    bad = torch.zeros(L, 5, k, dtype=torch.long)
    bad[1, 2, 0] = E
    with pytest.raises(ValueError, match="expected ids in \\[0, 16\\)"):
        with routing_replay(model, bad, valid, True):
            pass
    stock = load_model(model_dirs["qwen3_moe"], "stock")
    with pytest.raises(ValueError, match="trainer.routing_replay needs trainer.moe_impl"):
        with routing_replay(stock, torch.zeros(L, 5, k, dtype=torch.long), valid, True):
            pass
    assert all(isinstance(block_router(b), Fp32Router) and block_router(b).replay is None
               for _, b in moe_blocks(model))


def _own_routing(model, batch) -> list:
    """Per sequence the model's own experts for prompt + completion, int16 [T, L, k] (the 'sampler's')."""
    out = []
    for p, c in zip(batch.prompt_ids, batch.completion_ids):
        with torch.no_grad():
            _, seen = _forward(model, torch.tensor([p + c]), torch.ones(1, len(p) + len(c), dtype=torch.long))
        out.append(torch.stack(seen["ids"], 1).to(torch.int16).numpy())
    return out


def test_train_step_replays_and_reports(model_dirs):
    """TrainerWorker end to end (one unsharded rank, two minibatches: the PPO denominator's pass and each
    minibatch's forward get their sequences' routing): routing from a perturbed copy of the model replayed, the
    metrics report the disagreement of the trainer's own router, every real token replayed but one."""
    from trainer.testing import make_batch
    from trainer.worker import TrainerWorker

    d = model_dirs["qwen3_moe"]
    batch = make_batch(4, vocab=200, seed=5)
    sampler = load_model(d, "megamoe")
    with torch.no_grad():
        for _, b in moe_blocks(sampler):
            wr = block_router(b).weight
            wr.add_(torch.randn_like(wr) * wr.std() * 0.5)
    routed = _own_routing(sampler, batch)
    routed[2][1] = NO_ROUTING  # a prompt token without routing
    w = TrainerWorker(0, 1, "", 0, str(d), "megamoe", {"fsdp": False, "lr": 1e-4, "micro_batch_size": 2,
                                                       "minibatches": 2, "routing_replay": True})
    m = w.train_step(dataclasses.replace(batch, routed_experts=routed))
    real = sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids))
    assert m["routing/replayed_tokens"] == real - 1 and m["routing/unrouted_tokens"] == 1
    assert 0 < m["routing/agree_l0"] < 1, m
    assert {"routing/load_cv_l1", "routing/idle_experts_l1", "routing/entropy_l1"} <= set(m)
    bad = [r[:-1] for r in routed]
    with pytest.raises(Exception, match=r"routed_experts\[0\]: expected integer expert ids of shape"):
        w.train_step(dataclasses.replace(batch, routed_experts=bad))


def test_routing_load_hand_computed():
    import numpy as np

    from trainer.replay import routing_load

    # 2 sequences, L=2 layers, k=2, E=4; one token without routing (ignored)
    a = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 3]]], dtype=np.int16)
    b = np.array([[[0, 1], [3, 2]], [[-1, -1], [-1, -1]]], dtype=np.int16)
    m = routing_load([a, b], num_experts=4)
    # layer 0: expert counts [3, 2, 1, 0] -> mean 1.5, max/mean 2, std sqrt(1.25), one idle expert
    assert m["routing/load_max_over_mean_l0"] == pytest.approx(2.0, abs=1e-12)
    assert m["routing/load_cv_l0"] == pytest.approx(1.25 ** 0.5 / 1.5, abs=1e-12)
    assert m["routing/idle_experts_l0"] == 1
    # layer 1: counts [0, 0, 3, 3] -> mean 1.5, max/mean 2, std 1.5, two idle experts
    assert m["routing/load_max_over_mean_l1"] == pytest.approx(2.0, abs=1e-12)
    assert m["routing/load_cv_l1"] == pytest.approx(1.0, abs=1e-12)
    assert m["routing/idle_experts_l1"] == 2


def test_config_refusals():
    from rl import config as C
    from trainer.config import ConfigError

    base = ["model.make.seed=1", "data.task=digit"]
    with pytest.raises(ConfigError, match=r"trainer.routing_replay: expected false \(bitwise mode"):
        C.load(None, base + ["run.numerics=bitwise", "trainer.routing_replay=true"])
    for key in ("routing_replay", "routing_metrics"):
        with pytest.raises(ConfigError, match=rf"trainer.moe_impl: expected 'megamoe' or 'reference' with "
                                              rf"trainer.{key}=true"):
            C.load(None, base + ["trainer.moe_impl=stock", f"trainer.{key}=true"])
    assert C.trainer_worker_config(C.load(None, base + ["trainer.routing_replay=true"])).routing_replay


# Entropy of the fp32 router (its fp32 logits, softmax, sum) against float64 from the same hidden states:
# measured <= 3e-7 nats (2-core x86, 2026-12-07). Bound: 1e-5.
ENTROPY_TOL = 1e-5


def test_routing_entropy_is_the_float64_hand_computation(model_dirs):
    """`routing/entropy_l{i}`: the mean over real (unmasked) tokens of -sum p log p of the router's softmax, in
    nats, against float64 from the router's own inputs; 0 <= H <= ln E (a dropped sign reads negative)."""
    import math

    model = load_model(model_dirs["qwen3_moe"], "megamoe")
    torch.manual_seed(4)
    ids = torch.randint(3, model.config.vocab_size, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 6:] = 0  # padding: not counted
    with torch.no_grad():
        _, seen = _forward(model, ids, mask)
        routed = torch.stack(seen["ids"])
        with routing_replay(model, routed, mask.reshape(-1).bool(), replay=True) as states:
            _, seen = _forward(model, ids, mask)
    m = finish_routing(routing_sums(states))
    valid = mask.reshape(-1).bool()
    E = model.config.num_experts
    for layer, (_, block) in enumerate(moe_blocks(model)):
        w = block_router(block).weight.detach().double()
        p = torch.softmax(seen["h"][layer].double() @ w.T, dim=-1)
        want = float((-(p * torch.log(p)).sum(-1))[valid].mean())
        got = m[f"routing/entropy_l{layer}"]
        assert abs(got - want) <= ENTROPY_TOL, (layer, got, want)
        assert 0.0 <= got <= math.log(E), got


def _perturbed_routing(d, batch):
    sampler = load_model(d, "megamoe")
    with torch.no_grad():
        for _, b in moe_blocks(sampler):
            wr = block_router(b).weight
            wr.add_(torch.randn_like(wr) * wr.std() * 0.5)
    return _own_routing(sampler, batch)


def test_replay_with_activation_checkpointing_recomputes_the_replayed_routing(model_dirs):
    """trainer.activation_checkpointing recomputes every decoder layer in the backward: it must route by the
    sampler's experts there too, so the update equals the one without checkpointing (fp32, CPU: same ops)."""
    from trainer.testing import make_batch
    from trainer.worker import TrainerWorker

    d = model_dirs["qwen3_moe"]
    batch = make_batch(4, vocab=200, seed=6)
    torch.manual_seed(7)
    routed = _perturbed_routing(d, batch)
    params = {}
    for ckpt in (False, True):
        w = TrainerWorker(0, 1, "", 0, str(d), "megamoe", {"fsdp": False, "lr": 1e-3, "micro_batch_size": 2,
                                                           "routing_replay": True, "activation_checkpointing": ckpt})
        m = w.train_step(dataclasses.replace(batch, routed_experts=routed))
        assert 0 < m["routing/agree_l0"] < 1, m  # the trainer's own routing differs: replay matters here
        params[ckpt] = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    diff = max(float((params[True][n] - params[False][n]).abs().max()) for n in params[False])
    assert diff == 0.0, diff
