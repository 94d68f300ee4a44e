"""One communicator's life among peers that may be lost: who is gone, agreeing, the successor.

A :class:`Survival` belongs to each communicator of the "raise" mode. The first MPI error
that says a peer is gone revokes the MPI communicator and aborts the NCCL one, nothing
collective; what is agreed, the same on every survivor, is the successor
(:meth:`Survival.successor`: its members, and that every survivor stands at the same call).
Why: docs/internals.md, "survivors/state.py".

Example (4 ranks, world rank 1 killed)::

    survival = survival_for(mpi_comm, tracker, router)
    error = survival.lose("all_reduce", 7)   # on every survivor whose call fails
    error.ranks, survival.failed_ranks()     # (1,), [1]
    successor = survival.successor("shrink")  # collective over the survivors
"""
from __future__ import annotations

import time
import weakref
from typing import Any, List, Optional, Tuple

from mpi4py import MPI

from ..errors import PeerLost
from . import policy
from .lost import FAILURES, enlist, failed_in
from .numbering import keep, note_lost, world_ranks

__all__ = ["Survival", "survival_for"]

#: Seconds a rank whose call was revoked by another survivor waits for its own MPI to name
#: the lost ranks (ULFM tells every process of a failure; a revoke may come first).
NOTICE = 2.0
#: ULFM agrees on a C int: call counts are compared modulo 2**30 (survivors that stand at
#: different calls are a few calls apart, never 2**30).
_BITS = (1 << 30) - 1


def survival_for(mpi_comm: MPI.Comm, tracker: Any, router: Any) -> Optional["Survival"]:
    """The state of a new communicator over ``mpi_comm`` (watched by ``tracker``, its
    backends in ``router``) where this process survives losses, its MPI errors translated
    from now on; None in "abort" mode."""
    if not policy.raising():
        return None
    survival = Survival(mpi_comm, router, tracker)
    enlist(tracker, survival)
    return survival


