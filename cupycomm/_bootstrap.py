"""Process bootstrap: the MPI world, local ranks, device choice, the NCCL unique id, exit order.

The only module that touches ``MPI.COMM_WORLD``. Also installs, when ``init()`` asks for it,
the handler that aborts the whole MPI job when an exception escapes on one rank (as
``python -m mpi4py`` does), so that its peers never wait forever in a collective.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import traceback
import weakref
from typing import Any, Callable, Optional, TextIO

from mpi4py import MPI

__all__ = ["world", "node_comm", "choose_device", "import_cupy", "broadcast_unique_id",
           "install_abort_handler", "abort_enabled", "abort_world", "env_flag",
           "track_for_exit", "describe_rank", "report_to", "report_stream", "exiting"]


def world() -> MPI.Comm:
    """MPI_COMM_WORLD."""
    return MPI.COMM_WORLD


def node_comm(comm: MPI.Comm) -> MPI.Comm:
    """The ranks of ``comm`` that share this node (MPI_COMM_TYPE_SHARED); collective."""
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


def describe_rank(rank: Optional[int] = None) -> str:
    """'rank 3 of 4 (host node17, pid 4242)' for messages."""
    w = MPI.COMM_WORLD
    rank = w.Get_rank() if rank is None else rank
    return f"rank {rank} of {w.Get_size()} (host {socket.gethostname()}, pid {os.getpid()})"


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


# -- abort on an uncaught exception ---------------------------------------------------------------
_ENV_ABORT = "CUPYCOMM_ABORT_ON_EXCEPTION"


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable: 0/false/no/off and 1/true/yes/on, any case."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no or on/off")


def abort_enabled(requested: Optional[bool]) -> bool:
    """The init() argument wins; else the environment variable (on by default)."""
    return requested if requested is not None else env_flag(_ENV_ABORT, True)


_report: Optional[TextIO] = None


def report_to(stream: Optional[TextIO]) -> None:
    """Write abort messages and stacks to ``stream`` (a file with a descriptor of its own),
    not to ``sys.stderr``; None: back to ``sys.stderr``. The pytest plugin passes a duplicate
    of the terminal's descriptor: pytest's capture of fd 2 is lost when the job aborts."""
    global _report
    _report = stream


def report_stream() -> TextIO:
    """Where abort messages go (see :func:`report_to`)."""
    return _report if _report is not None else sys.stderr


def install_abort_handler() -> None:
    """Abort the MPI job when an exception escapes on this rank (only if the world has peers)."""
    if MPI.COMM_WORLD.Get_size() == 1 or getattr(sys.excepthook, "_cupycomm", False):
        return
    previous = sys.excepthook

    def abort_job(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        report_stream().write(f"cupycomm: uncaught exception on {describe_rank()}; "
                              f"aborting the MPI job\n{text}")
        # No close_all() here: closing waits for calls in flight (a dropped receive whose
        # sender will never send would hold the abort until the timeout); MPI_Abort ends
        # every process, which frees what they hold.
        abort_world()
        previous(kind, value, tb)  # only reached if Abort returned

    abort_job._cupycomm = True  # type: ignore[attr-defined]
    sys.excepthook = abort_job


def abort_world(code: int = 1) -> None:
    """MPI_Abort on every rank of the job, after a pause that lets mpiexec forward what this
    rank has just written (an abort kills the job at once: the explanation must arrive)."""
    report_stream().flush()
    time.sleep(0.3)
    MPI.COMM_WORLD.Abort(code)


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
