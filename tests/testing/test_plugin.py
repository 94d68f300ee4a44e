"""The pytest plugin (cupycomm.testing): the scratch suites of tests/plugin_cases run under
mpiexec -n 2 and 3, with what rank 0 prints, the exit status and the time it takes; the
plugin in one process; the launcher.

The launched runs cannot start inside an mpiexec run of the suite (mpiexec does not nest
there), so these tests run in the single-process pass and skip under mpiexec, alike on
every rank (the reason depends on the world size only).
"""
import os
from pathlib import Path

import pytest

from cupycomm.run import launchers
from cupycomm.testing import launch_environment, no_auto_cleanup, run_mpiexec
from cupycomm.testing._session import TIMEOUT, worst_exit_status

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.mpi(max_size=1)   # starts mpiexec jobs of its own

CASES = Path(__file__).resolve().parents[1] / "plugin_cases"
SIZES = [2, 3]


def run_cases(n, *args, timeout=90):
    """``mpiexec -n n python -m pytest *args`` in the scratch suites' directory, with the
    launcher's options that docs/guide/testing.md recommends. Without colour: Open MPI's
    launcher gives its ranks a terminal, and the reports are read as plain text."""
    return run_mpiexec(n, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", *args,
                       timeout=timeout, cwd=str(CASES), mpiexec_args=no_auto_cleanup())


def without_stacks(text):
    """``text`` without the lines of Python stacks (for assertion messages)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("  File "))


@pytest.mark.parametrize("n", SIZES)
def test_a_test_fails_if_it_fails_on_any_rank(n):
    job = run_cases(n, "case_outcomes.py", "-ra")
    last = n - 1
    out = job.stdout
    assert job.returncode == 1, job.output
    assert out.count("test session starts") == 1, out   # one report: rank 0's
    assert "3 failed, 2 passed, 1 skipped, 1 xfailed" in out, out
    assert f"- rank {last} of {n} -" in out
    assert f"AssertionError: deliberate failure on rank {last}" in out
    assert f"FAILED case_outcomes.py::test_fails_on_the_last_rank - [rank {last}] Assert" in out
    assert f"Captured stdout call (rank {last})" in out
    assert f"captured output of rank {last}" in out
    # Isolation: the message left behind by the failed test does not reach the next one.
    assert "test_next_test_gets_its_own_messages" not in out.split("short test summary")[1]


@pytest.mark.parametrize("n", SIZES)
def test_ranks_agree_on_skips(n):
    job = run_cases(n, "case_outcomes.py", "-rs", "-q", "-k", "skip")
    last = n - 1
    assert job.returncode == 1, job.output
    assert (f"SKIPPED [1] case_outcomes.py:18: skipped on rank {last} of {n}: deliberately "
            "skipped on the last rank only") in job.stdout
    assert "the ranks disagree on the outcome of the call phase" in job.stdout
    assert f"skipped on rank {last} (deliberately skipped in the call" in job.stdout
    assert "1 failed, 1 skipped, 5 deselected" in job.stdout


@pytest.mark.parametrize("n, how", [(2, "-o mpi_timeout=3"), (3, "--mpi-timeout=3")])
def test_a_hanging_test_ends_the_job_with_every_ranks_stack(n, how):
    job = run_cases(n, "case_hang.py", *how.split(), timeout=60)
    assert job.returncode == 1, job.output
    assert not job.timed_out
    assert job.elapsed < 3 + 12, job.elapsed
    err = job.stderr
    assert "case_hang.py::test_rank_0_waits_alone did not finish within 3 s" in err, err
    for rank in range(n):
        assert f" rank {rank} (pid " in err, err
    rank_0, others = err.split(" rank 1 (pid ")
    assert "in test_rank_0_waits_alone" in rank_0
    assert others.count("in _agree_on_the_end") == n - 1
    assert "aborting the MPI job" in err
    assert "test_never_reached" not in job.output
    assert "mpi_timeout 3 s" in job.stdout and "not enforced" not in job.stdout


@pytest.mark.parametrize("n, how", [(2, ()), (3, ()), (2, ("-o", "mpi_timeout=2"))],
                         ids=["2-seen", "3-seen", "2-timeout"])
def test_a_failure_that_leaves_the_others_waiting_ends_the_job_with_it(n, how):
    """The last rank fails before a barrier that the others enter: the job ends within
    seconds (the hang guard sees the failure and the ranks still inside the test; or at the
    timeout, if it comes first) and prints that failure and the earlier ones."""
    job = run_cases(n, "case_stuck.py", "-k", "fails_on_rank_0 or fails_while", *how)
    last, err = n - 1, without_stacks(job.stderr)
    assert job.returncode == 1, without_stacks(job.output)
    assert job.elapsed < 15, (job.elapsed, err)
    if how:
        assert "test_last_rank_fails_while_the_others_wait did not finish within 2 s" in err
    else:
        stuck = "rank 0 is" if n == 2 else "ranks 0, 1 are"
        assert (f"test_last_rank_fails_while_the_others_wait failed on rank {last}, and "
                f"{stuck} still inside it") in err, err
    assert f" rank {last} (pid " in err, err
    mine = err.split(f" rank {last} (pid ")[1]
    assert f"AssertionError: deliberate failure on rank {last} before the barrier" in mine, err
    assert "tests that failed before it" in err and \
        "FAILED case_stuck.py::test_fails_on_rank_0" in err, err


def test_a_rank_that_exits_inside_a_test_is_named_and_fails_the_job():
    job = run_cases(2, "case_stuck.py", "-k", "exits_while")
    err = without_stacks(job.stderr)
    assert job.returncode == 1, without_stacks(job.output)
    assert job.elapsed < 15, (job.elapsed, err)
    assert "died during case_stuck.py::test_last_rank_exits_while_the_others_wait" in err, err
    assert "rank 1 (pid " in err and "(the process has exited)" in err, err


def test_the_watchdogs_message_and_stacks_reach_the_terminal():
    """Rank 0 reduces alone on ``cupycomm_comm``; rank 1 passes and closes it. The watchdog of
    rank 0 says so and aborts: what it writes must not stay in pytest's capture."""
    job = run_cases(2, "case_stuck.py", "-k", "reduces_alone")
    assert job.returncode == 1, without_stacks(job.output)
    assert job.elapsed < 15, (job.elapsed, without_stacks(job.stderr))
    assert ("cupycomm watchdog: rank 1 of communicator mpi_comm" in job.stderr
            and "closed the communicator after its collective #0 while rank 0 of 2"
            in job.stderr and "waits in all_reduce #1" in job.stderr), job.stderr
    assert "in test_rank_0_reduces_alone" in job.stderr, job.stderr