class Survival:
    """What a communicator of the "raise" mode knows of its lost peers (docs/internals.md)."""

    def __init__(self, mpi_comm: MPI.Comm, router: Any, tracker: Any) -> None:
        self._mpi = mpi_comm
        self._router = router
        self._tracker = weakref.ref(tracker)   # its calls (seq); not kept alive by this
        self.world_ranks: Tuple[int, ...] = tracker.world_ranks   # of each rank of mpi_comm
        self.lost: Optional[Tuple[int, ...]] = None   # world ranks, once a loss was seen
        self._successor: Optional[MPI.Comm] = None    # shrunk, then refused (successor)
        self._raised_at = 0   # the number of the last call that raised PeerLost here
        self._agreed_at = 0   # the calls issued here when the last agreement ended
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
        communicator (and those attached) and aborting its NCCL communicator; local: the
        lost ranks are those this rank's MPI knows of."""
        self._raised_at = max(self._raised_at, seq)
        if self.lost is None:
            for comm in (self._mpi, *self._attached):
                if not comm.Is_revoked():
                    comm.Revoke()
            self._note_lost(self._noticed())
        lost = self.lost or ()
        return PeerLost(f"{call} #{seq}: lost world rank(s) {list(lost)} of "
                        f"{len(self.world_ranks)}; the survivors may comm.shrink() and go on "
                        f"(where they all stand at the same call: see comm.agree)",
                        ranks=lost, call=call, seq=seq)

    def failed_ranks(self) -> List[int]:
        """The world ranks known here to be lost: those this rank knew of at the first
        loss, and any its MPI has noticed since."""
        noticed = failed_in(self._mpi)
        return sorted(set(self.lost or ()) | {self.world_ranks[r] for r in noticed})

    def agree(self, flag: bool) -> bool:
        """ULFM's agreement: the AND of ``flag`` over the survivors, the same on each, also
        after a loss (the failures known are acknowledged first; one noticed meanwhile is
        raised on every survivor alike, acknowledged, and the agreement made again). The
        survivors stand at the same call after it (what :meth:`successor` checks)."""
        agreed = bool(_agreed(self._mpi, int(bool(flag)), len(self.world_ranks)))
        self._agreed_at = self._calls()
        return agreed

    def successor(self, call: str) -> MPI.Comm:
        """The survivors' MPI communicator (this one's then no longer usable): revoke and
        shrink, then agree that every survivor has issued as many calls here since the last
        agreement; where not, RuntimeError on every survivor alike, naming ``call``, and the
        successor is kept for the next call (after ``comm.agree``) or freed by close.
        Collective over the survivors."""
        successor, self._successor = self._successor, None
        if successor is None:
            if not self._mpi.Is_revoked():
                self._mpi.Revoke()
            successor = self._mpi.Shrink()
            kept = set(world_ranks(successor))
            self._note_lost(tuple(r for r in self.world_ranks if r not in kept))
            note_lost(self.lost or ())
        calls = self._calls() - self._agreed_at
        mine = calls & _BITS   # all equal where, bit by bit, the AND of each or of its not is 1
        tries = len(self.world_ranks)
        if _agreed(successor, mine, tries) | _agreed(successor, ~mine & _BITS, tries) != _BITS:
            self._successor = successor
            tracker = self._tracker()
            raise RuntimeError(
                f"{call}: the survivors stand at different calls of communicator "
                f"{getattr(tracker, 'name', '?')}: a call that the loss broke completed on "
                f"some and raised PeerLost on others, so redoing the step that raised would "
                f"redo different steps (world rank {self.world_ranks[self._mpi.Get_rank()]} "
                f"has issued {calls} call(s) on it since its start or the last comm.agree(), "
                f"not every survivor as many). Agree first, on every survivor, whether the "
                f"step counts (comm.agree(done), then {call}() and redo the same step), or "
                f"use cupycomm.resilient(); the communicator was not replaced")
        return successor

    def revoke(self) -> None:
        """Revoke the MPI communicator (shrink() retires it): Open MPI's MPI_Finalize waits
        for ever on a communicator of a lost rank that was freed unrevoked."""
        if not self._mpi.Is_revoked():
            self._mpi.Revoke()

    def discard(self) -> None:
        """Free a successor that was made and refused (the communicator closes)."""
        if self._successor is not None:
            self._successor.Free()
            self._successor = None

    def _calls(self) -> int:
        """The calls this rank has issued on the communicator (a call that raised PeerLost
        before its number was counted, such as the exchange that sizes it, counts)."""
        tracker = self._tracker()
        return max(0 if tracker is None else tracker.seq, self._raised_at)

    def _noticed(self) -> Tuple[int, ...]:
        """The world ranks this rank's MPI knows to be lost, waiting up to :data:`NOTICE`
        seconds for one (a revoke by another survivor may come before the news)."""
        deadline = time.monotonic() + NOTICE
        while True:
            noticed = failed_in(self._mpi)
            if noticed or time.monotonic() > deadline:
                return tuple(sorted(self.world_ranks[r] for r in noticed))
            time.sleep(0.01)

    def _note_lost(self, lost: Tuple[int, ...]) -> None:
        """The lost world ranks are ``lost``. The NCCL communicator, if any, is aborted now,
        never destroyed (its collectives would wait for the lost ranks;
        cupycomm/testing/standin.py rule 21)."""
        self.lost = lost
        device = self._router.device
        if device is not None:
            device.abort(f"world rank(s) {list(lost)} lost", lost)


def _agreed(mpi_comm: MPI.Comm, value: int, tries: int) -> int:
    """ULFM's agreement over ``mpi_comm``: the bitwise AND of ``value`` over the survivors,
    the same on each, also after a loss (the known failures are acknowledged first, so that
    a failure does not make it fail; ULFM raises a failure noticed meanwhile on every
    survivor alike, and each acknowledges it and agrees again, at most ``tries`` times)."""
    for _ in range(tries):   # each retry follows one more failure
        mpi_comm.Ack_failed()
        try:
            return int(mpi_comm.Agree(value))
        except MPI.Exception as error:
            if error.Get_error_class() not in FAILURES:
                raise
    raise RuntimeError(f"agree: failures went on until no rank could be left ({tries} ranks)")
