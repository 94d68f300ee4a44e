"""Tests that leave the other ranks waiting in a collective: a failure, an exit, a
communicator closed by its peer (run by tests/testing/test_plugin.py under mpiexec, one at a time
with -k, after test_fails_on_rank_0)."""
import os

import numpy as np
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()
LAST = MPI.COMM_WORLD.Get_size() - 1


def test_fails_on_rank_0():
    assert RANK != 0, "an earlier failure on rank 0"


def test_last_rank_fails_while_the_others_wait(mpi_comm):
    assert RANK != LAST, f"deliberate failure on rank {RANK} before the barrier"
    mpi_comm.Barrier()


def test_last_rank_exits_while_the_others_wait(mpi_comm):
    if RANK == LAST:
        os._exit(0)
    mpi_comm.Barrier()


def test_rank_0_reduces_alone(cupycomm_comm):
    if RANK == 0:
        cupycomm_comm.all_reduce(np.ones(2))


def test_not_reached():
    pass
