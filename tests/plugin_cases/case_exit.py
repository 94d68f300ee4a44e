"""One rank stops the session (run by tests/testing/test_plugin.py under mpiexec)."""
import pytest
from mpi4py import MPI


def test_last_rank_stops():
    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
        pytest.exit("deliberate stop on the last rank")


def test_not_run():
    pass
