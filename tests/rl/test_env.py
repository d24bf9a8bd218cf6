"""Multi-turn episodes without an engine (rl/envs.py, rl/episodes.py, rl/episode_step.py, rl/tool_task.py):
the token-exact trajectory, the loss mask, the template refusals, the tool-call parser, the per-call timeout,
TRL's and verifiers' environment shapes run unchanged, the limits, the rewards and the trainer's mask.

The engine half (the sampler's logprobs equal the trainer's on every assistant token of a three-turn episode,
bitwise) runs on tests/rl/test_divergence.py's bitwise engine (test_multi_turn_episode_is_bitwise_on_the_engine).

    .venv/bin/python -m pytest -q tests/rl/test_env.py
"""

from __future__ import annotations

import dataclasses
import random
import sys
import textwrap
import time

import pytest

from records import Sample
from rl.envs import Environment, EnvError, ToolSession, call_all
from rl.episodes import ChatFormat, EpisodeRunner, TemplateError, parse_hermes
from rl.tool_task import calculator, tool_arith, tool_used


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl.make_model import make_model

    return AutoTokenizer.from_pretrained(make_model(tmp_path_factory.mktemp("env_tok") / "m", layers=1, seed=0))


@pytest.fixture
def envmod(tmp_path, monkeypatch):
    """A user module of tools and environment classes, written as TRL and verifiers users write them."""
    (tmp_path / "user_env.py").write_text(textwrap.dedent('''
        import asyncio
        import time

        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first integer
                b: the second integer
            """
            return a + b

        def broken(x: int) -> int:
            """Always fails.

            Args:
                x: anything
            """
            raise RuntimeError("the tool is broken")

        def slow(x: int) -> int:
            """Hangs.

            Args:
                x: anything
            """
            time.sleep(30)
            return x

        def no_doc(x):
            return x

        class Counter:  # TRL's environment_factory shape
            def __init__(self):
                self.total = 0
                self.reward = None

            def reset(self, **row):
                self.total = int(row["start"])
                return " Start at " + str(row["start"]) + "."

            def increment(self, by: int) -> int:
                """Add to the counter.

                Args:
                    by: how much to add
                """
                self.total += by
                self.reward = float(self.total == 10)
                return self.total

            def fail(self) -> str:
                """Raises.
                """
                raise ValueError("not allowed")

        class DoubleCheck:  # verifiers' MultiTurnEnv shape: async env_response, is_completed
            def __init__(self, rounds=2):
                self.rounds = rounds

            async def setup_state(self, state, **kwargs):
                state["asked"] = 0
                return state

            async def is_completed(self, messages, state, **kwargs):
                return state["asked"] >= self.rounds

            async def env_response(self, messages, state, **kwargs):
                state["asked"] += 1
                state["reward"] = 0.25 * state["asked"]
                await asyncio.sleep(0)
                return [{"role": "user", "content": "Are you sure?"}]

        class OldStyle:  # older verifiers: env_response returns (messages, state)
            def is_completed(self, messages, state, **kwargs):
                return state["turn"] > 1

            def env_response(self, messages, state, **kwargs):
                return [{"role": "user", "content": "again"}], {**state, "reward": 1.0}

        class Flaky:  # verifiers' shape whose env_response raises at turn 1 and whose is_completed hangs at turn 2
            def is_completed(self, messages, state, **kwargs):
                if state["turn"] >= 2:
                    time.sleep(30)
                return False

            def env_response(self, messages, state, **kwargs):
                raise RuntimeError("backend down")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_env", None)
    yield "user_env"
    sys.modules.pop("user_env", None)


def env_cfg(**kw):
    from rl.config import EnvConfig

    return EnvConfig(**kw)


EOS = "<|im_end|>"


def eos_ids(tok):
    return [tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids("<|endoftext|>")]


# The two-turn calculator episode the scripted sampler plays (CALL, then "444"), as chat messages after the prompt.
CALC_TURNS = [
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "37 * 12"}}}]},
    {"role": "tool", "name": "calculator", "content": "444"},
    {"role": "assistant", "content": "444"}]


class Scripted:
    """A stand-in for the rollout workers: each live episode's turn is a scripted text, sampled as its
    tokens (or as the byte tokens of it, a tokenisation the tokenizer would never give) plus the end-of-turn
    token, with seeded random logprobs; records what it returned and every call."""

    def __init__(self, tok, script, byte_split=False, stop=True, stop_string=False):
        self.stop_string = stop_string
        self.tok, self.script, self.byte_split, self.stop = tok, script, byte_split, stop
        self.rng = random.Random(0)
        self.calls, self.returned = [], []

    def ids(self, text):
        if self.byte_split:  # one token per character: a valid spelling of the text, not the tokenizer's
            return [t for ch in text for t in self.tok(ch, add_special_tokens=False)["input_ids"]]
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def __call__(self, ctx, budgets, turn):
        self.calls.append((len(ctx), list(budgets), turn))
        outs = []
        for k, c in enumerate(ctx):
            text = self.script(c, turn, k)
            ids = self.ids(text)[: budgets[k]]
            if self.stop and not self.stop_string and len(ids) < budgets[k]:
                ids = ids + [self.tok.convert_tokens_to_ids(EOS)]
            lps = [-self.rng.uniform(0.01, 5.0) for _ in ids]
            self.returned.append((turn, k, ids, lps))
            stopped = ids[-1] == self.tok.convert_tokens_to_ids(EOS) or self.stop_string
            outs.append(Sample(prompt_index=k, prompt_ids=list(c), completion_ids=ids, sampler_logprobs=lps,
                               text=self.tok.decode(ids, skip_special_tokens=True),
                               finish_reason="stop" if stopped else "length", policy_version=0))
        return outs


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12"}}\n</tool_call>'


def tools_runner(tok, tools=("rl.tool_task:calculator",), **limits):
    env = Environment(env_cfg(tools=list(tools)))
    fmt = ChatFormat(tok, env.schemas, eos_ids(tok))
    kw = dict(max_turns=4, max_tokens_per_turn=200, max_total_tokens=2048) | limits
    return env, fmt, EpisodeRunner(env, fmt, **kw)


# ---- token-exact trajectories ------------------------------------------------------------------

def test_two_turn_episode_is_the_sampled_tokens_plus_the_templates_tokens(tok):
    """Ground truth independent of rl/episodes.py: when the model writes exactly what the template would
    write, the episode's sequence is the template's rendering of the whole conversation (less the newline
    after the last end-of-turn token), token for token; the loss mask is 1 exactly on the sampled tokens."""
    env, fmt, runner = tools_runner(tok)
    prompt = [{"role": "user", "content": "What is 37 * 12?"}]
    gen = Scripted(tok, lambda c, turn, k: CALL if turn == 0 else "444")
    (ep,) = runner.run([{"answer": "444"}], [prompt], 1, gen)
    messages = prompt + CALC_TURNS
    want = tok.apply_chat_template(messages, tools=env.schemas, tokenize=True)["input_ids"]
    assert tok.decode(want[-1:]) == "\n"
    assert ep.prompt_ids + ep.completion_ids == want[:-1]
    assert ep.turns == 2 and ep.tool_calls == 1 and not ep.truncated and ep.tool_errors == 0
    assert ep.messages[1] == {"role": "tool", "name": "calculator", "content": "444"}
    # The mask: 1 on the two sampled turns, 0 on the environment's tokens between them.
    (_, _, ids0, lp0), (_, _, ids1, lp1) = gen.returned
    n_env = len(ep.completion_ids) - len(ids0) - len(ids1)
    assert n_env > 5
    assert ep.loss_mask == [1] * len(ids0) + [0] * n_env + [1] * len(ids1)
    assert ep.completion_ids[:len(ids0)] == ids0 and ep.completion_ids[-len(ids1):] == ids1
    assert ep.sampler_logprobs == lp0 + [0.0] * n_env + lp1
    # The second turn was generated from exactly the episode's sequence so far (one call per turn).
    assert [c[0] for c in gen.calls] == [1, 1]


def test_a_turn_stopped_by_a_stop_string_gets_the_end_of_turn_token_as_context(tok):
    """sampling['stop'] ends a turn without the end-of-turn token: the template's one follows as an
    environment token (mask 0), so the sequence is still the template's rendering."""
    env, fmt, runner = tools_runner(tok)
    prompt = [{"role": "user", "content": "What is 37 * 12?"}]
    gen = Scripted(tok, lambda c, turn, k: CALL if turn == 0 else "444", stop_string=True)
    (ep,) = runner.run([{}], [prompt], 1, gen)
    messages = prompt + CALC_TURNS
    want = tok.apply_chat_template(messages, tools=env.schemas, tokenize=True)["input_ids"]
    assert ep.prompt_ids + ep.completion_ids == want[:-2]  # less the last turn's end-of-turn token and newline
    (_, _, ids0, _), _ = gen.returned
    assert ep.completion_ids[len(ids0)] == tok.convert_tokens_to_ids(EOS) and ep.loss_mask[len(ids0)] == 0
    assert ep.turns == 2 and not ep.truncated


def test_the_sampled_tokens_are_kept_not_retokenised(tok):
    """A turn sampled as a spelling the tokenizer would not produce (one token per character) stays in the
    trajectory as sampled; re-tokenising its text would give other, fewer tokens."""
    env, fmt, runner = tools_runner(tok)
    gen = Scripted(tok, lambda c, turn, k: CALL if turn == 0 else "444", byte_split=True)
    (ep,) = runner.run([{}], [[{"role": "user", "content": "What is 37 * 12?"}]], 1, gen)
    (_, _, ids0, _), (_, _, ids1, _) = gen.returned
    assert len(ids0) > len(tok(CALL, add_special_tokens=False)["input_ids"]) + 1  # really another spelling
    assert ep.completion_ids[:len(ids0)] == ids0 and ep.completion_ids[-len(ids1):] == ids1
    assert ep.tool_calls == 1 and ep.messages[1]["content"] == "444"  # the text still parsed


def test_a_turn_of_all_live_episodes_is_one_generate_call(tok):
    """8 episodes (2 prompts x 4): those that call the tool go on, the others end; each turn is one call
    holding every live episode."""
    env, fmt, runner = tools_runner(tok)
    gen = Scripted(tok, lambda c, turn, k: CALL if (turn == 0 and k % 2 == 0) else "444")
    prompts = [[{"role": "user", "content": "What is 37 * 12?"}], [{"role": "user", "content": "And 2 + 2?"}]]
    eps = runner.run([{}, {}], prompts, 4, gen)
    assert [c[0] for c in gen.calls] == [8, 4]
    assert [e.prompt_index for e in eps] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [e.turns for e in eps] == [2, 1] * 4


# ---- refusals ----------------------------------------------------------------------------------

def test_a_template_that_is_not_prefix_extensible_is_refused_naming_it(tok, tmp_path):
    """A template that writes the number of tool results into its first line renders the prompt and the
    assistant turn as a prefix, but re-renders the conversation differently once a tool answers: refused
    before any episode, with the template named and the roles of the turn."""
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path / "bad")
    bad = AutoTokenizer.from_pretrained(tmp_path / "bad")
    bad.chat_template = ("{{ messages | selectattr('role', 'equalto', 'tool') | list | length }} results<|im_end|>\n"
                         + tok.chat_template)
    with pytest.raises(TemplateError, match=r"the chat template of .*bad \(sha256 [0-9a-f]{12}\) cannot be extended "
                                            r"as a prefix: the conversation of roles \['user', 'assistant'\] renders "
                                            r"differently once \['tool'\] follow"):
        ChatFormat(bad, Environment(env_cfg(tools=["rl.tool_task:calculator"])).schemas, eos_ids(tok))
    ChatFormat(tok, Environment(env_cfg(tools=["rl.tool_task:calculator"])).schemas, eos_ids(tok))  # the control


def test_a_template_without_a_tool_format_is_refused(tok, tmp_path):
    from transformers import AutoTokenizer

    from rl.make_model import CHAT_TEMPLATE

    tok.save_pretrained(tmp_path / "plain")
    plain = AutoTokenizer.from_pretrained(tmp_path / "plain")
    plain.chat_template = CHAT_TEMPLATE[CHAT_TEMPLATE.index("{%- for message in messages %}"):].replace(
        "<tool_call>", "<call>")
    schemas = Environment(env_cfg(tools=["rl.tool_task:calculator"])).schemas
    with pytest.raises(TemplateError, match=r"defines no tool-call format this project parses"):
        ChatFormat(plain, schemas, eos_ids(tok))


def test_tools_without_a_schema_and_bad_specs_are_refused(envmod):
    with pytest.raises(EnvError, match=r"env.tools.0: tool 'no_doc' has no usable JSON schema"):
        Environment(env_cfg(tools=[f"{envmod}:no_doc"]))
    with pytest.raises(EnvError, match=r"env.tools.0: module 'user_env' has no attribute 'nope'"):
        Environment(env_cfg(tools=[f"{envmod}:nope"]))
    with pytest.raises(EnvError, match=r"env.environment: .* is a function, expected a class"):
        Environment(env_cfg(environment=f"{envmod}:add"))


def test_config_env_section_refusals():
    from rl.config import ConfigError, load

    base = "configs/tiny_tools.yaml"
    cfg = load(base)
    assert cfg.env.enabled and cfg.env.tools == ["rl.tool_task:calculator"]
    for over, msg in [
        (["env.max_total_tokens=100000"], r"env.max_total_tokens: expected an int <= min\(rollout.max_model_len"),
        (["env.environment=a:B"], r"env: set at most one of env.tools and env.environment"),
        (["env.max_turns=0"], r"env.max_turns: expected an int >= 1"),
        (["env.tool_timeout_s=0"], r"env.tool_timeout_s: expected a finite float > 0"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            load(base, over)
    # What combines with episodes (each tested below and in tests/rl/test_rl_faults.py's run).
    both = load(base, ["trainer.routing_replay=true", "trainer.routing_metrics=true", "eval.every=1",
                       "eval.data.task=tool_arith", "reward.overlong_buffer=8", "data.dynamic_sampling=true",
                       "run.max_async_steps=2"])
    assert both.trainer.routing_replay and both.eval.every == 1 and both.data.dynamic_sampling
    assert both.run.max_async_steps == 2  # episodes in flight (tests/rl/test_episode_pipeline.py)


class EvalEngine:
    """A stand-in for RolloutWorker.generate (prompts, n, sampling, max_tokens, offset, policy_version) in the
    evaluation of episodes: turn 0 calls the calculator, turn 1 answers; records every call's sizes, seeds and
    budgets."""

    def __init__(self, tok):
        self.calls = []
        self.scripted = Scripted(tok, lambda c, turn, k: "The answer is 2." if turn else
                                 '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>')

    def generate(self, prompts, n, sampling, max_tokens=None, *, offset=0, policy_version=0):
        self.calls.append((len(prompts), n, sampling["seed"], sampling["temperature"], max_tokens))
        turn = len(self.calls) - 1
        return [dataclasses.replace(o, prompt_index=offset + i, policy_version=policy_version)
                for i, o in enumerate(self.scripted(prompts, max_tokens, turn))]


EVAL_ENV = ["eval.data.task=tool_arith", "eval.data.task_size=3", "eval.n=2", "rollout.max_model_len=2048",
            "trainer.max_seq_len=2048", "env.max_tokens_per_turn=200", "eval.temperature=0.5"]


def check_eval_of_episodes(engine, metrics, rows, base_seed):
    """3 prompts x 2 episodes of two turns: one engine call per turn with every live episode (seeds: the run's
    eval seed + turn * TURN_SEED_STRIDE, budgets: env.max_tokens_per_turn), scored on the message lists
    (tool_used pays 1 x 0.5 for the calculator's result, numeric 0: "2" is no answer), env/* metrics under eval/."""
    from rl.episode_step import TURN_SEED_STRIDE

    assert [c[:4] for c in engine.calls] == [(6, 1, base_seed, 0.5), (6, 1, base_seed + TURN_SEED_STRIDE, 0.5)]
    assert engine.calls[0][4] == [200] * 6
    assert metrics["eval/env/turns_mean"] == 2.0 and metrics["eval/env/tool_calls"] == 6.0
    assert metrics["eval/reward/tool_used/mean"] == 1.0 and metrics["eval/reward/numeric/mean"] == 0.0
    assert metrics["eval/reward_mean"] == 0.5  # tool_used and numeric weigh 0.5 each
    assert metrics["eval/samples"] == 6 and metrics["eval/prompts"] == 3
    assert [r["prompt_index"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert all("<tool_response>" in r["completion"] and "The answer is 2." in r["completion"] for r in rows), rows[0]


def test_the_evaluation_runs_episodes(tok, tmp_path):
    """eval.every with an env section (rl/evaluation.py): the eval prompts as episodes, scored like training's."""
    from rl import config as C
    from rl.episode_step import EpisodeStep
    from rl.evaluation import EVAL_SEED_OFFSET, Evaluator

    cfg = C.load("configs/tiny_tools.yaml", ["eval.every=1", *EVAL_ENV])
    step = EpisodeStep(cfg, tok, tmp_path)
    engine = EvalEngine(tok)
    m, rows = Evaluator(cfg, tok, episodes=step).run(lambda p, s, n, b: engine.generate(p, n, s, b), 1)
    check_eval_of_episodes(engine, m, rows, cfg.run.seed * 1_000_003 + EVAL_SEED_OFFSET)
    with pytest.raises(C.ConfigError, match=r"eval.max_tokens: expected null with multi-turn episodes"):
        Evaluator(C.load("configs/tiny_tools.yaml", ["eval.every=1", *EVAL_ENV, "eval.max_tokens=8"]), tok,
                  episodes=step)


def test_megamoe_rl_eval_runs_episodes(tok, tmp_path, monkeypatch):
    """`megamoe-rl eval` on a config with an env section: the same episodes on its one engine."""
    import argparse
    import json

    import rollout.worker
    from rl.eval_cmd import evaluate, resolve
    from rl.evaluation import EVAL_SEED_OFFSET

    engine = EvalEngine(tok)

    class Worker:
        def __init__(self, *a, **kw):
            pass

        generate = staticmethod(engine.generate)

        def close(self):
            pass

    monkeypatch.setattr(rollout.worker, "RolloutWorker", Worker)
    args = argparse.Namespace(config="configs/tiny_tools.yaml", overrides=EVAL_ENV, run=None, step=[], latest=False,
                              model=[tok.name_or_path], moe_impl=None, out=str(tmp_path / "r.json"),
                              samples_out=str(tmp_path / "s.jsonl"))
    cfg, targets = resolve(args)
    assert evaluate(args, cfg, targets) == 0
    metrics = json.loads((tmp_path / "r.json").read_text())["targets"][0]["metrics"]
    rows = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    check_eval_of_episodes(engine, metrics, rows, cfg.run.seed * 1_000_003 + EVAL_SEED_OFFSET)


# ---- parsing, tools, timeouts -------------------------------------------------------------------

@pytest.mark.parametrize("text, content, calls, err", [
    ("The answer is 5.", "The answer is 5.", [], None),
    (f"Let me compute.\n{CALL}", "Let me compute.", [{"name": "calculator", "arguments": {"expression": "37 * 12"}}],
     None),
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
     '"{\\"y\\": 2}"}\n</tool_call>', "", [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}}],
     None),
    ('<tool_call>\n{"name": "a", "arguments": {x: 1}}\n</tool_call>', "", [], "is not valid JSON"),
    ('<tool_call>\n{"name": "a"', "", [], "without its closing"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "", [], 'has no "name" string'),
], ids=["no-call", "one-call", "two-calls-string-args", "bad-json", "unclosed", "no-name"])
def test_parse_hermes(text, content, calls, err):
    got_content, got_calls, got_err = parse_hermes(text)
    assert got_content == content and got_calls == calls
    assert (got_err is None) if err is None else (err in got_err)


def test_a_raising_and_a_hanging_tool_are_counted_and_answered(envmod):
    """One turn calling a tool that works, one that raises, one that hangs (timeout 0.3 s), one that does
    not exist and one with bad arguments: each gets its tool message, the errors and the timeout are counted,
    and the turn takes the timeout, not the hang."""
    env = Environment(env_cfg(tools=[f"{envmod}:add", f"{envmod}:broken", f"{envmod}:slow"], tool_timeout_s=0.3))
    s = env.session()
    calls = [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "broken", "arguments": {"x": 1}},
             {"name": "slow", "arguments": {"x": 1}}, {"name": "nope", "arguments": {}},
             {"name": "add", "arguments": [1, 2]}]
    t0 = time.monotonic()
    r = s.respond([], calls, None)
    assert time.monotonic() - t0 < 2.0
    assert [m["content"] for m in r.messages] == [
        "5", "Error: tool 'broken' raised RuntimeError: the tool is broken", "Error: tool 'slow' timed out after 0.3 s",
        "Error: no tool named 'nope'; the tools are ['add', 'broken', 'slow']",
        "Error: the arguments of 'add' must be a JSON object, got [1, 2]"]
    assert (r.tool_calls, r.tool_errors, r.tool_timeouts, r.done) == (5, 3, 1, False)
    assert s.respond([], [], None).done  # no call: the episode is over


def nap(s: float) -> float:
    time.sleep(s)
    return s


def test_calls_run_concurrently_each_with_its_deadline():
    t0 = time.monotonic()
    out = call_all([(nap, {"s": 0.3})] * 4 + [(nap, {"s": 5})], 0.6)
    assert [s for s, _ in out] == ["ok"] * 4 + ["timeout"]
    assert time.monotonic() - t0 < 1.5  # concurrent: one deadline, not five


def test_a_malformed_call_is_fed_back_and_the_episode_goes_on(tok):
    env, fmt, runner = tools_runner(tok)
    gen = Scripted(tok, lambda c, turn, k: '<tool_call>\n{"name": "calculator"' if turn == 0 else "444")
    (ep,) = runner.run([{}], [[{"role": "user", "content": "37 * 12?"}]], 1, gen)
    assert ep.parse_errors == 1 and ep.tool_errors == 1 and ep.turns == 2 and not ep.truncated
    assert ep.messages[1]["role"] == "tool" and "without its closing" in ep.messages[1]["content"]


def test_calculator_tool():
    assert calculator("37 * (12 + 5)") == "629" and calculator("-3 - 4") == "-7"
    for bad in ("2 ** 100", "__import__('os')", "1 / 2", "10**12 * 10**12"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


# ---- environment shapes ------------------------------------------------------------------------

def test_trl_environment_factory_class_runs_unchanged(tok, envmod):
    """TRL's shape: a fresh instance per episode, reset(**row) appended to the user message, public methods
    as tools (reset excluded), an exception as the tool's answer, the instance reaching reward functions."""
    env = Environment(env_cfg(environment=f"{envmod}:Counter"))
    assert env.kind == "trl"
    assert sorted(s["function"]["name"] for s in env.schemas) == ["fail", "increment"]
    fmt = ChatFormat(tok, env.schemas, eos_ids(tok))
    runner = EpisodeRunner(env, fmt, max_turns=4, max_tokens_per_turn=200, max_total_tokens=2048)
    inc = '<tool_call>\n{"name": "increment", "arguments": {"by": 3}}\n</tool_call>'
    fail = '<tool_call>\n{"name": "fail", "arguments": {}}\n</tool_call>'
    gen = Scripted(tok, lambda c, turn, k: [inc, fail, "done"][turn] if k == 0 else "done")
    eps = runner.run([{"start": 7}], [[{"role": "user", "content": "Count."}]], 2, gen)
    a, b = eps
    assert tok.decode(a.prompt_ids).count("Count. Start at 7.") == 1
    assert a.messages[1]["content"] == "10" and a.messages[3]["content"] == "Error: tool 'fail' raised ValueError: " \
                                                                             "not allowed"
    assert (a.turns, a.tool_calls, a.tool_errors, a.env_reward) == (3, 2, 1, 1.0)
    assert (b.turns, b.tool_calls, b.env_reward) == (1, 0, None)
    assert a.handle is not b.handle and a.handle.total == 10 and b.handle.total == 7


@pytest.mark.parametrize("cls, rounds", [("DoubleCheck", 2), ("OldStyle", 1)])
def test_verifiers_multiturn_env_runs_unchanged(tok, envmod, cls, rounds):
    """verifiers' shape: one instance, per-episode state (setup_state), env_response answering with user
    messages (async, or the older (messages, state) return), is_completed ending the episode."""
    kwargs = {"rounds": rounds} if cls == "DoubleCheck" else {}
    env = Environment(env_cfg(environment=f"{envmod}:{cls}", environment_kwargs=kwargs))
    assert env.kind == "verifiers" and env.schemas is None
    fmt = ChatFormat(tok, None, eos_ids(tok), env_role="user")
    runner = EpisodeRunner(env, fmt, max_turns=5, max_tokens_per_turn=32, max_total_tokens=512)
    gen = Scripted(tok, lambda c, turn, k: f"answer {turn}")
    eps = runner.run([{"answer": "x"}], [[{"role": "user", "content": "Hi"}]], 2, gen)
    for ep in eps:
        assert ep.turns == rounds + 1 and not ep.truncated
        assert [m["role"] for m in ep.messages] == ["assistant", "user"] * rounds + ["assistant"]
        assert ep.env_reward == (0.25 * rounds if cls == "DoubleCheck" else 1.0)
        rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}] + ep.messages, tokenize=True)["input_ids"]
        assert ep.prompt_ids + ep.completion_ids == rendered[:-1]
    assert eps[0].handle is not eps[1].handle  # one state per episode


def test_a_verifiers_env_that_raises_or_hangs_is_answered_and_counted(tok, envmod):
    """env_response raising: its error becomes the environment's message and the episode goes on (tool_errors 1);
    is_completed hanging past env.tool_timeout_s: the episode ends there, the timeout counted (tool_timeouts 1)."""
    env = Environment(env_cfg(environment=f"{envmod}:Flaky", tool_timeout_s=0.3))
    fmt = ChatFormat(tok, None, eos_ids(tok), env_role="user")
    runner = EpisodeRunner(env, fmt, max_turns=5, max_tokens_per_turn=32, max_total_tokens=512)
    (ep,) = runner.run([{}], [[{"role": "user", "content": "Hi"}]], 1, Scripted(tok, lambda c, turn, k: f"answer {turn}"))
    # the ending reply's message is not appended: no assistant turn follows it
    assert [m["role"] for m in ep.messages] == ["assistant", "user", "assistant"]
    assert ep.messages[1]["content"] == "Error: env_response raised RuntimeError: backend down"
    assert (ep.turns, ep.tool_errors, ep.tool_timeouts) == (2, 1, 1)


# ---- limits ------------------------------------------------------------------------------------

def test_limits_end_episodes_truncated(tok):
    # max_turns: the tool answered, no assistant turn left
    env, fmt, runner = tools_runner(tok, max_turns=1)
    (ep,) = runner.run([{}], [[{"role": "user", "content": "q"}]], 1, Scripted(tok, lambda c, t, k: CALL))
    assert ep.truncated and ep.turns == 1 and ep.loss_mask == [1] * len(ep.completion_ids)
    # max_tokens_per_turn: the turn is cut before its end-of-turn token
    env, fmt, runner = tools_runner(tok, max_tokens_per_turn=5)
    gen = Scripted(tok, lambda c, t, k: CALL)
    (ep,) = runner.run([{}], [[{"role": "user", "content": "q"}]], 1, gen)
    assert ep.truncated and ep.turns == 1 and len(ep.completion_ids) == 5 and gen.calls[0][1] == [5]
    # max_total_tokens: the second turn's budget is what is left of the episode
    env, fmt, runner = tools_runner(tok)
    p = fmt.prompt_ids([{"role": "user", "content": "q"}])
    first = len(tok(CALL, add_special_tokens=False)["input_ids"]) + 1
    env_n = len(fmt.env_ids([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37 * 12"}}}]}],
        [{"role": "tool", "name": "calculator", "content": "444"}]))
    total = len(p) + first + env_n + 3
    env, fmt, runner = tools_runner(tok, max_total_tokens=total)
    gen = Scripted(tok, lambda c, t, k: CALL)
    (ep,) = runner.run([{}], [[{"role": "user", "content": "q"}]], 1, gen)
    assert gen.calls[1][1] == [3] and ep.truncated and len(ep.prompt_ids) + len(ep.completion_ids) == total


# ---- rewards -----------------------------------------------------------------------------------

def test_rewards_get_message_lists_environments_and_the_env_reward(tok, envmod, tmp_path):
    from rl import config as C
    from rl.data import Batch
    from rl.episode_step import EpisodeStep
    from rl.rewards import RewardScorer, TrainerState, load_rewards

    seen = {}

    def spy(completions, environments, **kw):
        seen["completions"], seen["environments"] = completions, environments
        return [0.5] * len(completions)

    mod = sys.modules[envmod] if envmod in sys.modules else __import__(envmod)
    mod.spy = spy
    cfg = C.load("configs/tiny_tools.yaml", [f"env.environment={envmod}:Counter", "env.tools=[]",
                                             "rollout.n=2", "rollout.max_model_len=2048", "trainer.max_seq_len=2048",
                                             "env.max_tokens_per_turn=200"])
    step = EpisodeStep(cfg, tok, tmp_path)
    inc = '<tool_call>\n{"name": "increment", "arguments": {"by": 3}}\n</tool_call>'
    eps = step.runner.run([{"start": 7}], [[{"role": "user", "content": "Count."}]], 2,
                          Scripted(tok, lambda c, t, k: inc if (t == 0 and k == 0) else "10"))
    scorer = RewardScorer(load_rewards(C.RewardConfig(functions=[
        C.RewardFnConfig(fn=f"{envmod}:spy"), C.RewardFnConfig(fn="numeric")])))
    batch = Batch(prompts=[[{"role": "user", "content": "Count."}]], columns={"answer": ["10"], "start": [7]})
    res = step.rewards(scorer, batch, eps, TrainerState(global_step=0, max_steps=1))
    assert [m["role"] for m in seen["completions"][0]] == ["assistant", "tool", "assistant"]
    assert seen["environments"][0].total == 10
    assert res.per_fn["numeric"] == [1.0, 1.0]  # the last assistant message is read, not the tool's
    assert res.per_fn["env"] == [1.0, None] and res.total == [0.5 + 1.0 + 1.0, 0.5 + 1.0]
    m = res.metrics(2)
    assert m["env/turns_mean"] == 1.5 and m["env/tool_calls"] == 1.0 and m["reward/env/mean"] == 1.0
    samples = step.samples(eps, version=3)
    assert samples[0].loss_mask == eps[0].loss_mask and samples[0].policy_version == 3


def test_tool_arith_task_and_its_rewards():
    from rl import config as C
    from rl.rewards import RewardScorer, load_rewards
    from rl.tasks import TASK_REWARDS, make_task

    rows = make_task("tool_arith", 16, seed=1)
    assert rows == tool_arith(16, random.Random("tool_arith:1")) and rows != make_task("tool_arith", 16, seed=2)
    s = RewardScorer(load_rewards(C.RewardConfig(functions=[C.RewardFnConfig(**r) for r in TASK_REWARDS["tool_arith"]])))
    good = [[{"role": "assistant", "content": ""}, {"role": "tool", "content": r["answer"]},
             {"role": "assistant", "content": r["answer"]}] for r in rows]
    no_tool = [[{"role": "assistant", "content": r["answer"]}] for r in rows]
    bad_tool = [[{"role": "assistant", "content": ""}, {"role": "tool", "content": "Error: x"},
                 {"role": "assistant", "content": "7"}] for r in rows]
    answers = {"answer": [r["answer"] for r in rows]}
    prompts = [r["prompt"] for r in rows]
    assert s(prompts, ["-"] * 16, answers, completion_messages=good).total == [1.0] * 16
    assert s(prompts, ["-"] * 16, answers, completion_messages=no_tool).total == [0.5] * 16
    assert s(prompts, ["-"] * 16, answers, completion_messages=bad_tool).total == [0.0] * 16
    assert tool_used([[{"role": "tool", "content": "5"}]]) == [1.0]


# ---- the trainer's loss mask -------------------------------------------------------------------

def test_the_trainer_masks_environment_tokens():
    """collate's mask is the loss mask; the loss and the mismatch statistics do not depend on the sampler
    logprobs (placeholders) or the trainer's values at environment tokens."""
    import torch

    from records import RecordError, TrainBatch
    from trainer.batch import collate, train_rows
    from trainer.loss import policy_loss

    g = torch.Generator().manual_seed(0)
    batch = dict(prompt_ids=[[5, 6, 7], [8, 9]], completion_ids=[[10, 11, 12, 13, 14], [15, 16, 17]],
                 sampler_logprobs=[[-1.0, 0.0, 0.0, -2.0, -0.5], [-0.3, -0.2, -0.1]], advantages=[1.0, -0.5],
                 policy_versions=[0, 0], loss_mask=[[1, 0, 0, 1, 1], [1, 1, 1]])
    seqs, _ = train_rows(TrainBatch(**batch), vocab_size=100, max_seq_len=16, truncate=False)
    mb = collate(seqs, 0, torch.device("cpu"))
    assert mb.mask.tolist() == [[True, False, False, True, True], [True, True, True, False, False]]
    assert [s.loss_tokens for s in seqs] == [3, 3]
    logp = -torch.rand(2, 5, generator=g) * 3
    base = policy_loss(logp, logp, mb.sampler_logprobs, mb.advantages, mb.mask)
    logp2, samp2 = logp.clone(), mb.sampler_logprobs.clone()
    logp2[0, 1:3] = -50.0
    samp2[0, 1:3] = 7.0
    other = policy_loss(logp2, logp2, samp2, mb.advantages, mb.mask)
    assert float(base[0]) == float(other[0]) and base[1]["abs_logp_diff_max"] == other[1]["abs_logp_diff_max"]
    # refused where the record is built (records/samples.py), before any trainer sees it
    for bad, msg in [([[1, 0, 1], [1, 1, 1]], r"loss_mask\[0\]: expected 5 values 0 or 1"),
                     ([[0, 0, 0, 0, 0], [1, 1, 1]], r"expected at least one 1"),
                     ([[1, 0, 0, 1, 2], [1, 1, 1]], r"expected 5 values 0 or 1")]:
        with pytest.raises(RecordError, match=msg):
            TrainBatch(**{**batch, "loss_mask": bad})


def test_train_batch_carries_the_loss_mask():
    from records import RecordError, Sample, TrainBatch

    s = [Sample(0, [1, 2], [3, 4, 5], [-1.0, 0.0, -1.0], "t", "stop", 0, loss_mask=[1, 0, 1]),
         Sample(0, [1, 2], [6], [-0.5], "t", "stop", 0)]
    assert TrainBatch.from_samples(s, [1.0, -1.0]).loss_mask == [[1, 0, 1], [1]]
    assert TrainBatch.from_samples(s[1:], [0.0]).loss_mask is None
    with pytest.raises(RecordError, match=r"TrainBatch.loss_mask\[0\]: expected 3 values"):
        TrainBatch.from_samples([Sample(0, [1], [3, 4, 5], [0.0] * 3, "t", "stop", 0, loss_mask=[1])], [0.0])


# ---- on an engine (tests/rl/test_divergence.py's bitwise engine runs these) -----------------------------

class AreYouSure:
    """A verifiers-shape environment: asks back until the assistant has spoken three times."""

    def is_completed(self, messages, state, **kwargs):
        return state["turn"] >= 3

    def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Sure?"}]


ENGINE_PROMPTS = ["digit 3:", "the red bird is"]


def engine_episodes(worker, model_dir, temperature: float):
    """2 prompts x 2 episodes of up to three turns on `worker` (a RolloutWorker), each turn one generate call
    of token-id prompts; the turns stop on the string "e" (a random model seldom samples its end-of-turn
    token within a few tokens), 8 tokens at most, 128 in all (the engine's max_model_len)."""
    from transformers import AutoTokenizer

    from rl.config import EnvConfig
    from rl.episode_step import eos_ids as model_eos_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    env = Environment(EnvConfig(environment="test_env:AreYouSure"))
    fmt = ChatFormat(tok, None, model_eos_ids(tok, model_dir), env_role="user")
    runner = EpisodeRunner(env, fmt, max_turns=3, max_tokens_per_turn=8, max_total_tokens=128)
    calls = []

    def gen(ctx, budgets, turn):
        calls.append(len(ctx))
        return worker.generate(ctx, 1, {"temperature": temperature, "stop": ["e"], "seed": 11 + 1000 * turn},
                               max_tokens=budgets)

    return runner.run([{}] * len(ENGINE_PROMPTS), [[{"role": "user", "content": p}] for p in ENGINE_PROMPTS], 2,
                      gen), calls


def check_engine_episodes(model_dir, episodes, calls, temperature: float) -> dict:
    """The trainer's logprobs of every episode's sequence: equal to the sampler's on every assistant token in
    bitwise numerics, within the loop's fp32 bound in fast numerics; environment tokens exist and are masked."""
    from test_rl_loop import FP32_MAX_ABS_LOGP_DIFF
    from trainer.testing import free_port
    from trainer.worker import TrainerWorker

    assert calls[0] == 2 * len(ENGINE_PROMPTS) and len(calls) == 3, calls  # one engine call per turn, every live episode in it
    three = [e for e in episodes if e.turns == 3]
    assert three, [e.turns for e in episodes]
    assert all(0 in e.loss_mask and 1 in e.loss_mask for e in three)
    out = {}
    for numerics in ("bitwise", "fast"):
        w = TrainerWorker(0, 1, "127.0.0.1", free_port(), str(model_dir), "megamoe",
                          {"dtype": "float32", "device": "cpu", "numerics": numerics, "temperature": temperature,
                           "max_seq_len": 128})
        try:
            lps = w.logprobs([e.prompt_ids for e in episodes], [e.completion_ids for e in episodes])
        finally:
            w.close()
        diffs = [abs(t - s) for e, lp in zip(episodes, lps) for t, s, m in zip(lp, e.sampler_logprobs, e.loss_mask)
                 if m]
        out[numerics] = max(diffs)
        assert len(diffs) == sum(sum(e.loss_mask) for e in episodes) > 0
    assert out["bitwise"] == 0.0, out
    assert 0.0 < out["fast"] < FP32_MAX_ABS_LOGP_DIFF, out  # > 0: fast numerics really differ from the sampler's
    return out


class Ref:
    def __init__(self, value):
        self.value = value


class FakeWorker:
    """A rollout worker's host as the driver calls it (`w.generate.remote(...)`), answering with `gen` (a
    Scripted; its `turn` argument: the call's seed, which tells the turns and the draws apart)."""

    def __init__(self, gen):
        self.gen, self.seen = gen, []
        self.generate = self

    def remote(self, ctx, n, sampling, offset, policy_version, max_tokens):
        self.seen.append((len(ctx), n, sampling["seed"], list(max_tokens), offset, policy_version))
        outs = [dataclasses.replace(o, prompt_index=offset + o.prompt_index, policy_version=policy_version)
                for o in self.gen(ctx, max_tokens, sampling["seed"])]
        return Ref((outs, 0.5))


class FakeActors:
    def __init__(self, workers):
        self.rollouts = workers

    def get(self, refs, names, method):
        return [r.value for r in refs]


def test_the_loop_hook_splits_each_turn_over_the_rollout_workers(tok, tmp_path):
    """EpisodeStep.submit (what the driver queues a step's generation with, with an env section): each turn is
    one call per rollout worker on its contiguous slice of the live episodes, with per-episode token budgets
    and a seed offset by the slice's start (so no two episodes share a seed), stamped with the version last
    published; the Flight holds masked Samples, and Scoring's rewards the env/* metrics."""
    from rl import config as C
    from rl.data import Batch
    from rl.episode_step import TURN_SEED_STRIDE, EpisodeStep
    from rl.pipeline import Generation, Scoring
    from rl.rewards import RewardScorer, load_rewards

    cfg = C.load("configs/tiny_tools.yaml", ["rollout.n=2", "rollout.max_model_len=2048", "trainer.max_seq_len=2048",
                                             "env.max_tokens_per_turn=200", "rollout.num_workers=2"])
    step = EpisodeStep(cfg, tok, tmp_path)
    gen = Scripted(tok, lambda c, seed, k: "444" if "<tool_response>" in tok.decode(c) else CALL)
    workers = [FakeWorker(gen), FakeWorker(gen)]
    generation = Generation(cfg, FakeActors(workers))
    generation.version = 4
    batch = Batch(prompts=[[{"role": "user", "content": "What is 37 * 12?"}]] * 3, columns={"answer": ["444"] * 3})
    flight = step.submit(generation, 3, batch, ["p"] * 3, {"temperature": 1.0, "seed": 100})
    assert generation.pop(3) is flight
    assert [w.seen[0][:3] for w in workers] == [(3, 1, 100), (3, 1, 103)]
    assert [w.seen[1][:3] for w in workers] == [(3, 1, 100 + TURN_SEED_STRIDE), (3, 1, 103 + TURN_SEED_STRIDE)]
    assert workers[0].seen[0][3] == [200] * 3 and [w.seen[0][4:] for w in workers] == [(0, 4), (3, 4)]
    assert flight.step == 3 and flight.version == 4
    assert len(flight.samples) == 6 and all(s.policy_version == 4 and 0 in s.loss_mask for s in flight.samples)
    scoring = Scoring(cfg, None, None, RewardScorer(load_rewards(cfg.reward)), step)
    rewards = scoring.rewards(batch, flight.samples, 3, flight.episodes)
    assert rewards.total == [1.0] * 6  # a tool result and the right number
    m = rewards.metrics(2)
    assert m["env/turns_mean"] == 2.0 and m["env/tool_calls"] == 6.0 and m["env/truncated"] == 0.0


def arith_episodes(tok, tmp_path, *overrides):
    """The tool_arith task's episodes on two fake rollout workers: turn 0 calls the calculator on the question's
    expression; turn 1 answers the tool's result, except in the first draw of a step (seed below
    1_000_000_007: Scoring.prompts' stride of the extra draws) and in the odd episodes of a later draw."""
    import re

    from rl import config as C
    from rl.data import PromptSource
    from rl.episode_step import EpisodeStep
    from rl.pipeline import Generation, Scoring
    from rl.rewards import RewardScorer, load_rewards

    cfg = C.load("configs/tiny_tools.yaml", ["rollout.n=2", "run.prompts_per_step=2", "rollout.max_model_len=2048",
                                             "trainer.max_seq_len=2048", "env.max_tokens_per_turn=200",
                                             "rollout.num_workers=2", *overrides])

    def script(c, seed, k):
        text = tok.decode(c)
        if "<tool_response>" not in text:
            expr = re.findall(r"What is (\d+ [+*] \d+)\?", text)[-1]
            return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr
        result = re.findall(r"<tool_response>\n(\d+)\n</tool_response>", text)[-1]
        return result if seed >= 1_000_000_007 and k % 2 == 0 else "0"

    step = EpisodeStep(cfg, tok, tmp_path)
    generation = Generation(cfg, FakeActors([FakeWorker(Scripted(tok, script)), FakeWorker(Scripted(tok, script))]))
    source = PromptSource.from_config(cfg.data, seed=cfg.run.seed)
    scoring = Scoring(cfg, source, tok, RewardScorer(load_rewards(cfg.reward)), step)
    return cfg, step, generation, scoring


def test_dynamic_sampling_draws_episodes(tok, tmp_path):
    """data.dynamic_sampling with episodes: the first draw (every answer wrong: no signal) is dropped, the extra
    draw is episodes too (other prompts, the extra call's seeds) and fills the batch."""
    cfg, step, generation, scoring = arith_episodes(tok, tmp_path, "data.dynamic_sampling=true")
    flight = step.submit(generation, 0, *scoring.prompts(0))
    generation.pop(0)
    scored = scoring.score(flight, 0, step.extra_draws(generation))  # what the driver passes (rl/loop.py)
    assert scored.metrics["dynamic_sampling/generate_calls"] == 2 and scored.metrics["dynamic_sampling/kept_groups"] == 2
    assert scored.rewards.total == [1.0, 0.5] * 2  # tool_used 0.5 each, numeric 0.5 for the right answers
    assert all(0 in s.loss_mask and 1 in s.loss_mask for s in scored.samples)
    assert scored.prompts == scoring.prompts(0, 1)[1]  # the extra draw's prompts
    assert scored.batch.loss_mask == [s.loss_mask for s in scored.samples]


def test_overlong_shaping_counts_an_episodes_assistant_tokens(tok, tmp_path):
    """reward.overlong_buffer with episodes: the length is the episode's assistant tokens (its loss mask), the limit
    L = env.max_turns x env.max_tokens_per_turn (2 x 200 here), B = 390: the ramp starts at 10 tokens."""
    from rl import config as C

    cfg, step, generation, scoring = arith_episodes(tok, tmp_path, "env.max_turns=2", "reward.overlong_buffer=390",
                                                    "reward.overlong_penalty=2.0")
    flight = step.submit(generation, 0, *scoring.prompts(0))
    generation.pop(0)
    rewards = scoring.rewards(flight.batch, flight.samples, 0, flight.episodes)
    sampled = [sum(s.loss_mask) for s in flight.samples]
    assert all(len(s.completion_ids) > n > 10 for s, n in zip(flight.samples, sampled))
    assert rewards.per_fn["overlong"] == [-2.0 * (n - 10) / 390 for n in sampled]
    with pytest.raises(C.ConfigError, match=r"reward.overlong_buffer: expected an int <= env.max_turns x "
                                            r"env.max_tokens_per_turn \(400\), got 401"):
        C.load("configs/tiny_tools.yaml", ["env.max_turns=2", "env.max_tokens_per_turn=200",
                                           "reward.overlong_buffer=401", "rollout.max_model_len=2048",
                                           "trainer.max_seq_len=2048"])


def test_an_episodes_routing_is_merged_over_its_turns(tok, tmp_path):
    """Routing replay with episodes: each turn's capture covers its context and its tokens, with -1 rows where the
    prefix cache served the context (here: every token an earlier turn computed) and for its last token; the
    episode's routing takes each token's row from the turn that computed it, and reaches the Sample."""
    import numpy as np

    from rl.episodes import merge_routing

    gen = Scripted(tok, lambda c, turn, k: "444" if "<tool_response>" in tok.decode(c) else CALL)
    computed = {}  # episode -> tokens an earlier turn computed

    def routed(ctx, budgets, turn):
        outs = gen(ctx, budgets, turn)
        routed_outs = []
        for k, (c, o) in enumerate(zip(ctx, outs)):
            r = np.full((len(c) + len(o.completion_ids), 2, 2), turn, dtype=np.int16)
            r[:computed.get(k, 0)] = -1  # served by the prefix cache
            r[-1] = -1  # sampled, never fed back
            computed[k] = r.shape[0] - 1
            routed_outs.append(dataclasses.replace(o, routed_experts=r))
        return routed_outs

    *_, runner = tools_runner(tok, max_tokens_per_turn=200)
    (ep,) = runner.run([{}], [[{"role": "user", "content": "What is 37 * 12?"}]], 1, routed)
    assert ep.turns == 2
    first = len(ep.prompt_ids) + ep.loss_mask.index(0) - 1  # the first turn computed up to its last sampled token
    r = ep.routed_experts
    assert r.shape == (len(ep.prompt_ids) + len(ep.completion_ids), 2, 2)
    assert (r[:first] == 0).all() and (r[first:-1] == 1).all() and (r[-1] == -1).all()
    with pytest.raises(RuntimeError, match=r"routing: a turn's capture \(2, 2, 2\) does not extend the episode's"):
        merge_routing(r, r[:2])
    from rl import config as C
    from rl.episode_step import EpisodeStep

    step = EpisodeStep(C.load("configs/tiny_tools.yaml", ["trainer.routing_replay=true"]), tok, tmp_path)
    (sample,) = step.samples([ep], version=0)
    assert sample.routed_experts is r  # what TrainBatch.from_samples hands the trainer


def test_the_gsm8k_shaped_variant_scores_the_last_assistant_message():
    """configs/tiny_tools_math.yaml: the math reward on a multi-turn completion grades the final answer, not
    the tool's output."""
    from rl import config as C
    from rl.rewards import RewardScorer, load_rewards

    cfg = C.load("configs/tiny_tools_math.yaml")
    assert cfg.env.tools == ["rl.tool_task:calculator"] and cfg.data.task == "math"
    s = RewardScorer(load_rewards(cfg.reward))
    episode = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": "36"},
               {"role": "assistant", "content": "So she has #### 36"}]
    wrong = episode[:2] + [{"role": "assistant", "content": "#### 35"}]
    got = s([[{"role": "user", "content": "q"}]] * 2, ["-", "-"], {"answer": ["36", "36"]},
            completion_messages=[episode, wrong])
    assert got.total == [1.0, 0.0]
