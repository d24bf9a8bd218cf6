"""The typed config tree of `megamoe-rl train`; YAML files in configs/ are instances of it.

    megamoe-rl train --config configs/tiny.yaml rollout.temperature=0.8 run.steps=10 --dry-run
    megamoe-rl train --help-config        # every key with its type and one-line doc

Every field carries its documentation in `metadata["doc"]` (`describe()` lists them all). The
`trainer` section is trainer/config.py's TrainerConfig, defined there next to the code that reads
it, as are the typed loader and `field` (trainer/ cannot import rl/); this module adds the other
sections, the cross-section checks, the dotted overrides and `load`. Loading checks every key and
every value against the tree: an unknown key is an error that names it and suggests close matches,
a value of the wrong type or out of range is an error that names the key, the expected and the
actual value. Nothing here imports torch, vLLM or Ray, so the CLI parses and validates a config
(and answers `--help`) without paying for them.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from megamoe.contract import BITWISE, FAST, MEGAMOE, NUMERICS  # standard library only at import time
from rl.make_model import ARCHS  # standard library only at import time
from trainer.config import (DTYPES, ConfigError, MoEImpl, TrainerConfig, TrainerWorkerConfig, build, check,
                            dataclass_in, describe as describe_tree, field, suggest, to_plain, unknown_key)

@dataclass
class MakeModelConfig:
    """A random-initialised HF checkpoint written by `rl.make_model.make_model` (no download)."""
    arch: Literal[ARCHS] = field("qwen3_moe", "transformers model_type of the made model (rl.make_model.ARCHS)")
    layers: int = field(2, "decoder layers")
    hidden: int = field(64, "hidden size H")
    experts: int = field(8, "routed experts E per MoE layer")
    topk: int = field(2, "experts per token k")
    intermediate: int = field(32, "expert intermediate size I")
    vocab: int | None = field(None, "vocabulary size; null = the tokenizer's own size")
    seed: int = field(0, "seed of the random initialisation")
    heads: int | None = field(None, "query heads; with kv_heads and head_dim (all three or none: null derives "
                                    "the layout from hidden)")
    kv_heads: int | None = field(None, "key/value heads (grouped-query attention), a divisor of heads")
    head_dim: int | None = field(None, "head size")
    dtype: Literal[DTYPES] = field("float32", "the made checkpoint's dtype (bfloat16 halves the host memory "
                                              "making it takes)")


@dataclass
class ModelConfig:
    path: str | None = field(None, "local HF checkpoint folder (config.json, safetensors, tokenizer); "
                                   "exactly one of `path` and `make` is set")
    make: MakeModelConfig | None = field(None, "make a random-initialised model into <run.out_dir>/model "
                                               "instead of loading `path`")
    dtype: Literal[DTYPES] = field("float32", "parameter dtype on both sides (sampler and trainer)")

    def validate(self, at: str) -> None:
        if (self.path is None) == (self.make is None):
            raise ConfigError(f"{at}: set exactly one of {at}.path and {at}.make "
                              f"(got path={self.path!r}, make={'set' if self.make else None})")


ENGINE_KWARGS_OWNED = {"numerics": "run.numerics", "weight_sync": "rollout.weight_sync", "dtype": "model.dtype",
                       "seed": "run.seed", "max_model_len": "rollout.max_model_len",
                       "kv_cache_memory_bytes": "rollout.kv_cache_bytes", "sleep_mode": "rollout.sleep_level",
                       "return_routing": "trainer.routing_replay or trainer.routing_metrics"}
"""RolloutWorker arguments rl/loop.py derives from other keys (named in the error), never engine_kwargs."""


@dataclass
class RolloutConfig:
    moe_impl: MoEImpl = field("megamoe", "MoE implementation inside vLLM: megamoe, reference, or stock (vLLM's own)")
    n: int = field(8, "samples per prompt (the GRPO group size G), >= 2: the advantage is relative to the group")
    temperature: float = field(1.0, "sampling temperature; logprobs are taken after it (processed logprobs)")
    top_p: float = field(1.0, "nucleus sampling mass in (0, 1]")
    max_tokens: int = field(64, "completion length limit in tokens")
    stop: list[str] = field(doc="stop strings (vLLM's SamplingParams.stop): a completion, or an episode's assistant "
                                "turn, ends at the first one; its text drops the string, its token ids keep it",
                            factory=list)
    max_model_len: int = field(512, "vLLM max_model_len: prompt + completion tokens")
    kv_cache_bytes: int = field(256 * 2**20, "KV-cache size per engine in bytes (vLLM kv_cache_memory_bytes; "
                                             "vLLM on CPU needs it explicit)")
    num_workers: int = field(1, "RolloutWorker actors (vLLM engines); prompts are split between them")
    cpus_per_worker: float = field(1.0, "CPUs reserved per RolloutWorker in its placement-group bundle")
    gpus_per_worker: float = field(0.0, "GPUs reserved per RolloutWorker (0 on CPU machines)")
    max_restarts: int = field(3, "times a dead RolloutWorker is restarted (with the current weights) before the run fails")
    weight_sync: Literal["auto", "ipc", "nccl", "files"] = field(
        "auto", "how trainer weights reach the engines (rollout/sync.py): ipc (vLLM's CUDA IPC engine; trainer "
                "rank and engine on one GPU), nccl (separate GPUs, vLLM's NCCL engine; opt-in, not yet run on "
                "two GPUs), files (safetensors buckets in /dev/shm; CPU); auto = ipc when colocated on CUDA, files on CPU")
    ipc_bucket_bytes: int = field(1 << 30, "weight_sync=ipc: bytes of the one GPU buffer the trainer packs each "
                                           "chunk into (vLLM's packed IPC transfer; its default, 1 GiB); nccl: "
                                           "bytes of each of vLLM's packed broadcast buffers")
    sleep_level: int = field(0, "vLLM sleep mode while the trainer trains (CUDA): 0 = the engine stays awake; "
                                "1 = KV cache freed, weights moved to host memory; 2 = both freed (the sync "
                                "after the step delivers every weight again)")
    worker: str = field("rollout.worker:RolloutWorker", "the rollout actor's class (module:Class); another class with "
                                                        "RolloutWorker's interface (docs/CONTRIBUTING.md) may replace it")
    engine_kwargs: dict[str, Any] = field(doc="extra keyword arguments for RolloutWorker (passed through unchanged)",
                                          factory=dict)

    def validate(self, at: str) -> None:
        owned = sorted(set(self.engine_kwargs) & set(ENGINE_KWARGS_OWNED))
        check(not owned, f"{at}.engine_kwargs", "no key the run derives from another setting (set "
              f"{', '.join(ENGINE_KWARGS_OWNED[k] for k in owned)} instead)", owned)
        # Refused, not warned: the advantage is relative to the group (rl.advantages.group_advantages,
        # with or without reward.scale_by_std), so a lone sample is its own group's mean, every
        # advantage is 0 and the run would spend its steps learning nothing; a warning scrolls past.
        check(self.n >= 2, f"{at}.n", "an int >= 2 (the GRPO advantage is a sample's reward minus its group's "
               "mean: with one sample per prompt every advantage is 0 and nothing is learned)", self.n)
        check(self.temperature > 0, f"{at}.temperature", "a float > 0", self.temperature)
        check(0 < self.top_p <= 1, f"{at}.top_p", "a float in (0, 1]", self.top_p)
        check(self.max_tokens >= 1, f"{at}.max_tokens", "an int >= 1", self.max_tokens)
        check(all(isinstance(x, str) and x for x in self.stop), f"{at}.stop", "a list of non-empty strings", self.stop)
        check(self.max_model_len > self.max_tokens, f"{at}.max_model_len",
               f"an int > {at}.max_tokens ({self.max_tokens})", self.max_model_len)
        check(self.kv_cache_bytes > 0, f"{at}.kv_cache_bytes", "an int > 0", self.kv_cache_bytes)
        check(self.num_workers >= 1, f"{at}.num_workers", "an int >= 1", self.num_workers)
        check(self.cpus_per_worker >= 0, f"{at}.cpus_per_worker", "a float >= 0", self.cpus_per_worker)
        check(self.gpus_per_worker >= 0, f"{at}.gpus_per_worker", "a float >= 0", self.gpus_per_worker)
        check(self.max_restarts >= 0, f"{at}.max_restarts", "an int >= 0", self.max_restarts)
        check(self.ipc_bucket_bytes >= 1 << 20, f"{at}.ipc_bucket_bytes", "an int >= 1048576 (1 MiB)",
               self.ipc_bucket_bytes)
        check(self.sleep_level in (0, 1, 2), f"{at}.sleep_level", "0, 1 or 2", self.sleep_level)
        check(self.cpus_per_worker + self.gpus_per_worker > 0, f"{at}.cpus_per_worker/{at}.gpus_per_worker",
               "at least one of them > 0 (a placement-group bundle cannot be empty)",
               (self.cpus_per_worker, self.gpus_per_worker))


ROLES = ("prompt", "answer", "data_source")
"""Column roles a dataset maps to its own column names (`data.columns`)."""


@dataclass
class DataConfig:
    task: str | None = field(None, "built-in synthetic task (rl/tasks.py: `megamoe-rl train --list-tasks`); "
                                   "exactly one of `task` and `path` is set")
    task_size: int = field(2048, "examples the task generator makes (seeded by run.seed)")
    task_kwargs: dict[str, Any] = field(doc="keyword arguments of the task generator", factory=dict)
    path: str | None = field(None, "local dataset: a .json/.jsonl/.parquet file or a `save_to_disk` folder")
    split: str = field("train", "split of a `save_to_disk` DatasetDict (ignored for single datasets and files)")
    columns: dict[str, str] = field(doc="role -> dataset column; roles: prompt (required), answer, data_source; "
                                        "a dotted name reaches into a nested column (verl: answer: "
                                        "reward_model.ground_truth). Every other column reaches reward functions "
                                        "as a keyword argument",
                                    factory=lambda: {"prompt": "prompt", "answer": "answer"})
    prompt_template: str = field("{prompt}", "format string applied to the prompt column ({prompt} is replaced)")
    chat_template: bool = field(False, "wrap each string prompt as one user turn with the tokenizer's chat template "
                                       "(prompts that are chat-message lists, TRL's conversational form, always get it)")
    shuffle: bool = field(True, "shuffle each epoch (seeded by run.seed and the epoch)")
    dynamic_sampling: bool = field(False, "DAPO's dynamic sampling: drop the groups whose rewards are all equal "
                                          "(advantage 0) and generate for new prompts until run.prompts_per_step "
                                          "groups with signal fill the batch (rl/dynamic_sampling.py)")
    max_extra_generates: int = field(4, "dynamic_sampling: generate calls per step beyond the first, at most; "
                                        "after them the batch is filled with dropped groups (counted)")
    long_prompts: Literal["drop", "refuse"] = field(
        "drop", "prompts longer than min(rollout.max_model_len, trainer.max_seq_len) - rollout.max_tokens "
                "tokens, found when the run starts: drop them (counted in train.log and the metric "
                "data/dropped_prompts) or refuse the run naming the first one")

    def validate(self, at: str) -> None:
        if (self.task is None) == (self.path is None):
            raise ConfigError(f"{at}: set exactly one of {at}.task and {at}.path "
                              f"(got task={self.task!r}, path={self.path!r})")
        check(self.task_size >= 1, f"{at}.task_size", "an int >= 1", self.task_size)
        check(not self.dynamic_sampling or self.max_extra_generates >= 1, f"{at}.max_extra_generates",
              f"an int >= 1 with {at}.dynamic_sampling (the extra generate calls that replace dropped groups)",
              self.max_extra_generates)
        for role in self.columns:
            if role not in ROLES:
                raise ConfigError(f"{at}.columns: unknown role {role!r}; roles are {list(ROLES)}"
                                  + suggest(role, ROLES))
        if "prompt" not in self.columns:
            raise ConfigError(f"{at}.columns: the role 'prompt' must map to a column, got {self.columns!r}")
        if "{prompt}" not in self.prompt_template:
            raise ConfigError(f"{at}.prompt_template: expected a format string containing '{{prompt}}', "
                              f"got {self.prompt_template!r}")


@dataclass
class RewardFnConfig:
    fn: str = field("exact_match", "a built-in reward name (exact_match, numeric, format, ...) "
                                   "or a dotted path `pkg.module:function`")
    weight: float = field(1.0, "weight of this function in the summed reward")
    kwargs: dict[str, Any] = field(doc="extra keyword arguments for the function", factory=dict)
    style: Literal["auto", "batch", "per_sample"] = field(
        "auto", "batch (TRL's, called by keyword): f(prompts=, completions=, completion_ids=, **columns) "
                "-> list[float]; per_sample: verl's "
                "compute_score(data_source, solution_str, ground_truth, extra_info) -> float; "
                "auto: per_sample when the function has a `solution_str` parameter")
    name: str | None = field(None, "name in metrics (reward/<name>); null = the function's name")
    factory: bool = field(False, "`fn` is a factory (TRL's get_cosine_scaled_reward, get_soft_overlong_punishment): "
                                 "called once at load with factory_kwargs, it returns the reward function")
    factory_kwargs: dict[str, Any] = field(doc="keyword arguments of the factory (factory: true)", factory=dict)


@dataclass
class RewardConfig:
    functions: list[RewardFnConfig] = field(doc="reward functions; the reward is their weighted sum",
                                            factory=lambda: [RewardFnConfig()])
    scale_by_std: bool | None = field(None, "group advantage (r - mean_G) / (std_G + eps); false: r - mean_G; "
                                            "null = true, except false under trainer.loss=dr_grpo")
    eps: float = field(1e-6, "added to the group std")
    overlong_buffer: int = field(0, "DAPO's soft overlong punishment (rl/overlong.py): completions longer than "
                                    "rollout.max_tokens - overlong_buffer tokens lose up to overlong_penalty, "
                                    "linearly, by rollout.max_tokens; 0 = off")
    overlong_penalty: float = field(1.0, "the overlong punishment at rollout.max_tokens (a reward amount, >= 0)")

    def validate(self, at: str) -> None:
        if not self.functions:
            raise ConfigError(f"{at}.functions: expected at least one reward function, got []")
        for i, f in enumerate(self.functions):
            check(math.isfinite(f.weight), f"{at}.functions.{i}.weight", "a finite float", f.weight)
            check(bool(f.fn), f"{at}.functions.{i}.fn", "a reward name or `pkg.module:fn`", f.fn)
            check(f.factory or not f.factory_kwargs, f"{at}.functions.{i}.factory_kwargs",
                  "empty unless factory: true (they are the factory's arguments)", f.factory_kwargs)
        check(self.overlong_buffer >= 0, f"{at}.overlong_buffer", "an int >= 0 (0 = off)", self.overlong_buffer)
        check(self.overlong_penalty >= 0, f"{at}.overlong_penalty", "a float >= 0", self.overlong_penalty)


@dataclass
class EvalConfig:
    """Evaluation between steps on the rollout engines (rl/evaluation.py) and `megamoe-rl eval`."""
    every: int = field(0, "evaluate before the first step, every N steps and after the last one; 0 = never "
                          "(`megamoe-rl eval` ignores it)")
    data: DataConfig | None = field(None, "the eval dataset, the keys of `data` (task or path, split, columns, "
                                          "templates, long_prompts; shuffle is ignored: every row is evaluated in "
                                          "its order); required when eval.every > 0")
    task_seed: int | None = field(None, "seed of a built-in eval task's generator; null = run.seed + 1 (run.seed "
                                        "would make the training task's first rows)")
    prompts: int | None = field(None, "evaluate the first N rows of the eval dataset (after long prompts are "
                                      "dropped); null = every row")
    n: int = field(4, "samples per prompt (pass@k needs k <= n)")
    temperature: float = field(1.0, "sampling temperature of the evaluation")
    max_tokens: int | None = field(None, "completion length limit in tokens; null = rollout.max_tokens")
    functions: list[RewardFnConfig] | None = field(None, "reward functions of the evaluation (the keys of "
                                                         "reward.functions); null = reward.functions")
    pass_k: list[int] = field(doc="the k of eval/pass@k (unbiased estimator from eval.n samples per prompt); "
                                  "eval/pass@1 is always reported", factory=lambda: [1])
    correct_at: float = field(1.0, "a sample counts as solved (pass@k) when its summed reward >= this")

    def validate(self, at: str) -> None:
        check(self.every >= 0, f"{at}.every", "an int >= 0 (0 = never)", self.every)
        if self.every > 0 and self.data is None:
            raise ConfigError(f"{at}.data: expected an eval dataset (task or path) when {at}.every > 0, got null")
        if self.data is not None:
            self.data.validate(f"{at}.data")
        check(self.prompts is None or self.prompts >= 1, f"{at}.prompts", "an int >= 1 or null", self.prompts)
        check(self.n >= 1, f"{at}.n", "an int >= 1", self.n)
        check(self.temperature > 0, f"{at}.temperature", "a float > 0", self.temperature)
        check(self.max_tokens is None or self.max_tokens >= 1, f"{at}.max_tokens", "an int >= 1 or null",
              self.max_tokens)
        if self.functions is not None:
            RewardConfig(functions=self.functions).validate(f"{at}")
        check(bool(self.pass_k) and all(k >= 1 for k in self.pass_k), f"{at}.pass_k",
              "a non-empty list of ints >= 1", self.pass_k)
        check(max(self.pass_k) <= self.n, f"{at}.pass_k", f"every k <= {at}.n ({self.n}): pass@k is estimated "
              f"from {at}.n samples per prompt", self.pass_k)
        check(math.isfinite(self.correct_at), f"{at}.correct_at", "a finite float", self.correct_at)

    def reward_config(self, training: RewardConfig) -> RewardConfig:
        """The reward section the evaluation scores with: eval.functions, else the training functions."""
        return RewardConfig(functions=self.functions) if self.functions is not None else training


@dataclass
class EnvConfig:
    """Multi-turn, tool-using episodes (rl/envs.py, rl/episodes.py; docs/MULTI_TURN.md); off while neither
    `tools` nor `environment` is set."""
    tools: list[str] = field(doc="tool functions as TRL's `tools=` takes them (type hints and a Google-style "
                                 "docstring), each `module:function`; their JSON schemas reach the chat template",
                             factory=list)
    environment: str | None = field(None, "an environment class, `module:Class`: TRL's environment_factory shape "
                                          "(no-arg __init__, reset(**row), each public method a tool; one instance "
                                          "per episode) or verifiers' MultiTurnEnv shape (env_response(messages, "
                                          "state), is_completed; one instance, built with environment_kwargs)")
    environment_kwargs: dict[str, Any] = field(doc="keyword arguments of a verifiers-shape environment's "
                                                   "constructor", factory=dict)
    max_turns: int = field(4, "assistant turns per episode at most; an episode still going after them ends "
                              "truncated")
    max_tokens_per_turn: int | None = field(None, "tokens per assistant turn at most; null = rollout.max_tokens; "
                                                  "a turn cut by it ends its episode truncated")
    max_total_tokens: int | None = field(None, "tokens of a whole episode (prompt, assistant and environment "
                                               "turns) at most; null = min(rollout.max_model_len, "
                                               "trainer.max_seq_len); reaching it ends the episode truncated")
    tool_timeout_s: float = field(10.0, "seconds one tool call (or one env_response) may take; a call that "
                                        "takes longer returns its timeout as the tool message (counted)")
    reward_weight: float = field(1.0, "weight of the environment's own reward (a verifiers state['reward'], or "
                                      "an environment instance's `reward` attribute) added to reward.functions'")

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None

    def validate(self, at: str) -> None:
        if self.tools and self.environment is not None:
            raise ConfigError(f"{at}: set at most one of {at}.tools and {at}.environment (an environment class "
                              f"brings its own tools), got tools={self.tools!r}, environment={self.environment!r}")
        for i, spec in enumerate(self.tools):
            check(isinstance(spec, str) and ":" in spec, f"{at}.tools.{i}", "`module:function`", spec)
        check(self.environment is None or ":" in self.environment, f"{at}.environment", "`module:Class` or null",
              self.environment)
        check(not self.environment_kwargs or self.environment is not None, f"{at}.environment_kwargs",
              f"empty unless {at}.environment is set", self.environment_kwargs)
        check(self.max_turns >= 1, f"{at}.max_turns", "an int >= 1", self.max_turns)
        check(self.max_tokens_per_turn is None or self.max_tokens_per_turn >= 1, f"{at}.max_tokens_per_turn",
              "an int >= 1 or null", self.max_tokens_per_turn)
        check(self.max_total_tokens is None or self.max_total_tokens >= 2, f"{at}.max_total_tokens",
              "an int >= 2 or null", self.max_total_tokens)
        check(math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0, f"{at}.tool_timeout_s",
              "a finite float > 0", self.tool_timeout_s)
        check(math.isfinite(self.reward_weight), f"{at}.reward_weight", "a finite float", self.reward_weight)


WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class WandbConfig:
    """Weights & Biases logging (rl/wandb_log.py); needs the `wandb` extra: pip install 'megamoe-rl[wandb]'."""
    mode: Literal[WANDB_MODES] = field("disabled", "disabled (no W&B), offline (files in <out_dir>/wandb, "
                                                   "`wandb sync` later; no network) or online")
    project: str = field("megamoe-rl", "W&B project")
    entity: str | None = field(None, "W&B entity (user or team); null = the account's default")
    name: str | None = field(None, "run name; null = the run folder's name")
    group: str | None = field(None, "W&B group")
    tags: list[str] = field(doc="W&B tags", factory=list)
    samples_every: int = field(0, "a table of sample completions (samples.jsonl's rows) every N steps; "
                                  "0 = run.samples_every")


@dataclass
class RayConfig:
    address: str | None = field(None, "Ray cluster to join ('auto' or host:port); null: $RAY_ADDRESS if set, "
                                      "else start a local instance")
    placement: Literal["colocated", "disaggregated"] = field(
        "colocated", "colocated: rollout workers share the trainer ranks' bundles (one placement group); "
                     "disaggregated: rollout and trainer get bundles of their own")
    num_cpus: int | None = field(None, "logical CPUs of a local instance; null = what the placement needs "
                                       "(at least the machine's cores)")
    env: dict[str, str] = field(doc="environment variables for every actor", factory=dict)


@dataclass
class RunConfig:
    out_dir: str = field("runs/default", "run folder: resolved config, metrics.jsonl, plot, checkpoints")
    steps: int = field(30, "RL steps (a resumed run counts the steps it already did)")
    seed: int = field(0, "seed of data order, sampling and initialisation")
    prompts_per_step: int = field(8, "prompts per step; each gets rollout.n samples")
    progress: bool = field(True, "show a live progress bar with the key metrics")
    tensorboard: bool = field(True, "also write TensorBoard events to <out_dir>/tensorboard")
    plot: bool = field(True, "write plot.png (reward and mismatch over steps) at the end")
    numerics: Literal[NUMERICS] = field(
        FAST, "the ops outside the MoE: fast (each side's own kernels; logprobs differ by float rounding) or "
              "bitwise (both sides on megamoe.invariant's batch-invariant linears, attention and norms: the "
              "trainer's logprobs equal the sampler's bit for bit; both sides on CPU (fp32) or both on CUDA "
              "(vLLM 0.26's batch-invariant mode), megamoe on both sides, top_p 1, Qwen3-MoE, OLMoE or "
              "Mixtral; docs/CONSISTENCY.md)")
    export_final: bool = field(True, "at the end, write the last step's policy to <out_dir>/final as a "
                                     "Hugging Face checkpoint (what `megamoe-rl export` writes)")
    max_async_steps: int = field(0, "fixed lag k of asynchronous RL: the batch trained at step t is sampled by "
                                    "the policy after step max(0, t-1-k), while the trainer trains earlier "
                                    "batches; 0 = on-policy, generate then train; every transport, evaluation, "
                                    "dynamic sampling, sleep mode and multi-turn episodes work at any k "
                                    "(docs/ASYNC.md)")
    check_memory: bool = field(True, "before a GPU run (trainer.gpus_per_rank > 0) starts, check its memory plan "
                                     "(what `megamoe-rl doctor --config` prints) against the first GPU this machine "
                                     "shows and refuse one that does not fit, naming the most layers that would; "
                                     "false starts it anyway (the plan is an estimate)")
    samples_every: int = field(0, "every N steps, append that step's samples (prompt, completion, rewards, "
                                  "advantage) to <out_dir>/samples.jsonl; 0 = never")
    wandb: WandbConfig = field(doc="Weights & Biases logging (default disabled)", factory=WandbConfig)

    def validate(self, at: str) -> None:
        check(self.steps >= 1, f"{at}.steps", "an int >= 1", self.steps)
        k = self.max_async_steps
        check(not isinstance(k, bool) and isinstance(k, int) and 0 <= k < self.steps, f"{at}.max_async_steps",
              f"an int in [0, {at}.steps={self.steps}) (a lag of {at}.steps or more would sample every batch "
              "from the initial weights)", k)
        check(self.prompts_per_step >= 1, f"{at}.prompts_per_step", "an int >= 1", self.prompts_per_step)
        check(self.samples_every >= 0, f"{at}.samples_every", "an int >= 0 (0 = never)", self.samples_every)
        check(self.wandb.samples_every >= 0, f"{at}.wandb.samples_every", "an int >= 0", self.wandb.samples_every)


@dataclass
class Config:
    """Everything `megamoe-rl train` needs; `configs/*.yaml` are instances of it."""
    model: ModelConfig = field(doc="the policy model", factory=ModelConfig)
    rollout: RolloutConfig = field(doc="sampling with vLLM (RolloutWorker actors)", factory=RolloutConfig)
    trainer: TrainerConfig = field(doc="the FSDP2 trainer (TrainerWorker actors) and its loss", factory=TrainerConfig)
    data: DataConfig = field(doc="where prompts come from", factory=DataConfig)
    reward: RewardConfig = field(doc="reward functions and group advantages", factory=RewardConfig)
    ray: RayConfig = field(doc="the Ray cluster and actor placement", factory=RayConfig)
    run: RunConfig = field(doc="the run: folder, length, seed, batch", factory=RunConfig)
    eval: EvalConfig = field(doc="evaluation between steps (off by default) and `megamoe-rl eval`",
                             factory=EvalConfig)
    env: EnvConfig = field(doc="multi-turn, tool-using episodes (off by default; docs/MULTI_TURN.md)",
                           factory=EnvConfig)


# ---------------------------------------------------------------------------------------------
# Loading: YAML / dict -> Config, with every key and value checked.


def validate(cfg: Config) -> Config:
    """Cross-field checks of every section; raises ConfigError naming the key."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "validate"):
            section.validate(f.name)
    if cfg.model.make is not None:
        m = cfg.model.make
        for name in ("layers", "hidden", "experts", "topk", "intermediate"):
            check(getattr(m, name) >= 1, f"model.make.{name}", "an int >= 1", getattr(m, name))
        check(m.topk <= m.experts, "model.make.topk", f"an int <= model.make.experts ({m.experts})", m.topk)
    resolve_weight_sync(cfg)
    if cfg.rollout.sleep_level and not _on_gpu(cfg):
        raise ConfigError(f"rollout.sleep_level: expected 0 on CPU (vLLM's sleep mode needs CUDA: "
                          f"rollout.gpus_per_worker and trainer.gpus_per_rank > 0), got {cfg.rollout.sleep_level}")
    if cfg.run.numerics == BITWISE:
        check_bitwise(cfg)
    limit, what = overlong_limit(cfg)
    if cfg.reward.overlong_buffer > limit:
        raise ConfigError(f"reward.overlong_buffer: expected an int <= {what} ({limit}), "
                          f"got {cfg.reward.overlong_buffer}")
    if cfg.trainer.loss == "dr_grpo" and cfg.reward.scale_by_std:
        raise ConfigError("reward.scale_by_std: expected null or false with trainer.loss='dr_grpo' (Dr. GRPO's "
                          "advantage is r - mean_G, without the std scaling), got True")
    check_routing(cfg)
    check_env(cfg)
    e = cfg.eval
    if e.max_tokens is not None and e.max_tokens >= cfg.rollout.max_model_len:
        raise ConfigError(f"eval.max_tokens: expected an int < rollout.max_model_len ({cfg.rollout.max_model_len}), "
                          f"got {e.max_tokens}")
    if cfg.trainer.max_seq_len < cfg.rollout.max_tokens + 1:
        raise ConfigError(f"trainer.max_seq_len: expected an int > rollout.max_tokens ({cfg.rollout.max_tokens}), "
                          f"got {cfg.trainer.max_seq_len}")
    return cfg


