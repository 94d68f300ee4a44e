"""One communicator's life among peers that may be lost: who is gone, agreeing, the
successor.

A :class:`Survival` belongs to each communicator made in ``on_peer_loss="raise"`` mode. The
first MPI error that says a peer is gone (:mod:`.lost`) makes this rank revoke the MPI
communicator, so that every survivor's pending and later calls on it fail too, and shrink
it at once: ULFM's ``MPI_Comm_shrink`` is a fault-tolerant agreement, so every survivor
learns the same set of lost ranks (PeerLost's ``ranks``) and the successor's MPI
communicator is ready for :meth:`Survival.successor`.

Example (4 ranks, world rank 1 killed)::

    survival = survival_for(mpi_comm, tracker, router)
    error = survival.lose("all_reduce", 7)   # on every survivor
    error.ranks, survival.failed_ranks()     # (1,), [1]
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

from mpi4py import MPI

from ..errors import PeerLost
from . import policy
from .lost import FAILURES, enlist, failed_in
from .numbering import keep, note_lost, world_ranks

__all__ = ["Survival", "survival_for", "survival_of"]


def survival_for(mpi_comm: MPI.Comm, tracker: Any, router: Any) -> Optional["Survival"]:
    """The state of a new communicator over ``mpi_comm`` (watched by ``tracker``, its
    backends in ``router``) where this process survives losses, its MPI errors translated
    from now on; None in "abort" mode."""
    if not policy.raising():
        return None
    survival = Survival(mpi_comm, router, tracker.world_ranks)
    enlist(tracker, survival)
    return survival


def survival_of(comm: Any, call: str) -> "Survival":
    """The state of ``comm`` for ``call`` (shrink, grow), which needs the "raise" mode:
    CommClosedError where ``comm`` is closed, RuntimeError where a loss ends the job."""
    comm.parts.checks.check_open(call)
    survival = comm.parts.survival
    if survival is None:
        raise RuntimeError(f"{call}: this communicator ends the job when a peer is lost; "
                           f"{call}() needs cupycomm.init(on_peer_loss='raise') (rank "
                           f"{comm.rank})")
    return survival


class Survival:
    """What a communicator of the "raise" mode knows of its lost peers; see the module."""

    def __init__(self, mpi_comm: MPI.Comm, router: Any, ranks: Tuple[int, ...]) -> None:
        self._mpi = mpi_comm
        self._router = router
        self.world_ranks = ranks   # of each rank of mpi_comm (its tracker's)
        self.lost: Optional[Tuple[int, ...]] = None   # world ranks, once a loss was seen
        self._successor: Optional[MPI.Comm] = None    # the survivors, shrunk at that loss
        self._children: "weakref.WeakSet[Any]" = weakref.WeakSet()   # split from this one
        self._attached: List[MPI.Comm] = []   # revoked with it (see attach)

    def adopt(self, child: Any) -> None:
        """``child``, a communicator split from this one, is retired with it by shrink()."""
        self._children.add(child)
        keep(child)

    def children(self) -> List[Any]:
        """The open communicators split from this one."""
        return [child for child in self._children if not child.closed]

    def attach(self, mpi_comm: MPI.Comm) -> None:
        """Revoke ``mpi_comm`` too on a loss (the object collectives' duplicate)."""
        self._attached.append(mpi_comm)

    def lose(self, call: str, seq: int) -> PeerLost:
        """The PeerLost of ``call`` #``seq``, after (the first time) revoking the
        communicator (and those attached) and shrinking it to the survivors: collective over
        them."""
        lost = self.lost
        if lost is None:
            for comm in (self._mpi, *self._attached):
                if not comm.Is_revoked():
                    comm.Revoke()
            self._successor = self._mpi.Shrink()
            lost = self._note_lost(self._successor)
        return PeerLost(f"{call} #{seq}: lost world rank(s) {list(lost)} of "
                        f"{len(self.world_ranks)}; the survivors may comm.shrink() and go on",
                        ranks=lost, call=call, seq=seq)

    def failed_ranks(self) -> List[int]:
        """The world ranks known here to be lost: those every survivor agreed on at the
        first loss, and any this rank's MPI has noticed since."""
        noticed = failed_in(self._mpi)
        return sorted(set(self.lost or ()) | {self.world_ranks[r] for r in noticed})

    def agree(self, flag: bool) -> bool:
        """ULFM's agreement: the AND of ``flag`` over the survivors, the same on each, also
        after a loss (this rank's known failures are acknowledged first, so that a failure
        does not make it fail; one noticed meanwhile is acknowledged and the agreement
        run again)."""
        for _ in range(len(self.world_ranks)):   # each retry follows one more failure
            self._mpi.Ack_failed()
            try:
                return bool(self._mpi.Agree(int(bool(flag))))
            except MPI.Exception as error:
                if error.Get_error_class() not in FAILURES:
                    raise
        raise RuntimeError(f"agree: failures went on until no rank could be left (world "
                           f"ranks {list(self.world_ranks)})")

    def successor(self) -> MPI.Comm:
        """The survivors' MPI communicator (this one's then no longer usable): the one
        shrunk at the loss, else revoke and shrink now. Collective over the survivors."""
        successor, self._successor = self._successor, None
        if successor is None:
            if not self._mpi.Is_revoked():
                self._mpi.Revoke()
            successor = self._mpi.Shrink()
            if self.lost is None:
                self._note_lost(successor)
        return successor

    def _note_lost(self, successor: MPI.Comm) -> Tuple[int, ...]:
        """The lost ranks: those not in ``successor``. The NCCL communicator, if any, is
        aborted now on every survivor, never destroyed (its collectives would wait for the
        lost ranks; cupycomm/testing/standin.py rule 21)."""
        kept = set(world_ranks(successor))
        self.lost = tuple(r for r in self.world_ranks if r not in kept)
        note_lost(self.lost)
        device = self._router.device
        if device is not None:
            device.abort(f"world rank(s) {list(self.lost)} lost", self.lost)
        return self.lost

    def revoke(self) -> None:
        """Revoke the MPI communicator (shrink() retires it): Open MPI's MPI_Finalize waits
        for ever on a communicator of a lost rank that was freed unrevoked."""
        if not self._mpi.Is_revoked():
            self._mpi.Revoke()

    def discard(self) -> None:
        """Free a successor that was made and never taken (the communicator closes)."""
        if self._successor is not None:
            self._successor.Free()
            self._successor = None
