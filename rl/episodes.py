"""Multi-turn episodes, token-exact (docs/MULTI_TURN.md): the sequence the trainer sees is the sampler's own
token ids for every assistant turn plus the chat template's tokens for every environment turn, never
re-tokenised assistant text.

    ChatFormat     the model's chat template as a token-level format: the prompt's tokens, the tokens of an
                   environment turn (render the conversation with and without it, require the shorter to be
                   a token prefix of the longer, take the suffix), tool calls parsed from an assistant turn;
                   refuses (TemplateError, naming the template) a template that cannot be extended as a
                   prefix or whose tool-call format it cannot parse
    EpisodeRunner  runs a batch of episodes turn by turn: each turn's generation for every live episode is
                   one `generate` call (token-id prompts), the environments answer concurrently (rl/envs.py),
                   the limits (env.max_turns, env.max_tokens_per_turn, env.max_total_tokens) end an episode
                   truncated
    Episode        one finished episode: prompt ids, completion ids (assistant and environment tokens), the
                   loss mask (1 on assistant tokens), the sampler's logprobs (0.0 on environment tokens, which
                   the mask excludes), the completion as messages, counts

The environment tokens of turn t: with history H (the prompt, then every message so far, ending with the
assistant's turn t as parsed) and the environment's messages E,
    render(H) must be a token prefix of render(H + E, add_generation_prompt=True)
and the tokens appended after the sampled ones are (what the template writes after the assistant's
end-of-turn token in render(H)) + (render(H + E) minus render(H)). The assistant's own tokens are never
rendered into the sequence: they are the sampled ones, ending with the end-of-turn token the sampler stopped on
(a turn that stopped on a stop string, rollout.stop, gets the template's end-of-turn token as context).

Routing (trainer.routing_replay / routing_metrics): each turn's generate call returns, per episode, the experts
the engine routed the call's tokens to (rollout/capture.py: [context + completion tokens, layers, k], -1 rows
for the prompt tokens the engine's prefix cache served and for the last sampled token, never fed back). An
episode's routing is `merge_routing` over its turns: a token's row from the latest turn that computed it, else
from the earlier turn that did (the prefix cache hands later turns that turn's keys and values).
"""

from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from records import Sample
from rl.envs import EnvError, Environment, Reply


class TemplateError(EnvError):
    """A chat template that multi-turn episodes cannot use; the message names it."""


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[dict], str | None]:
    """Qwen's / Hermes' format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after the
    content. Returns (content, calls [{"name", "arguments"}], parse error or None)."""
    start = text.find("<tool_call>")
    if start < 0:
        return text.strip(), [], None
    content = text[:start].strip()
    calls = []
    rest = text[start:]
    blocks = _TOOL_CALL.findall(rest)
    if rest.count("<tool_call>") != len(blocks):
        return content, [], "a <tool_call> without its closing </tool_call>"
    for raw in blocks:
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as e:
            return content, [], f"the tool call {raw.strip()!r} is not valid JSON ({e.msg})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return content, [], f"the tool call {raw.strip()!r} has no \"name\" string"
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append({"name": call["name"], "arguments": args})
    return content, calls, None


