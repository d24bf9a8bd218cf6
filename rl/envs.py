"""Environments of multi-turn episodes, written the way TRL and verifiers users write them
(docs/MULTI_TURN.md); rl/episodes.py drives them turn by turn.

Three shapes, named in the config (`env`, rl/config.py EnvConfig):
    env.tools: [module:function, ...]   TRL's `tools=`: plain functions with type hints and a Google-style
                                        docstring; their JSON schemas come from transformers'
                                        `get_json_schema`; the episode ends when the model calls none
    env.environment: module:Class       TRL's `environment_factory` shape: no-arg __init__, reset(**row) ->
                                        str | None (appended to the last user message), each public method
                                        a tool; one instance per episode; a raised exception is the tool's
                                        answer
    env.environment: module:Class       verifiers' `MultiTurnEnv` shape (the class has env_response):
                                        env_response(messages, state) -> messages (or (messages, state),
                                        possibly async), is_completed(messages, state) as the stop predicate,
                                        setup_state(state) optional; one instance built with
                                        env.environment_kwargs, the state per episode

Nothing here depends on trl or verifiers: the shapes are duck-typed. Every call into user code (a tool,
env_response, is_completed, reset) runs in a worker thread with a deadline (env.tool_timeout_s): a call
that raises or runs past it becomes an error message fed back to the model, is counted, and never stops
the run. A thread that runs past its deadline cannot be killed in Python; it is left behind (a daemon)
and its late result is dropped.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

OK, ERROR, TIMEOUT = "ok", "error", "timeout"


class EnvError(ValueError):
    """An environment or tool that cannot be used; raised before any episode runs, naming it."""


def load_object(spec: str, key: str) -> Any:
    """`module:attr` -> the object; EnvError naming the key otherwise."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise EnvError(f"{key}: expected `module:name`, got {spec!r}")
    mod, name = spec.split(":")
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise EnvError(f"{key}: cannot import module {mod!r} of {spec!r}: {e}") from e
    if not hasattr(module, name):
        raise EnvError(f"{key}: module {mod!r} has no attribute {name!r}")
    return getattr(module, name)


def tool_schema(fn: Callable, key: str) -> dict:
    """The JSON schema a chat template renders for `fn`, from transformers' own helper (the schema TRL
    passes to the template too); EnvError naming the function when its hints or docstring do not do."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its TypeHintParsingException / DocstringParsingException
        raise EnvError(f"{key}: tool {getattr(fn, '__name__', fn)!r} has no usable JSON schema ({e}); a tool needs "
                       "type hints on every argument and a Google-style docstring with an Args section") from e


# ---------------------------------------------------------------------------------------------
# Calls into user code, each with a deadline.


@dataclass
class Call:
    """One call into user code, started in its own thread."""
    fn: Callable
    args: dict
    deadline: float
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Call:
        def run():
            try:
                out = self.fn(**self.args)
                if inspect.isawaitable(out):
                    out = asyncio.run(_awaited(out))
                self.result = out
            except BaseException as e:  # noqa: BLE001 - user code: whatever it raises is its answer
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True, name=f"env-call-{getattr(self.fn, '__name__', 'fn')}").start()
        return self

    def wait(self) -> tuple[str, Any]:
        """(status, value): (ok, result), (error, the exception) or (timeout, None)."""
        if not self.done.wait(max(0.0, self.deadline - time.monotonic())):
            return TIMEOUT, None
        return (ERROR, self.error) if self.error is not None else (OK, self.result)


async def _awaited(aw):
    return await aw


def call_all(calls: list[tuple[Callable, dict]], timeout_s: float) -> list[tuple[str, Any]]:
    """Run every call concurrently, each with its own `timeout_s`; their (status, value) in order."""
    started = [Call(fn, args, time.monotonic() + timeout_s).start() for fn, args in calls]
    return [c.wait() for c in started]


def error_text(status: str, value: Any, what: str, timeout_s: float) -> str:
    """The message the model reads for a failed call."""
    if status == TIMEOUT:
        return f"Error: {what} timed out after {timeout_s:g} s"
    return f"Error: {what} raised {type(value).__name__}: {value}"


def result_text(value: Any) -> str:
    """A tool's result as the tool message's content (strings as they are, the rest as JSON)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


# ---------------------------------------------------------------------------------------------
# The per-episode interface the episode runner drives.


