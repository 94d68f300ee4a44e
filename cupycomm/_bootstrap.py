"""Process bootstrap: the MPI world, local ranks, device choice, the NCCL unique id, exit order.

The only module that touches ``MPI.COMM_WORLD`` (others ask :func:`world`).
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple

from .errors import LocalRankWarning
from .run import launchers

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["world", "node_comm", "node_name", "check_launch", "choose_device",
           "device_count", "import_cupy", "broadcast_unique_id", "track_for_exit",
           "at_safe_point",
           "describe_rank", "exiting"]


def world() -> MPI.Comm:
    """MPI_COMM_WORLD."""
    # Imported here: importing mpi4py.MPI starts MPI, and the tools that need none (cupycomm.run,
    # cupycomm.tools.flight) import this module for node_name() and the records of a rank's end.
    from mpi4py import MPI
    return MPI.COMM_WORLD


def node_comm(comm: MPI.Comm) -> MPI.Comm:
    """The ranks of ``comm`` that share this node (MPI_COMM_TYPE_SHARED); collective."""
    from mpi4py import MPI
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


def node_name() -> str:
    """This node's name: the launcher's (hydra's may be a simulated node's), else the host's."""
    return next((os.environ[name] for name in launchers.job_variables("node")
                 if os.environ.get(name)), socket.gethostname())


def launcher_number(says: str) -> Optional[int]:
    """The number the launcher gave this process in one of its variables that say ``says``
    (``"rank"``, ``"size"``), before MPI is started; None without one."""
    return next((int(os.environ[name]) for name in launchers.job_variables(says)
                 if os.environ.get(name, "").strip().isdigit()), None)


_local_rank_checked = False


def _said(environ: Mapping[str, str], names: Tuple[str, ...]) -> Dict[str, int]:
    return {name: int(environ[name]) for name in names
            if environ.get(name, "").strip().isdigit()}


def check_launch(comm: MPI.Comm, environ: Mapping[str, str] = os.environ) -> None:
    """Check that the world MPI formed is the job the launcher started; ``init()`` calls it.

    Raises RuntimeError (on every process alike, before any communication) when the world's
    size agrees with none of the sizes the launcher gave (``SLURM_STEP_NUM_TASKS``,
    ``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``): N singletons of size 1 where srun started N
    tasks without ``--mpi=pmi2``, or an ``mpiexec`` of another MPI than the one mpi4py loads.
    When ``comm`` is the world (a collective on it, then: every rank calls ``init()``), also
    warns (:class:`LocalRankWarning`, once per process) when the launcher's local ranks
    (``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``) of the ranks in
    this rank's shared-memory split are not 0 .. size - 1 for any of them: the default
    device choice follows the split, so two ranks of one node would pick the same GPU.
    A warning, not an error:
    a program on NumPy arrays runs correctly all the same, and ``init(device=...)`` sets the
    device by the launcher's number.

    Example::

        check_launch(world(), {"SLURM_STEP_NUM_TASKS": "3"})   # in a world of 1: raises
    """
    global _local_rank_checked
    size = world().Get_size()
    said_by = launchers.job_variables("size")
    sizes = _said(environ, tuple(said_by))
    # the world must agree with one of them (a launcher inside another's rank), not with all
    if sizes and size not in sizes.values():
        said = ", ".join(f"{name}={n} ({said_by[name]})" for name, n in sizes.items())
        from mpi4py import MPI
        library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        raise RuntimeError(
            f"init: MPI formed a world of {size} rank{'s' * (size != 1)}, but the launcher "
            f"started {max(sizes.values())} ({said}): "
            + ("each process is a world of its own (a singleton). " if size == 1 else "")
            + f"The launcher must speak the process-management interface of the MPI that "
            f"mpi4py loads ({library}): under srun, --mpi=pmi2 for MPICH and Intel MPI or "
            f"--mpi=pmix for Open MPI (srun --mpi=list says which this Slurm has); else that "
            f"MPI's own mpiexec (python -m cupycomm.run.launchers names the one found here). A "
            f"program started from inside a rank inherits these variables: start it with "
            f"cupycomm.run.launchers.nested_environment(os.environ).")
    if _local_rank_checked or comm != world():
        return
    _local_rank_checked = True
    node = node_comm(comm)
    local_names = tuple(launchers.job_variables("local rank"))
    mine = tuple(_said(environ, (name,)).get(name, -1) for name in local_names)
    seen = node.allgather(mine)
    on_node = node.Get_size()
    node.Free()
    # Compared as sets: a launcher may number a node's ranks in another order than MPI's
    # split (Open MPI's mpiexec does), which is harmless; what is not is MPI seeing fewer or
    # other ranks on this node than the launcher put there.
    numbered = {name: sorted(ids[i] for ids in seen)
                for i, name in enumerate(local_names) if mine[i] >= 0}
    if numbered and all(ids != list(range(on_node)) for ids in numbered.values()):
        said = ", ".join(f"{name} {ids}" for name, ids in numbered.items())
        warnings.warn(
            f"cupycomm: on {describe_rank()}, MPI's shared-memory split of node "
            f"{node_name()} holds {on_node} rank{'s' * (on_node != 1)}, but the launcher's "
            f"local ranks of those are {said}: MPI does not see the ranks that share this "
            f"node (Open MPI under srun's pmix, for one), and the default device choice "
            f"follows MPI, so ranks of this node may pick the same GPU; pass "
            f"init(device=...) from the launcher's local rank",
            LocalRankWarning, stacklevel=3)


