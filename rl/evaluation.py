"""Evaluation of a policy on a held-out dataset: between RL steps on the rollout engines, and in
`megamoe-rl eval` (rl/eval_cmd.py) on one engine of its own.

    ev = Evaluator(cfg, tokenizer)                        # checks the eval section and dataset first
    metrics, rows = ev.run(generate, step)                # generate(prompts, sampling, n[, max_tokens]) -> Samples
    pass_at_k(n=4, c=1, k=2)                              # 0.5

What one evaluation does: every prompt of the eval dataset (`eval.data`, the first `eval.prompts`
rows in the dataset's order, long prompts dropped or refused as `eval.data.long_prompts` says) gets
`eval.n` samples at `eval.temperature` / `eval.max_tokens`, scored by `eval.functions` (default: the
training reward functions). Its sampler seeds are the same at every evaluation of a run (run.seed +
EVAL_SEED_OFFSET, vLLM's per-request seeds), so two evaluations differ by the policy only, and no
evaluation draws from a training step's seeds or from an engine's own generator: a run's training
stream is the same with evaluation on and off (tests/rl/test_rl_loop.py checks its metrics).

With multi-turn episodes (`episodes`, an rl.episode_step.EpisodeStep) every sample is an episode of the
training environment and limits: `generate(prompts, sampling, 1, max_tokens)` is called once per turn with
the token ids of every live episode (docs/MULTI_TURN.md); the rewards get the message lists, and the env/*
metrics are reported as eval/env/*.

Metrics (also in metrics.jsonl, TensorBoard, W&B and the plot):
    eval/reward_mean        mean summed reward over the scored samples
    eval/pass@k             for k = 1 and every k of eval.pass_k: the mean over prompts of the unbiased
                            estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), c = the prompt's samples
                            whose summed reward is >= eval.correct_at, n = eval.n
    eval/len_mean           mean completion length in tokens
    eval/reward/<fn>/mean   each reward function's unweighted mean over the samples it scored
    eval/reward/none, eval/reward/errors, eval/prompts, eval/samples, eval/time_s
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable

from records import Sample

log = logging.getLogger("megamoe.rl.eval")

EVAL_SEED_OFFSET = 500_000_000
"""The eval sampler's base seed is run.seed * 1_000_003 + this: fixed for the whole run (module docstring)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expected 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(totals: list[float | None], per_fn: dict[str, list[float | None]], lengths: list[int], *,
                 n: int, ks: list[int], correct_at: float, errors: int = 0) -> dict[str, float]:
    """The eval/* metrics (module docstring) of prompt-major samples, n per prompt."""
    if not totals or len(totals) % n or len(lengths) != len(totals):
        raise ValueError(f"eval_metrics: {len(totals)} rewards and {len(lengths)} lengths for {n} samples per prompt")
    scored = [t for t in totals if t is not None]
    m: dict[str, float] = {"eval/reward_mean": sum(scored) / len(scored) if scored else float("nan")}
    solved = [sum(t is not None and t >= correct_at for t in totals[i:i + n]) for i in range(0, len(totals), n)]
    for k in sorted({1, *ks}):
        m[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in solved) / len(solved)
    m["eval/len_mean"] = sum(lengths) / len(lengths)
    for name, vals in per_fn.items():
        got = [v for v in vals if v is not None]
        m[f"eval/reward/{name}/mean"] = sum(got) / len(got) if got else float("nan")
    m["eval/reward/none"] = len(totals) - len(scored)
    m["eval/reward/errors"] = errors
    m["eval/prompts"] = len(solved)
    m["eval/samples"] = len(totals)
    return m


