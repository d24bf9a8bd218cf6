"""Logprob consistency: sampler (vLLM) vs trainer (transformers), per MoE implementation, per MoE layer
and end to end. The engine of `megamoe-rl consistency` (rl/consistency_cmd.py parses its arguments).

    plan = prepare(cfg, impls=("megamoe", "reference", "stock"), prompts=8, out_dir="runs/consistency")
    report = run(plan)                 # generate once, score everywhere, probe every MoE layer
    paths = write_outputs(report, plan.out_dir)   # consistency.json, dlogp_hist.png, layers.png
    print(format_table(report))

What is compared, and how:
1. Completions are generated once, by a RolloutWorker on the first implementation of `impls`.
2. Trainer side, for each implementation: `trainer.probe.score` (what TrainerWorker.logprobs computes,
   unsharded) gives the logprob of every completion token at the run's temperature. The first
   implementation's forward also records the hidden states entering every MoE block.
3. Sampler side, for each implementation: a RolloutWorker on that implementation scores the same
   tokens with vLLM's processed logprobs (`rollout.probe.score_completions`), and runs every MoE block
   of its model on the recorded hidden states inside vLLM's worker (`rollout.probe.run_moe_blocks`).
4. Each pair (sampler impl x trainer impl) gets the mismatch metrics of `rl.metrics.mismatch_metrics`
   (trainer/loss.py's definitions, the ones every `megamoe-rl train` step reports) and, per MoE layer,
   `rl.metrics.moe_layer_metrics` (routing agreement, relative output difference, bitwise equality).
   Both sides' MoE blocks see the same hidden states, so a layer's numbers are the MoE's own
   contribution, separate from attention and norms.

Every check of the input (implementation names, the checkpoint on both sides, prompt lengths against
the context) happens in `prepare`, before any engine starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from megamoe.contract import BITWISE, FAST, MEGAMOE
from megamoe.contract import HOST_IMPLS as MOE_IMPLS

DEFAULT_IMPLS = MOE_IMPLS

log = logging.getLogger("megamoe.rl.consistency")


class ConsistencyError(ValueError):
    """Input the consistency run cannot use; the message names the argument or config key."""


def parse_impls(text: str) -> tuple[str, ...]:
    """'megamoe,stock' -> ("megamoe", "stock"); unknown, empty or repeated names raise, naming --impls."""
    names = [p.strip() for p in str(text).split(",")]
    if not all(names):
        raise ConsistencyError(f"--impls: expected a comma-separated list of {', '.join(MOE_IMPLS)}, got {text!r}")
    unknown = [n for n in names if n not in MOE_IMPLS]
    if unknown:
        raise ConsistencyError(f"--impls: unknown implementation(s) {unknown}; expected names from {list(MOE_IMPLS)}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConsistencyError(f"--impls: {dup} listed more than once, got {text!r}")
    return tuple(names)


@dataclasses.dataclass
class Plan:
    """Everything `run` needs, checked."""
    model_dir: Path
    dtype: str                      # "float32" | "bfloat16", both sides
    impls: tuple[str, ...]          # impls[0] generates and provides the hidden states
    prompts: list[str]
    prompt_ids: list[list[int]]     # the driver's tokenisation (checked against vLLM's after generation)
    n: int                          # samples per prompt
    temperature: float
    max_tokens: int
    max_model_len: int
    kv_cache_bytes: int
    engine_kwargs: dict[str, Any]
    seed: int
    device: str                     # trainer side: "cpu" | "cuda"
    micro_batch_size: int
    out_dir: Path
    numerics: str = FAST            # run.numerics: "bitwise" puts both sides' dense ops on megamoe.invariant
    config_path: str | None = None


# ---------------------------------------------------------------------------------------------
# checks (no engine, no model weights in memory)
# ---------------------------------------------------------------------------------------------
def _resolve_model(cfg, out_dir: Path) -> Path:
    if cfg.model.path is not None:
        path = Path(cfg.model.path).absolute()
        if not (path / "config.json").is_file():
            raise ConsistencyError(f"model.path: expected a Hugging Face checkpoint folder with config.json, "
                                   f"got {str(path)!r}")
        return path
    from rl import make_model as mm

    path = (out_dir / "model").absolute()
    want = dataclasses.asdict(cfg.model.make)
    marker = path / mm.MARKER_FILE
    if marker.is_file():
        have = json.loads(marker.read_text())
        if {k: have.get(k) for k in want if want[k] is not None} == {k: v for k, v in want.items() if v is not None}:
            return path
    mm.make_model(path, **want, overwrite=marker.is_file())
    log.info("made a random-initialised model in %s", path)
    return path


def check_checkpoint(model_dir: Path, device: str) -> Any:
    """Both sides can load `model_dir`, or a ConsistencyError naming what is wrong. Returns its HF config."""
    from transformers import AutoConfig

    from trainer.model import SUPPORTED_ARCHS, check_checkpoint as trainer_check

    where = f"model {str(model_dir)!r}"
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - any reason it does not load is reported, with the reason
        raise ConsistencyError(f"{where}: config.json does not load ({type(e).__name__}: {e})") from e
    if config.model_type not in SUPPORTED_ARCHS:
        raise ConsistencyError(f"{where}: model_type {config.model_type!r} cannot be loaded by the trainer; "
                               f"expected one of {SUPPORTED_ARCHS}")
    try:
        trainer_check(model_dir, config)  # names and shapes of every tensor vs config.json
        from rollout.weights import CheckpointSpec

        spec = CheckpointSpec.from_dir(model_dir)
    except Exception as e:  # noqa: BLE001
        raise ConsistencyError(f"{where}: the checkpoint does not load ({type(e).__name__}: {e})") from e
    from rollout.archs import SUPPORTED_ARCHITECTURES

    if spec.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConsistencyError(f"{where}: architecture {spec.architecture!r} is not served by the rollout hook; "
                               f"expected one of {SUPPORTED_ARCHITECTURES}")
    if device == "cpu":
        from rl.make_model import HEAD_DIMS

        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head_dim not in HEAD_DIMS:
            raise ConsistencyError(f"{where}: head_dim {head_dim} is not supported by vLLM's CPU attention; "
                                   f"expected one of {HEAD_DIMS}")
    return config


def _pick_device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ConsistencyError(f"--device: expected auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConsistencyError("--device: 'cuda' was asked for, but torch.cuda.is_available() is False")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def prepare(cfg, *, impls: tuple[str, ...] = DEFAULT_IMPLS, prompts: int | None = None, n: int | None = None,
            out_dir: str | os.PathLike | None = None, device: str = "auto", config_path: str | None = None) -> Plan:
    """Check the whole input and return the plan; raises ConsistencyError (or rl.data.DataError)."""
    impls = parse_impls(impls if isinstance(impls, str) else ",".join(impls))
    num_prompts = cfg.run.prompts_per_step if prompts is None else prompts
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ConsistencyError(f"--prompts: expected an int >= 1, got {num_prompts!r}")
    n = cfg.rollout.n if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConsistencyError(f"--n: expected an int >= 1, got {n!r}")
    if cfg.run.numerics == BITWISE and impls != (MEGAMOE,):
        raise ConsistencyError(f"--impls: expected megamoe alone with run.numerics=bitwise (the mode needs megamoe's "
                               f"MoE on both sides), got {','.join(impls)}")
    if cfg.rollout.top_p != 1.0:
        # The trainer's logprobs (trainer.loss.token_logprobs) apply the temperature only; with nucleus
        # filtering the sampler's processed logprobs differ from them by construction, not by kernel.
        raise ConsistencyError(f"rollout.top_p: expected 1.0 (the trainer's logprobs apply no nucleus filter), "
                               f"got {cfg.rollout.top_p}")
    device = _pick_device(device)
    out = Path(out_dir if out_dir is not None else Path(cfg.run.out_dir) / "consistency").absolute()
    model_dir = _resolve_model(cfg, out)
    config = check_checkpoint(model_dir, device)

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001
        raise ConsistencyError(f"model {str(model_dir)!r}: the tokenizer does not load "
                               f"({type(e).__name__}: {e})") from e

    from rl.data import PromptSource, apply_chat_template

    texts = PromptSource.from_config(cfg.data, seed=cfg.run.seed).batch(0, num_prompts).prompts
    texts = apply_chat_template(tokenizer, texts, strings=cfg.data.chat_template)
    context = min(cfg.rollout.max_model_len, int(getattr(config, "max_position_embeddings", cfg.rollout.max_model_len)))
    if cfg.rollout.max_model_len > context:
        raise ConsistencyError(f"rollout.max_model_len: expected <= the model's max_position_embeddings ({context}), "
                               f"got {cfg.rollout.max_model_len}")
    prompt_ids = [list(tokenizer(t)["input_ids"]) for t in texts]
    for i, (t, ids) in enumerate(zip(texts, prompt_ids)):
        if len(ids) + cfg.rollout.max_tokens > context:
            preview = t if len(t) <= 40 else t[:37] + "..."
            raise ConsistencyError(
                f"prompt {i} ({preview!r}) has {len(ids)} tokens; with rollout.max_tokens={cfg.rollout.max_tokens} it "
                f"needs {len(ids) + cfg.rollout.max_tokens} <= rollout.max_model_len={cfg.rollout.max_model_len} "
                f"(the context); shorten the prompt or raise rollout.max_model_len")
        if not ids:
            raise ConsistencyError(f"prompt {i}: tokenises to no tokens; expected a non-empty prompt")
    return Plan(model_dir=model_dir, dtype=cfg.model.dtype, impls=impls, prompts=texts, prompt_ids=prompt_ids, n=n,
                temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens,
                max_model_len=cfg.rollout.max_model_len, kv_cache_bytes=cfg.rollout.kv_cache_bytes,
                engine_kwargs=dict(cfg.rollout.engine_kwargs), seed=cfg.run.seed, device=device,
                micro_batch_size=cfg.trainer.micro_batch_size, out_dir=out, config_path=config_path,
                numerics=cfg.run.numerics)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _start_engine(plan: Plan, impl: str):
    from rollout.worker import RolloutWorker

    return RolloutWorker(plan.model_dir, impl, dtype=plan.dtype, seed=plan.seed, max_model_len=plan.max_model_len,
                         kv_cache_memory_bytes=plan.kv_cache_bytes, numerics=plan.numerics, **plan.engine_kwargs)


def _sampler_side(engine, plan: Plan, prompt_ids, completion_ids, hidden) -> dict:
    from rollout import probe

    t0 = time.perf_counter()
    logprobs = probe.score_completions(engine, prompt_ids, completion_ids, temperature=plan.temperature)
    layers = probe.run_moe_blocks(engine, hidden)
    return {"logprobs": logprobs, "layers": layers, "seconds": time.perf_counter() - t0}


def _trainer_side(plan: Plan, impl: str, prompt_ids, completion_ids, hidden) -> tuple[dict, list]:
    """Score on the trainer with `impl`; record the MoE inputs when `hidden` is None; run its MoE blocks."""
    import torch

    from trainer import probe
    from trainer.model import load_model

    t0 = time.perf_counter()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[plan.dtype]
    model = load_model(plan.model_dir, impl, dtype=dtype, device=plan.device, numerics=plan.numerics).eval()
    logprobs, captured = probe.score(model, prompt_ids, completion_ids, temperature=plan.temperature,
                                     micro_batch_size=plan.micro_batch_size, capture=hidden is None,
                                     numerics=plan.numerics)
    hidden = captured if hidden is None else hidden
    layers = probe.run_moe_blocks(model, hidden)
    return {"logprobs": logprobs, "layers": layers, "seconds": time.perf_counter() - t0}, hidden


def run(plan: Plan) -> dict:
    """Generate, score on both sides with every implementation, probe every MoE layer; the report."""
    import torch

    from rl.metrics import mismatch_metrics, moe_layer_metrics

    t_start = time.perf_counter()
    gen_impl = plan.impls[0]
    sampler: dict[str, dict] = {}
    trainer: dict[str, dict] = {}
    sampling = {"temperature": plan.temperature, "max_tokens": plan.max_tokens, "seed": plan.seed}
    engine = _start_engine(plan, gen_impl)
    try:
        samples = engine.generate(plan.prompts, plan.n, sampling)
        for s in samples:
            if s.prompt_ids != plan.prompt_ids[s.prompt_index]:
                raise RuntimeError(f"prompt {s.prompt_index}: vLLM tokenised it to {len(s.prompt_ids)} tokens, "
                                   f"the preflight check to {len(plan.prompt_ids[s.prompt_index])}; the length "
                                   "check does not hold")
        samples = [s for s in samples if s.completion_ids]
        if not samples:
            raise RuntimeError("every completion is empty: nothing to score")
        prompt_ids = [s.prompt_ids for s in samples]
        completion_ids = [s.completion_ids for s in samples]
        gen_logprobs = [s.sampler_logprobs for s in samples]

        # Trainer side first: it records the hidden states that both sides' MoE blocks are fed.
        hidden = None
        for impl in plan.impls:
            trainer[impl], hidden = _trainer_side(plan, impl, prompt_ids, completion_ids, hidden)
        sampler[gen_impl] = _sampler_side(engine, plan, prompt_ids, completion_ids, hidden)
    finally:
        engine.close()
    for impl in plan.impls[1:]:
        engine = _start_engine(plan, impl)
        try:
            sampler[impl] = _sampler_side(engine, plan, prompt_ids, completion_ids, hidden)
        finally:
            engine.close()

    pairs = []
    for s_impl in plan.impls:
        for t_impl in plan.impls:
            s_lp, t_lp = sampler[s_impl]["logprobs"], trainer[t_impl]["logprobs"]
            metrics = mismatch_metrics(t_lp, s_lp)
            metrics.pop("mismatch/masked_frac")  # a train-time correction's statistic; no correction here
            layers = [moe_layer_metrics(a, b) for a, b in zip(sampler[s_impl]["layers"], trainer[t_impl]["layers"])]
            dlogp = [t - s for ts, ss in zip(t_lp, s_lp) for t, s in zip(ts, ss)]
            pairs.append({"sampler": s_impl, "trainer": t_impl, "metrics": metrics, "layers": layers, "dlogp": dlogp})
    gen_vs_score = mismatch_metrics(sampler[gen_impl]["logprobs"], gen_logprobs)
    gen_vs_score.pop("mismatch/masked_frac")
    # what a train step compares: the trainer's logprobs against those vLLM reported while sampling
    trainer_vs_gen = mismatch_metrics(trainer[gen_impl]["logprobs"], gen_logprobs)
    trainer_vs_gen.pop("mismatch/masked_frac")

    import transformers
    import vllm

    return {
        "meta": {
            "config": plan.config_path, "model_dir": str(plan.model_dir), "dtype": plan.dtype, "device": plan.device,
            "numerics": plan.numerics,
            "impls": list(plan.impls), "generator": gen_impl, "hidden_states_from": f"trainer, moe_impl={gen_impl}",
            "prompts": len(plan.prompts), "samples_per_prompt": plan.n, "sequences": len(completion_ids),
            "completion_tokens": sum(len(c) for c in completion_ids),
            "moe_layer_tokens": int(hidden[0].shape[0]) if hidden else 0, "moe_layers": len(hidden or []),
            "temperature": plan.temperature, "max_tokens": plan.max_tokens, "seed": plan.seed,
            "sampler_scoring": "vLLM processed logprobs of the given tokens: one max_tokens=1 request per "
                               "completion position with logprob_token_ids (rollout/probe.py)",
            "versions": {"torch": torch.__version__, "vllm": vllm.__version__,
                         "transformers": transformers.__version__},
            "seconds": {"total": time.perf_counter() - t_start,
                        **{f"sampler/{k}": v["seconds"] for k, v in sampler.items()},
                        **{f"trainer/{k}": v["seconds"] for k, v in trainer.items()}},
        },
        "pairs": pairs,
        "generation_vs_scoring": {"impl": gen_impl, "metrics": gen_vs_score},
        "trainer_vs_generation": {"impl": gen_impl, "metrics": trainer_vs_gen},
        # what was compared: the sampled sequences and the logprobs vLLM reported while generating them
        "sequences": [{"prompt_ids": p, "completion_ids": c, "sampler_logprobs": lp}
                      for p, c, lp in zip(prompt_ids, completion_ids, gen_logprobs)],
    }


# ---------------------------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------------------------
_TABLE_COLUMNS = (("k3 KL", "mismatch/k3_kl", ".2e"),
                  ("mean|Δlogp|", "mismatch/abs_logp_diff_mean", ".2e"),
                  ("max|Δlogp|", "mismatch/abs_logp_diff_max", ".2e"),
                  ("mean|Δp|", "mismatch/abs_prob_diff_mean", ".2e"),
                  ("max|Δp|", "mismatch/abs_prob_diff_max", ".2e"),
                  ("1-pearson(p)", "mismatch/prob_pearson", "1-"),
                  ("frac>1e-3", "mismatch/logp_diff_gt_1e-3_frac", ".3f"))


def _fmt(v: float, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if spec == "1-":  # a correlation near 1: its distance from 1 is what tells pairs apart
        return format(1.0 - v, ".1e")
    return format(v, spec)


def format_table(report: dict) -> str:
    """The console summary: one line per (sampler, trainer) pair, then one per MoE layer and pair."""
    m = report["meta"]
    lines = [f"consistency: {m['model_dir']} dtype={m['dtype']} device={m['device']} numerics={m.get('numerics', 'fast')} "
             f"{m['sequences']} sequences, {m['completion_tokens']} completion tokens, "
             f"{m['moe_layers']} MoE layers x {m['moe_layer_tokens']} tokens",
             "end to end (Δlogp = trainer - sampler, per completion token):"]
    head = ["sampler", "trainer"] + [c[0] for c in _TABLE_COLUMNS] + ["routing agree (min)", "MoE rel diff (max)"]
    rows = []
    for p in report["pairs"]:
        agree = min(x["moe/routing_agreement"] for x in p["layers"]) if p["layers"] else float("nan")
        rel = max(x["moe/out_rel_diff"] for x in p["layers"]) if p["layers"] else float("nan")
        rows.append([p["sampler"], p["trainer"]] + [_fmt(p["metrics"][k], f) for _, k, f in _TABLE_COLUMNS]
                    + [_fmt(agree, ".4f"), _fmt(rel, ".2e")])
    lines += _grid(head, rows)
    lines.append("per MoE layer (both sides fed the trainer's hidden states):")
    head = ["sampler", "trainer", "layer", "routing agree", "out rel diff", "out max|Δ|", "bitwise", "logits max|Δ|"]
    rows = []
    for p in report["pairs"]:
        for i, x in enumerate(p["layers"]):
            rows.append([p["sampler"], p["trainer"], str(i), _fmt(x["moe/routing_agreement"], ".4f"),
                         _fmt(x["moe/out_rel_diff"], ".2e"), _fmt(x["moe/out_max_abs_diff"], ".2e"),
                         "yes" if x["moe/out_bitwise_equal"] else "no",
                         _fmt(x["moe/router_logits_max_abs_diff"], ".2e")])
    lines += _grid(head, rows)
    g = report["generation_vs_scoring"]
    lines.append(f"sampler {g['impl']}: logprobs while generating vs when scoring the same tokens: "
                 f"max|Δlogp| {_fmt(g['metrics']['mismatch/abs_logp_diff_max'], '.2e')}, "
                 f"k3 KL {_fmt(g['metrics']['mismatch/k3_kl'], '.2e')} (decode vs prefill kernels)")
    t = report.get("trainer_vs_generation")
    if t:
        lines.append(f"trainer {t['impl']} vs sampler {t['impl']} while generating (what a train step compares): "
                     f"max|Δlogp| {_fmt(t['metrics']['mismatch/abs_logp_diff_max'], '.2e')}, "
                     f"k3 KL {_fmt(t['metrics']['mismatch/k3_kl'], '.2e')}")
    return "\n".join(lines)


def _grid(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # strict JSON has no NaN / inf
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_outputs(report: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """consistency.json (without the per-token Δlogp lists), dlogp_hist.png, layers.png in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slim = dict(report, pairs=[{k: v for k, v in p.items() if k != "dlogp"} for p in report["pairs"]])
    paths = {"json": out / "consistency.json", "dlogp_hist": out / "dlogp_hist.png", "layers": out / "layers.png"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(slim), indent=2) + "\n")
    os.replace(tmp, paths["json"])
    plot_dlogp(report, paths["dlogp_hist"])
    plot_layers(report, paths["layers"])
    return paths


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    tmp = path.with_name(path.stem + ".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def plot_dlogp(report: dict, path: Path) -> Path:
    """A grid of histograms of Δlogp, one panel per (sampler, trainer) pair."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = report["meta"]["impls"]
    k = len(impls)
    fig, axes = plt.subplots(k, k, figsize=(3.2 * k, 2.6 * k), squeeze=False)
    for p in report["pairs"]:
        ax = axes[impls.index(p["sampler"])][impls.index(p["trainer"])]
        d = p["dlogp"]
        if d and all(v == 0.0 for v in d):
            ax.text(0.5, 0.5, f"all {len(d)} tokens\nΔlogp = 0 exactly", ha="center", va="center",
                    transform=ax.transAxes)
        else:
            ax.hist(d, bins=40, color="tab:blue")
        ax.set_title(f"sampler {p['sampler']} / trainer {p['trainer']}\n"
                     f"max|Δlogp| {p['metrics']['mismatch/abs_logp_diff_max']:.1e}", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"Δlogp = trainer - sampler ({report['meta']['dtype']}, {report['meta']['device']})", fontsize=9)
    _save(fig, path)
    return path


def plot_layers(report: dict, path: Path) -> Path:
    """Per MoE layer, grouped by pair: routing agreement (top) and relative output difference (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = report["pairs"]
    n_layers = report["meta"]["moe_layers"]
    width = 0.8 / max(len(pairs), 1)
    fig, (ax_a, ax_d) = plt.subplots(2, 1, figsize=(max(6, 1.2 * n_layers * len(pairs) ** 0.5 + 4), 6), sharex=True)
    floor = 1e-12  # a bar for an exact zero on the log axis, labelled "0"
    for j, p in enumerate(pairs):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(n_layers)]
        label = f"{p['sampler']}/{p['trainer']}"
        agree = [x["moe/routing_agreement"] for x in p["layers"]]
        rel = [x["moe/out_rel_diff"] for x in p["layers"]]
        ax_a.bar(xs, agree, width=width, label=label)
        ax_d.bar(xs, [max(v, floor) for v in rel], width=width, label=label)
        for x, v in zip(xs, rel):
            if v == 0.0:
                ax_d.text(x, floor, "0", ha="center", va="bottom", fontsize=6)
    ax_a.set_ylabel("routing agreement")
    ax_a.set_ylim(min([0.9] + [x["moe/routing_agreement"] for p in pairs for x in p["layers"]]) - 0.01, 1.005)
    ax_a.legend(fontsize=7, title="sampler/trainer", title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax_d.set_yscale("log")
    ax_d.set_ylabel("rel. diff of MoE output")
    ax_d.set_xlabel("MoE layer")
    ax_d.set_xticks(range(n_layers))
    fig.suptitle(f"per MoE layer, both sides fed the same hidden states ({report['meta']['dtype']})", fontsize=9)
    _save(fig, path)
    return path
