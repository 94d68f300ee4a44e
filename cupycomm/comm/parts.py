"""The parts a :class:`~cupycomm.comm.communicator.Communicator` is made of, as cupycomm's own
modules see them (:class:`Parts`), and the collective making of the watched one
(:func:`watched`: the node's board, the heartbeats, the watchdog's tracker).

Example (what ``Communicator.create`` does)::

    tracker, local_rank = watched(mpi_comm, "world", timeout=600.0)
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from mpi4py import MPI

from .. import _bootstrap
from . import coalesce
from .route import Router
from .checks import Checks
from ..faults.board import NodeBoard
from ..faults.heartbeat import Heartbeats
from ..faults.watchdog import Tracker, watch
from ..survivors.numbering import world_ranks
from ..survivors.state import Survival

__all__ = ["Parts", "watched"]


class Parts(NamedTuple):
    """The parts of a :class:`~cupycomm.comm.communicator.Communicator` that cupycomm's own
    modules use (``coalesce``, ``faults.debug``, ``survivors``); not a public
    API."""

    checks: Checks            # argument checks, the closed state and the open batch() block
    router: Router            # the backends (host, device) and which one takes an array
    tracker: Tracker          # the watchdog's view: calls counted, the call in progress
    staging: coalesce.Staging   # all_reduce_coalesced's buffers, kept from call to call
    survival: Optional[Survival]   # its lost peers (on_peer_loss="raise"), or None


def watched(mpi_comm: MPI.Comm, name: str, timeout: float) -> Tuple[Tracker, int]:
    """(the watchdog's tracker for a communicator over ``mpi_comm``, this rank's local rank).

    Collective: the ranks find those of their node, which open the node's board, and the
    node leaders connect their heartbeats across nodes (with more than one rank); then the
    watchdog looks at the tracker, its thread started by the first communicator."""
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    node = _bootstrap.node_comm(mpi_comm)
    board = NodeBoard(node, rank, mpi_comm) if size > 1 else None
    beats = Heartbeats.connect(mpi_comm, node, board, name) if board is not None else None
    local_rank = node.Get_rank()
    node.Free()
    tracker = Tracker(name, rank, size, timeout, board, beats, world_ranks(mpi_comm))
    if size > 1:
        watch(tracker)
    return tracker, local_rank
