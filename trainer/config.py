"""The trainer's settings, defined once: the run config's `trainer` section and what one rank gets.

    TrainerSettings       what every TrainerWorker rank reads: optimizer, schedule, loss, batch,
                          precision, device (trainer.lr, trainer.minibatches, ...)
    TrainerConfig         = TrainerSettings + moe_impl, world_size, placement and checkpoint cadence;
                          rl/config.py's `trainer` section is this class, as it is
    TrainerWorkerConfig   = TrainerSettings + temperature, dtype, seed, numerics, max_tokens: what
                          TrainerWorker gets; rl/ passes them explicitly from rollout.temperature,
                          model.dtype, run.seed, run.numerics, rollout.max_tokens

    cfg = TrainerWorkerConfig.from_dict({"lr": 1e-5, "is_correction": "tis", "temperature": 0.8})

TrainerWorker takes moe_impl and world_size as its own arguments, so they travel to a rank once.
Below the classes, the typed loader rl/config.py builds its whole tree with (trainer/ cannot import
rl/): `field` (a dataclass field whose one-line doc travels in `metadata["doc"]`), `build` (a
mapping -> dataclass, every key and value checked; errors name the key, unknown keys suggest close
matches), `describe`, `to_plain`. Nothing here imports torch, so the CLI validates without it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from megamoe.contract import BITWISE, FAST, HOST_IMPLS, NUMERICS

# The choices of the trainer's settings; trainer/loss.py and rl/config.py import them from here.
IS_CORRECTIONS = ("none", "tis", "token_mask", "seq_mask", "metrics_only")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "constant")
# The policy objectives (trainer/loss.py; docs/OBJECTIVES.md gives each one's formula) and the
# aggregation each uses when trainer.loss_agg is null.
OBJECTIVES = ("grpo", "gspo", "cispo", "dr_grpo")
OBJECTIVE_AGG = {"grpo": "token_mean", "gspo": "seq_mean_token_mean", "cispo": "token_mean", "dr_grpo": "constant"}
KL_ESTIMATORS = ("k1", "k3")
DTYPES = ("float32", "bfloat16")
LR_SCHEDULES = ("constant", "cosine")
DEVICES = ("auto", "cpu", "cuda")
# What a trainer's MoE layers can run: megamoe/contract.py's names (importing them costs no torch).
MoEImpl = Literal[HOST_IMPLS]
# What trainer.lora.targets may name (trainer/lora.py): the attention projections (nn.Linear weights [out, in]),
# the experts' fused 3-D parameters (per-expert factors) and the MoE router's weight.
LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_EXPERTS = ("gate_up_proj", "down_proj")
LORA_TARGETS = LORA_ATTENTION + LORA_EXPERTS + ("router",)


class ConfigError(ValueError):
    """A config file, override or cfg mapping that does not fit its dataclass; the message names the key."""


def field(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING):
    """A dataclass field whose one-line documentation travels with it (`metadata["doc"]`)."""
    if not doc:
        raise TypeError("every config field needs a doc string")
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


def check(ok: bool, key: str, expected: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}: expected {expected}, got {got!r}")


def _key(at: str, name: str) -> str:
    return f"{at}.{name}" if at else name


@dataclass(frozen=True)
class LoraSettings:
    """trainer.lora: low-rank adapters on a frozen base (trainer/lora.py, docs/TRAINING.md#lora)."""
    enabled: bool = field(False, "train LoRA adapters instead of the whole model: the base is frozen (no gradient, "
                                 "no optimizer state), only the factors are trained")
    rank: int = field(8, "r, the factors' rank")
    alpha: float = field(16.0, "lora_alpha: the update is (alpha / rank) * B @ A (PEFT's scaling)")
    dropout: float = field(0.0, "lora_dropout; only 0 (the merged weight the sampler receives is the whole update)")
    targets: list[Literal[LORA_TARGETS]] = field(
        doc="what gets adapters: q_proj, k_proj, v_proj, o_proj (attention), gate_up_proj, down_proj (every "
            "expert's w13 / w2, per-expert factors), router (the MoE gate's weight)",
        factory=lambda: list(LORA_ATTENTION + LORA_EXPERTS))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self, at: str = "") -> None:
        k = functools.partial(_key, at)
        check(self.rank >= 1, k("rank"), "an int >= 1", self.rank)
        check(self.alpha > 0, k("alpha"), "a float > 0", self.alpha)
        check(self.dropout == 0.0, k("dropout"), "0 (the sampler computes with the merged weight W + scale * B @ A, "
              "which has no dropout)", self.dropout)
        check(len(self.targets) >= 1 and len(set(self.targets)) == len(self.targets), k("targets"),
              f"a non-empty list of distinct names from {LORA_TARGETS}", self.targets)


