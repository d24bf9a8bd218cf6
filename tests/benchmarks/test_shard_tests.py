"""benchmarks/device/shard_tests.py, the runner the GPU stages use to run the op's GPU tests as
concurrent pytest processes: every collected test is reported with the outcome its shard recorded,
a failure, an error, a skip or a test its shard never finished makes the exit status non-zero."""
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


def _run(tmp_path, *args, timeout=60):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow_one: a test that outlasts the runner's time-out\n")
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout)
    lines = {ln.rsplit(None, 1)[1]: ln.rsplit(None, 1)[0].strip() for ln in proc.stdout.splitlines()
             if "::" in ln and not ln.startswith("shard_tests")}
    return proc, lines


def test_every_outcome_reported_and_only_all_passed_exits_zero(tmp_path):
    proc, lines = _run(tmp_path, "--shards", "3", "--timeout", "50", "--out", str(tmp_path / "o"), "--",
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

    proc, lines = _run(tmp_path, "--shards", "2", "--timeout", "50", "--out", str(tmp_path / "p"), "--",
                       "-k", "ok or in_class", "test_sample.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(lines.values()) == {"PASSED"} and len(lines) == 2


def test_a_shard_cut_by_the_timeout_reports_its_tests_not_run(tmp_path):
    # one shard per test: the slow test's shard is killed at the time-out, the others finish
    proc, lines = _run(tmp_path, "--shards", "8", "--timeout", "15", "--out", str(tmp_path / "o"), "--",
                       "-k", "ok or slow", "test_sample.py")
    assert lines == {"test_sample.py::test_ok": "PASSED", "test_sample.py::test_slow": "NOT RUN"}, proc.stdout
    assert proc.returncode == 1 and "1 passed, 1 not run" in proc.stdout


def test_bad_arguments_are_refused(tmp_path):
    proc, _ = _run(tmp_path, "--shards", "2", "--out", str(tmp_path / "o"), "test_sample.py")
    assert proc.returncode != 0 and "expected `[options] -- PYTEST_ARGS`" in proc.stderr
    proc, _ = _run(tmp_path, "--shards", "0", "--out", str(tmp_path / "o"), "--", "test_sample.py")
    assert proc.returncode != 0 and "--shards: expected an int >= 1, got 0" in proc.stderr
