"""Four tests for 3 ranks, the third of which crashes rank 1 (run by tests/testing/test_isolated.py in
one process: isolated mode runs them in an mpiexec job)."""
import os

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi(n=3)


def test_first(mpi_comm):
    assert mpi_comm.allreduce(1) == 3


def test_second_fails_on_rank_2():
    print(f"captured output of rank {MPI.COMM_WORLD.Get_rank()}")
    assert MPI.COMM_WORLD.Get_rank() != 2, "deliberate failure on rank 2"


def test_third_exits_on_rank_1(mpi_comm):
    if mpi_comm.Get_rank() == 1:
        os._exit(0)
    mpi_comm.Barrier()


def test_fourth(mpi_comm):
    assert mpi_comm.allreduce(mpi_comm.Get_rank()) == 3
