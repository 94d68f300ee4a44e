"""A module that fails to import on one rank only (run by tests/testing/test_plugin.py under mpiexec)."""
from mpi4py import MPI

if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
    raise ImportError("deliberate import failure on the last rank")


def test_nothing():
    pass
