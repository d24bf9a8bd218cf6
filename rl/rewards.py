"""Reward functions: built-ins, user functions by dotted path, and the scorer the loop calls.

    reward:                                   # in a config, or `--reward pkg.module:fn` on the CLI
      functions:
        - {fn: math, weight: 1.0}                              # math-verify on the answer column
        - {fn: my_pkg.rewards:judge, weight: 0.5}
        - {fn: trl.rewards:get_cosine_scaled_reward, factory: true, factory_kwargs: {max_len: 256}}

Two calling styles are accepted:
- batch (TRL's): called by keyword, as TRL calls reward functions:
  `f(prompts=[...], completions=[...], completion_ids=[[...]], trainer_state=..., log_extra=...,
  log_metric=..., **columns) -> list[float | None]`, sync or `async def`; so `f(completions,
  **kwargs)`, `f(prompts, completions, answer)` and `f(completions, completion_ids, **kwargs)` all
  work. A function receives the arguments it names, or all of them when it takes `**kwargs`; it
  must name `completions` or take `**kwargs`. The dataset's columns arrive one list per column
  (`answer=[...]`). Prompts and completions come in the dataset's form (rl/data.py): strings, or
  for conversational data the message lists and `[{"role": "assistant", "content": text}]`.
  `trainer_state` has `global_step` (steps done before this one) and `max_steps` (run.steps);
  `log_metric(name, value)` adds `reward/<function>/metric/<name>` to the step's metrics (the mean
  when called more than once in a step); `log_extra(column, values)` records one value per
  sample, and the first sample's lands in the step's metrics as `sample/<column>` beside
  `sample/completion` (the run keeps no per-sample table).
- per sample (verl's): `compute_score(data_source, solution_str, ground_truth, extra_info=None)
  -> float` (or a dict with a "score"), sync or async; `solution_str` is the completion's text,
  `ground_truth` the answer column, `extra_info` the dataset's `extra_info` column when it has one
  (verl's layout), else a dict of the prompt and the other columns.
A factory (`factory: true`): `fn` is called once at load with `factory_kwargs` and returns the
reward function (TRL's `get_cosine_scaled_reward(...)`, `get_soft_overlong_punishment(...)`).

None means "this function does not score this sample" (TRL's convention): the sample's reward is
the weighted sum over the functions that scored it (TRL's NaN-aware sum), and a sample that no
function scored has no reward at all (`RewardResult.total` holds None; counted as `reward/none`,
and per function as `reward/<name>/none`). Such a sample gets advantage 0 and stays out of its
group's mean and std (rl.advantages.group_advantages): "could not judge" is not "wrong", and
scoring it 0, as TRL's sum of NaNs does, would push the policy away from it and shift its group's
baseline. Never an error.

Failures never stop a run: a sample whose reward raises or is not a finite number (nor None) gets
0 from that function, the failure is counted (`reward/errors` in the metrics) and logged once per
function and kind with its traceback. When a batch call raises, the batch is re-scored one sample
at a time so that only the failing samples get 0; a batch call that returns the wrong number of
values is a failure of every sample of the call (counted, logged once, never re-scored: a
function returning `[1.0]` for any batch would otherwise earn full reward). Problems visible before
the run starts (a path that does not import, a name that is not callable, keyword arguments the
function does not take, a factory that fails) are errors at load time that name the config key.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import inspect
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("megamoe.rl.rewards")


class RewardLoadError(ValueError):
    """A reward function that cannot be used; the message names the config key."""


# ---------------------------------------------------------------------------------------------
# Built-ins (batch style; each takes the columns it needs and ignores the rest, and reads a
# completion in either form).


def completion_text(c) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's last assistant
    message (a multi-turn completion ends with the assistant's answer, or with a tool message if it was cut)."""
    if isinstance(c, str):
        return c
    return next((m.get("content") or "" for m in reversed(c) if m.get("role") == "assistant"), c[-1]["content"])