@pytest.mark.parametrize("n", SIZES)
def test_a_fixture_that_skips_on_one_rank_cannot_hold_the_others(n):
    """The plugin's communicators are made before the test's fixtures, so the ranks that
    did not skip are not left waiting in a collective of theirs."""
    job = run_cases(n, "case_fixture_skip.py", "-rs")
    assert job.returncode == 0, without_stacks(job.output)
    assert job.elapsed < 15, job.elapsed
    assert f"skipped on rank {n - 1} of {n}: deliberately skipped by a fixture" in job.stdout
    assert "1 passed, 1 skipped" in job.stdout


def test_a_rank_that_fails_before_the_session_cannot_hang_the_others():
    job = run_cases(2, "-p", "case_early_failure", "case_hang.py", "-o", "mpi_timeout=3",
                    timeout=60)
    assert job.returncode == 1, job.output
    assert job.elapsed < 3 + 12, job.elapsed
    assert "deliberate plugin import failure on the last rank" in job.output
    assert "the start of the session did not finish within 3 s" in job.stderr


@pytest.mark.parametrize("n", SIZES)
def test_ranks_that_collect_different_tests_stop_before_the_first(n):
    job = run_cases(n, "case_collect_mismatch.py", "case_collect_error.py")
    last = n - 1
    out = job.stdout
    assert job.returncode == 2, job.output
    assert "ERROR collecting case_collect_error.py" in out
    assert f"on rank {last} of {n}:" in out
    assert "ImportError: deliberate import failure on the last rank" in out
    assert "the ranks collected different tests" in out
    assert (f"rank 0 has case_collect_error.py::test_nothing, rank {last} has "
            "case_collect_mismatch.py::test_only_on_the_last_rank") in out
    assert "Interrupted: 2 errors during collection" in out
    assert " passed" not in out


def test_a_rank_that_stops_the_session_stops_every_rank():
    job = run_cases(3, "case_exit.py")
    assert job.returncode == 2, job.output
    assert "Interrupted: rank 2 left the session" in job.stdout
    assert "rank 2: _pytest.outcomes.Exit: deliberate stop on the last rank" in job.stdout
    assert "1 failed" in job.stdout and "test_not_run" not in job.stdout