@dataclass(frozen=True)
class TrainerSettings:
    """What every TrainerWorker rank reads."""
    lr: float = field(1e-5, "AdamW learning rate (the peak, after warmup)")
    weight_decay: float = field(0.0, "AdamW weight decay")
    adam_beta1: float = field(0.9, "AdamW beta1, in [0, 1)")
    adam_beta2: float = field(0.999, "AdamW beta2, in [0, 1)")
    adam_eps: float = field(1e-8, "AdamW epsilon, > 0")
    lr_schedule: Literal[LR_SCHEDULES] = field("constant", "after linear warmup: constant, or cosine to 0 at total_steps")
    warmup_steps: int = field(0, "optimizer steps of linear learning-rate warmup from 0")
    total_steps: int = field(0, "optimizer steps of the cosine schedule (must exceed warmup_steps for cosine)")
    grad_clip: float = field(1.0, "max global gradient norm; 0 disables clipping (the norm is still measured and checked)")
    clip_eps: float = field(0.2, "PPO ratio clip epsilon (lower side: 1 - clip_eps)")
    clip_eps_high: float | None = field(None, "upper PPO clip epsilon (1 + clip_eps_high); null = clip_eps")
    loss: Literal[OBJECTIVES] = field(
        "grpo", "the policy objective (docs/OBJECTIVES.md): grpo (per-token PPO-clipped ratio); gspo (one "
                "length-normalised ratio per sequence, clipped per sequence); cispo (REINFORCE weighted by the "
                "clipped, stop-gradient token ratio: no token loses its gradient); dr_grpo (grpo without the "
                "std scaling of the advantage, over a constant normaliser)")
    loss_agg: Literal[LOSS_AGGS] | None = field(
        None, "token_mean: sum over every completion token / their number in the minibatch; "
              "seq_mean_token_mean: mean over sequences of each one's token mean (GRPO's original); "
              "constant: sum over every token / (sequences x rollout.max_tokens) (Dr. GRPO's); "
              "null = the objective's: constant for dr_grpo, seq_mean_token_mean for gspo, else token_mean")
    kl_coef: float = field(0.0, "weight of the KL penalty to the reference policy (the initial weights: a frozen "
                                "copy sharded over the trainer ranks in the compute dtype, parameters x 2 bytes "
                                "(bf16; 4 in fp32) / world_size per rank); 0 = no reference, no penalty")
    kl_estimator: Literal[KL_ESTIMATORS] = field(
        "k3", "per-token estimator of KL(policy || reference) on the sampled tokens, d = ref_logp - logp: "
              "k1 = -d; k3 = exp(d) - 1 - d (>= 0, lower variance)")
    is_correction: Literal[IS_CORRECTIONS] = field(
        "tis", "sampler-trainer importance correction, r = pi_trainer_old / pi_sampler per token: none; tis "
               "(weight min(r, is_cap)); token_mask / seq_mask (drop tokens / sequences whose ratio leaves "
               "[is_low, is_high]); metrics_only (measure, do not correct)")
    is_cap: float = field(2.0, "tis: the cap C of the weight min(pi_train / pi_sampler, C)")
    is_low: float = field(0.5, "token_mask / seq_mask: lower bound of the kept importance ratio")
    is_high: float = field(2.0, "token_mask / seq_mask: upper bound of the kept importance ratio")
    minibatches: int = field(1, "optimizer steps per RL step: the batch is split into this many (with more than "
                                "one, the PPO ratio's old logprobs are taken once before the first update)")
    micro_batch_size: int = field(8, "sequences per forward/backward on one rank (gradient accumulation above it)")
    max_seq_len: int = field(512, "longest prompt + completion the trainer accepts, in tokens")
    truncate: bool = field(False, "sequences longer than max_seq_len: cut the completion (true) or fail the step (false)")
    activation_checkpointing: bool = field(False, "recompute each decoder layer in backward (transformers' "
                                                  "non-reentrant gradient checkpointing): less memory, more compute")
    fsdp: bool = field(True, "shard with FSDP2 fully_shard; false only with world_size 1 (one unsharded rank, "
                             "no process group: the ground truth FSDP is compared against)")
    device: Literal[DEVICES] = field("auto", "auto: cuda when available (one GPU per rank, NCCL), else cpu (gloo)")
    num_threads: int | None = field(None, "torch intra-op threads per rank (CPU); null leaves torch's default")
    export_dtype: Literal[DTYPES] | None = field(None, "dtype of exported weights when the caller names none; "
                                                       "null = the fp32 master weights as held")
    routing_replay: bool = field(False, "rollout routing replay (R3, docs/ROUTING_REPLAY.md): the sampler returns the "
                                        "experts it routed every token to and the trainer's forward uses them, with "
                                        "combine weights from its own router; fast numerics only (bitwise needs none)")
    routing_metrics: bool = field(False, "the sampler returns its routing and every step logs sampler-vs-trainer "
                                         "top-k agreement and load balance per MoE layer, without replaying it "
                                         "(routing_replay logs them too)")
    lora: LoraSettings = field(doc="LoRA adapters on a frozen base (trainer/lora.py)", factory=LoraSettings)
    packing: bool = field(False, "pack each micro-batch's sequences into one row without padding (trainer/packing.py): "
                                 "micro-batches by token_budget instead of micro_batch_size, position ids restart "
                                 "per sequence and attention stays inside each sequence")
    token_budget: int = field(4096, "packing: the most tokens (prompt + completion) in one packed micro-batch; a "
                                    "longer sequence gets a micro-batch of its own")

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def aggregation(self) -> str:
        """loss_agg, or the objective's own when it is null."""
        return OBJECTIVE_AGG[self.loss] if self.loss_agg is None else self.loss_agg

    def validate(self, at: str = "") -> None:
        """Range and cross-field checks (types are the loader's); ConfigError naming `at.key`."""
        k = functools.partial(_key, at)
        check(self.lr > 0, k("lr"), "a float > 0", self.lr)
        check(self.weight_decay >= 0, k("weight_decay"), "a float >= 0", self.weight_decay)
        for name in ("adam_beta1", "adam_beta2"):
            check(0 <= getattr(self, name) < 1, k(name), "a float in [0, 1)", getattr(self, name))
        check(self.adam_eps > 0, k("adam_eps"), "a float > 0", self.adam_eps)
        check(self.warmup_steps >= 0, k("warmup_steps"), "an int >= 0", self.warmup_steps)
        check(self.total_steps >= 0, k("total_steps"), "an int >= 0", self.total_steps)
        if self.lr_schedule == "cosine":
            check(self.total_steps > self.warmup_steps, k("total_steps"),
                  f"an int > {k('warmup_steps')} ({self.warmup_steps}) for lr_schedule 'cosine'", self.total_steps)
        check(self.grad_clip >= 0, k("grad_clip"), "a float >= 0", self.grad_clip)
        check(0 < self.clip_eps < 1, k("clip_eps"), "a float in (0, 1)", self.clip_eps)
        check(self.clip_eps_high is None or self.clip_eps_high > 0, k("clip_eps_high"),
              "null or a float > 0", self.clip_eps_high)
        check(self.loss != "dr_grpo" or self.aggregation == "constant", k("loss_agg"),
              "null or 'constant' with loss 'dr_grpo' (Dr. GRPO's normaliser is a constant)", self.loss_agg)
        check(self.kl_coef >= 0, k("kl_coef"), "a float >= 0 (0 = no KL penalty)", self.kl_coef)
        check(self.is_cap >= 1, k("is_cap"), "a float >= 1", self.is_cap)
        check(0 <= self.is_low < 1 < self.is_high, f"{k('is_low')}/{k('is_high')}",
              "0 <= is_low < 1 < is_high", (self.is_low, self.is_high))
        check(self.minibatches >= 1, k("minibatches"), "an int >= 1", self.minibatches)
        check(self.micro_batch_size >= 1, k("micro_batch_size"), "an int >= 1", self.micro_batch_size)
        check(self.max_seq_len >= 2, k("max_seq_len"), "an int >= 2 (one prompt and one completion token)",
              self.max_seq_len)
        check(self.num_threads is None or self.num_threads >= 1, k("num_threads"), "null or an int >= 1",
              self.num_threads)
        self.lora.validate(k("lora"))
        check(self.token_budget >= 2, k("token_budget"), "an int >= 2", self.token_budget)