def exact_match(prompts: list[str], completions: list[str], answer: list[Any], *,
                match: str = "full", ignore_case: bool = False, **_) -> list[float]:
    """1.0 when the completion equals the answer (both stripped); match="prefix": starts with it."""
    if match not in ("full", "prefix"):
        raise ValueError(f"exact_match: kwargs.match: expected 'full' or 'prefix', got {match!r}")
    out = []
    for c, a in zip(completions, answer, strict=True):
        c, a = completion_text(c).strip(), str(a).strip()
        if ignore_case:
            c, a = c.lower(), a.lower()
        out.append(float(c == a if match == "full" else (c.startswith(a) and a != "")))
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _answer_number(a: Any) -> float:
    """The answer as a number: the whole value, else the last number in it (GSM8K's "... #### 72")."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a)
    try:
        return float(str(a).replace(",", "").strip())
    except ValueError:
        found = _NUMBER.findall(str(a))
        if not found:
            raise ValueError(f"numeric: the answer {a!r} holds no number") from None
        return float(found[-1].replace(",", ""))


def numeric(prompts: list[str], completions: list[str], answer: list[Any], *,
            which: str = "last", tol: float = 1e-6, **_) -> list[float]:
    """1.0 when the first/last number in the completion equals the numeric answer within `tol`."""
    if which not in ("first", "last"):
        raise ValueError(f"numeric: kwargs.which: expected 'first' or 'last', got {which!r}")
    out = []
    for c, a in zip(completions, answer, strict=True):
        target = _answer_number(a)
        found = _NUMBER.findall(completion_text(c))
        if not found:
            out.append(0.0)
            continue
        got = float(found[0 if which == "first" else -1].replace(",", ""))
        out.append(float(abs(got - target) <= tol))
    return out


def format_reward(prompts: list[str], completions: list[str], *, pattern: str, **_) -> list[float]:
    """1.0 when the regex `pattern` matches at the start of the completion (re.match)."""
    rx = re.compile(pattern, re.DOTALL)
    return [float(rx.match(completion_text(c)) is not None) for c in completions]


def _gold(a: Any) -> str:
    """The part of an answer math-verify should read: after GSM8K's last "####" when there is one,
    else the whole answer; a bare number or expression gets LaTeX's $...$ so math-verify parses it as math."""
    text = str(a)
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    return text if any(t in text for t in ("$", "\\boxed", "\\(", "\\[")) else f"${text}$"


def math_reward(prompts: list, completions: list, answer: list[Any], **_) -> list[float | None]:
    """math-verify's judgement (the `math-verify` package, Hugging Face's grader for math RL): 1.0
    when the completion's final answer (its last \\boxed{}, "#### n", or last expression; commas in
    numbers, LaTeX forms like \\frac{1}{2} vs 0.5 compared as math) equals the answer column's, 0.0
    when it does not or holds no answer, None when math-verify cannot parse the gold answer (that
    sample is not scored: TRL's accuracy_reward does the same)."""
    from math_verify import parse, verify

    out: list[float | None] = []
    for c, a in zip(completions, answer, strict=True):
        gold = parse(_gold(a)) if a is not None else None
        if not gold:
            out.append(None)
            continue
        text = completion_text(c)
        if "####" in text:  # GSM8K's marker: what follows it is the answer, commas and all
            text = text.rsplit("####", 1)[1].replace(",", "")
        out.append(float(verify(gold, parse(text))))
    return out


BUILTINS: dict[str, Callable] = {"exact_match": exact_match, "numeric": numeric, "format": format_reward,
                                 "math": math_reward}


# ---------------------------------------------------------------------------------------------
# Loading.


@dataclass
class RewardFn:
    """One loaded reward function, normalised to the batch style."""
    name: str
    weight: float
    fn: Callable
    kwargs: dict
    style: str  # "batch" or "per_sample"
    key: str    # the config key it came from, for messages
    columns: tuple[str, ...] | None = None  # columns the function names; None = all (**kwargs)
    accepts: tuple[str, ...] = ()  # which of BATCH_ARGS it takes
    is_async: bool = False
    logged: set = field(default_factory=set)


def resolve(spec: str, key: str) -> Callable:
    """A built-in name or `pkg.module:function` -> the callable; errors name `key`."""
    if ":" not in spec:
        if spec in BUILTINS:
            return BUILTINS[spec]
        hint = difflib.get_close_matches(spec, BUILTINS, n=3)
        raise RewardLoadError(
            f"{key}: {spec!r} is neither a built-in reward ({', '.join(BUILTINS)}) nor a dotted path "
            f"'pkg.module:function'" + (f" (did you mean {' or '.join(map(repr, hint))}?)" if hint else ""))
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise RewardLoadError(f"{key}: expected 'pkg.module:function', got {spec!r}")
    # Like `python -m`, a reward module in the working directory is importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise RewardLoadError(f"{key}: cannot import module {mod_name!r} of {spec!r}: "
                              f"{type(e).__name__}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = difflib.get_close_matches(part, names, n=3)
            raise RewardLoadError(f"{key}: {mod_name!r} has no attribute {attr!r}"
                                  + (f" (did you mean {' or '.join(map(repr, hint))}?)" if hint else ""))
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardLoadError(f"{key}: {spec!r} is a {type(obj).__name__}, expected a callable")
    return obj


