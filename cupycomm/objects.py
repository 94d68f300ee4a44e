"""Collectives on picklable Python objects, through MPI's pickle path (mpi4py's pkl5, which
also carries objects of more than 2 GiB).

Unpickling runs code chosen by whoever made the bytes: use these calls between trusted
ranks of your own job only, never on data from outside it.

They run on their own duplicate of the communicator's MPI communicator (made on first use,
collectively), so their messages never meet the array traffic. Blocking, and watched by
the watchdog like every other blocking call.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from mpi4py import MPI
from mpi4py.util import pkl5

from ._validate import Checks
from .faults.watchdog import Tracker
from .survivors.lost import peer_lost

__all__ = ["Objects"]


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
        self._checks.check_open(label)
        if self._transport is None:
            self._transport = pkl5.Intracomm(self._mpi.Dup())
        tracker = self._tracker
        tracker.seq += 1
        tracker.flight.calls[tracker.seq % tracker.flight.size] = label
        with tracker.inside(label):
            try:
                return call(self._transport, *args)
            except MPI.Exception as error:   # a lost peer: PeerLost where the process survives
                peer_lost(error, tracker, label, tracker.seq, also=self._transport)
                raise

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        self._checks.check_rank("broadcast_object", "root", root)
        return self._run("broadcast_object", pkl5.Intracomm.bcast, obj, root)

    def all_gather(self, obj: Any) -> List[Any]:
        return self._run("all_gather_object", pkl5.Intracomm.allgather, obj)

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        self._checks.check_rank("gather_object", "root", root)
        return self._run("gather_object", pkl5.Intracomm.gather, obj, root)

    def scatter(self, objs: Optional[Sequence[Any]], root: int = 0) -> Any:
        checks = self._checks
        checks.check_rank("scatter_object", "root", root)
        if objs is not None or checks.rank == root:   # checked wherever given: every rank alike
            if not isinstance(objs, (list, tuple)) or len(objs) != checks.size:
                got = f"a {type(objs).__name__} of length {len(objs)}" if isinstance(
                    objs, (list, tuple)) else repr(type(objs).__name__)
                raise checks.fail(ValueError, "scatter_object", f"objs must be a list of "
                                                                f"{checks.size} objects (one "
                                                                f"per rank), got {got}")
        return self._run("scatter_object", pkl5.Intracomm.scatter,
                         list(objs) if objs is not None and checks.rank == root else None,
                         root)

    def close(self) -> None:
        """Free the duplicate, if made (MPI still initialized)."""
        if self._transport is not None:
            if self._checks.shrunk and not self._transport.Is_revoked():
                self._transport.Revoke()   # see cupycomm.survivors.state.Survival.revoke
            self._transport.Free()
