"""Outcomes that differ between ranks (run by tests/testing/test_plugin.py under mpiexec)."""
import pytest
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()
LAST = MPI.COMM_WORLD.Get_size() - 1


def test_passes(mpi_comm):
    assert mpi_comm.allreduce(1) == mpi_comm.Get_size()


def test_fails_on_the_last_rank():
    print(f"captured output of rank {RANK}")
    assert RANK != LAST, f"deliberate failure on rank {RANK}"


@pytest.mark.skipif(RANK == LAST, reason="deliberately skipped on the last rank only")
def test_skip_in_setup_on_one_rank(mpi_comm):
    mpi_comm.Barrier()  # would hang if the last rank's skip were not every rank's


def test_skip_in_call_on_one_rank():
    if RANK == LAST:
        pytest.skip("deliberately skipped in the call on the last rank only")


@pytest.mark.mpi(min_size=2)
def test_leaves_a_message_behind(mpi_comm):
    # Rank 0 sends; the last rank fails before it receives.
    if RANK == 0:
        mpi_comm.send("stale", dest=LAST, tag=5)
    assert RANK != LAST, "deliberate failure before receiving"


@pytest.mark.mpi(min_size=2)
def test_next_test_gets_its_own_messages(mpi_comm):
    if RANK == 0:
        mpi_comm.send("fresh", dest=LAST, tag=5)
    if RANK == LAST:
        assert mpi_comm.recv(source=0, tag=5) == "fresh"


@pytest.mark.xfail(reason="fails on the last rank only")
def test_expected_to_fail_on_one_rank():
    assert RANK != LAST
