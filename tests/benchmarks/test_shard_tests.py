"""benchmarks/device/shard_tests.py, the runner the GPU stages use to run the op's GPU tests as
concurrent pytest processes: every collected test is reported with the outcome its shard recorded,
a failure, an error, a skip or a test its shard never finished makes the exit status non-zero; the
processes are as many as the GPU's free memory holds (sized here with injected numbers, no GPU)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "device", "shard_tests.py")

SAMPLE = textwrap.dedent('''
    import time
    import pytest

    def test_ok():
        pass

    @pytest.mark.parametrize("v", [1, 2, 3])
    def test_param(v):
        assert v != 2

    def test_skip():
        pytest.skip("not here")

    class TestGroup:
        def test_in_class(self):
            pass

    @pytest.mark.slow_one
    def test_slow():
        time.sleep(120)
''')


def _run(tmp_path, *args, timeout=60, env=None):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow_one: a test that outlasts the runner's time-out\n")
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = {ln.rsplit(None, 1)[1]: ln.rsplit(None, 1)[0].strip() for ln in proc.stdout.splitlines()
             if "::" in ln and not ln.startswith("shard_tests")}
    return proc, lines


def test_every_outcome_reported_and_only_all_passed_exits_zero(tmp_path):
    proc, lines = _run(tmp_path, "--shards", "3", "--mem-per-shard-gib", "0", "--timeout", "50", "--out", str(tmp_path / "o"), "--",
                       "-m", "not slow_one", "test_sample.py")
    assert lines == {
        "test_sample.py::test_ok": "PASSED",
        "test_sample.py::test_param[1]": "PASSED",
        "test_sample.py::test_param[2]": "FAILED",
        "test_sample.py::test_param[3]": "PASSED",
        "test_sample.py::test_skip": "SKIPPED",
        "test_sample.py::TestGroup::test_in_class": "PASSED",
    }, proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "6 collected, 4 passed, 1 failed, 1 skipped" in proc.stdout
    assert sorted(os.listdir(tmp_path / "o")) == [f"shard{i}.{e}" for i in range(3) for e in ("log", "xml")]

    proc, lines = _run(tmp_path, "--shards", "2", "--mem-per-shard-gib", "0", "--timeout", "50", "--out", str(tmp_path / "p"), "--",
                       "-k", "ok or in_class", "test_sample.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(lines.values()) == {"PASSED"} and len(lines) == 2


def test_a_shard_cut_by_the_timeout_reports_its_tests_not_run(tmp_path):
    # one shard per test: the slow test's shard is killed at the time-out, the others finish (a whole run
    # of the quick tests, collection included, takes ~2 s on the loaded 2-core CI machine: 10 s leaves 5x)
    proc, lines = _run(tmp_path, "--shards", "8", "--mem-per-shard-gib", "0", "--timeout", "10", "--out", str(tmp_path / "o"), "--",
                       "-k", "ok or slow", "test_sample.py")
    assert lines == {"test_sample.py::test_ok": "PASSED", "test_sample.py::test_slow": "NOT RUN"}, proc.stdout
    assert proc.returncode == 1 and "1 passed, 1 not run" in proc.stdout


def test_bad_arguments_are_refused(tmp_path):
    proc, _ = _run(tmp_path, "--shards", "2", "--out", str(tmp_path / "o"), "test_sample.py")
    assert proc.returncode != 0 and "expected `[options] -- PYTEST_ARGS`" in proc.stderr
    proc, _ = _run(tmp_path, "--shards", "0", "--out", str(tmp_path / "o"), "--", "test_sample.py")
    assert proc.returncode != 0 and "--shards: expected an int >= 1, got 0" in proc.stderr
    proc, _ = _run(tmp_path, "--mem-per-shard-gib", "-1", "--out", str(tmp_path / "o"), "--", "test_sample.py")
    assert proc.returncode != 0 and "--mem-per-shard-gib: expected a number >= 0, got -1.0" in proc.stderr
    proc, _ = _run(tmp_path, "--gpu-free-gib", "0", "--out", str(tmp_path / "o"), "--", "test_sample.py")
    assert proc.returncode != 0 and "--gpu-free-gib: expected a number > 0, got 0.0" in proc.stderr


def _plan_shards():
    spec = importlib.util.spec_from_file_location("shard_tests", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.plan_shards, mod.GIB


def test_processes_are_as_many_as_the_free_gpu_memory_holds():
    plan, gib = _plan_shards()
    per = int(16 * gib)
    # an 80 GB H100 (79.1 GiB free) and the H200 (139.8 GiB free): 4, and 8 as asked
    assert plan(8, 98, int(79.1 * gib), per)[0] == 4
    assert plan(8, 98, int(139.8 * gib), per)[0] == 8
    assert plan(8, 3, int(139.8 * gib), per)[0] == 3  # no more processes than tests
    assert plan(8, 98, int(64 * gib), per)[0] == 4 and plan(8, 98, int(64 * gib) - 1, per)[0] == 3  # the edge
    n, why = plan(8, 98, int(10 * gib), per)
    assert n == 1 and "fewer than one" in why  # one process at least, said
    assert plan(8, 98, None, 0) == (8, "--shards 8, not sized by GPU memory")
    assert "79.1 GiB free on the GPU holds 4 processes of 16.0 GiB" in plan(8, 98, int(79.1 * gib), per)[1]


def test_the_run_uses_the_sized_count_of_processes(tmp_path):
    proc, lines = _run(tmp_path, "--shards", "8", "--gpu-free-gib", "33", "--mem-per-shard-gib", "16", "--timeout", "50",
                       "--out", str(tmp_path / "o"), "--", "-k", "ok or param or in_class", "test_sample.py")
    assert "5 tests in 2 processes (--shards 8; 33.0 GiB free on the GPU holds 2 processes of 16.0 GiB)" in proc.stdout
    assert len(lines) == 5 and "over 2 processes" in proc.stdout, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path / "o")) == [f"shard{i}.{e}" for i in range(2) for e in ("log", "xml")]
    # Sized by default: with no CUDA device visible and no --gpu-free-gib, refused naming the way out.
    proc, _ = _run(tmp_path, "--shards", "2", "--out", str(tmp_path / "q"), "--", "test_sample.py",
                   env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode != 0 and "no CUDA device to read the free memory of" in proc.stderr, proc.stderr
    assert "--gpu-free-gib" in proc.stderr and "--mem-per-shard-gib 0" in proc.stderr
