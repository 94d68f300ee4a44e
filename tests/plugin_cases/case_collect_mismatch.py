"""Ranks that collect different tests (run by tests/testing/test_plugin.py under mpiexec)."""
from mpi4py import MPI


def test_everywhere():
    pass


if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
    def test_only_on_the_last_rank():
        pass