@dataclass
class Reply:
    """What the environment answers to one assistant turn."""
    messages: list[dict]      # appended to the conversation (tool or user messages); may be empty
    done: bool                # the episode is over (no environment turn follows)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0


class Session:
    """One episode's environment."""
    schemas: list[dict] | None = None  # tool schemas for the chat template; None: no tools

    def start(self, row: dict, prompt: list[dict]) -> list[dict]:
        """The prompt messages the episode starts from (a copy, possibly extended)."""
        return [dict(m) for m in prompt]

    def respond(self, messages: list[dict], calls: list[dict] | None, parse_error: str | None) -> Reply:
        raise NotImplementedError

    def reward(self) -> float | None:
        return None

    def handle(self) -> Any:
        """What reward functions get as this episode's entry of `environments` (TRL's keyword)."""
        return None


class ToolSession(Session):
    """Tools called by name; the episode ends at the first assistant turn that calls none."""

    def __init__(self, tools: dict[str, Callable], schemas: list[dict], timeout_s: float):
        self.tools, self.schemas, self.timeout_s = tools, schemas, timeout_s

    def respond(self, messages, calls, parse_error) -> Reply:
        if parse_error is not None:
            # A malformed call is the model's mistake: it reads the error and may try again.
            return Reply([{"role": "tool", "content": f"Error: {parse_error}"}], done=False, tool_calls=1,
                         tool_errors=1)
        if not calls:
            return Reply([], done=True)
        runs, out = [], []
        for c in calls:
            fn = self.tools.get(c["name"])
            ok = fn is not None and isinstance(c["arguments"], dict)
            runs.append((fn, c["arguments"]) if ok else None)
        results = iter(call_all([r for r in runs if r is not None], self.timeout_s))
        errors = timeouts = 0
        for c, r in zip(calls, runs):
            if r is None:
                errors += 1
                text = (f"Error: no tool named {c['name']!r}; the tools are {sorted(self.tools)}"
                        if c["name"] not in self.tools else
                        f"Error: the arguments of {c['name']!r} must be a JSON object, got {c['arguments']!r}")
            else:
                status, value = next(results)
                if status == OK:
                    text = result_text(value)
                else:
                    errors += status == ERROR
                    timeouts += status == TIMEOUT
                    text = error_text(status, value, f"tool {c['name']!r}", self.timeout_s)
            out.append({"role": "tool", "name": c["name"], "content": text})
        return Reply(out, done=False, tool_calls=len(calls), tool_errors=errors, tool_timeouts=timeouts)


class TRLSession(ToolSession):
    """TRL's environment_factory shape: one instance per episode, its public methods the tools."""

    def __init__(self, cls: type, timeout_s: float, key: str):
        self.instance = cls()
        tools = trl_tools(self.instance)
        super().__init__(tools, [tool_schema(fn, key) for fn in tools.values()], timeout_s)

    def start(self, row, prompt):
        messages = super().start(row, prompt)
        status, value = call_all([(self.instance.reset, dict(row))], self.timeout_s)[0]
        if status != OK:
            raise EnvError(f"env.environment: {type(self.instance).__name__}.reset(**row) failed: "
                           + error_text(status, value, "reset", self.timeout_s))
        if value is not None:
            if not isinstance(value, str):
                raise EnvError(f"env.environment: {type(self.instance).__name__}.reset must return a str or None, "
                               f"got {type(value).__name__}")
            last = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last] = {**messages[last], "content": messages[last]["content"] + value}
        return messages

    def reward(self):
        r = getattr(self.instance, "reward", None)
        return float(r) if isinstance(r, (int, float)) and not isinstance(r, bool) else None

    def handle(self):
        return self.instance


def trl_tools(instance: Any) -> dict[str, Callable]:
    """The public methods of an environment_factory instance other than reset (TRL's rule)."""
    out = {}
    for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction):
        if not name.startswith("_") and name != "reset":
            out[name] = getattr(instance, name)
    return out