@dataclass(frozen=True)
class TrainerConfig(TrainerSettings):
    """The run config's `trainer` section: every rank's settings plus what rl/ reads to place and drive the ranks."""
    moe_impl: MoEImpl = field("megamoe", "MoE implementation in the trainer's experts: megamoe, reference, "
                                         "or stock (transformers' own)")
    world_size: int = field(1, "TrainerWorker ranks (one FSDP2 group; gloo on CPU, NCCL on GPU)")
    checkpoint_every: int = field(10, "save a checkpoint every this many steps (and at the end); 0 = only at the end")
    keep_checkpoints: int = field(2, "newest checkpoints kept in <run.out_dir>/checkpoints")
    cpus_per_rank: float = field(1.0, "CPUs reserved per TrainerWorker in its placement-group bundle")
    gpus_per_rank: float = field(0.0, "GPUs reserved per TrainerWorker (0 on CPU machines)")
    worker: str = field("trainer.worker:TrainerWorker", "the trainer actor's class (module:Class); another class with "
                                                        "TrainerWorker's interface may replace it")

    def validate(self, at: str = "") -> None:
        super().validate(at)
        k = functools.partial(_key, at)
        for name in ("routing_replay", "routing_metrics"):
            check(not getattr(self, name) or self.moe_impl != "stock", k("moe_impl"),
                  f"'megamoe' or 'reference' with {k(name)}=true (transformers' own router has no seam for given "
                  "experts)", self.moe_impl)
        check(self.world_size >= 1, k("world_size"), "an int >= 1", self.world_size)
        check(self.fsdp or self.world_size == 1, k("fsdp"),
              f"true with {k('world_size')}={self.world_size} (false means one unsharded rank)", self.fsdp)
        check(self.checkpoint_every >= 0, k("checkpoint_every"), "an int >= 0", self.checkpoint_every)
        check(self.keep_checkpoints >= 1, k("keep_checkpoints"), "an int >= 1", self.keep_checkpoints)
        check(self.cpus_per_rank >= 0, k("cpus_per_rank"), "a float >= 0", self.cpus_per_rank)
        check(self.gpus_per_rank >= 0, k("gpus_per_rank"), "a float >= 0", self.gpus_per_rank)
        check(self.cpus_per_rank + self.gpus_per_rank > 0, f"{k('cpus_per_rank')}/{k('gpus_per_rank')}",
              "at least one of them > 0 (a placement-group bundle cannot be empty)",
              (self.cpus_per_rank, self.gpus_per_rank))


