"""Shared pytest fixtures: GPU skips with computed reasons, the files with `slow` tests first, NaN-poisoned
megamoe allocations, one Ray cluster per test process for the `megamoe-rl train` launches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

# tests/ mirrors the packages (tests/megamoe, tests/rollout, ...) and is not a package itself: test
# modules share helpers by plain import (`from test_rl_loop import SMALL`), so every test folder is
# on the path whichever file pytest was asked to run.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith(("_", ".")):
        sys.path.insert(0, str(_folder))

# Without a GPU, Triton kernels run on the CPU through Triton's interpreter. The variable is read
# when a kernel is decorated, so it is set here, before any test imports megamoe's kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _gpu_reason(n: int) -> str | None:
    if not torch.cuda.is_available():
        return f"needs {n} CUDA GPU(s); torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    have = torch.cuda.device_count()
    if have < n:
        return f"needs {n} CUDA GPUs; torch.cuda.device_count() is {have}"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multigpu" in item.keywords:
            reason = _gpu_reason(2)
        elif "gpu" in item.keywords:
            reason = _gpu_reason(1)
        else:
            continue
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
    # The files holding a `slow` test first, each file's tests in their own order (a stable sort).
    # `make test` hands whole files to its pytest-xdist workers in this order (--dist loadfile
    # --no-loadscope-reorder; xdist's own order is by test count, which put the few-test files of
    # minutes-long runs last): the long files overlap first and the short ones even out the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture
def nan_fill():
    """Fill every buffer megamoe allocates with NaN for the duration of the test."""
    from megamoe import alloc
    with alloc.poison(float("nan")):
        yield


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """The environment for this test process's `megamoe-rl train` launches to join one Ray cluster
    ($RAY_ADDRESS, which rl.cluster.start_ray joins instead of starting a local instance: about 5 s a
    launch), started at the first test that asks for it, stopped when the session ends (its tests passed
    or not) and when this process dies (the parent-death signal of the `ray start --block` process, which
    stops its node's processes on SIGTERM).

    Nothing else finds it: this process's environment stays as it was (only the launches' get these
    variables), and `ray start` writes its address file into its own --temp-dir, not /tmp/ray, where an
    address-less `ray.init()` would look. Its ports are free ones (the other test process may run a
    cluster beside it). Token authentication, as Ray gives a local instance, with a token of its own
    (RAY_AUTH_TOKEN_PATH): Ray turns it on for `ray start` when ~/.ray/auth_token exists but never for a
    driver joining by address, so both sides are told (RAY_AUTH_MODE). 2 logical CPUs, as a launch's
    local instance on the 2-core machine (the tiny plans need 2)."""
    import shutil

    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    temp = tempfile.mkdtemp(prefix="mmray", dir="/tmp")  # short: Ray's socket paths live under it
    token = Path(temp) / "auth_token"
    token.write_text(generate_new_authentication_token())
    token.chmod(0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    log = open(os.path.join(temp, "ray_start.log"), "w")
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={_free_port()}",
            f"--ray-client-server-port={_free_port()}", "--num-cpus=2", "--include-dashboard=false",
            "--disable-usage-stats", f"--temp-dir={temp}"]
    # prctl(PR_SET_PDEATHSIG, SIGTERM), kept across exec: the node goes down with this process.
    wrapper = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
               "os.execv(sys.argv[1], sys.argv[1:])")
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **auth}
    proc = subprocess.Popen([sys.executable, "-c", wrapper, *argv], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    address_file = Path(temp) / "ray_current_cluster"
    try:
        deadline = time.monotonic() + 120
        while not (address_file.is_file() and address_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`ray start` failed (exit {proc.poll()}):\n" + Path(log.name).read_text()[-3000:])
            time.sleep(0.2)
        yield {"RAY_ADDRESS": address_file.read_text().strip(), **auth}
    finally:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and \
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            time.sleep(0.2)
        # Whatever of the node's session is left: its own process group, whose leader is not reaped yet
        # (so that group id is still this one's).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
