"""``comm.shrink()``: the survivors' communicator, after a peer was lost.

On MPI: ULFM's revoke, agree and shrink (:meth:`.state.Survival.successor`), refused on every
survivor alike where they stand at different calls. On the device: the old NCCL
communicator is aborted, never destroyed (NCCL >= 2.31 hangs in ncclCommDestroy after an
abortive shrink, pytorch#194679), and the successor makes a new one from a fresh unique id.
The old communicator then refuses every call (:class:`~cupycomm.errors.CommShrunkError`).

Example (4 ranks, world rank 1 killed)::

    try:
        comm.all_reduce(x)
    except cupycomm.PeerLost as lost:    # lost.ranks == (1,) on ranks 0, 2 and 3
        comm = comm.shrink()             # 3 ranks; comm.world_ranks == (0, 2, 3)
"""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..errors import PeerLost
from ..run import exit_records
from .state import Survival

__all__ = ["successor", "retire"]


def successor(comm: Any, survival: Survival) -> MPI.Comm:
    """The survivors' MPI communicator replacing ``comm`` (a Communicator, retired here); see
    the module. Collective over the survivors."""
    shrunk = survival.successor("shrink")
    exit_records.note_survived(survival.lost or ())   # cupycomm.run: the program recovered
    retire(comm, survival)
    return shrunk


def retire(comm: Any, survival: Survival, by: str = "shrink") -> None:
    """Close ``comm`` and its subgroups for good, their NCCL communicators aborted; ``by``:
    the call that replaced it ("shrink" or "grow"), which its refusals name."""
    for child in survival.children():
        child_survival = child.parts.survival
        if child_survival is not None:
            retire(child, child_survival, by)
    survival.discard()
    survival.revoke()
    parts = comm.parts
    parts.checks.shrunk = by   # every later call: CommShrunkError
    device = parts.router.device
    if device is not None:   # aborted, never destroyed: NCCL's destroy may hang
        device.abort(f"the communicator was replaced by {by}()", survival.lost or ())
    try:
        comm.close()
    except (PeerLost, MPI.Exception):
        pass   # its calls in flight failed: the peers they waited for are gone
