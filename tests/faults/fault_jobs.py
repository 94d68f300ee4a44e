"""What the fault tests share: running a scenario of tests/faults/scenario.py as a job of
its own, with a hard bound, and judging how it ended (test_abort.py, test_timeouts.py,
test_mismatches.py, test_heartbeat.py); each rank's node (test_nodes.py, test_board.py,
test_heartbeat.py).

Each scenario runs under its own mpiexec, with a hard bound. The tests that start such jobs
run in the single-process pass of the suite (mpiexec does not nest inside an mpiexec run)
and skip under mpiexec on every rank. The jobs run as docs/guide/faults-and-timeouts.md
recommends, with hydra's (MPICH's, Intel MPI's) ``-disable-auto-cleanup``: the watchdog,
not the launcher, must end them.

Example::

    job = run("raise-before-collective")
    ended_quickly(job)
    no_rank_finished(job)
"""
from pathlib import Path

from mpi4py import MPI

from cupycomm import _bootstrap
from cupycomm.run import launchers
from cupycomm.testing import no_auto_cleanup, run_mpiexec

SCENARIO = str(Path(__file__).resolve().parent / "scenario.py")
BOUND = 10.0   # seconds within which every fault must end the job
LAUNCHER = launchers.find().kind
LIBRARY = launchers.library_kind(MPI.Get_library_version())


def run(name, n=3, timeout=60):
    return run_mpiexec(n, SCENARIO, name, timeout=timeout, mpiexec_args=no_auto_cleanup())


def ended_quickly(job, bound=BOUND):
    assert not job.timed_out, f"the job hung:\n{job.output}"
    assert job.elapsed < bound, f"took {job.elapsed:.1f} s:\n{job.output}"


def no_rank_finished(job):
    assert "finished with" not in job.output, f"a rank went on as if nothing happened:\n" \
                                              f"{job.output}"


def nodes_of(comm):
    """Each rank's node name, as every rank sees it."""
    return comm.all_gather_object(_bootstrap.node_name())


# hydra's own failure after every rank finished (docs/guide/faults-and-timeouts.md)
HYDRA_OWN_FAILURE = "unable to send SIGUSR1 downstream"
# hydra's proxy failing its own assertion at a rank's exit, then killing the job before any
# rank can name what happened (seen once in a whole CI run; the same guide)
HYDRA_PROXY_ASSERTION = "pmip_control_cmd_cb"