def test_x_stops_every_rank_after_the_same_test():
    job = run_cases(3, "case_outcomes.py", "-x")
    assert job.returncode == 1, job.output
    assert "stopping after 1 failures" in job.stdout
    assert "1 failed, 1 passed in" in job.stdout


def test_last_failed_reads_the_cache_rank_0_wrote(tmp_path):
    cache = ["-p", "cacheprovider", "-o", f"cache_dir={tmp_path}"]
    first = run_cases(2, "case_outcomes.py", *cache)
    assert first.returncode == 1, first.output
    again = run_cases(2, "case_outcomes.py", "--lf", *cache)
    assert again.returncode == 1, again.output
    assert "run-last-failure: rerun previous 3 failures" in again.stdout
    assert "3 failed, 4 deselected" in again.stdout


# -- in one process -------------------------------------------------------------------------------
def test_in_one_process_the_plugin_adds_only_its_header(pytester):
    pytester.makepyfile(case_outcomes=(CASES / "case_outcomes.py").read_text())
    result = pytester.runpytest("case_outcomes.py")
    result.assert_outcomes(failed=1, passed=1, skipped=4, xfailed=1)
    result.stdout.fnmatch_lines(["cupycomm.testing: 1 MPI rank (*; mpi_timeout 60 s (not "
                                 "enforced in one process)"])
    assert " of 1 -" not in result.stdout.str()    # no rank sections in the report


SKIPS = """
import pytest

@pytest.mark.parametrize("i", range(3))
@pytest.mark.skip(reason="no GPU: none here (run on a GPU machine)")
def test_gpu(i):
    pass

@pytest.mark.skip(reason="torch is not installed (pip install torch)")
def test_torch():
    pass

@pytest.mark.mpi(n=2)
def test_two():
    pass

def test_runs():
    pytest.skip("needs Open MPI; this is MPICH")
"""


def test_a_pass_says_in_one_line_why_its_tests_skipped(pytester):
    """Without -rs, one line groups the skips by the head of their reason (before the first
    ':', '(', ';' or ','), most first: a suite with thousands of skips says why."""
    pytester.makepyfile(test_skips=SKIPS)
    result = pytester.runpytest("--mpi-isolated=no", "test_skips.py")
    result.assert_outcomes(skipped=6)
    result.stdout.fnmatch_lines(["cupycomm.testing: 6 skipped: no GPU 3, needs Open MPI 1, "
                                 "runs on 2 MPI ranks 1, torch is not installed 1 "
                                 "(-rs lists each)"])


@pytest.mark.parametrize("n", SIZES)
def test_under_mpiexec_rank_0_says_why_tests_skipped(n):
    """The reason as every rank's, without the ranks that the report names."""
    job = run_cases(n, "case_outcomes.py", "-q", "-k", "skip_in_setup")
    assert job.returncode == 0, job.output
    assert ("cupycomm.testing: 1 skipped: deliberately skipped on the last rank only 1 "
            "(-rs lists each)") in job.stdout.splitlines(), job.output


def test_the_plugin_leaves_no_file_open():
    """Python's development mode reports every file still open at exit (ResourceWarning):
    the non-zero ranks' quiet terminal, every rank's stream for abort messages."""
    job = run_mpiexec(3, "-X", "dev", "-m", "pytest", "-p", "no:cacheprovider", "-q",
                      "case_outcomes.py", "-k", "passes", timeout=90, cwd=str(CASES),
                      mpiexec_args=no_auto_cleanup())
    assert job.returncode == 0, job.output
    assert "ResourceWarning" not in job.output, job.output


def test_timeouts_come_from_the_marker_the_option_the_ini_value(pytester):
    pytester.makepyfile("""
        import pytest

        def test_default():
            pass

        @pytest.mark.mpi_timeout(7)
        def test_marked():
            pass
    """)
    for args, default in [((), 60.0), (("-o", "mpi_timeout=5"), 5.0),
                          (("-o", "mpi_timeout=5", "--mpi-timeout=4"), 4.0)]:
        items, _ = pytester.inline_genitems(*args)
        assert [item.stash[TIMEOUT] for item in items] == [default, 7.0]