class VerifiersSession(Session):
    """verifiers' MultiTurnEnv shape: env_response(messages, state) answers each assistant turn."""

    def __init__(self, env: Any, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s
        self.state: dict = {}

    def start(self, row, prompt):
        messages = super().start(row, prompt)
        self.state = {"prompt": [dict(m) for m in messages], "answer": row.get("answer"), "info": row.get("info", {}),
                      "task": row.get("task"), "turn": 0, "responses": [], "completion": []}
        if hasattr(self.env, "setup_state"):
            status, value = call_all([(self.env.setup_state, {"state": self.state})], self.timeout_s)[0]
            if status != OK:
                raise EnvError("env.environment: setup_state failed: " + error_text(status, value, "setup_state",
                                                                                    self.timeout_s))
            if isinstance(value, dict):
                self.state = value
        return messages

    def _failed(self, status, value, method: str, done: bool) -> Reply:
        """A user method that raised or timed out: its error as the environment's message, counted."""
        return Reply([{"role": "user", "content": error_text(status, value, method, self.timeout_s)}], done=done,
                     tool_errors=status == ERROR, tool_timeouts=status == TIMEOUT)

    def respond(self, messages, calls, parse_error) -> Reply:
        self.state["turn"] += 1
        self.state["responses"].append(messages[-1])
        if hasattr(self.env, "is_completed"):
            status, value = call_all([(self.env.is_completed, {"messages": messages, "state": self.state})],
                                     self.timeout_s)[0]
            if status != OK:
                return self._failed(status, value, "is_completed", done=True)
            if value:
                return Reply([], done=True)
        status, value = call_all([(self.env.env_response, {"messages": messages, "state": self.state})],
                                 self.timeout_s)[0]
        if status != OK:
            return self._failed(status, value, "env_response", done=False)
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):  # older verifiers
            value, self.state = value
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
            msg = f"Error: env_response returned {type(value).__name__}, expected a list of messages"
            return Reply([{"role": "user", "content": msg}], done=False, tool_errors=1)
        return Reply([dict(m) for m in value], done=False)

    def reward(self):
        r = self.state.get("reward")
        return float(r) if isinstance(r, (int, float)) and not isinstance(r, bool) else None

    def handle(self):
        return self.state


# ---------------------------------------------------------------------------------------------
# From the config.


class Environment:
    """The `env` section made concrete: builds one Session per episode."""

    def __init__(self, env_cfg):
        self.timeout_s = float(env_cfg.tool_timeout_s)
        self.kind = None
        self.schemas: list[dict] | None = None
        if env_cfg.tools:
            self.kind = "tools"
            self.tools = {}
            schemas = []
            for i, spec in enumerate(env_cfg.tools):
                fn = load_object(spec, f"env.tools.{i}")
                if not callable(fn):
                    raise EnvError(f"env.tools.{i}: {spec!r} is a {type(fn).__name__}, expected a function")
                schema = tool_schema(fn, f"env.tools.{i}")
                name = schema["function"]["name"] if "function" in schema else schema["name"]
                if name in self.tools:
                    raise EnvError(f"env.tools.{i}: a second tool named {name!r} ({spec!r})")
                self.tools[name] = fn
                schemas.append(schema)
            self.schemas = schemas
        elif env_cfg.environment is not None:
            cls = load_object(env_cfg.environment, "env.environment")
            if not isinstance(cls, type):
                raise EnvError(f"env.environment: {env_cfg.environment!r} is a {type(cls).__name__}, expected a class")
            if hasattr(cls, "env_response"):
                self.kind = "verifiers"
                try:
                    self.env = cls(**env_cfg.environment_kwargs)
                except Exception as e:
                    raise EnvError(f"env.environment: {cls.__name__}(**env.environment_kwargs) failed: {e}") from e
            else:
                if not callable(getattr(cls, "reset", None)):
                    raise EnvError(f"env.environment: {cls.__name__} has neither env_response (verifiers' "
                                   "MultiTurnEnv shape) nor reset (TRL's environment_factory shape)")
                if env_cfg.environment_kwargs:
                    raise EnvError("env.environment_kwargs: TRL's environment_factory classes take no arguments "
                                   f"(no-arg __init__), got {env_cfg.environment_kwargs!r}")
                self.kind = "trl"
                self.cls = cls
                probe = TRLSession(cls, self.timeout_s, "env.environment")  # schemas checked before any run
                if not probe.tools:
                    raise EnvError(f"env.environment: {cls.__name__} has no public method besides reset (its tools)")
                self.schemas = probe.schemas
        else:
            raise EnvError("env: set env.tools or env.environment")

    def session(self) -> Session:
        if self.kind == "tools":
            return ToolSession(self.tools, self.schemas, self.timeout_s)
        if self.kind == "trl":
            return TRLSession(self.cls, self.timeout_s, "env.environment")
        return VerifiersSession(self.env, self.timeout_s)
