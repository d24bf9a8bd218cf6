"""The megamoe vLLM plugin fails loudly: a broken or misconfigured hook stops the engine from starting.

vLLM loads `vllm.general_plugins` entry points inside `try/except Exception: logger.exception(...)`,
so a plugin that breaks while being imported is only logged and vLLM runs its own MoE. Each case
here starts plain `vllm.LLM` in a fresh Python process (plugins load once per process) and expects
the process to fail with our message, never to reach generation.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_plugin.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rollout import plugin

SCRIPT = textwrap.dedent("""
    import sys
    from vllm import LLM, SamplingParams

    def main():
        kwargs = dict(model=sys.argv[1], dtype="float32", max_model_len=64, enforce_eager=True,
                      kv_cache_memory_bytes=32 << 20, distributed_executor_backend="mp")
        if len(sys.argv) > 2:
            kwargs["worker_extension_cls"] = sys.argv[2]
        llm = LLM(**kwargs)
        llm.generate(["1 + 1 ="], SamplingParams(max_tokens=2))
        print("ENGINE GENERATED")

    if __name__ == "__main__":
        main()
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start the failing engines concurrently (each process imports vLLM: ~10 s), then collect."""
    from rl.make_model import make_model

    root = tmp_path_factory.mktemp("rollout_plugin")
    model = make_model(root / "model", arch="qwen3_moe", layers=1, seed=0)
    script = root / "start_engine.py"
    script.write_text(SCRIPT)
    # A `megamoe` package that cannot be imported, first on the path: the hook's dependency is broken.
    shadow = root / "shadow" / "megamoe"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("megamoe deliberately broken for this test")\n')

    base = {k: v for k, v in os.environ.items() if k not in (plugin.ENV_VAR, "VLLM_PLUGINS", "PYTHONPATH")}
    # As RolloutWorker places them on CPU: the engine core in the process that calls LLM and the model in a
    # worker process (the script asks for the `mp` executor, which vLLM CPU picks itself when the engine
    # core has a process of its own): two processes per case, not three (the third only imports vLLM again).
    base["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cases = {
        "broken_dependency": ({plugin.ENV_VAR: "megamoe", "PYTHONPATH": str(shadow.parent)}, []),
        "bad_impl": ({plugin.ENV_VAR: "fused"}, []),
        # The plugin never runs (VLLM_PLUGINS="" loads none), as when vLLM swallowed its import error;
        # the worker extension notices in the engine's worker process.
        "plugin_not_loaded": ({plugin.ENV_VAR: "megamoe", "VLLM_PLUGINS": ""},
                              ["rollout.extension.MegaMoEWorkerExtension"]),
    }
    procs = {name: subprocess.Popen([sys.executable, str(script), str(model), *extra], cwd=root,
                                    env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, (env, extra) in cases.items()}
    out = {}
    for name, p in procs.items():
        try:
            log, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
        out[name] = (p.returncode, log)
    return out


def _assert_failed_with(run, message):
    code, log = run
    assert "ENGINE GENERATED" not in log, "the engine started and generated despite the broken hook"
    assert code != 0, "the process exited successfully"
    assert message in log, f"expected {message!r} in the output; its tail:\n{log[-3000:]}"


@pytest.mark.slow  # three vLLM processes (the module's `runs`)
def test_broken_hook_dependency_stops_the_engine(runs):
    _assert_failed_with(runs["broken_dependency"], "megamoe deliberately broken for this test")


@pytest.mark.slow
def test_misconfigured_impl_stops_the_engine(runs):
    _assert_failed_with(runs["bad_impl"], f"{plugin.ENV_VAR}: expected one of ('megamoe', 'reference', 'stock')")


@pytest.mark.slow
def test_plugin_that_did_not_run_stops_the_engine(runs):
    _assert_failed_with(runs["plugin_not_loaded"], "megamoe plugin did not register its MoE hook")


def test_rollout_worker_refuses_an_excluded_plugin(tmp_path, monkeypatch):
    from rl.make_model import make_model

    from rollout.worker import RolloutWorker

    model = make_model(tmp_path / "m", arch="qwen3_moe", layers=1, seed=0)
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)  # RolloutWorker sets it; restored after the test
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    with pytest.raises(RuntimeError, match="excludes the 'megamoe' plugin"):
        RolloutWorker(model, "megamoe")


def test_plugin_validates_its_variable(monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "megamoe ")
    assert plugin.configured_impl() == "megamoe"
    monkeypatch.setenv(plugin.ENV_VAR, "")
    assert plugin.configured_impl() is None
    monkeypatch.setenv(plugin.ENV_VAR, "Megamoe")
    with pytest.raises(ValueError, match="MEGAMOE_MOE_IMPL: expected one of .* got 'Megamoe'"):
        plugin.register()


def test_bitwise_registrations_are_installed_and_removed_in_this_process():
    """rollout.bitwise.apply(True) puts the batch-invariant linears, LM head and CPU attention backend into
    vLLM's registries; apply(False) restores vLLM's own (the plugin calls it on every registration, so a
    process that served a bitwise engine builds a fast one with vLLM's kernels)."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rollout import bitwise

    names = ("ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
             "RowParallelLinear", "ParallelLMHead")
    default = AttentionBackendEnum.CPU_ATTN.value
    bitwise.apply(False)
    assert not any(n in op_registry_oot for n in names)
    assert AttentionBackendEnum.CPU_ATTN.get_path() == default
    try:
        bitwise.apply(True)
        assert all(op_registry_oot[n].__name__ == f"Invariant{n}" for n in names)
        assert AttentionBackendEnum.CPU_ATTN.get_class().__name__ == "InvariantCPUAttentionBackend"
        bitwise.apply(True)  # idempotent
    finally:
        bitwise.apply(False)
    assert not any(n in op_registry_oot for n in names)
    assert AttentionBackendEnum.CPU_ATTN.get_path() == default