@pytest.mark.parametrize("mark", ["mpi_timeout(-1)", "mpi_timeout(1, 2)", "mpi(2)",
                                  "mpi(min_size=0)", "mpi(min_size=3, max_size=2)",
                                  "mpi(n=0)", "mpi(n=[])", "mpi(n=2, min_size=1)",
                                  "mpi(n=True)"])
def test_bad_marker_arguments_are_usage_errors(pytester, mark):
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.{mark}
        def test_x():
            pass
    """)
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_x*"])


def test_mpi_marker_skips_alike_with_a_reason(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.mpi(min_size=2)
        def test_two():
            pass

        @pytest.mark.mpi(min_size=1, max_size=1)
        def test_one():
            pass
    """)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*test_*.py:3: needs at least 2 MPI ranks, has 1 (mpiexec -n 2*"])


def test_worst_exit_status_keeps_pytests_meaning():
    assert worst_exit_status([0, 1, 0]) == 1          # never 1 | 4 = 5, "no tests collected"
    assert worst_exit_status([1, 4]) == 4
    assert worst_exit_status([5, 5]) == 5
    assert worst_exit_status([0, 0]) == 0
    assert worst_exit_status([2, 7]) == 7             # pytest.exit(returncode=7)


# -- the launcher ---------------------------------------------------------------------------------
def test_run_mpiexec_kills_a_job_past_its_bound():
    job = run_mpiexec(2, "-c", "import time; time.sleep(60)", timeout=1)
    assert job.timed_out and job.returncode != 0
    assert job.elapsed < 5


def test_run_mpiexec_returns_status_and_output():
    job = run_mpiexec(2, "-c", "import sys; from mpi4py import MPI; w = MPI.COMM_WORLD; "
                               "w.Get_rank() or print(w.Get_size()); sys.exit(3)", timeout=60)
    assert (job.returncode, job.stdout, job.timed_out) == (3, "2\n", False)


def test_launch_environment_drops_the_launchers_variables(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("HYDI_CONTROL_FD", "7")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    env = launch_environment({"EXTRA": "1"})
    assert not {"PMI_RANK", "HYDI_CONTROL_FD", "OMPI_COMM_WORLD_SIZE"} & set(env)
    assert env["EXTRA"] == "1" and env["PATH"] == os.environ["PATH"]


def test_no_auto_cleanup_is_for_hydra_only_among_mpiexecs(tmp_path):
    other = tmp_path / "mpiexec"
    other.write_text("#!/bin/sh\necho 'mpiexec (Open MPI) 5.0.3'\n")
    other.chmod(0o755)
    assert no_auto_cleanup(str(other)) == []
    hydra = tmp_path / "hydra"
    hydra.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    hydra.chmod(0o755)
    assert no_auto_cleanup(str(hydra)) == ["-disable-auto-cleanup"]


@pytest.mark.parametrize("bad", [dict(n=0, timeout=1), dict(n=2, timeout=0)])
def test_run_mpiexec_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match="run_mpiexec"):
        run_mpiexec(bad["n"], "-c", "pass", timeout=bad["timeout"])


ROUND_LOOKS = """
import time
from mpi4py import MPI
from cupycomm import work
from cupycomm.testing._exchange import Point, Rounds

rounds = Rounds(MPI.COMM_WORLD.Dup())
rounds.exchange(Point.SETUP)
if rounds.rank == 0:
    time.sleep(1)   # every other rank's record has arrived by now
sleeps = []
work.time = type("Clock", (), {"monotonic": time.monotonic,
                               "sleep": lambda s: (sleeps.append(s), time.sleep(s))})
rounds.exchange(Point.END, 1)
if rounds.rank == 0:
    print(f"rank 0 slept {len(sleeps)} times")
"""


def test_a_round_whose_records_are_there_completes_without_sleeping(tmp_path):
    """Rank 0 takes in the records that have arrived without a sleep between them: MPICH
    completes about one message a look, and a sleep (up to 10 ms) after each made a round
    at 16 ranks on 2 cores take 100 ms (benchmarks/plugin_cost.py). Open MPI's rank 0 still
    sleeps a few times here, before this change too: its sends complete as it progresses."""
    if launchers.find().kind != "hydra":
        pytest.skip("MPICH's progress engine (one message a look) is what this measures")
    (tmp_path / "round.py").write_text(ROUND_LOOKS)
    job = run_mpiexec(8, "round.py", timeout=90, cwd=str(tmp_path))
    assert job.returncode == 0, job.output
    assert "rank 0 slept 0 times" in job.stdout, job.output