def check_routing(cfg: Config) -> None:
    """trainer.routing_replay / routing_metrics make every engine capture the experts each token is routed to
    while it generates (rollout/capture.py, docs/ROUTING_REPLAY.md); what such an engine cannot do is refused
    here, before Ray or any engine starts. megamoe and reference write the capture inside their opaque MoE op
    (compiled engines and CUDA graphs included); stock writes it in Python in vLLM's MoE layer, which only an
    eager engine runs on every step."""
    if not (cfg.trainer.routing_replay or cfg.trainer.routing_metrics):
        return
    key = "trainer.routing_replay" if cfg.trainer.routing_replay else "trainer.routing_metrics"
    kwargs = cfg.rollout.engine_kwargs
    eager = kwargs.get("enforce_eager")
    if cfg.rollout.moe_impl == "stock" and eager is not True and (eager is False or cfg.rollout.gpus_per_worker > 0):
        raise ConfigError(f"rollout.engine_kwargs.enforce_eager: expected true with {key} and rollout.moe_impl="
                          "'stock' (stock's routing is recorded in Python inside vLLM's MoE layer, which torch.compile "
                          "traces and CUDA graphs skip; megamoe and reference record it inside their opaque op), got "
                          f"{eager!r}{' (vLLM compiles on CUDA by default)' if eager is None else ''}")
    if kwargs.get("speculative_config"):
        raise ConfigError(f"rollout.engine_kwargs.speculative_config: expected none with {key} (a step's draft "
                          "tokens are routed too, and the capture does not tell rejected drafts from accepted tokens), "
                          f"got {kwargs['speculative_config']!r}")