def assistant_message(content: str, calls: list[dict]) -> dict:
    """The parsed assistant turn in transformers' message format (the chat template renders it)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in calls]
    return msg


class ChatFormat:
    """A tokenizer's chat template as a token-level, prefix-extensible format (see the module docstring)."""

    def __init__(self, tokenizer, schemas: list[dict] | None, eos_ids: list[int], env_role: str = "tool"):
        self.tok = tokenizer
        self.schemas = schemas or None
        self.eos_ids = set(int(i) for i in eos_ids)
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str):
            raise TemplateError(f"the tokenizer of {tokenizer.name_or_path} has no (single) chat template; "
                                "multi-turn episodes render every turn with it")
        digest = hashlib.sha256(template.encode()).hexdigest()[:12]
        self.name = f"the chat template of {tokenizer.name_or_path} (sha256 {digest})"
        self.parser: Callable[[str, list[int]], tuple[str, list[dict], str | None]] | None = None
        if self.schemas:
            if getattr(tokenizer, "response_template", None) is not None:
                self.parser = self._parse_with_tokenizer
            elif "<tool_call>" in template:
                self.parser = lambda text, _ids: parse_hermes(text)
            else:
                raise TemplateError(f"{self.name} defines no tool-call format this project parses: the tokenizer has "
                                    "no response_template (transformers' parse_response) and the template writes no "
                                    "<tool_call> blocks (Qwen's / Hermes' format)")
            probe = self.render_text([{"role": "user", "content": "x"}], True)
            name = self.schemas[0].get("function", self.schemas[0])["name"]
            if name not in probe:
                raise TemplateError(f"{self.name} does not render the tools (tools=...): the tool {name!r} is not in "
                                    "its prompt, so the model could not know it")
        self.check_prefix(env_role)

    # -- rendering ---------------------------------------------------------------------------
    def render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.schemas, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def render_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The template's tokens of `messages` (the rendered text tokenised without added special tokens, as
        apply_chat_template(tokenize=True) does)."""
        return list(self.tok(self.render_text(messages, add_generation_prompt), add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.render_ids(messages, True)

    def env_ids(self, history: list[dict], env_messages: list[dict], closed: bool = True) -> list[int]:
        """The tokens that follow an assistant turn's sampled tokens when the environment answers with
        `env_messages`: the template's tail of that assistant turn, then its rendering of `env_messages` and
        the next generation prompt. closed: the sampled turn ended on an end-of-turn token; otherwise (it
        stopped on a stop string) the template's end-of-turn token comes first, as context. TemplateError
        where `history` does not render as a token prefix of `history + env_messages`."""
        prev = self.render_ids(history, False)
        new = self.render_ids(history + env_messages, True)
        if new[:len(prev)] != prev:
            at = next((i for i, (a, b) in enumerate(zip(prev, new)) if a != b), min(len(prev), len(new)))
            raise TemplateError(
                f"{self.name} cannot be extended as a prefix: the conversation of roles "
                f"{[m['role'] for m in history]} renders differently once {[m['role'] for m in env_messages]} "
                f"follow (first differing token at {at}: {self.tok.decode(prev[at:at + 8])!r} became "
                f"{self.tok.decode(new[at:at + 8])!r}); the sampled tokens of earlier turns would no longer be what "
                "the template gives the trainer")
        return self.turn_tail(prev, closed) + new[len(prev):]

    def turn_tail(self, rendered: list[int], closed: bool = True) -> list[int]:
        """What the template writes after the last end-of-turn token of `rendered` (e.g. ChatML's newline);
        closed=False: from that end-of-turn token on."""
        last = max((i for i, t in enumerate(rendered) if t in self.eos_ids), default=None)
        if last is None:
            raise TemplateError(f"{self.name} ends an assistant turn with none of the end-of-turn tokens "
                                f"{sorted(self.eos_ids)} the sampler stops on")
        return rendered[last + int(closed):]

    def check_prefix(self, env_role: str) -> None:
        """Refuse, before any episode, a template whose renderings do not extend one another at the turn
        boundaries an episode has (prompt -> assistant, assistant -> environment -> next prompt)."""
        call = [{"name": self.schemas[0].get("function", self.schemas[0])["name"], "arguments": {}}] if self.schemas else []
        user = {"role": "user", "content": "What is 2 + 3?"}
        a1 = assistant_message("Let me check.", call)
        env = ([{"role": "tool", "name": call[0]["name"], "content": "5"}] if env_role == "tool" and call
               else [{"role": "user", "content": "Are you sure?"}])
        a2 = assistant_message("The answer is 5.", [])
        prompt = self.render_ids([user], True)
        first = self.render_ids([user, a1], False)
        if first[:len(prompt)] != prompt:
            raise TemplateError(f"{self.name} cannot be extended as a prefix: an assistant turn does not start where "
                                "its generation prompt ends")
        self.env_ids([user, a1], env)
        self.env_ids([user, a1] + env + [a2], env)

    # -- parsing -----------------------------------------------------------------------------
    def parse(self, text: str, context_ids: list[int]) -> tuple[dict, list[dict], str | None]:
        """(assistant message, tool calls, parse error or None) of one sampled assistant turn."""
        if self.parser is None:
            return assistant_message(text.strip(), []), [], None
        content, calls, err = self.parser(text, context_ids)
        return assistant_message(content, calls), calls, err

    def _parse_with_tokenizer(self, text: str, context_ids: list[int]):
        try:
            msg = self.tok.parse_response(text, prefix=self.tok.decode(context_ids), tools=self.schemas)
        except Exception as e:  # noqa: BLE001 - a malformed turn is the model's, fed back to it
            return text.strip(), [], f"the turn does not parse ({type(e).__name__}: {e})"
        calls = [{"name": c.get("function", c)["name"], "arguments": c.get("function", c).get("arguments", {})}
                 for c in msg.get("tool_calls") or []]
        return msg.get("content") or "", calls, None


# ---------------------------------------------------------------------------------------------
# Episodes.


@dataclass
class Episode:
    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the completion: assistant, tool / user messages
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    parse_errors: int = 0
    truncated: bool = False
    finish_reason: str | None = None
    env_reward: float | None = None
    handle: Any = None  # the environment instance (TRL) or state (verifiers) reward functions may read
    text: str = ""
    routed_experts: Any = None  # [prompt + completion tokens, layers, k] int16 over the turns (module docstring)

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.completion_ids += ids
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)
        self.sampler_logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


# generate(prompt_ids, max_tokens, turn) -> per prompt a records.Sample (completion_ids, sampler_logprobs, text,
# finish_reason are read)
Generate = Callable[[list[list[int]], list[int], int], list[Sample]]


class EpisodeRunner:
    """Episodes of one batch, turn by turn; see the module docstring."""

    def __init__(self, env: Environment, fmt: ChatFormat, *, max_turns: int, max_tokens_per_turn: int,
                 max_total_tokens: int):
        self.env, self.fmt = env, fmt
        self.max_turns, self.per_turn, self.total = max_turns, max_tokens_per_turn, max_total_tokens

    def run(self, rows: list[dict], prompts: list[list[dict]], n: int, generate: Generate) -> list[Episode]:
        """n episodes per prompt (prompt-major, as RolloutWorker.generate orders samples)."""
        episodes, sessions, history = [], [], []
        for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            for _ in range(n):
                session = self.env.session()
                messages = session.start(row, prompt)
                ids = self.fmt.prompt_ids(messages)
                if len(ids) + 1 > self.total:
                    raise EnvError(f"prompt {i}: {len(ids)} tokens after the chat template leave no room in "
                                   f"env.max_total_tokens={self.total}")
                episodes.append(Episode(i, ids, handle=session.handle()))
                sessions.append(session)
                history.append(messages)
        live = list(range(len(episodes)))
        for turn in range(self.max_turns):
            if not live:
                break
            ctx = [episodes[e].prompt_ids + episodes[e].completion_ids for e in live]
            budgets = [min(self.per_turn, self.total - len(c)) for c in ctx]
            outs = generate(ctx, budgets, turn)
            if len(outs) != len(live):
                raise RuntimeError(f"generate: expected {len(live)} completions (one per live episode), got {len(outs)}")
            answering = []
            for e, c, budget, out in zip(live, ctx, budgets, outs):
                ep = episodes[e]
                ids = list(out.completion_ids)
                ep.append(ids, list(out.sampler_logprobs))
                if out.routed_experts is not None:
                    ep.routed_experts = merge_routing(ep.routed_experts, out.routed_experts)
                ep.turns += 1
                ep.finish_reason = out.finish_reason
                closed = bool(ids) and ids[-1] in self.fmt.eos_ids
                # Cut by a token limit (not an end-of-turn token, nor a stop string): the episode ends there.
                if not ids or (not closed and out.finish_reason != "stop"):
                    ep.truncated = True
                    msg, _, _ = self.fmt.parse(out.text, c)
                    ep.messages.append(msg)
                    continue
                msg, calls, err = self.fmt.parse(out.text, c)
                ep.messages.append(msg)
                history[e].append(msg)
                ep.parse_errors += err is not None
                answering.append((e, calls, err, closed))
            replies = self._respond(sessions, history, answering)
            nxt = []
            for (e, _, _, closed), reply in zip(answering, replies):
                ep = episodes[e]
                ep.tool_calls += reply.tool_calls
                ep.tool_errors += reply.tool_errors
                ep.tool_timeouts += reply.tool_timeouts
                if reply.done:
                    continue
                if turn + 1 == self.max_turns:
                    ep.truncated = True  # the environment answered, but no assistant turn is left
                    continue
                env_ids = self.fmt.env_ids(history[e], reply.messages, closed)
                if len(ep.prompt_ids) + len(ep.completion_ids) + len(env_ids) + 1 > self.total:
                    ep.truncated = True
                    continue
                ep.append(env_ids, None)
                ep.messages += reply.messages
                history[e] += reply.messages
                nxt.append(e)
            live = nxt
        for ep, session in zip(episodes, sessions):
            ep.env_reward = session.reward()
            ep.text = self.fmt.tok.decode(ep.completion_ids)
        return episodes

    @staticmethod
    def _respond(sessions, history, answering) -> list[Reply]:
        """Every answering episode's environment at once (each call keeps its own deadline)."""
        if not answering:
            return []
        with ThreadPoolExecutor(max_workers=min(32, len(answering)), thread_name_prefix="env") as pool:
            futures = [pool.submit(sessions[e].respond, list(history[e]), calls, err) for e, calls, err, _ in answering]
            return [f.result() for f in futures]


def merge_routing(earlier, turn):
    """An episode's routing so far (None before its first turn) with the capture of its next turn, which covers
    the whole context and the turn's tokens: the turn's rows where it computed the token, the earlier rows where
    it did not (-1: served by the prefix cache)."""
    if earlier is None:
        return turn
    if turn.shape[0] < earlier.shape[0] or turn.shape[1:] != earlier.shape[1:]:
        raise RuntimeError(f"routing: a turn's capture {tuple(turn.shape)} does not extend the episode's "
                           f"{tuple(earlier.shape)}")
    out = turn.copy()
    head = out[:earlier.shape[0]]
    missing = (head < 0).all(axis=(1, 2))
    head[missing] = earlier[missing]
    return out


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """env/* metrics of one step's episodes."""
    n = len(episodes)
    tokens = sum(len(e.completion_ids) for e in episodes)
    env_tokens = sum(len(e.loss_mask) - sum(e.loss_mask) for e in episodes)
    return {
        "env/turns_mean": sum(e.turns for e in episodes) / n,
        "env/tool_calls": float(sum(e.tool_calls for e in episodes)),
        "env/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "env/tool_timeouts": float(sum(e.tool_timeouts for e in episodes)),
        "env/parse_errors": float(sum(e.parse_errors for e in episodes)),
        "env/truncated": float(sum(e.truncated for e in episodes)),
        "env/truncated_frac": sum(e.truncated for e in episodes) / n,
        "env/env_token_frac": env_tokens / max(tokens, 1),
    }
