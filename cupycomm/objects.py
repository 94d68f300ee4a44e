"""Collectives on picklable Python objects, through MPI's pickle path (mpi4py's pkl5, which
also carries objects of more than 2 GiB).

Unpickling runs code chosen by whoever made the bytes: use these calls between trusted
ranks of your own job only, never on data from outside it.

They run on their own duplicate of the communicator's MPI communicator (made on first use,
collectively), so their messages never meet the array traffic. Blocking, and watched by
the watchdog like every other blocking call.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from mpi4py.util import pkl5

__all__ = ["broadcast_object", "all_gather_object", "gather_object", "scatter_object"]


def _pickled(comm: Any) -> pkl5.Intracomm:
    if comm._objects is None:
        comm._objects = pkl5.Intracomm(comm.mpi_comm.Dup())
    return comm._objects


def _run(comm: Any, label: str, call, *args: Any) -> Any:
    comm._check_open(label)
    transport = _pickled(comm)
    tracker = comm._tracker
    tracker.seq += 1
    tracker.flight.calls[tracker.seq % tracker.flight.size] = label
    with tracker.inside(label):
        return call(transport, *args)


def broadcast_object(comm: Any, obj: Any, root: int = 0) -> Any:
    comm._check_rank("broadcast_object", "root", root)
    return _run(comm, "broadcast_object", pkl5.Intracomm.bcast, obj, root)


def all_gather_object(comm: Any, obj: Any) -> List[Any]:
    return _run(comm, "all_gather_object", pkl5.Intracomm.allgather, obj)


def gather_object(comm: Any, obj: Any, root: int = 0) -> Optional[List[Any]]:
    comm._check_rank("gather_object", "root", root)
    return _run(comm, "gather_object", pkl5.Intracomm.gather, obj, root)


def scatter_object(comm: Any, objs: Optional[Sequence[Any]], root: int = 0) -> Any:
    comm._check_rank("scatter_object", "root", root)
    if objs is not None or comm.rank == root:   # checked wherever given: alike on every rank
        if not isinstance(objs, (list, tuple)) or len(objs) != comm.size:
            got = f"a {type(objs).__name__} of length {len(objs)}" if isinstance(
                objs, (list, tuple)) else repr(type(objs).__name__)
            raise comm._fail(ValueError, "scatter_object", f"objs must be a list of "
                                                           f"{comm.size} objects (one per "
                                                           f"rank), got {got}")
    return _run(comm, "scatter_object", pkl5.Intracomm.scatter,
                list(objs) if comm.rank == root else None, root)
