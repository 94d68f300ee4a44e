"""The fault suite, a rank that fails: an exception, an exit, a signal, a dead peer of a
device wait end the whole job quickly, non-zero, saying which rank and why (the abort
handler and the watchdog's naming of the departed, cupycomm/faults/abort.py).

Each scenario runs as a job of its own (tests/faults/fault_jobs.py says how).
"""
import re

import pytest

from fault_jobs import ended_quickly, no_rank_finished, run

pytestmark = pytest.mark.mpi(max_size=1)


def test_an_exception_on_one_rank_aborts_the_job_with_its_traceback():
    job = run("raise-before-collective")
    ended_quickly(job)
    assert job.returncode != 0
    assert "cupycomm: uncaught exception on rank 2 of 3" in job.output
    assert "RuntimeError: deliberate failure before the collective" in job.output
    no_rank_finished(job)


def test_the_abort_does_not_wait_for_calls_in_flight():
    """The abort on an exception ends the job at once, without waiting (until the timeout)
    for a receive whose sender never sends."""
    job = run("raise-with-receive-pending")
    ended_quickly(job)
    assert job.returncode != 0
    assert "RuntimeError: deliberate failure with a receive in flight" in job.output
    assert "has waited" not in job.output, job.output   # no timeout was needed to end it
    no_rank_finished(job)


def test_a_rank_that_calls_sys_exit_0_is_named():
    job = run("sys-exit-0")
    ended_quickly(job)
    assert job.returncode != 0
    assert ("rank 2 of communicator world" in job.output
            and "has exited (its program ended or called sys.exit) after its collective #1"
            in job.output), job.output
    no_rank_finished(job)


def test_a_rank_that_exits_0_without_python_is_named_and_the_job_fails():
    job = run("os-exit-0")
    ended_quickly(job)
    no_rank_finished(job)
    assert job.returncode != 0, job.output
    assert "rank 2 of communicator world" in job.output and "has died" in job.output, \
        job.output


def test_a_rank_killed_by_a_signal_fails_the_job():
    """Even with -disable-auto-cleanup, hydra ends the job itself when a rank is killed by a
    signal (exit status 9), often before the watchdog has looked: not always named."""
    job = run("sigkill")
    ended_quickly(job)
    no_rank_finished(job)
    assert job.returncode != 0, job.output


def test_a_dead_peer_ends_a_device_wait_with_peer_lost():
    """Device collectives cannot end the job from the watchdog (NCCL kernels are aborted,
    not MPI calls): the wait raises PeerLost, which the abort handler reports."""
    job = run("device-peer-dies")
    ended_quickly(job)
    assert job.returncode != 0
    assert "has died (its process ended: os._exit, a signal or a crash)" in job.output, job.output
    assert re.search(r"cupycomm.errors.PeerLost: recv #\d+: the NCCL communicator was "
                     r"aborted", job.output), job.output
    lost = re.findall(r"rank (\d+): PeerLost ranks=(\([\d, ]*\)) call=(\w+) seq=(\d+) "
                      r"\(recv #(\d+), world rank (\d+) killed\)", job.output)
    assert lost, job.output
    for _, ranks, call, seq, expected_seq, killed in lost:   # every survivor that says
        assert (ranks, call, seq) == (f"({killed},)", "recv", expected_seq), job.output
    no_rank_finished(job)
