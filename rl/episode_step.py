"""The RL loop's multi-turn hook (docs/MULTI_TURN.md): a step's generation as episodes, and their scoring.

With `env.tools` or `env.environment` set, the driver (rl/loop.py) queues a step's generation with
`EpisodeStep.submit` instead of rl/pipeline.py's Generation.submit, at any lag k = run.max_async_steps. An
episode needs the driver between its turns (the environment's reply decides the next context), so a step's
episodes run turn by turn in a driver thread: ONE thread for every flight of episodes, dynamic sampling's extra
draws and the evaluation's episodes (`queued`), so they run one after another in the order the driver queued them
and the run stays a function of its config and seed. A flight's policy version is the one last published when
it is queued (as Generation.submit's); Publication.publish waits for every flight queued before it
(Generation.join) before it queues the next weights, so each turn of a flight of version v runs on v.
`on_workers` sends every turn's token-id contexts to the rollout workers in one call each (each worker gets
a contiguous slice, as Generation splits prompts); `samples` turns the episodes into Samples (completion =
assistant and environment tokens, loss_mask 1 on the sampled ones, the routing merged over the turns);
`rewards` scores them: reward functions get the completion as a message list including the tool messages
(TRL's conversational convention) and, as TRL's `environments` keyword, each episode's environment instance
(or verifiers state); the environment's own reward is added with env.reward_weight (reward/env/mean). The
env/* metrics ride in the reward metrics. A rollout worker that dies during a turn ends the run (ActorError,
raised where the driver collects the flight); `--resume` continues from the last checkpoint.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

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


class Stopped(RuntimeError):
    """The run is ending (EpisodeStep.close): a flight's next turn is not sent."""


class Turns:
    """`generate(prompts, sampling, n, max_tokens) -> samples` of one flight on the rollout workers
    (EpisodeStep.on_workers); busy_s adds the slowest worker's seconds of each call."""

    def __init__(self, owner: EpisodeStep, gen, version: int):
        self.owner, self.gen, self.version, self.busy_s = owner, gen, version, 0.0

    def __call__(self, prompts: list[list[int]], sampling: dict, n: int, max_tokens: list[int]) -> list[Sample]:
        if self.owner.stopped.is_set():
            raise Stopped("the run is ending: the episodes in flight stop before their next turn")
        actors, refs = self.gen.actors, []
        for w, (a, b) in zip(actors.rollouts, self.gen.bounds(len(prompts))):
            if a == b:
                refs.append(None)
                continue
            s = {**sampling, "seed": sampling["seed"] + a * n}
            refs.append(w.generate.remote(prompts[a:b], n, s, offset=a, policy_version=self.version,
                                          max_tokens=max_tokens[a:b]))
        live = [(j, r) for j, r in enumerate(refs) if r is not None]
        outs = actors.get([r for _, r in live], [f"RolloutWorker {j}" for j, _ in live], "generate")
        self.busy_s += max(sec for _, sec in outs)
        return [x for out, _ in outs for x in out]


