"""The RL loop's multi-turn hook (docs/MULTI_TURN.md): one step's generate call as episodes, and their scoring.

With `env.tools` or `env.environment` set, the driver (rl/loop.py) takes a step's generation from
`EpisodeStep.flight` instead of rl/pipeline.py's Generation.submit (episodes run on-policy, k = 0: the
config refuses run.max_async_steps with them), dynamic sampling's extra draws too, and Scoring scores them
with `EpisodeStep.rewards`; the evaluation (rl/evaluation.py) runs its episodes with `EpisodeStep.run`.
`on_workers` sends every turn's token-id contexts to the rollout workers in one call each (each worker gets
a contiguous slice, as Generation splits prompts); `samples` turns the episodes into Samples (completion =
assistant and environment tokens, loss_mask 1 on the sampled ones, the routing merged over the turns);
`rewards` scores them: reward functions get the completion as a message list including the tool messages
(TRL's conversational convention) and, as TRL's `environments` keyword, each episode's environment instance
(or verifiers state); the environment's own reward is added with env.reward_weight (reward/env/mean). The
env/* metrics ride in the reward metrics.
"""

from __future__ import annotations

from pathlib import Path

from rl.envs import Environment
from rl.episodes import ChatFormat, Episode, EpisodeRunner, episode_metrics
from records import Sample

TURN_SEED_STRIDE = 1_000_003  # turn t of a step samples with the step's seed + t * this (+ the worker's slice start)


def eos_ids(tokenizer, model_dir: str | Path) -> list[int]:
    """The tokens vLLM stops a turn on: the tokenizer's eos and generation_config.json's eos_token_id."""
    import json

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


class EpisodeStep:
    """Builds the environment and the chat format from the config (refusing, before any actor starts, what
    cannot run), then serves Loop.draw."""

    def __init__(self, cfg, tokenizer, model_dir: str | Path):
        from rl.config import env_limits

        self.cfg = cfg
        self.env = Environment(cfg.env)
        self.fmt = ChatFormat(tokenizer, self.env.schemas, eos_ids(tokenizer, model_dir),
                              env_role="user" if self.env.kind == "verifiers" else "tool")
        per_turn, total = env_limits(cfg)
        self.runner = EpisodeRunner(self.env, self.fmt, max_turns=cfg.env.max_turns, max_tokens_per_turn=per_turn,
                                    max_total_tokens=total)
        self.episodes: list[Episode] = []  # the last draw's
        self.busy_s = 0.0  # the rollout workers' seconds in the last draw's generate calls

    def on_workers(self, gen, version: int):
        """`generate(prompts, sampling, n, max_tokens) -> samples` (RolloutWorker.generate's dict fields) on the
        rollout workers of `gen` (rl.pipeline.Generation), one call each on a contiguous slice (as Generation
        splits prompts), each slice's seed offset by its start as one engine would offset it, stamped with policy
        version `version` (the one last published); self.busy_s adds the slowest worker's seconds of each call."""
        actors = gen.actors

        def generate(prompts: list[list[int]], sampling: dict, n: int, max_tokens: list[int]) -> list[Sample]:
            refs = []
            for w, (a, b) in zip(actors.rollouts, gen.bounds(len(prompts))):
                if a == b:
                    refs.append(None)
                    continue
                s = {**sampling, "seed": sampling["seed"] + a * n}
                refs.append(w.generate.remote(prompts[a:b], n, s, offset=a, policy_version=version,
                                              max_tokens=max_tokens[a:b]))
            live = [(j, r) for j, r in enumerate(refs) if r is not None]
            outs = actors.get([r for _, r in live], [f"RolloutWorker {j}" for j, _ in live], "generate")
            self.busy_s += max(sec for _, sec in outs)
            return [x for out, _ in outs for x in out]
        return generate

    def run(self, batch, n: int, sampling: dict, generate) -> list[Episode]:
        """n episodes of each of `batch`'s prompts (rl.data's batch: prompts and reward columns), every turn one
        `generate(prompts, sampling, 1, max_tokens)` call holding every live episode; turn t samples with
        sampling's seed + t * TURN_SEED_STRIDE (+ the episode's index, as one engine gives it)."""
        rows = [{"prompt": p, **{k: v[i] for k, v in batch.columns.items()}} for i, p in enumerate(batch.prompts)]

        def one_turn(ctx: list[list[int]], budgets: list[int], turn: int) -> list[dict]:
            return generate(ctx, {**sampling, "seed": sampling["seed"] + turn * TURN_SEED_STRIDE}, 1, budgets)

        return self.runner.run(rows, batch.prompts, n, one_turn)

    def generate(self, gen, batch, sampling: dict, version: int) -> list[Episode]:
        """The step's episodes of `batch`'s prompts on the rollout workers of `gen`, by policy version `version`."""
        self.busy_s = 0.0
        self.episodes = self.run(batch, self.cfg.rollout.n, sampling, self.on_workers(gen, version))
        return self.episodes

    def samples(self, episodes: list[Episode], version: int) -> list[Sample]:
        return [Sample(prompt_index=e.prompt_index, prompt_ids=e.prompt_ids, completion_ids=e.completion_ids,
                       sampler_logprobs=e.sampler_logprobs, text=e.text,
                       finish_reason="truncated" if e.truncated else e.finish_reason, policy_version=version,
                       loss_mask=e.loss_mask, routed_experts=e.routed_experts) for e in episodes]

    def rewards(self, scorer, batch, episodes: list[Episode], trainer_state):
        """The reward functions on message-list completions, plus the environment's reward; env/* metrics."""
        from rl.rewards import RewardResult

        idx = [e.prompt_index for e in episodes]
        columns = {k: [v[i] for i in idx] for k, v in batch.columns.items()}
        prompts = [batch.prompts[i] if not isinstance(batch.prompts[i], str)
                   else [{"role": "user", "content": batch.prompts[i]}] for i in idx]
        res = scorer(prompts, [e.text for e in episodes], columns,
                     completion_ids=[e.completion_ids for e in episodes], trainer_state=trainer_state,
                     completion_messages=[e.messages for e in episodes],
                     environments=[e.handle for e in episodes])
        env_r = [e.env_reward for e in episodes]
        total, per_fn = list(res.total), dict(res.per_fn)
        if any(r is not None for r in env_r):
            w = self.cfg.env.reward_weight
            total = [t if r is None else (t or 0.0) + w * r for t, r in zip(total, env_r)]
            per_fn["env"] = env_r
        errors = {**res.errors, **({"env": 0} if "env" in per_fn else {})}
        return RewardResult(total=total, per_fn=per_fn, errors=errors,
                            logged={**res.logged, **episode_metrics(episodes)})

    def extra_draws(self, gen):
        """Dynamic sampling's extra draws (Scoring.score's `generate(batch, prompts, sampling) -> samples`): episodes
        too, by the version last published."""
        return lambda batch, prompts, sampling: self.flight(gen, None, batch, prompts, sampling).samples

    def flight(self, gen, step: int, batch, prompts: list, sampling: dict):
        """Step `step`'s generation as episodes: an rl.pipeline.Flight whose samples are the episodes'
        (completion = assistant and environment tokens, loss_mask 1 on the sampled ones)."""
        from rl.pipeline import Flight

        episodes = self.generate(gen, batch, sampling, gen.version)
        return Flight(step, gen.version, batch, prompts, sampling, self.cfg.rollout.n, gen.bounds(len(prompts)),
                      samples=self.samples(episodes, gen.version), busy_s=self.busy_s)
