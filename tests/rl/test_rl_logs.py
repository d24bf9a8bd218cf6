"""vLLM's logging config for a run (rl/logs.py): INFO into <run>/vllm.log, warnings on the terminal once each.

    .venv/bin/python -m pytest -q tests/rl/test_rl_logs.py

Two processes apply the config the way vLLM does (logging.config.dictConfig of the JSON file that
VLLM_LOGGING_CONFIG_PATH names) and log to `vllm.*` loggers, as an engine process and its engine
core would: every record reaches the shared vllm.log, each distinct warning reaches a terminal
once over both processes. No vLLM import: what is tested is the file handed to vLLM.
(tests/rl/test_rl_loop.py checks the same on a real run's engines.)
"""

from __future__ import annotations

import json
import subprocess
import sys

from rl.logs import VLLM_LOG, vllm_log_env, vllm_logs_to

PROCESS = r"""
import json, logging, logging.config, os, sys
logging.config.dictConfig(json.load(open(os.environ["VLLM_LOGGING_CONFIG_PATH"])))
log = logging.getLogger("vllm.model_executor.reload")
log.info("Reloading weights inplace... (%s)", sys.argv[1])
for _ in range(3):
    log.warning("Following weights were not loaded from checkpoint: %s", {"lm_head.weight"})
log.warning("only in process %s", sys.argv[1])
logging.getLogger("other").warning("not vLLM's")
"""


def test_vllm_info_goes_to_the_file_and_each_warning_once_to_the_terminal(tmp_path):
    env = vllm_log_env(tmp_path)
    terminals = [subprocess.run([sys.executable, "-c", PROCESS, str(i)], env={**env, "PATH": ""}, capture_output=True,
                                text=True, timeout=60, check=True) for i in (1, 2)]
    log = (tmp_path / VLLM_LOG).read_text().splitlines()
    assert sum("INFO" in ln and "Reloading weights inplace" in ln for ln in log) == 2
    assert sum("were not loaded" in ln for ln in log) == 6  # the file keeps every record
    shown = [ln for t in terminals for ln in t.stderr.splitlines() if "vllm pid=" in ln]
    assert not [ln for ln in shown if " INFO " in ln] and not any(t.stdout for t in terminals)
    assert [ln.split("] ", 1)[1] for ln in shown] == [
        "Following weights were not loaded from checkpoint: {'lm_head.weight'}", "only in process 1",
        "only in process 2"]
    assert "not vLLM's" in terminals[0].stderr  # other loggers are left alone


def test_vllm_logs_to_sets_the_environment_for_the_block_only(tmp_path, monkeypatch):
    import logging
    import os

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    vllm = logging.getLogger("vllm")
    monkeypatch.setattr(vllm, "handlers", list(vllm.handlers))  # this process's vLLM logging comes back after
    monkeypatch.setattr(vllm, "propagate", vllm.propagate)
    monkeypatch.setattr(vllm, "level", vllm.level)
    with vllm_logs_to(tmp_path / "out") as path:
        cfg = json.loads(open(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read())
        assert cfg["handlers"]["file"]["filename"] == str(path) == str(tmp_path / "out" / VLLM_LOG)
        logging.getLogger("vllm.engine").info("applied at once, before any engine")
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ
    assert "applied at once, before any engine" in path.read_text()


def test_vllm_logs_to_gives_the_vllm_logger_back_when_the_folder_is_gone(tmp_path):
    """A refused `consistency` removes its folder inside the block; a later engine of the same process
    (the next test, here) must not log into it (make test failed that way: FileNotFoundError)."""
    import logging
    import shutil

    vllm = logging.getLogger("vllm")
    before = (list(vllm.handlers), vllm.level, vllm.propagate)
    with vllm_logs_to(tmp_path / "out"):
        assert vllm.handlers != before[0]
        shutil.rmtree(tmp_path / "out")
    assert (list(vllm.handlers), vllm.level, vllm.propagate) == before
    logging.getLogger("vllm.entrypoints").info("a later engine's first line")  # raised before the fix
    assert not (tmp_path / "out").exists()