_PER_SAMPLE_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
# What a batch reward is called with besides the dataset's columns (TRL's keyword names).
BATCH_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def _build(factory: Callable, spec, key: str) -> Callable:
    """The reward function a factory returns for `spec.factory_kwargs` (called once, at load)."""
    try:
        fn = factory(**spec.factory_kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the factory raises, the user gets the key
        raise RewardLoadError(f"{key}.factory_kwargs: {spec.fn!r}(**{spec.factory_kwargs!r}) raised "
                              f"{type(e).__name__}: {e}") from e
    if not callable(fn):
        raise RewardLoadError(f"{key}.factory: {spec.fn!r}(**{spec.factory_kwargs!r}) returned a "
                              f"{type(fn).__name__}, expected a reward function")
    return fn


def load_reward(spec, index: int, at: str = "reward.functions") -> RewardFn:
    """A `RewardFnConfig` (config.reward.functions[index]) -> RewardFn, checked before any sample."""
    key = f"{at}.{index}"
    fn = resolve(spec.fn, f"{key}.fn")
    if spec.factory:
        fn = _build(fn, spec, key)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardLoadError(f"{key}.fn: cannot read the signature of {spec.fn!r}: {e}") from e
    params = sig.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    style = spec.style
    if style == "auto":
        style = "per_sample" if "solution_str" in params else "batch"
    try:
        if style == "per_sample":
            sig.bind_partial(**dict.fromkeys(_PER_SAMPLE_PARAMS), **spec.kwargs)
        else:
            if "completions" not in params and not has_var_kw:
                raise TypeError("it takes neither `completions` nor **kwargs")
            given = [n for n in BATCH_ARGS if n in params or has_var_kw]
            sig.bind_partial(**dict.fromkeys(given), **spec.kwargs)
    except TypeError as e:
        expected = ("compute_score(data_source, solution_str, ground_truth, extra_info, ...)"
                    if style == "per_sample" else "f(prompts=, completions=, completion_ids=, **columns)")
        raise RewardLoadError(f"{key}: {spec.fn!r} does not fit the {style} style {expected} with "
                              f"kwargs {spec.kwargs!r}: {e}") from e
    if style == "batch":
        # Required keyword-only parameters must be met by kwargs or by dataset columns at call time;
        # builtins with required kwargs (format's pattern) are checked here.
        missing = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and p.default is p.empty
                   and n not in spec.kwargs]
        if fn in BUILTINS.values() and missing:
            raise RewardLoadError(f"{key}.kwargs: the built-in {spec.fn!r} needs {', '.join(missing)} "
                                  f"(e.g. kwargs: {{{missing[0]}: ...}})")
    columns = None if has_var_kw else tuple(n for n in params if n not in BATCH_ARGS)
    accepts = BATCH_ARGS if has_var_kw else tuple(n for n in BATCH_ARGS if n in params)
    name = spec.name or (spec.fn if ":" not in spec.fn and not spec.factory
                         else getattr(fn, "__name__", spec.fn.split(":")[-1]))
    return RewardFn(name=name, weight=spec.weight, fn=fn, kwargs=dict(spec.kwargs), style=style, key=key,
                    columns=columns, accepts=accepts, is_async=inspect.iscoroutinefunction(fn))


def load_rewards(reward_cfg, at: str = "reward.functions") -> list[RewardFn]:
    fns = [load_reward(s, i, at) for i, s in enumerate(reward_cfg.functions)]
    names = [f.name for f in fns]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RewardLoadError(f"{at}: two functions are named {sorted(dup)}; give them distinct "
                              f"`name`s so their metrics do not collide")
    return fns


# ---------------------------------------------------------------------------------------------
# Scoring.


@dataclass
class TrainerState:
    """What a reward function gets as `trainer_state` (the fields of TRL's that a reward reads)."""
    global_step: int    # RL steps done before the one being scored
    max_steps: int      # run.steps


