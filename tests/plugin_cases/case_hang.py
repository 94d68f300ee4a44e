"""A test that hangs: rank 0 waits in a collective the others never enter (run by
tests/testing/test_plugin.py under mpiexec, with a small timeout)."""
from mpi4py import MPI


def test_passes_first(mpi_comm):
    mpi_comm.Barrier()


def test_rank_0_waits_alone(mpi_comm):
    if MPI.COMM_WORLD.Get_rank() == 0:
        mpi_comm.Barrier()


def test_never_reached():
    pass
