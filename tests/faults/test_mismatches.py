"""The fault suite, ranks that disagree: debug mode names a count, dtype, op or root mismatch
on every rank (cupycomm/faults/debug.py); without it a mismatch is what the MPI library
makes of it, and at least never a hang.

Where an MPI behaves otherwise, the test says what each does; the jobs:
tests/faults/fault_jobs.py.
"""
import pytest

from fault_jobs import LIBRARY, ended_quickly, no_rank_finished, run

pytestmark = pytest.mark.mpi(max_size=1)


@pytest.mark.parametrize("kind", ["count", "dtype", "op", "root"])
def test_debug_mode_names_the_disagreement_on_every_rank(kind):
    job = run(f"debug-mismatch-{kind}")
    ended_quickly(job)
    assert job.returncode == 3, job.output
    for rank in range(3):
        assert f"rank {rank}: CollectiveMismatch: " in job.output
    assert "ranks disagree: rank 2 called" in job.output


def test_a_count_mismatch_without_debug_mode_is_what_the_mpi_makes_of_it():
    """Without debug mode cupycomm adds no check to a collective (that would cost every call a
    round of messages), so a count mismatch is what the MPI library makes of it, as
    docs/guide/debug-mode.md tabulates; debug mode names it on every rank under each (above).
    MPICH: an error (truncated) on every rank. Open MPI: an error on a rank that receives more
    than it posted, which ends the job non-zero, but another rank may finish first with a
    result. Intel MPI: not seen at all; every rank finishes."""
    job = run("mismatch-count")
    ended_quickly(job)
    if LIBRARY == "intelmpi":
        assert job.returncode == 0 and job.output.count("finished with") == 3, job.output
        return
    assert job.returncode != 0
    assert "truncated" in job.output.lower(), job.output   # MPI sees the sizes differ
    if LIBRARY == "mpich":
        no_rank_finished(job)


@pytest.mark.parametrize("kind", ["dtype", "op", "root"])
def test_mismatches_mpi_cannot_see_end_without_hanging(kind):
    """Equal byte counts with another dtype or op, or another root, look valid to MPI: such
    a run is only ever bounded (here it completes); debug mode is what catches it."""
    job = run(f"mismatch-{kind}")
    ended_quickly(job)
