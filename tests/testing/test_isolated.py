"""Isolated mode of the pytest plugin: in a plain single-process ``pytest``, the tests meant for
more ranks run in mpiexec jobs, and a crash or a hang there fails only the test it was in.

The scratch suites of tests/plugin_cases run in a fresh pytest process each (the mode's
parent), which starts the jobs.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cupycomm.run import launchers
from cupycomm.testing import launch_environment, no_auto_cleanup, run_mpiexec
from cupycomm.work import poll_until

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.mpi(max_size=1)   # starts pytest sessions that start mpiexec jobs

CASES = Path(__file__).resolve().parents[1] / "plugin_cases"
TIMEOUT = 120


def plain_pytest(*args):
    """``python -m pytest *args`` in one fresh process, in the scratch suites' directory."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=CASES, env=launch_environment({"COLUMNS": "300"}),
                          capture_output=True, text=True,
                          timeout=TIMEOUT)
    return done.returncode, done.stdout + done.stderr


def test_a_rank_that_crashes_fails_its_test_and_the_session_goes_on():
    status, out = plain_pytest("case_isolated.py", "-v", "-rfE")
    assert status == 1, out
    assert "2 failed, 2 passed" in out, out
    for passed in ("test_first", "test_fourth"):
        assert f"case_isolated.py::{passed}[mpi3] PASSED" in out, out
    # The crash: one failure of the call, naming the rank, with the job's report.
    assert ("FAILED case_isolated.py::test_third_exits_on_rank_1[mpi3] - rank 1 (pid "
            in out), out
    assert "the MPI job of 3 ranks ended with exit status 1 during this test" in out
    assert "died during case_isolated.py::test_third_exits_on_rank_1[mpi3]" in out
    assert "ERROR" not in out
    # A failure on one rank is named as under mpiexec.
    assert "FAILED case_isolated.py::test_second_fails_on_rank_2[mpi3] - [rank 2]" in out
    assert "- rank 2 of 3 -" in out
    assert "Captured stdout call (rank 2)" in out and "captured output of rank 2" in out


def test_a_hang_fails_its_test_at_the_timeout_and_the_session_goes_on():
    status, out = plain_pytest("case_isolated_hang.py", "-v", "-rf")
    assert status == 1, out
    assert "1 failed, 3 passed" in out, out
    assert "case_isolated_hang.py::test_fourth[mpi2] PASSED" in out, out
    assert ("FAILED case_isolated_hang.py::test_third_hangs_on_rank_0[mpi2] - "
            "case_isolated_hang.py::test_third_hangs_on_rank_0[mpi2] did not finish within "
            "3 s") in out, out
    for rank in (0, 1):
        assert f" rank {rank} (pid " in out, out


def test_outcomes_in_a_job_read_as_under_mpiexec():
    """The suite that tests/testing/test_plugin.py runs under mpiexec -n 3, run here at sizes 1 and
    3 by the ini value mpi_sizes: each test twice, the size in its id."""
    status, out = plain_pytest("case_outcomes.py", "-ra", "-o", "mpi_sizes=1 3")
    assert status == 1, out
    assert "4 failed, 3 passed, 3 skipped, 2 xfailed" in out, out
    assert "FAILED case_outcomes.py::test_fails_on_the_last_rank[mpi3] - [rank 2] Assert" in out
    assert "FAILED case_outcomes.py::test_fails_on_the_last_rank[mpi1] - AssertionError" in out
    assert ("SKIPPED [1] case_outcomes.py:18: skipped on rank 2 of 3: deliberately skipped on "
            "the last rank only") in out
    assert "the ranks disagree on the outcome of the call phase" in out
    assert "test_leaves_a_message_behind[mpi1]" not in out     # min_size=2: at 3 only
    assert "Captured stdout call (rank 2)" in out


def test_a_job_that_dies_before_its_first_test_fails_its_tests_once(pytester):
    pytester.makepyfile(test_dies="""
        import os
        import pytest
        from mpi4py import MPI

        pytestmark = pytest.mark.mpi(n=2)
        if MPI.COMM_WORLD.Get_rank() == 1:
            os._exit(3)

        def test_a():
            pass

        def test_b():
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mpi-timeout=20",
                                           timeout=TIMEOUT)
    result.assert_outcomes(errors=2)
    out = result.stdout.str()
    if launchers.find().kind == "openmpi":
        # Open MPI's launcher ends the job as soon as a rank exits non-zero, with that rank's
        # status, naming it in its own words before the plugin's hang guard can
        status = 3
        assert re.search(r"Process name: *\[\S+,1\]\s+Exit code: *3", out), out
    else:   # hydra leaves the job to the plugin (isolated mode disables its cleanup)
        status = 1
        assert "rank 1 (pid" in out and "died during" in out, out
    assert out.count(f"the MPI job of 2 ranks ended with exit status {status} before its "
                     f"first test") == 2, out


def test_with_isolated_mode_off_tests_for_other_sizes_skip_as_under_mpiexec(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.mpi(n=[2, 3])
        def test_two_or_three():
            pass

        def test_any():
            pass
    """)
    listed = pytester.runpytest("--collect-only", "-q").stdout.lines
    assert [line.split("::")[1] for line in listed if "::" in line] == [
        "test_any", "test_two_or_three[mpi2]", "test_two_or_three[mpi3]"]   # by size
    result = pytester.runpytest("-rs", "--mpi-isolated=no")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*test_*.py:3: runs on 2 or 3 MPI ranks, has 1 (mpiexec -n 2*"])


@pytest.mark.parametrize("n", [1, 2])   # one rank of a launcher's is no plain pytest
def test_under_mpiexec_the_sizes_of_the_marker_skip_the_others(n):
    job = run_mpiexec(n, "-m", "pytest", "-p", "no:cacheprovider", "case_isolated.py", "-rs",
                      timeout=TIMEOUT, cwd=str(CASES), mpiexec_args=no_auto_cleanup())
    assert job.returncode == 0, job.output
    assert "4 skipped" in job.stdout, job.stdout
    assert f"runs on 3 MPI ranks, has {n}" in job.stdout
    assert "[mpi3]" not in job.stdout      # no ids by size under mpiexec: as before the mode


@pytest.mark.parametrize("value", ["0", "two"])
def test_bad_mpi_sizes_are_usage_errors(pytester, value):
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("-o", f"mpi_sizes={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*mpi_sizes must be numbers of ranks >= 1, got *{value}*"])


def test_a_job_ends_when_the_session_that_started_it_is_killed(tmp_path):
    """A session killed from outside (a CI timeout) leaves no job running: the job's rank 0
    removes its directory and aborts it."""
    (tmp_path / "test_sleeps.py").write_text(
        "import time\nimport pytest\n\n@pytest.mark.mpi(n=2)\ndef test_sleeps():\n"
        "    time.sleep(120)\n")
    # TMPDIR: the session makes the job's directory here.
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                                "--mpi-timeout=300", "test_sleeps.py"], cwd=tmp_path,
                               env=launch_environment({"TMPDIR": str(tmp_path)}),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert poll_until(lambda: _started(tmp_path), timeout=TIMEOUT)
    finally:
        session.kill()
        session.wait()
    assert poll_until(lambda: not list(tmp_path.glob("cupycomm-isolated-*")), timeout=TIMEOUT)


def _started(directory):
    """Whether a job under ``directory`` has started its test."""
    return any('"start"' in events.read_text()
               for events in directory.glob("cupycomm-isolated-*/events"))
