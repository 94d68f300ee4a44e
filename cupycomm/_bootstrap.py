"""Process bootstrap: the MPI world, local ranks, device choice, the NCCL unique id, exit order.

The only module that touches ``MPI.COMM_WORLD`` (others ask :func:`world`).
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import weakref
from typing import Any, Callable, Optional

from mpi4py import MPI

__all__ = ["world", "node_comm", "node_name", "choose_device", "import_cupy", "broadcast_unique_id",
           "track_for_exit", "describe_rank", "exiting"]


def world() -> MPI.Comm:
    """MPI_COMM_WORLD."""
    return MPI.COMM_WORLD


def node_comm(comm: MPI.Comm) -> MPI.Comm:
    """The ranks of ``comm`` that share this node (MPI_COMM_TYPE_SHARED); collective."""
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


def node_name() -> str:
    """This node's name: the launcher's (MPICH's hydra says PMI_HOSTNAME, the name it was
    given, which may be a simulated node's), else the host's."""
    return os.environ.get("PMI_HOSTNAME") or socket.gethostname()


def describe_rank(rank: Optional[int] = None) -> str:
    """'rank 3 of 4 (host node17, pid 4242)' for messages."""
    w = MPI.COMM_WORLD
    rank = w.Get_rank() if rank is None else rank
    return f"rank {rank} of {w.Get_size()} (host {node_name()}, pid {os.getpid()})"


def import_cupy() -> Optional[Any]:
    """CuPy, or None when it is not installed or cannot load."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    return cupy


def choose_device(local_rank: int, cupy: Any) -> Optional[int]:
    """The device for this rank: ranks of one node spread round-robin over its GPUs.

    None when CuPy sees no usable GPU (no driver, no device, or CUDA_VISIBLE_DEVICES empty).
    """
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # cudaErrorNoDevice, cudaErrorInsufficientDriver...
        return None
    return local_rank % count if count > 0 else None


def broadcast_unique_id(comm: MPI.Comm, make: Callable[[], Any]) -> Any:
    """Rank 0 makes the NCCL unique id; MPI carries it to the others (no socket of ours)."""
    return comm.bcast(make() if comm.Get_rank() == 0 else None, root=0)


# -- exit order: NCCL communicators before MPI_Finalize -------------------------------------------
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_exiting = False


def track_for_exit(communicator: Any) -> None:
    """Close ``communicator`` at interpreter exit, before mpi4py finalizes MPI."""
    _LIVE.add(communicator)


def exiting() -> bool:
    """Whether this process has started to exit (its communicators are being closed for it)."""
    return _exiting


def close_all() -> None:
    global _exiting
    _exiting = True
    for communicator in list(_LIVE):
        try:
            communicator.close()
        except Exception as error:  # exit must go on; say what failed
            sys.stderr.write(f"cupycomm: closing a communicator at exit failed: {error!r}\n")


# mpi4py finalizes MPI after the atexit handlers, so this runs first.
atexit.register(close_all)