def env_limits(cfg: Config) -> tuple[int, int]:
    """(tokens per assistant turn, tokens per episode) of multi-turn episodes, the nulls resolved."""
    room = min(cfg.rollout.max_model_len, cfg.trainer.max_seq_len)
    e = cfg.env
    return (cfg.rollout.max_tokens if e.max_tokens_per_turn is None else e.max_tokens_per_turn,
            room if e.max_total_tokens is None else e.max_total_tokens)


def overlong_limit(cfg: Config) -> tuple[int, str]:
    """(L, its name) of the overlong shaping (rl/overlong.py): the most tokens a sample may sample, rollout.max_tokens;
    with multi-turn episodes the most assistant tokens of an episode, env.max_turns x the per-turn limit."""
    if not cfg.env.enabled:
        return cfg.rollout.max_tokens, "rollout.max_tokens"
    return cfg.env.max_turns * env_limits(cfg)[0], "env.max_turns x env.max_tokens_per_turn"


def check_env(cfg: Config) -> None:
    """The limits of multi-turn episodes (env.tools / env.environment); ConfigError naming the key."""
    e = cfg.env
    if not e.enabled:
        return
    room = min(cfg.rollout.max_model_len, cfg.trainer.max_seq_len)
    per_turn, total = env_limits(cfg)
    check(total <= room, "env.max_total_tokens", f"an int <= min(rollout.max_model_len, trainer.max_seq_len) "
          f"= {room} (the model length both sides hold)", e.max_total_tokens)
    check(per_turn < total, "env.max_tokens_per_turn", f"an int < the episode's token limit ({total})", per_turn)


