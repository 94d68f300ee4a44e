"""A fixture that skips on one rank, requested before the plugin's communicators (run by
tests/testing/test_plugin.py under mpiexec)."""
import pytest
from mpi4py import MPI


@pytest.fixture
def skips_on_the_last_rank():
    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
        pytest.skip("deliberately skipped by a fixture on the last rank only")


def test_skipped_alike(skips_on_the_last_rank, mpi_comm, cupycomm_comm):
    mpi_comm.Barrier()


def test_next_one_runs(mpi_comm, cupycomm_comm):
    mpi_comm.Barrier()
    cupycomm_comm.barrier()
