"""The heartbeats between nodes (cupycomm/faults/heartbeat.py): on every node of a job, the
node leaders beat to each other and no one else (test_nodes.py runs these on two simulated
nodes too); and, as jobs of their own on two simulated nodes (tests/faults/fault_jobs.py),
a whole node's failure ends the job in seconds naming it, while a rank slower than the
heartbeat bound is not taken for dead.

The jobs start mpiexec themselves, so they run in the single-process pass of the suite and
skip under mpiexec; they need MPICH's hydra to simulate nodes.
"""
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

import cupycomm
from cupycomm.faults.board import FIELDS, PID, RANK
from cupycomm.faults.heartbeat import Heartbeats
from cupycomm.testing import SIMULATES_NODES, no_auto_cleanup, run_mpiexec, simulated_nodes
from fault_jobs import (BOUND, HYDRA_OWN_FAILURE, HYDRA_PROXY_ASSERTION, LAUNCHER, SCENARIO, ended_quickly,
                        no_rank_finished, nodes_of)


def test_heartbeats_join_the_nodes_and_only_them():
    comm = cupycomm.init()
    nodes = nodes_of(comm)
    beats = comm.parts.tracker.beats
    if len(set(nodes)) == 1:
        assert beats is None
        return
    assert beats.nodes == list(dict.fromkeys(nodes))   # in the order of their first rank
    assert [beats.nodes[beats.node_of[rank]] for rank in range(comm.size)] == nodes
    assert beats.departure() is None   # every rank is here and well


def test_a_subgroup_within_one_node_has_no_heartbeats():
    comm = cupycomm.init()
    nodes = nodes_of(comm)
    sub = comm.split(nodes.index(nodes[comm.rank]))   # one subgroup per node
    try:
        assert sub.size == nodes.count(nodes[comm.rank])
        assert sub.parts.tracker.beats is None
    finally:
        sub.close()


# -- a node leader lost under ULFM, in "raise" mode (a unit: hydra, which simulates nodes, has
# no ULFM) ------------------------------------------------------------------------------------
class _Board:
    """A node board's rows (this node: ranks 0 and 1) and the departure its leader relays."""

    def __init__(self):
        self.rows = np.zeros((2, FIELDS), np.int64)
        self.rows[:, RANK] = 0, 1
        self.rows[:, PID] = os.getpid()
        self.gone = (0, 0, 0, 0)

    def relay(self, gone, state, seq, since_ns):
        self.gone = (gone, state, seq, since_ns)

    def relayed(self):
        return self.gone


class _Request:
    def __init__(self, dead):
        self.dead = dead

    def Test(self):
        if self.dead:
            raise MPI.Exception(MPI.ERR_PROC_FAILED)
        return False


class _Leaders:
    """The leaders' communicator as ULFM leaves it once leader 1 (node b's) died: receives
    from it fail; it is in the failed group."""

    def Set_errhandler(self, handler):
        pass

    def Get_rank(self):
        return 0

    def Irecv(self, buffer, source, tag):
        return _Request(source == 1)

    def Isend(self, buffer, dest, tag):
        return _Request(False)


@pytest.mark.mpi(max_size=1)
@pytest.mark.parametrize("raising", [True, False], ids=["raise", "abort"])
def test_a_dead_leader_is_relayed_as_a_dead_rank_in_raise_mode(monkeypatch, raising):
    """Node b (ranks 2, 3; leader 2) loses its leader: in "raise" mode its receive fails
    with ERR_PROC_FAILED, and every rank of node a reads rank 2's death (the watchdog then
    aborts their device work for PeerLost naming it); the heartbeats go on for node c. In
    "abort" mode such an error stops the heartbeats, as any MPI error does."""
    monkeypatch.setattr("cupycomm.survivors.policy._raising", raising)
    monkeypatch.setattr("cupycomm.faults.heartbeat.failed_in", lambda comm: [1])
    board = _Board()
    beats = Heartbeats(_Leaders(), board, "world", ["a", "b", "c"], [[0, 1], [2, 3], [4]],
                       [0, 0, 1, 1, 2], bound=5.0)
    now = time.monotonic()
    beats.poll(now)
    if not raising:
        assert beats._broken and beats.departure() is None
        return
    assert not beats._broken and sorted(beats._receiving) == [2]   # node c's leader still
    gone = beats.departure()
    assert gone is not None and gone.ranks == (2,) and gone.left == 0, gone
    assert gone.who == "rank 2 of communicator world (node b)" and "has died" in gone.how
    beats.poll(now + 10.0)   # past the bound: node c, never heard, is silent; node b is done with
    assert beats._silent == [False, False, True]


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
@pytest.mark.mpi(max_size=1)
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
    elif cleanup == "hydra's cleanup" and HYDRA_PROXY_ASSERTION in job.output:
        assert "BAD TERMINATION" in job.output and "RUNNING AT node" in job.output, job.output
    else:
        assert any(text in job.output for text in named), job.output
        if name != "raise-before-collective":   # the abort handler's end, not a wait's
            assert COLLECTIVE in job.output, job.output


@simulates_nodes
@pytest.mark.mpi(max_size=1)
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