_joined: Optional[Tuple[int, int]] = None   # (world rank, job size) of a process grow() started


def joined_as(rank: int, size: int) -> None:
    """This process, started by ``comm.grow()`` in a world of its own, took world rank
    ``rank`` of a job of ``size``: messages name those."""
    global _joined
    _joined = (rank, size)


def describe_rank(rank: Optional[int] = None) -> str:
    """'rank 3 of 4 (host node17, pid 4242)' for messages; in a process that ``comm.grow()``
    started, 'rank 1 of 4, started by grow() (host ...)'."""
    where = f"host {node_name()}, pid {os.getpid()}"
    if rank is None and _joined is not None:
        return f"rank {_joined[0]} of {_joined[1]}, started by grow() ({where})"
    w = world()
    rank = w.Get_rank() if rank is None else rank
    return f"rank {rank} of {w.Get_size()} ({where})"


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
    count = device_count(cupy)
    return local_rank % count if count > 0 else None


def device_count(cupy: Any) -> int:
    """How many GPUs ``cupy`` sees: 0 where it sees no usable one."""
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # cudaErrorNoDevice, cudaErrorInsufficientDriver...
        return 0


def broadcast_unique_id(comm: MPI.Comm, make: Callable[[], Any]) -> Any:
    """Rank 0 makes the NCCL unique id; MPI carries it to the others (no socket of ours)."""
    return comm.bcast(make() if comm.Get_rank() == 0 else None, root=0)


# -- exit order: NCCL communicators before MPI_Finalize -------------------------------------------
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_SAFE_POINT: list = []   # what close_all runs after closing the live communicators
_exiting = False


def track_for_exit(communicator: Any) -> None:
    """Close ``communicator`` at interpreter exit, before mpi4py finalizes MPI."""
    _LIVE.add(communicator)


def at_safe_point(release: Callable[[], None]) -> None:
    """Have :func:`close_all` (at interpreter exit, on the main thread, before MPI is
    finalized) call ``release()`` after closing the live communicators: what must not be
    freed in whichever thread the garbage collector runs (a dropped communicator's NCCL
    communicator, see :meth:`cupycomm.backends.nccl.NcclBackend.drop`)."""
    _SAFE_POINT.append(release)


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
    for release in _SAFE_POINT:
        try:
            release()
        except Exception as error:  # as above
            sys.stderr.write(f"cupycomm: releasing at exit failed: {error!r}\n")


def _forked() -> None:
    """In a child that ``os.fork()`` made of a rank: the child is not the rank, and closes
    none of its communicators at exit (that would tell the rank's peers it left, and wait
    for the watchdog's lock, which no thread of the child will ever release)."""
    _LIVE.clear()


# mpi4py finalizes MPI after the atexit handlers, so this runs first.
atexit.register(close_all)
os.register_at_fork(after_in_child=_forked)