@dataclass
class RewardResult:
    total: list[float | None]               # weighted sum over the functions that scored; None: none did
    per_fn: dict[str, list[float | None]]   # unweighted, per function; failed samples 0, unscored None
    errors: dict[str, int]                  # failed samples per function in this call
    logged: dict[str, float] = field(default_factory=dict)  # log_metric means and log_extra's first values

    def none(self, name: str) -> int:
        return sum(v is None for v in self.per_fn[name])

    def metrics(self, group_size: int) -> dict[str, Any]:
        """This step's reward metrics (the module docstring names them)."""
        scored = [r for r in self.total if r is not None]
        n = len(scored)
        mean = sum(scored) / n if n else float("nan")
        m: dict[str, Any] = {"reward/mean": mean}
        if n:
            m.update({"reward/std": math.sqrt(sum((r - mean) ** 2 for r in scored) / n),
                      "reward/min": min(scored), "reward/max": max(scored)})
        m["reward/none"] = len(self.total) - n
        for name, vals in self.per_fn.items():
            got = [v for v in vals if v is not None]
            m[f"reward/{name}/mean"] = sum(got) / len(got) if got else float("nan")
            m[f"reward/{name}/none"] = len(vals) - len(got)
            m[f"reward/{name}/errors"] = self.errors[name]
        m["reward/errors"] = sum(self.errors.values())
        groups = [[r for r in self.total[g:g + group_size] if r is not None]
                  for g in range(0, len(self.total), group_size)]
        # A group with fewer than two scored samples has no signal either.
        m["reward/zero_std_groups_frac"] = sum(len(g) < 2 or max(g) == min(g) for g in groups) / len(groups)
        m.update(self.logged)
        return m


def _run(value):
    return asyncio.run(value) if inspect.isawaitable(value) else value


async def _gather(values):
    return await asyncio.gather(*values, return_exceptions=True)


class _WrongLength(ValueError):
    """A batch call returned a number of values other than its number of samples."""


class _Log:
    """The log_metric / log_extra callables of one function in one call."""

    def __init__(self, name: str):
        self.name = name
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list] = {}

    def metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(f"reward/{self.name}/metric/{name}", []).append(float(value))

    def extra_column(self, column: str, values: list) -> None:
        self.extra[f"sample/{column}"] = list(values)


