"""The fault suite: each scenario of tests/faults/scenario.py runs under its own mpiexec,
with a hard bound, and must end the whole job quickly, non-zero, saying which rank and why.

These tests start mpiexec jobs of their own, so they run in the single-process pass of the
suite (mpiexec does not nest inside an mpiexec run) and skip under mpiexec on every rank.
"""
from pathlib import Path

import pytest

from cupycomm.testing import run_mpiexec

pytestmark = pytest.mark.mpi(max_size=1)

SCENARIO = str(Path(__file__).resolve().parent / "faults" / "scenario.py")
BOUND = 10.0   # seconds within which every fault must end the job


def run(name, n=3, timeout=60, mpiexec_args=()):
    return run_mpiexec(n, SCENARIO, name, timeout=timeout, mpiexec_args=mpiexec_args)


def ended_quickly(job, bound=BOUND):
    assert not job.timed_out, f"the job hung:\n{job.output}"
    assert job.elapsed < bound, f"took {job.elapsed:.1f} s:\n{job.output}"


def no_rank_finished(job):
    assert "finished with" not in job.output, f"a rank went on as if nothing happened:\n" \
                                              f"{job.output}"


def test_an_exception_on_one_rank_aborts_the_job_with_its_traceback():
    job = run("raise-before-collective")
    ended_quickly(job)
    assert job.returncode != 0
    assert "cupycomm: uncaught exception on rank 2 of 3" in job.output
    assert "RuntimeError: deliberate failure before the collective" in job.output
    no_rank_finished(job)


def test_a_rank_that_calls_sys_exit_0_is_named():
    job = run("sys-exit-0")
    ended_quickly(job)
    assert job.returncode != 0
    assert "rank 2 of communicator world" in job.output and "is exiting" in job.output
    no_rank_finished(job)


@pytest.mark.parametrize("name", ["os-exit-0", "sigkill"])
def test_a_rank_that_dies_ends_the_job(name):
    """MPICH's mpiexec (hydra) sees the process end and kills the other ranks itself, at once
    (SIGKILL: nothing of theirs runs again), usually before cupycomm's watchdog looks; with
    exit code 0 hydra's own exit status is then sometimes 0. The guarantee kept here is that
    the job ends at once and no rank goes on as if nothing happened; the next test shows the
    named, non-zero ending."""
    job = run(name)
    ended_quickly(job)
    no_rank_finished(job)
    assert job.returncode != 0 or name == "os-exit-0"


def test_without_hydras_cleanup_the_watchdog_names_a_rank_that_exited_0():
    """``mpiexec -disable-auto-cleanup`` leaves the survivors running: their watchdog sees the
    peer's process gone, names it and aborts the job non-zero (the README recommends it).
    A rank killed by a signal is not covered: hydra then ends the job itself, exit status 9,
    often before the watchdog has looked."""
    job = run("os-exit-0", mpiexec_args=["-disable-auto-cleanup"])
    ended_quickly(job)
    no_rank_finished(job)
    assert job.returncode != 0, job.output
    assert "rank 2 of communicator world" in job.output and "has died" in job.output, \
        job.output


def test_a_rank_that_never_arrives_times_out_naming_it():
    job = run("never-arrives")
    ended_quickly(job)
    assert job.returncode != 0
    assert "all_reduce #2 on communicator world has waited 3 s (timeout 3 s)" in job.output
    assert "ranks not arrived: [2]" in job.output
    assert "in all_reduce" in job.output   # the waiting rank's stack


def test_a_call_that_holds_the_gil_ends_the_process_with_its_stacks():
    job = run("hold-gil", n=2)
    ended_quickly(job, bound=20.0)   # the 3 s timeout + the 10 s margin, then mpiexec's cleanup
    assert job.returncode != 0
    assert "Timeout (0:00:13)!" in job.output
    assert "scenario.py" in job.output   # where the main thread held on


@pytest.mark.parametrize("kind", ["count", "dtype", "op", "root"])
def test_debug_mode_names_the_disagreement_on_every_rank(kind):
    job = run(f"debug-mismatch-{kind}")
    ended_quickly(job)
    assert job.returncode == 3, job.output
    for rank in range(3):
        assert f"rank {rank}: CollectiveMismatch: " in job.output
    assert "ranks disagree: rank 2 called" in job.output


def test_a_count_mismatch_without_debug_mode_is_an_error_not_garbage():
    job = run("mismatch-count")
    ended_quickly(job)
    assert job.returncode != 0
    assert "truncated" in job.output.lower()   # MPI sees the sizes differ
    no_rank_finished(job)


@pytest.mark.parametrize("kind", ["dtype", "op", "root"])
def test_mismatches_mpi_cannot_see_end_without_hanging(kind):
    """Equal byte counts with another dtype or op, or another root, look valid to MPI: such
    a run is only ever bounded (here it completes); debug mode is what catches it."""
    job = run(f"mismatch-{kind}")
    ended_quickly(job)
