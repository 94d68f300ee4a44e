"""Four tests for 2 ranks, the third of which hangs (run by tests/testing/test_isolated.py in one
process: isolated mode runs them in an mpiexec job; the third ends at its timeout)."""
import pytest

pytestmark = pytest.mark.mpi(n=2)


def test_first(mpi_comm):
    mpi_comm.Barrier()


def test_second(mpi_comm):
    mpi_comm.Barrier()


@pytest.mark.mpi_timeout(3)
def test_third_hangs_on_rank_0(mpi_comm):
    if mpi_comm.Get_rank() == 0:
        mpi_comm.Barrier()   # the others never enter it


def test_fourth(mpi_comm):
    assert mpi_comm.allreduce(1) == 2
