"""Reward functions: built-ins, user functions by dotted path, and the scorer the loop calls.

    reward:                                   # in a config, or `--reward pkg.module:fn` on the CLI
      functions:
        - {fn: format, weight: 0.5, kwargs: {pattern: '^\\s*\\d'}}
        - {fn: my_pkg.rewards:judge, weight: 0.5}

Two calling styles are accepted:
- batch (TRL's): called by keyword, as TRL calls reward functions:
  `f(prompts=[...], completions=[...], completion_ids=[[...]], **columns) -> list[float]`, sync or
  `async def`; so `f(completions, **kwargs)`, `f(prompts, completions, answer)` and
  `f(completions, completion_ids, **kwargs)` all work. The dataset's columns arrive one list per
  column (`answer=[...]`); a function receives the arguments it names, or all of them when it takes
  `**kwargs`. It must name `completions` or take `**kwargs`.
- per sample (verl's): `compute_score(data_source, solution_str, ground_truth, extra_info) -> float`
  (or a dict with a "score"), sync or async; `extra_info` holds the prompt and the other columns.

Failures never stop a run: a sample whose reward raises or is not a finite number gets 0 from that
function, the failure is counted (`reward/errors` in the metrics) and logged once per function and
exception type with its traceback. When a batch call fails as a whole, the batch is re-scored one
sample at a time so that only the failing samples get 0. Problems visible before the run starts (a
path that does not import, a name that is not callable, keyword arguments the function does not
take) are errors at load time that name the config key.
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
# Built-ins (batch style; each takes the columns it needs and ignores the rest).


def exact_match(prompts: list[str], completions: list[str], answer: list[Any], *,
                match: str = "full", ignore_case: bool = False, **_) -> list[float]:
    """1.0 when the completion equals the answer (both stripped); match="prefix": starts with it."""
    if match not in ("full", "prefix"):
        raise ValueError(f"exact_match: kwargs.match: expected 'full' or 'prefix', got {match!r}")
    out = []
    for c, a in zip(completions, answer, strict=True):
        c, a = c.strip(), str(a).strip()
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
        found = _NUMBER.findall(c)
        if not found:
            out.append(0.0)
            continue
        got = float(found[0 if which == "first" else -1].replace(",", ""))
        out.append(float(abs(got - target) <= tol))
    return out


def format_reward(prompts: list[str], completions: list[str], *, pattern: str, **_) -> list[float]:
    """1.0 when the regex `pattern` matches at the start of the completion (re.match)."""
    rx = re.compile(pattern, re.DOTALL)
    return [float(rx.match(c) is not None) for c in completions]


BUILTINS: dict[str, Callable] = {"exact_match": exact_match, "numeric": numeric, "format": format_reward}


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
BATCH_ARGS = ("prompts", "completions", "completion_ids")


def load_reward(spec, index: int) -> RewardFn:
    """A `RewardFnConfig` (config.reward.functions[index]) -> RewardFn, checked before any sample."""
    key = f"reward.functions.{index}"
    fn = resolve(spec.fn, f"{key}.fn")
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
    name = spec.name or (spec.fn if ":" not in spec.fn else getattr(fn, "__name__", spec.fn.split(":")[-1]))
    return RewardFn(name=name, weight=spec.weight, fn=fn, kwargs=dict(spec.kwargs), style=style, key=key,
                    columns=columns, accepts=accepts, is_async=inspect.iscoroutinefunction(fn))


def load_rewards(reward_cfg) -> list[RewardFn]:
    fns = [load_reward(s, i) for i, s in enumerate(reward_cfg.functions)]
    names = [f.name for f in fns]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RewardLoadError(f"reward.functions: two functions are named {sorted(dup)}; give them distinct "
                              f"`name`s so their metrics do not collide")
    return fns


# ---------------------------------------------------------------------------------------------
# Scoring.


@dataclass
class RewardResult:
    total: list[float]                 # weighted sum per sample
    per_fn: dict[str, list[float]]     # unweighted, per function, failed samples as 0
    errors: dict[str, int]             # failed samples per function in this call


def _run(value):
    return asyncio.run(value) if inspect.isawaitable(value) else value


async def _gather(values):
    return await asyncio.gather(*values, return_exceptions=True)


class RewardScorer:
    """Scores a batch of samples with every configured function (see the module docstring)."""

    def __init__(self, fns: list[RewardFn]):
        self.fns = fns
        self._ids: list[list[int]] | None = None  # the current call's completion_ids
        self.errors_total: dict[str, int] = {f.name: 0 for f in fns}

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list],
                 completion_ids: list[list[int]] | None = None) -> RewardResult:
        n = len(completions)
        if completion_ids is not None and len(completion_ids) != n:
            raise ValueError(f"rewards: completion_ids ({len(completion_ids)}) must have one entry per sample ({n})")
        self._ids = completion_ids
        if len(prompts) != n or any(len(v) != n for v in columns.values()):
            raise ValueError(f"rewards: prompts ({len(prompts)}), completions ({n}) and columns "
                             f"({ {k: len(v) for k, v in columns.items()} }) must have one entry per sample")
        total = [0.0] * n
        per_fn, errors = {}, {}
        for f in self.fns:
            values, failed = self._score(f, prompts, completions, columns)
            per_fn[f.name] = values
            errors[f.name] = failed
            self.errors_total[f.name] += failed
            for i, v in enumerate(values):
                total[i] += f.weight * v
        return RewardResult(total=total, per_fn=per_fn, errors=errors)

    def _log_once(self, f: RewardFn, exc: BaseException | None, what: str) -> None:
        tag = type(exc).__name__ if exc is not None else what
        if tag in f.logged:
            return
        f.logged.add(tag)
        log.error("reward %r (%s) failed on a sample; that sample gets reward 0 from it, the run goes on, "
                  "and further %s failures of this function are only counted (reward/errors): %s",
                  f.name, f.key, tag, what, exc_info=(type(exc), exc, exc.__traceback__) if exc else None)

    def _checked(self, f: RewardFn, value: Any) -> float | None:
        if isinstance(value, dict) and "score" in value:
            value = value["score"]
        try:
            x = float(value)
        except (TypeError, ValueError):
            self._log_once(f, None, f"returned {value!r}, not a number")
            return None
        if not math.isfinite(x):
            self._log_once(f, None, f"returned the non-finite value {x}")
            return None
        return x

    def _score(self, f, prompts, completions, columns) -> tuple[list[float], int]:
        n = len(completions)
        if f.style == "per_sample":
            raw = self._per_sample(f, prompts, completions, columns, range(n))
        else:
            raw = self._batch(f, prompts, completions, columns)
        values, failed = [], 0
        for r in raw:
            x = None if isinstance(r, BaseException) else self._checked(f, r)
            if x is None:
                failed += 1
                x = 0.0
            values.append(x)
        return values, failed

    def _cols(self, f: RewardFn, columns: dict[str, list], idx) -> dict[str, list]:
        names = columns if f.columns is None else [c for c in f.columns if c in columns]
        # A configured kwarg wins over a dataset column of the same name (never both: TypeError).
        return {c: [columns[c][i] for i in idx] for c in names if c not in f.kwargs}

    def _args(self, f: RewardFn, prompts, completions, idx) -> dict:
        """The TRL keyword arguments `f` takes, for the samples `idx`."""
        have = {"prompts": [prompts[i] for i in idx], "completions": [completions[i] for i in idx]}
        if self._ids is not None:
            have["completion_ids"] = [self._ids[i] for i in idx]
        return {k: v for k, v in have.items() if k in f.accepts}

    def _batch(self, f, prompts, completions, columns) -> list:
        n = len(completions)
        try:
            out = _run(f.fn(**self._args(f, prompts, completions, range(n)), **self._cols(f, columns, range(n)),
                            **f.kwargs))
            out = list(out)
            if len(out) != n:
                raise ValueError(f"returned {len(out)} values for {n} samples")
            return out
        except Exception as e:  # noqa: BLE001 - a reward must not end the run (module docstring)
            if n == 1:
                self._log_once(f, e, "raised")
                return [e]
        # Isolate the failing samples: one call per sample.
        results = []
        for i in range(n):
            try:
                one = list(_run(f.fn(**self._args(f, prompts, completions, [i]), **self._cols(f, columns, [i]),
                                     **f.kwargs)))
                if len(one) != 1:
                    raise ValueError(f"returned {len(one)} values for 1 sample")
                results.append(one[0])
            except Exception as e:  # noqa: BLE001
                self._log_once(f, e, "raised")
                results.append(e)
        return results

    def _per_sample(self, f, prompts, completions, columns, idx) -> list:
        def call(i):
            extra = {k: v[i] for k, v in columns.items() if k not in ("answer", "data_source")}
            extra["prompt"] = prompts[i]
            return f.fn(columns.get("data_source", [None] * len(completions))[i], completions[i],
                        columns.get("answer", [None] * len(completions))[i], extra, **f.kwargs)

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