@dataclass(frozen=True)
class TrainerWorkerConfig(TrainerSettings):
    """What one TrainerWorker rank gets: its settings plus the values rl/ takes from other sections."""
    temperature: float = field(1.0, "the sampler's temperature (rollout.temperature): trainer logprobs are "
                                    "log_softmax(logits / temperature)")
    dtype: Literal[("auto",) + DTYPES] = field(
        "auto", "compute dtype (model.dtype): auto = bfloat16 on CUDA, float32 on CPU. Master weights, optimizer "
                "state and gradient reduction stay fp32; bfloat16 is FSDP2's MixedPrecisionPolicy")
    seed: int = field(0, "seed of torch's RNG on every rank (run.seed; the same everywhere)")
    numerics: Literal[NUMERICS] = field(FAST, "run.numerics: bitwise puts the dense linears, attention and norms "
                                              "on megamoe.invariant's kernels (trainer/bitwise.py)")
    max_tokens: int | None = field(None, "rollout.max_tokens, the sampler's completion limit: loss_agg 'constant' "
                                         "divides by sequences x max_tokens (null only without that aggregation)")

    def validate(self, at: str = "") -> None:
        super().validate(at)
        check(self.temperature > 0, _key(at, "temperature"), "a float > 0", self.temperature)
        check(not (self.routing_replay and self.numerics == BITWISE), _key(at, "routing_replay"),
              "false with numerics 'bitwise' (the trainer routes bitwise like the sampler there: nothing to replay)",
              self.routing_replay)
        check(self.seed >= 0, _key(at, "seed"), "an int >= 0", self.seed)
        check(not (self.packing and self.numerics == BITWISE), _key(at, "packing"),
              "false with numerics 'bitwise' (its attention kernel takes right-padded rows, not packed ones)",
              self.packing)
        check(not (self.packing and (self.routing_replay or self.routing_metrics)), _key(at, "packing"),
              "false with routing_replay / routing_metrics (their routing rows follow the padded layout)", self.packing)
        check(self.max_tokens is None or self.max_tokens >= 1, _key(at, "max_tokens"), "null or an int >= 1",
              self.max_tokens)
        check(self.aggregation != "constant" or self.max_tokens is not None, _key(at, "max_tokens"),
              f"an int >= 1 with loss_agg 'constant' (loss={self.loss!r}): the normaliser is sequences x max_tokens",
              self.max_tokens)

    @classmethod
    def of(cls, settings: TrainerSettings, *, temperature: float, dtype: str, seed: int,
           numerics: str = FAST, max_tokens: int | None = None) -> "TrainerWorkerConfig":
        """A rank's config: `settings` (e.g. the run's TrainerConfig) and the values named here."""
        own = {f.name: getattr(settings, f.name) for f in dataclasses.fields(TrainerSettings)}
        cfg = cls(**own, temperature=temperature, dtype=dtype, seed=seed, numerics=numerics, max_tokens=max_tokens)
        cfg.validate()
        return cfg

    @classmethod
    def from_dict(cls, cfg: dict[str, Any] | None) -> "TrainerWorkerConfig":
        """A rank's config from a mapping of its field names (tests, scripts); ConfigError naming the key."""
        cfg = dict(cfg or {})
        for name in ("moe_impl", "world_size"):
            if name in cfg:
                raise ConfigError(f"{name}: expected it as TrainerWorker's {name} argument, not in cfg "
                                  f"(got cfg[{name!r}]={cfg[name]!r})")
        out = build(cls, cfg)
        out.validate()
        return out