def check_bitwise(cfg: Config) -> None:
    """run.numerics=bitwise needs what both sides can compute bit for bit (the architecture is checked
    where the model's config is read, rl/base_model.py); ConfigError naming the key otherwise."""
    def need(ok: bool, key: str, expected: str, got) -> None:
        if not ok:
            raise ConfigError(f"{key}: expected {expected} with run.numerics=bitwise, got {got!r}")

    need(cfg.rollout.moe_impl == MEGAMOE, "rollout.moe_impl", "'megamoe' (the MoE kernel the trainer runs)",
         cfg.rollout.moe_impl)
    need(cfg.trainer.moe_impl == MEGAMOE, "trainer.moe_impl", "'megamoe' (the MoE kernel the sampler runs)",
         cfg.trainer.moe_impl)
    need(not cfg.trainer.routing_replay, "trainer.routing_replay", "false (bitwise mode routes bitwise like the "
         "sampler: refused rather than ignored, docs/ROUTING_REPLAY.md)", cfg.trainer.routing_replay)
    need(cfg.rollout.top_p == 1.0, "rollout.top_p", "1.0 (vLLM's processed logprobs renormalise over the "
         "nucleus; the trainer's log_softmax covers the whole vocabulary)", cfg.rollout.top_p)
    rollout_gpu, trainer_gpu = cfg.rollout.gpus_per_worker > 0, cfg.trainer.gpus_per_rank > 0
    need(rollout_gpu == trainer_gpu, "trainer.gpus_per_rank", f"{'> 0' if rollout_gpu else '0'} as the sampler's "
         f"rollout.gpus_per_worker={cfg.rollout.gpus_per_worker} (both sides on CPU, fp32, or both on CUDA: one "
         "device's kernels give one device's bits)", cfg.trainer.gpus_per_rank)
    tp = cfg.rollout.engine_kwargs.get("tensor_parallel_size", 1)
    need(tp == 1, "rollout.engine_kwargs.tensor_parallel_size", "1 (a K reduction split over ranks is not the "
         "trainer's)", tp)
    eager = cfg.rollout.engine_kwargs.get("enforce_eager")
    need(rollout_gpu or eager is not False, "rollout.engine_kwargs.enforce_eager", "true or unset on CPU "
         "(torch.compile would compute the dense ops with Inductor's kernels, not the trainer's)", eager)


