"""Collectives on picklable Python objects, through MPI's pickle path (mpi4py's pkl5, which
also carries objects of more than 2 GiB).

Unpickling runs code chosen by whoever made the bytes: use these calls between trusted
ranks of your own job only, never on data from outside it.

They run on their own duplicate of the communicator's MPI communicator (made on first use,
collectively), so their messages never meet the array traffic. Blocking, and watched by
the watchdog like every other blocking call.

What a rank sends is pickled before the call is counted or anything is sent
(:class:`_Pickled`): an object that cannot be pickled raises a TypeError naming the argument
on that rank alone, and the communicator stays usable (its peers wait for the call it makes
next, as after any other local error).
"""
from __future__ import annotations

from pickle import PickleBuffer
from typing import Any, Callable, List, Optional, Sequence

from mpi4py import MPI
from mpi4py.util import pkl5

from .checks import Checks
from ..faults.watchdog import Tracker
from ..survivors.lost import attach, peer_lost

__all__ = ["Objects"]

_PICKLE = MPI.Pickle()   # pkl5's own pickler: protocol 5, buffers out of band


def _loads(data: Any, *buffers: Any) -> Any:
    """The object :class:`_Pickled` carried (run where it is unpickled)."""
    return _PICKLE.loads_oob(data, buffers)


class _Pickled:
    """An object pickled here, before its call: pkl5 pickles this again, which costs no copy
    of the object's bytes (they go out of band, as ``PickleBuffer``), and a peer's unpickling
    gives back the object itself.

    Example::

        pkl5.Intracomm.bcast(transport, _Pickled(obj), 0)   # every rank gets obj
    """

    __slots__ = ("_data", "_buffers")

    def __init__(self, obj: Any) -> None:
        data, buffers = _PICKLE.dumps_oob(obj)
        self._data: Any = data
        self._buffers: List[Any] = list(buffers)

    def __reduce__(self) -> Any:
        return _loads, (PickleBuffer(self._data), *[PickleBuffer(b) for b in self._buffers])


class Objects:
    """The object collectives of one communicator, as a part of it: its checks, its watchdog
    tracker and a duplicate of its MPI communicator (made on first use, collectively).

    Example (on 2 ranks, inside Communicator)::

        objects = Objects(comm.mpi_comm, tracker, checks)
        objects.all_gather(f"host{comm.rank}")   # both: ['host0', 'host1']
    """

    def __init__(self, mpi_comm: MPI.Comm, tracker: Tracker, checks: Checks) -> None:
        self._mpi = mpi_comm
        self._tracker = tracker
        self._checks = checks
        self._transport: Optional[pkl5.Intracomm] = None

    def _run(self, label: str, call: Callable, *args: Any) -> Any:
        tracker = self._tracker
        if self._transport is None:
            self._transport = pkl5.Intracomm(self._mpi.Dup())
            attach(tracker, self._transport)   # a lost peer revokes it with the communicator
        tracker.seq += 1
        tracker.flight.calls[tracker.seq % tracker.flight.size] = label
        with tracker.inside(label):
            try:
                return call(self._transport, *args)
            except MPI.Exception as error:   # a lost peer: PeerLost where the process survives
                peer_lost(error, tracker, label, tracker.seq)
                raise

    def _pickled(self, label: str, arg: str, obj: Any) -> _Pickled:
        """``obj`` pickled, or a TypeError naming ``arg`` (before any communication)."""
        try:
            return _Pickled(obj)
        except Exception as error:   # whatever a __reduce__ raised: the object's own fault
            raise self._checks.fail(TypeError, label, f"{arg} cannot be pickled "
                                                      f"({type(error).__name__}: {error})"
                                    ) from error

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        label = "broadcast_object"
        self._checks.check_open(label)
        self._checks.check_rank(label, "root", root)
        sent = self._pickled(label, "obj", obj) if self._checks.rank == root else None
        return self._run(label, pkl5.Intracomm.bcast, sent, root)

    def all_gather(self, obj: Any) -> List[Any]:
        label = "all_gather_object"
        self._checks.check_open(label)
        return self._run(label, pkl5.Intracomm.allgather, self._pickled(label, "obj", obj))

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        label = "gather_object"
        self._checks.check_open(label)
        self._checks.check_rank(label, "root", root)
        return self._run(label, pkl5.Intracomm.gather, self._pickled(label, "obj", obj), root)

    def scatter(self, objs: Optional[Sequence[Any]], root: int = 0) -> Any:
        checks = self._checks
        checks.check_open("scatter_object")
        checks.check_rank("scatter_object", "root", root)
        if objs is not None or checks.rank == root:   # checked wherever given: every rank alike
            if not isinstance(objs, (list, tuple)) or len(objs) != checks.size:
                got = f"a {type(objs).__name__} of length {len(objs)}" if isinstance(
                    objs, (list, tuple)) else repr(type(objs).__name__)
                raise checks.fail(ValueError, "scatter_object", f"objs must be a list of "
                                                                f"{checks.size} objects (one "
                                                                f"per rank), got {got}")
        sent = ([self._pickled("scatter_object", f"objs[{j}]", obj)
                 for j, obj in enumerate(objs)]
                if checks.rank == root and objs is not None else None)
        return self._run("scatter_object", pkl5.Intracomm.scatter, sent, root)

    def close(self) -> None:
        """Free the duplicate, if made (MPI still initialized)."""
        if self._transport is not None:
            if self._checks.shrunk and not self._transport.Is_revoked():
                self._transport.Revoke()   # see cupycomm.survivors.state.Survival.revoke
            self._transport.Free()