class Evaluator:
    """One run's evaluation: its prompts (rendered as the sampler gets them), sampling and rewards,
    all resolved and checked when it is built (before any actor or engine starts)."""

    def __init__(self, cfg, tokenizer, rewards: list | None = None, episodes=None):
        from rl.config import ConfigError
        from rl.data import PromptSource, apply_chat_template, check_prompt_lengths
        from rl.rewards import RewardScorer, load_rewards

        e = cfg.eval
        if e.data is None:
            raise ConfigError("eval.data: expected an eval dataset (task or path), got null")
        if episodes is not None and e.max_tokens is not None:
            raise ConfigError(f"eval.max_tokens: expected null with multi-turn episodes (env.tools or env.environment "
                              "set: the evaluation's episodes have the training episodes' limits, env.max_tokens_per_turn "
                              f"and env.max_total_tokens; docs/MULTI_TURN.md), got {e.max_tokens!r}")
        self.episodes = episodes  # rl.episode_step.EpisodeStep: the evaluation runs episodes (docs/MULTI_TURN.md)
        self.cfg = cfg
        self.every = e.every
        self.n = e.n
        self.ks = list(e.pass_k)
        self.correct_at = e.correct_at
        self.max_tokens = e.max_tokens if e.max_tokens is not None else cfg.rollout.max_tokens
        seed = e.task_seed if e.task_seed is not None else cfg.run.seed + 1
        # Every row in the dataset's own order: an evaluation is a fixed set, not a sample of it.
        source = PromptSource.from_config(dataclasses.replace(e.data, shuffle=False), seed=seed, key="eval.data")
        limit = cfg.rollout.max_model_len - self.max_tokens
        why = f" (rollout.max_model_len={cfg.rollout.max_model_len} - eval max_tokens={self.max_tokens})"
        dropped = check_prompt_lengths(source, tokenizer, limit, e.data.long_prompts, chat=e.data.chat_template,
                                       why=why)
        if dropped:
            log.warning("eval: dropped %d of %d prompts longer than %d tokens%s", len(dropped),
                        len(dropped) + source.n, limit, why)
        count = source.n if e.prompts is None else e.prompts
        if count > source.n:
            raise ConfigError(f"eval.prompts: expected at most the {source.n} rows of the eval dataset "
                              f"({source.origin}) left after dropping long prompts, got {e.prompts}")
        batch = self.batch = source.batch(0, count)
        self.raw_prompts = batch.prompts             # what reward functions get (strings or message lists)
        self.columns = batch.columns
        wants_template = e.data.chat_template or source.conversational
        self.prompts = (apply_chat_template(tokenizer, batch.prompts, strings=e.data.chat_template)
                        if wants_template else list(batch.prompts))  # what the sampler gets
        self.scorer = RewardScorer(load_rewards(e.reward_config(cfg.reward), "eval.functions" if e.functions is not None else "reward.functions") if rewards is None else rewards)
        self.sampling = {"temperature": e.temperature, "top_p": 1.0, "max_tokens": self.max_tokens,
                         "seed": cfg.run.seed * 1_000_003 + EVAL_SEED_OFFSET,
                         **({"stop": list(cfg.rollout.stop)} if cfg.rollout.stop else {})}
        log.info("eval: %d prompts x %d samples from %s%s", len(self.prompts), self.n, source.origin,
                 f", every {self.every} steps" if self.every else "")

    def due(self, step: int) -> bool:
        """Whether the policy after `step` is evaluated: before the first step (0), every eval.every
        steps, and after the last one (run.steps)."""
        return bool(self.every) and (step % self.every == 0 or step == self.cfg.run.steps)

    def run(self, generate: Callable[[list[str], dict, int], list[Sample]], step: int) -> tuple[dict, list[dict]]:
        """Sample, score and summarise; (eval/* metrics, one row per sample). `generate(prompts,
        sampling, n)` returns prompt-major records.Sample (RolloutWorker.generate's) from one policy; with
        episodes it also takes per-prompt `max_tokens` and is called once per turn (module docstring)."""
        from rl.rewards import TrainerState

        t0 = time.perf_counter()
        before = dict(self.scorer.errors_total)
        state = TrainerState(global_step=step, max_steps=self.cfg.run.steps)
        if self.episodes is not None:  # one generate call per turn, every live episode in it
            episodes = self.episodes.run(self.batch, self.n, dict(self.sampling), generate)
            idx, texts = [e.prompt_index for e in episodes], [e.text for e in episodes]
            lengths = [len(e.completion_ids) for e in episodes]
            rewards = self.episodes.rewards(self.scorer, self.batch, episodes, state)
        else:
            samples = generate(self.prompts, dict(self.sampling), self.n)
            idx, texts = [s.prompt_index for s in samples], [s.text for s in samples]
            lengths = [len(s.completion_ids) for s in samples]
        if idx != [i for i in range(len(self.prompts)) for _ in range(self.n)]:
            raise RuntimeError(f"eval: generate returned samples for prompts {idx}, expected {self.n} of each "
                               f"of {len(self.prompts)} in order")
        if self.episodes is None:
            rewards = self.scorer([self.raw_prompts[i] for i in idx], texts,
                                  {k: [v[i] for i in idx] for k, v in self.columns.items()},
                                  completion_ids=[s.completion_ids for s in samples], trainer_state=state)
        errors = sum(self.scorer.errors_total.values()) - sum(before.values())
        m = eval_metrics(rewards.total, rewards.per_fn, lengths, n=self.n, ks=self.ks, correct_at=self.correct_at,
                         errors=errors)
        m.update({f"eval/{k}": v for k, v in rewards.logged.items() if k.startswith("env/")})
        m["eval/time_s"] = time.perf_counter() - t0
        rows = [{"step": step, "prompt_index": i, "prompt": self.prompts[i], "completion": t,
                 "reward": r, "rewards": {name: v[j] for name, v in rewards.per_fn.items()},
                 "correct": r is not None and r >= self.correct_at}
                for j, (i, t, r) in enumerate(zip(idx, texts, rewards.total))]
        return m, rows


def summary_table(metrics: dict[str, Any]) -> str:
    """The eval/* metrics as an aligned two-column text table (the `megamoe-rl eval` printout)."""
    keys = [k for k in metrics if k.startswith("eval/")]
    width = max(len(k) for k in keys)
    return "\n".join(f"{k:<{width}}  {metrics[k]:.4g}" if isinstance(metrics[k], float)
                     else f"{k:<{width}}  {metrics[k]}" for k in keys)
