"""The fault suite: each scenario of tests/faults/scenario.py runs under its own mpiexec,
with a hard bound, and must end the whole job quickly, non-zero, saying which rank and why.

These tests start mpiexec jobs of their own, so they run in the single-process pass of the
suite (mpiexec does not nest inside an mpiexec run) and skip under mpiexec on every rank.
The jobs run as docs/guide/faults-and-timeouts.md recommends, with hydra's (MPICH's, Intel
MPI's) ``-disable-auto-cleanup``: the watchdog, not the launcher, must end them. Where an MPI
behaves otherwise, the test says what each does.
"""
import re

import pytest

from cupycomm.testing import SIMULATES_NODES, no_auto_cleanup, run_mpiexec, simulated_nodes
from fault_jobs import (BOUND, HYDRA_OWN_FAILURE, LAUNCHER, LIBRARY, SCENARIO, ended_quickly,
                        no_rank_finished, run)

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


def test_a_rank_that_never_arrives_times_out_naming_it():
    job = run("never-arrives")
    ended_quickly(job)
    assert job.returncode != 0
    assert "all_reduce #2 on communicator world has waited 3 s (timeout 3 s)" in job.output
    assert "ranks not arrived: [2]" in job.output
    assert "in all_reduce" in job.output   # the waiting rank's stack


def test_a_collective_that_holds_the_gil_ends_the_process_with_its_stacks():
    """The culprit's stacks, then its end is named: by its peer's watchdog where the launcher
    leaves the job to cupycomm (hydra with -disable-auto-cleanup), by Open MPI's launcher,
    which ends the job as soon as a rank exits non-zero, in its own words."""
    job = run("hold-gil", n=2)
    ended_quickly(job)   # the 3 s timeout + the margin, shrunk to 1 s by the scenario
    assert job.returncode != 0
    assert "Timeout (0:00:04)!" in job.output
    assert "in hold_the_gil" in job.output   # the thread that held on
    if LAUNCHER == "openmpi":
        assert re.search(r"exited with non-zero status.*Process name: *\[\S+,1\]",
                         job.output, re.DOTALL), job.output
    else:
        assert "rank 1 of communicator mpi_comm" in job.output and "has died" in job.output


def test_a_long_call_holding_the_gil_outside_collectives_is_left_alone():
    job = run("hold-gil-idle", n=2)
    ended_quickly(job)
    assert job.returncode == 0, job.output
    assert job.output.count("finished with") == 2, job.output


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


def test_a_dead_peer_ends_a_device_wait_with_peer_lost():
    """Device collectives cannot end the job from the watchdog (NCCL kernels are aborted,
    not MPI calls): the wait raises PeerLost, which the abort handler reports."""
    job = run("device-peer-dies")
    ended_quickly(job)
    assert job.returncode != 0
    assert "has died (its process ended: os._exit, a signal or a crash)" in job.output, job.output
    assert "cupycomm.errors.PeerLost: wait: the NCCL communicator was aborted" in job.output
    no_rank_finished(job)


# -- on two simulated nodes: the last node's ranks fail, the first node's wait --------------------
# 3 ranks: the culprit alone on node 1, or with the leader of node 1; time_to_exit.py --nodes
# runs the same faults on 4 ranks.
NODE_BOUND = 15.0   # seconds within which a whole node's failure must end the job
HEARTBEAT = 3.0     # CUPYCOMM_HEARTBEAT_TIMEOUT here (5 s by default: time_to_exit.py)
COLLECTIVE = "waits in all_reduce #"
NODE1_SILENT = "node node1 (ranks [1, 2]) of communicator world has sent no heartbeat"
CUPYCOMM_NAMES = {   # scenario: (ranks per node, what cupycomm's message says of the culprit)
    "os-exit-0": ((2, 1), ["node node1 (ranks [2]) of communicator world has sent no "
                           "heartbeat"]),
    "sys-exit-0": ((2, 1), ["rank 2 of communicator world (node node1) has exited (its "
                            "program ended or called sys.exit) after its collective #1"]),
    "exit-3": ((2, 1), ["rank 2 of communicator world (node node1) has exited"]),
    "sigkill": ((2, 1), ["node node1 (ranks [2]) of communicator world has sent no heartbeat"]),
    "raise-before-collective": ((2, 1), ["uncaught exception on rank 2 of 3 (host node1"]),
    # Its node's leader relays the death; hydra's cleanup may kill that leader first.
    "os-exit-0-beside-a-busy-leader": ((1, 2), ["rank 2 of communicator world (node node1) "
                                                "has died (its process ended", NODE1_SILENT]),
    "node-sigkill": ((1, 2), [NODE1_SILENT]),
    "node-sigstop": ((1, 2), [NODE1_SILENT]),
}
# With hydra's own cleanup, a rank killed by a signal makes mpiexec end the job at once,
# before any heartbeat is missed; hydra names the node and the signal then.
KILLED_BY_A_SIGNAL = ("sigkill", "node-sigkill")
simulates_nodes = pytest.mark.skipif(LAUNCHER not in SIMULATES_NODES,
                                     reason="only MPICH's hydra can simulate nodes")


def run_on_nodes(name, ranks_per_node, cleanup, timeout=60):
    return run_mpiexec(sum(ranks_per_node), SCENARIO, name, timeout=timeout,
                       mpiexec_args=cleanup + simulated_nodes(*ranks_per_node),
                       env={"CUPYCOMM_TIMEOUT": "600",
                            "CUPYCOMM_HEARTBEAT_TIMEOUT": str(HEARTBEAT)})


@simulates_nodes
@pytest.mark.parametrize("cleanup", ["hydra's cleanup", "-disable-auto-cleanup"])
@pytest.mark.parametrize("name", list(CUPYCOMM_NAMES))
def test_a_failure_on_another_node_ends_the_job_in_seconds_naming_it(name, cleanup):
    ranks_per_node, named = CUPYCOMM_NAMES[name]
    job = run_on_nodes(name, ranks_per_node, [] if cleanup == "hydra's cleanup"
                       else no_auto_cleanup())
    ended_quickly(job, NODE_BOUND if name.startswith("node-") else BOUND)
    assert job.returncode != 0, job.output
    no_rank_finished(job)
    if cleanup == "hydra's cleanup" and name in KILLED_BY_A_SIGNAL:
        assert "RUNNING AT node1" in job.output and "EXIT CODE: 9" in job.output, job.output
    else:
        assert any(text in job.output for text in named), job.output
        if name != "raise-before-collective":   # the abort handler's end, not a wait's
            assert COLLECTIVE in job.output, job.output


@simulates_nodes
@pytest.mark.parametrize("name", ["long-compute", "long-sleep"])
def test_a_rank_slower_than_the_heartbeat_bound_is_not_taken_for_dead(name):
    """The last rank, alone on its node, computes in Python or sleeps for longer than the
    heartbeat bound while the others wait: its watchdog thread beats all along."""
    job = run_on_nodes(name, (2, 1), no_auto_cleanup())
    ended_quickly(job)
    assert job.output.count("finished with") == 3, job.output
    # 0, or hydra's own failure after every rank finished (1 run in 6 on simulated nodes:
    # docs/guide/faults-and-timeouts.md; cupycomm.run ends 0 then, tests/run/test_job.py)
    assert job.returncode == 0 or (job.returncode == 255 and HYDRA_OWN_FAILURE in job.output), \
        job.output