class EpisodeStep:
    """Builds the environment and the chat format from the config (refusing, before any actor starts, what
    cannot run), then serves the driver (module docstring)."""

    def __init__(self, cfg, tokenizer, model_dir: str | Path):
        from rl.config import env_limits

        self.cfg = cfg
        self.env = Environment(cfg.env)
        self.fmt = ChatFormat(tokenizer, self.env.schemas, eos_ids(tokenizer, model_dir),
                              env_role="user" if self.env.kind == "verifiers" else "tool")
        per_turn, total = env_limits(cfg)
        self.runner = EpisodeRunner(self.env, self.fmt, max_turns=cfg.env.max_turns, max_tokens_per_turn=per_turn,
                                    max_total_tokens=total)
        self.pool: ThreadPoolExecutor | None = None  # the one driver thread of every episode (module docstring)
        self.stopped = threading.Event()  # close(): no further turn is sent

    def on_workers(self, gen, version: int) -> Turns:
        """`generate(prompts, sampling, n, max_tokens) -> samples` (RolloutWorker.generate's dict fields) on the
        rollout workers of `gen` (rl.pipeline.Generation), one call each on a contiguous slice (as Generation
        splits prompts), each slice's seed offset by its start as one engine would offset it, stamped with policy
        version `version`; its busy_s adds the slowest worker's seconds of each call."""
        return Turns(self, gen, version)

    def queued(self, gen, fn: Callable[[Turns], object]) -> Future:
        """`fn(turns)` in the episodes' driver thread, behind everything queued there, `turns` (on_workers) by the
        version last published (gen.version, taken now, as Generation.submit takes it); the weight updates queued
        on the workers since the last call (gen.unchecked) are checked first (ActorError naming the worker)."""
        version, syncs = gen.version, gen.unchecked
        gen.unchecked = [[] for _ in gen.actors.rollouts]

        def run():
            live = [(j, ref) for j, q in enumerate(syncs) for ref in q]
            if live:
                gen.actors.get([r for _, r in live], [f"RolloutWorker {j}" for j, _ in live], "update_weights")
            return fn(self.on_workers(gen, version))
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="episodes")
        return self.pool.submit(run)

    def close(self) -> None:
        """The run ends: a running flight stops before its next turn (Stopped), the queued ones never start."""
        self.stopped.set()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def run(self, batch, n: int, sampling: dict, generate) -> list[Episode]:
        """n episodes of each of `batch`'s prompts (rl.data's batch: prompts and reward columns), every turn one
        `generate(prompts, sampling, 1, max_tokens)` call holding every live episode; turn t samples with
        sampling's seed + t * TURN_SEED_STRIDE (+ the episode's index, as one engine gives it)."""
        rows = [{"prompt": p, **{k: v[i] for k, v in batch.columns.items()}} for i, p in enumerate(batch.prompts)]

        def one_turn(ctx: list[list[int]], budgets: list[int], turn: int) -> list[dict]:
            return generate(ctx, {**sampling, "seed": sampling["seed"] + turn * TURN_SEED_STRIDE}, 1, budgets)

        return self.runner.run(rows, batch.prompts, n, one_turn)

    def draw(self, turns: Turns, batch, sampling: dict) -> tuple[list[Sample], float, list[Episode]]:
        """(samples, the workers' busy seconds, episodes) of rollout.n episodes of each of `batch`'s prompts."""
        episodes = self.run(batch, self.cfg.rollout.n, sampling, turns)
        return self.samples(episodes, turns.version), turns.busy_s, episodes

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

    def flight(self, gen, step: int | None, batch, prompts: list, sampling: dict):
        """Step `step`'s generation as episodes, queued (`queued`): an rl.pipeline.Flight whose future resolves to
        the episodes' samples (completion = assistant and environment tokens, loss_mask 1 on the sampled ones),
        the busy seconds and the episodes; Generation.collect waits for it."""
        from rl.pipeline import Flight

        return Flight(step, gen.version, batch, prompts, sampling, self.cfg.rollout.n, gen.bounds(len(prompts)),
                      future=self.queued(gen, lambda turns: self.draw(turns, batch, sampling)))

    def submit(self, gen, step: int, batch, prompts: list, sampling: dict):
        """Step `step`'s episodes into the pipeline (gen.pending: Generation.pop and join collect them)."""
        f = self.flight(gen, step, batch, prompts, sampling)
        gen.pending.append(f)
        return f

    def extra_draws(self, gen):
        """Dynamic sampling's extra draws (Scoring.score's `generate(batch, prompts, sampling) -> (samples,
        episodes)`): a flight of episodes by the version last published, behind the flights in flight, collected."""
        def generate(batch, prompts: list, sampling: dict):
            f = self.flight(gen, None, batch, prompts, sampling)
            gen.collect(f)
            return f.samples, f.episodes
        return generate