class RewardScorer:
    """Scores a batch of samples with every configured function (see the module docstring)."""

    def __init__(self, fns: list[RewardFn]):
        self.fns = fns
        self._ids: list[list[int]] | None = None  # the current call's completion_ids
        self._state: TrainerState | None = None
        self.errors_total: dict[str, int] = {f.name: 0 for f in fns}
        self._envs: list | None = None

    def __call__(self, prompts: list, completions: list[str], columns: dict[str, list],
                 completion_ids: list[list[int]] | None = None,
                 trainer_state: TrainerState | None = None, completion_messages: list[list[dict]] | None = None,
                 environments: list | None = None) -> RewardResult:
        """`completions` are the sampled texts; batch functions get them in the prompts' form
        (conversational when the prompts are message lists). Multi-turn episodes (rl/episode_step.py) give
        `completion_messages`, what batch functions then get as completions (the assistant, tool and user
        messages after the prompt, TRL's convention), and `environments` (TRL's keyword: each episode's
        environment instance or verifiers state)."""
        n = len(completions)
        if completion_ids is not None and len(completion_ids) != n:
            raise ValueError(f"rewards: completion_ids ({len(completion_ids)}) must have one entry per sample ({n})")
        if len(prompts) != n or any(len(v) != n for v in columns.values()):
            raise ValueError(f"rewards: prompts ({len(prompts)}), completions ({n}) and columns "
                             f"({ {k: len(v) for k, v in columns.items()} }) must have one entry per sample")
        self._ids = completion_ids
        self._state = trainer_state
        self._envs = environments
        texts = list(completions)
        if completion_messages is not None:
            if len(completion_messages) != n:
                raise ValueError(f"rewards: completion_messages ({len(completion_messages)}) must have one entry per "
                                 f"sample ({n})")
            completions = [list(m) for m in completion_messages]
        elif any(isinstance(p, list) for p in prompts):  # TRL: conversational prompts, conversational completions
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        total: list[float | None] = [None] * n
        per_fn, errors, logged = {}, {}, {}
        for f in self.fns:
            log_ = _Log(f.name)
            values, failed = self._score(f, prompts, completions, texts, columns, log_)
            per_fn[f.name] = values
            errors[f.name] = failed
            self.errors_total[f.name] += failed
            for i, v in enumerate(values):
                if v is not None:
                    total[i] = (total[i] or 0.0) + f.weight * v
            logged.update({k: sum(v) / len(v) for k, v in log_.metrics.items()})
            logged.update({k: v[0] for k, v in log_.extra.items() if v})
        return RewardResult(total=total, per_fn=per_fn, errors=errors, logged=logged)

    def _log_once(self, f: RewardFn, exc: BaseException | None, what: str, tag: str | None = None) -> None:
        tag = tag or (type(exc).__name__ if exc is not None else what)
        if tag in f.logged:
            return
        f.logged.add(tag)
        log.error("reward %r (%s) failed on a sample; that sample gets reward 0 from it, the run goes on, "
                  "and further %s failures of this function are only counted (reward/errors): %s",
                  f.name, f.key, tag, what, exc_info=(type(exc), exc, exc.__traceback__) if exc else None)

    def _checked(self, f: RewardFn, value: Any) -> float | None | BaseException:
        """A finite float, None (not scored), or the failure it is."""
        if isinstance(value, dict) and "score" in value:
            value = value["score"]
        if value is None:
            return None
        try:
            x = float(value)
        except (TypeError, ValueError):
            self._log_once(f, None, f"returned {value!r}, not a number", tag="not a number")
            return ValueError(value)
        if not math.isfinite(x):
            self._log_once(f, None, f"returned the non-finite value {x}", tag="non-finite")
            return ValueError(value)
        return x

    def _score(self, f, prompts, completions, texts, columns, log_) -> tuple[list[float | None], int]:
        n = len(completions)
        if f.style == "per_sample":
            raw = self._per_sample(f, prompts, texts, columns, range(n))
        else:
            raw = self._batch(f, prompts, completions, columns, log_)
        values, failed = [], 0
        for r in raw:
            x = r if isinstance(r, BaseException) else self._checked(f, r)
            if isinstance(x, BaseException):
                failed += 1
                x = 0.0
            values.append(x)
        return values, failed

    def _cols(self, f: RewardFn, columns: dict[str, list], idx) -> dict[str, list]:
        names = columns if f.columns is None else [c for c in f.columns if c in columns]
        # A configured kwarg wins over a dataset column of the same name (never both: TypeError);
        # so do TRL's own keywords.
        return {c: [columns[c][i] for i in idx] for c in names if c not in f.kwargs and c not in BATCH_ARGS}

    def _args(self, f: RewardFn, prompts, completions, idx, log_: _Log) -> dict:
        """The TRL keyword arguments `f` takes, for the samples `idx`."""
        have = {"prompts": [prompts[i] for i in idx], "completions": [completions[i] for i in idx],
                "log_metric": log_.metric, "log_extra": log_.extra_column}
        if self._ids is not None:
            have["completion_ids"] = [self._ids[i] for i in idx]
        if self._state is not None:
            have["trainer_state"] = self._state
        if self._envs is not None:
            have["environments"] = [self._envs[i] for i in idx]
        return {k: v for k, v in have.items() if k in f.accepts}

    def _call(self, f, prompts, completions, columns, idx, log_) -> list:
        out = _run(f.fn(**self._args(f, prompts, completions, idx, log_), **self._cols(f, columns, idx), **f.kwargs))
        if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
            raise TypeError(f"returned {type(out).__name__}, expected a list of one value per sample")
        out = list(out)
        if len(out) != len(idx):
            raise _WrongLength(f"returned {len(out)} values for {len(idx)} samples")
        return out

    def _batch(self, f, prompts, completions, columns, log_) -> list:
        n = len(completions)
        try:
            return self._call(f, prompts, completions, columns, range(n), log_)
        except _WrongLength as e:  # a contract failure of the whole call: re-scoring would hide it
            self._log_once(f, e, "returned the wrong number of values; every sample of the call gets 0")
            return [e] * n
        except Exception as e:  # noqa: BLE001 - a reward must not end the run (module docstring)
            if n == 1:
                self._log_once(f, e, "raised")
                return [e]
        # Isolate the failing samples: one call per sample.
        results = []
        for i in range(n):
            try:
                results.append(self._call(f, prompts, completions, columns, [i], log_)[0])
            except Exception as e:  # noqa: BLE001
                self._log_once(f, e, "raised")
                results.append(e)
        return results

    def _per_sample(self, f, prompts, texts, columns, idx) -> list:
        n = len(texts)

        def call(i):
            if "extra_info" in columns:  # verl's layout: its own column
                extra = columns["extra_info"][i]
            else:
                extra = {k: v[i] for k, v in columns.items() if k not in ("answer", "data_source")}
                extra["prompt"] = prompts[i]
            return f.fn(columns.get("data_source", [None] * n)[i], texts[i],
                        columns.get("answer", [None] * n)[i], extra, **f.kwargs)

        if f.is_async:
            out = asyncio.run(_gather([call(i) for i in idx]))
        else:
            out = []
            for i in idx:
                try:
                    out.append(_run(call(i)))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
        for r in out:
            if isinstance(r, BaseException):
                self._log_once(f, r, "raised")
        return out