# ---------------------------------------------------------------------------------------------
# The typed loader: a mapping (from YAML) -> a dataclass tree, every key and value checked.


def suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return {int: "an int", float: "a float", str: "a string", bool: "a bool (true/false)"}.get(tp, str(tp))


def dataclass_in(tp):
    """The dataclass inside `X` or `X | None`, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        dcs = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return dcs[0] if dcs else None
    return None


def leaf_paths(cls, prefix: str = "") -> list[str]:
    """Every dotted key of the tree rooted at `cls`, sections included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out.append(path)
        inner = dataclass_in(hints[f.name])
        if inner is not None:
            out.extend(leaf_paths(inner, path + "."))
    return out


def unknown_key(cls, key: str, at: str, root=None) -> ConfigError:
    """The error for `key` under `at` (a dotted prefix ending in '.', or ''), with close matches and,
    when `root` is the tree's root, the other sections where a key of that name exists."""
    names = [f.name for f in dataclasses.fields(cls)]
    msg = f"unknown key {at + key!r}" + (f" in {at[:-1]!r}" if at else "") + suggest(key, names)
    # A key that exists in another section is a common slip (rollout.lr for trainer.lr): say where.
    elsewhere = [p for p in leaf_paths(root) if p.rsplit(".", 1)[-1] == key] if root is not None else []
    if elsewhere and "did you mean" not in msg:
        msg += f" (it exists as {', '.join(elsewhere)})"
    return ConfigError(msg + f"; valid keys: {', '.join(names)}")


def coerce(value: Any, tp, key: str, root=None) -> Any:
    """`value` (from YAML) as type `tp`, or a ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key, root)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: expected one of {', '.join(map(repr, choices))}, got {value!r}"
                              + suggest(value, choices))
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
        return build(tp, value, key + ".", root)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
        return [coerce(v, item, f"{key}.{i}", root) for i, v in enumerate(value)]
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {str(k): coerce(v, vt, f"{key}.{k}", root) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected a bool (true/false), got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-5 (no dot) as a string; take it as the number it obviously is.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a float, got {value!r}")
        if not math.isfinite(value):  # no setting means anything at inf or nan
            raise ConfigError(f"{key}: expected a finite float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"config type {tp} of {key} is not supported by the loader")


def build(cls, data: dict, at: str = "", root=None):
    """`cls(**data)` with every key and value checked; `at` prefixes the keys errors name."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise unknown_key(cls, str(k), at, root)
    return cls(**{k: coerce(v, hints[k], at + k, root) for k, v in data.items()})


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def describe(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, doc) of every field of the tree rooted at `cls`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        rows.append((prefix + f.name, type_name(tp), f.metadata.get("doc", "")))
        inner = dataclass_in(tp)
        if inner is not None:
            rows.extend(describe(inner, prefix + f.name + "."))
    return rows