def _on_gpu(cfg: Config) -> bool:
    return cfg.rollout.gpus_per_worker > 0 and cfg.trainer.gpus_per_rank > 0


def resolve_weight_sync(cfg: Config) -> str:
    """The transport rollout.weight_sync names for this placement ('auto' resolved); ConfigError
    naming the key, the value and what would work when the placement cannot run it."""
    from rollout.sync import resolve  # standard library only at import time

    t, r = cfg.trainer, cfg.rollout
    colocated = cfg.ray.placement == "colocated"
    # Colocated bundles hold a trainer rank and the workers placed round robin on it; one GPU per
    # bundle at most means they share it.
    per_bundle = math.ceil(r.num_workers / t.world_size)
    same_gpu = colocated and t.gpus_per_rank + per_bundle * r.gpus_per_worker <= 1
    try:
        return resolve(r.weight_sync, colocated=colocated, on_gpu=_on_gpu(cfg), same_gpu=same_gpu)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def from_dict(data: dict | None) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    trainer = data.get("trainer")
    if isinstance(trainer, dict) and "extra" in trainer:
        # Every run's config.yaml written before trainer.extra went holds `extra: {}`; an empty one
        # sets nothing, so those runs still resume and export.
        if trainer["extra"]:
            raise _extra_removed(trainer["extra"])
        data = {**data, "trainer": {k: v for k, v in trainer.items() if k != "extra"}}
    return build(Config, data, root=Config)


