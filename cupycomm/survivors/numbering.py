"""The job's world ranks across ``comm.grow()``: which world rank each process of a
communicator holds, which ranks are lost and free to take again, and which a newcomer takes.

A world rank is a process's rank in the job's ``MPI_COMM_WORLD``. The processes that
``comm.grow()`` starts are in a world of their own (MPI's ``Spawn``), and the survivors'
world does not hold them, so the numbers they take are kept here with the group of the grown
communicator: every communicator made from it later (a shrink, a split) is numbered from
that group first, then, in a process of the job's own world, from ``MPI_COMM_WORLD``.

Example (4 ranks, world rank 1 lost, then ``grow(1)``)::

    note_lost((1,))
    places((0, 2, 3), 1)     # (1,): the newcomer takes world rank 1
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from mpi4py import MPI

from .._bootstrap import joined_as, world

__all__ = ["world_ranks", "note_lost", "places", "job", "adopt", "joined_late", "keep"]

_LOST: Set[int] = set()   # world ranks lost and not taken again (noted by every survivor alike)
_given: Optional[int] = None   # how many world ranks the job has given: its world's size, more
# the groups of grown communicators and their ranks' world ranks, newest first
_GROWN: List[Tuple[MPI.Group, Tuple[int, ...]]] = []
_late = False   # this process was started by comm.grow() (it is in a world of its own)
_KEPT: List[Any] = []   # the communicators made since a grow (see keep)


def world_ranks(mpi_comm: MPI.Comm) -> Tuple[int, ...]:
    """The world rank of each rank of ``mpi_comm``, in its order (MPI.UNDEFINED for a process
    of no world this process knows)."""
    group = mpi_comm.Get_group()
    size = group.Get_size()
    found = [MPI.UNDEFINED] * size
    references: List[Tuple[MPI.Group, Optional[Tuple[int, ...]]]] = list(_GROWN)
    world_group = None if _late else world().Get_group()
    if world_group is not None:
        references.append((world_group, None))   # numbered as they are
    try:
        for reference, numbers in references:
            for i, r in enumerate(MPI.Group.Translate_ranks(group, list(range(size)),
                                                            reference)):
                if found[i] == MPI.UNDEFINED and r != MPI.UNDEFINED:
                    found[i] = r if numbers is None else numbers[r]
    finally:
        group.Free()
        if world_group is not None:
            world_group.Free()
    return tuple(found)


def note_lost(ranks: Sequence[int]) -> None:
    """World ``ranks`` are lost (every survivor notes the same, after the agreement)."""
    _LOST.update(ranks)


def places(members: Sequence[int], n: int) -> Tuple[int, ...]:
    """The world ranks that ``n`` newcomers to a communicator of world ranks ``members``
    take: the lost ones first, lowest first, then numbers the job has not given yet."""
    given = _count()
    free = sorted(_LOST - set(members))
    return tuple(free[:n]) + tuple(range(given, given + n - len(free[:n])))


def job() -> Dict[str, Any]:
    """What a newcomer must know of the numbering (:func:`adopt` takes it)."""
    return {"lost": sorted(_LOST), "given": _count()}


def adopt(mpi_comm: MPI.Comm, ranks: Sequence[int], known: Dict[str, Any], late: bool) -> None:
    """``mpi_comm`` (a grown communicator; its ranks' world ranks ``ranks``) numbers the
    communicators made from it; the job's numbering becomes ``known`` (:func:`job`, sent by
    the survivors' rank 0) with ``ranks`` taken; ``late``: this process is a newcomer."""
    global _given, _late
    _GROWN.insert(0, (mpi_comm.Get_group(), tuple(ranks)))
    _LOST.clear()
    _LOST.update(set(known["lost"]) - set(ranks))
    _given = max(known["given"], max(ranks) + 1)
    if late:
        _late = True
        joined_as(tuple(ranks)[mpi_comm.Get_rank()], len(ranks))


def joined_late() -> bool:
    """Whether this process was started by ``comm.grow()`` to join a job after it began
    (``cupycomm.init()`` then returned the grown communicator; its world rank is
    ``comm.world_ranks[comm.rank]``, often that of a lost rank).

    Example::

        comm = cupycomm.init(on_peer_loss="raise")
        if cupycomm.joined_late():
            state.sync(comm)   # the survivors sync too: they take part in the same call
    """
    return _late


def keep(communicator: Any) -> None:
    """Hold ``communicator`` until exit, where this process took part in a grow: its MPI
    communicator may hold processes of another MPI job (spawned ones), and Open MPI's
    MPI_Finalize disconnects each such communicator still allocated, waiting for its peers
    to do the same: for ever where one of them freed it (a Communicator dropped without
    ``close()``, then collected, leaves its MPI communicator allocated). Held, it is closed,
    and freed, at exit on every process alike (``_bootstrap.close_all``)."""
    if _GROWN:
        _KEPT.append(communicator)


def _count() -> int:
    return world().Get_size() if _given is None else _given
