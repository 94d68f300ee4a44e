"""An MPI error that says a peer is gone, turned into :class:`~cupycomm.errors.PeerLost`.

The host calls catch ``MPI.Exception`` (a ``try`` costs nothing in CPython 3.11 until it
raises) and hand it to :func:`peer_lost`: PeerLost in the "raise" mode for ULFM's errors
(ERR_PROC_FAILED, ERR_PROC_FAILED_PENDING, ERR_REVOKED), else the caller re-raises it.

Example (what a host call does)::

    try:
        call(...)
    except MPI.Exception as error:
        peer_lost(error, tracker, "all_reduce", seq)   # raises PeerLost where it is one
        raise
"""
from __future__ import annotations

import weakref
from typing import Any, List, Protocol, Tuple

from mpi4py import MPI

from ..errors import PeerLost

__all__ = ["peer_lost", "enlist", "attach", "failed_in", "known_lost", "FAILURES"]

#: The error classes of ULFM that say a peer is lost (the call saw it fail; a nonblocking
#: receive from any source cannot know; another survivor revoked the communicator).
FAILURES = frozenset(getattr(MPI, name) for name in
                     ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                     if hasattr(MPI, name))


class Survival(Protocol):
    """What this module asks of a communicator's :class:`.state.Survival` (which imports
    this module)."""

    def attach(self, mpi_comm: MPI.Comm) -> None: ...
    def lose(self, call: str, seq: int) -> PeerLost: ...
    def failed_ranks(self) -> List[int]: ...


# The state of each communicator that survives losses, by its watchdog tracker (what the
# host backend's calls hold).
_BY_TRACKER: "weakref.WeakKeyDictionary[Any, Survival]" = weakref.WeakKeyDictionary()


def enlist(tracker: Any, survival: Survival) -> None:
    """Translate the MPI errors of the communicator of ``tracker`` through ``survival``."""
    _BY_TRACKER[tracker] = survival


def attach(tracker: Any, mpi_comm: MPI.Comm) -> None:
    """``mpi_comm`` (the object collectives' duplicate) belongs to the communicator of
    ``tracker``: a loss revokes it too, so that no survivor stays blocked in it."""
    survival = _BY_TRACKER.get(tracker)
    if survival is not None:
        survival.attach(mpi_comm)


def failed_in(mpi_comm: MPI.Comm) -> List[int]:
    """The ranks of ``mpi_comm`` (in its numbering) that its MPI knows have failed (ULFM's
    ``MPI_Comm_get_failed``; a local query)."""
    group, mine = mpi_comm.Get_failed(), mpi_comm.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), mine))
    finally:
        group.Free()
        mine.Free()


def known_lost(tracker: Any) -> Tuple[int, ...]:
    """The world ranks this process knows are lost from the communicator of ``tracker``
    (agreed at a loss, or noticed by its MPI since: a local query); () where it does not
    survive losses."""
    survival = _BY_TRACKER.get(tracker)
    return () if survival is None else tuple(survival.failed_ranks())


def peer_lost(error: BaseException, tracker: Any, label: str, seq: int) -> None:
    """Raise PeerLost (from ``error``) where ``error`` says that a peer of the communicator of
    ``tracker`` is gone and it survives losses; else return. ``label`` names the call (or
    "call #seq", a Work's), ``seq`` its number."""
    survival = _BY_TRACKER.get(tracker)
    if survival is None or not isinstance(error, MPI.Exception):
        return
    if error.Get_error_class() not in FAILURES:
        return
    call, _, number = label.partition(" #")
    raise survival.lose(call, int(number) if number.isdigit() else seq) from error