def _extra_removed(extra: Any) -> ConfigError:
    """trainer.extra is gone: every trainer setting is a typed key of the section; say which."""
    fields = {f.name for f in dataclasses.fields(TrainerConfig)}
    entries = extra if isinstance(extra, dict) else {}
    moved = [f"trainer.{k}: {v!r}" if k in fields else str(unknown_key(TrainerConfig, str(k), "trainer.", Config))
             for k, v in entries.items()]
    return ConfigError("trainer.extra: removed; every trainer setting is a key of the trainer section "
                       "(megamoe-rl train --help-config lists them): "
                       + ("; ".join(moved) if moved else "move each entry up one level, into trainer"))


def _yaml_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse {text!r} as a YAML value: {e}") from None


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` to the raw config mapping `data` (checked later by the loader).

    The value is parsed as YAML (`3`, `1e-4`, `true`, `null`, `[a, b]`, `{fn: x}`); a field typed
    as a string keeps the text as written, so `run.out_dir=007` stays "007". List items are
    addressed by index (`reward.functions.0.weight=0.5`).
    """
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r}: expected key=value (e.g. run.steps=10)")
    key, text = assignment.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {assignment!r}: malformed key {key!r}")
    node, cls = data, Config
    value_tp = None  # the value type of a dict[str, X] being navigated
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        at = ".".join(parts[:depth])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {key!r}: {at} is a list of {len(node)} item(s); "
                                  f"{part!r} is not an index into it")
            idx = int(part)
            if last:
                node[idx] = _yaml_scalar(text)
                return
            node, cls = node[idx], cls
            continue
        tp = value_tp
        if cls is not None:
            hints = typing.get_type_hints(cls)
            if cls is TrainerConfig and part == "extra":
                raise _extra_removed({parts[depth + 1]: _yaml_scalar(text)} if not last else _yaml_scalar(text))
            if part not in hints:
                raise unknown_key(cls, part, at + "." if at else "", Config)
            tp = hints[part]
        if last:
            node[part] = text if _is_str_type(tp) and text != "null" else _yaml_scalar(text)
            return
        inner = dataclass_in(tp) if tp is not None else None
        if typing.get_origin(tp) is list:
            item = typing.get_args(tp)[0]
            if part not in node:
                node[part] = [to_plain(x) for x in _default_of(cls, part)]
            node, cls = node[part], (item if dataclasses.is_dataclass(item) else None)
            continue
        value_tp = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if node.get(part) is None:
            node[part] = {}
        node, cls = node[part], inner


def _default_of(cls, name):
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _is_str_type(tp) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return str in typing.get_args(tp)
    return False


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or start from the defaults), apply `a.b=value` overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {str(path)!r}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    for o in overrides:
        apply_override(data, o)
    try:
        return validate(from_dict(data))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None


def to_dict(cfg: Config) -> dict:
    return to_plain(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def describe(cls=Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, doc) of every field, for `megamoe-rl train --help-config` and for tests."""
    return describe_tree(cls, prefix)


def scale_by_std(cfg: Config) -> bool:
    """Whether group advantages divide by the group's std: reward.scale_by_std, or when null, true
    except under trainer.loss=dr_grpo."""
    if cfg.reward.scale_by_std is not None:
        return cfg.reward.scale_by_std
    return cfg.trainer.loss != "dr_grpo"


def trainer_worker_config(cfg: Config) -> TrainerWorkerConfig:
    """What each TrainerWorker rank gets: the trainer section, plus the sampler's temperature, the
    model's dtype, the run's seed and numerics (the trainer computes the sampler's logprobs in the same
    dtype, with the same kernels in numerics=bitwise) and rollout.max_tokens (the constant normaliser of
    loss_agg 'constant')."""
    return TrainerWorkerConfig.of(cfg.trainer, temperature=cfg.rollout.temperature, dtype=cfg.model.dtype,
                                  seed=cfg.run.seed, numerics=cfg.run.numerics, max_tokens=cfg.rollout.max_tokens)
