"""A plugin (loaded with -p) that fails to import on the last rank only, before the session
starts there (run by tests/testing/test_plugin.py under mpiexec)."""
from mpi4py import MPI

if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
    raise ImportError("deliberate plugin import failure on the last rank")
