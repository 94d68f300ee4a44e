"""Status boards in node-local shared memory: what each process on this node is doing,
readable by its peers without any MPI call (so it works while they are blocked).

:class:`Board` is a table of int64 fields, one row per rank of a node communicator, each
rank writing its own row; :class:`NodeBoard` is the communicator's board of the watchdog
(how far each rank has got, which collective it is blocked in, whether it has left). The
pytest plugin's hang guard keeps its own fields on a :class:`Board`. Ranks on other nodes
are not on a node's board.
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
import weakref
from typing import Iterator, Optional

import numpy as np
from mpi4py import MPI

from .. import _bootstrap
from ..errors import SharedFileRefused
from .. import _private as private
from .._private import alive

__all__ = ["Board", "NodeBoard", "alive", "RANK", "PID", "LEFT", "SEQ", "BUSY", "BUSY_SEQ",
           "LEFT_AT", "GONE", "GONE_STATE", "GONE_SEQ", "GONE_AT", "REPORTED_AT", "CLOSED",
           "EXITING"]

_FILE = "board"   # its name in the private directory of the node's first rank


class Board:
    """``fields`` int64 per rank of ``node`` (the ranks of one communicator on this node), in
    shared memory; made collectively over ``agree`` (default: ``node``), neither of which it
    keeps. ``rows[i]`` is the row of ``node``'s rank ``i``; ``mine`` is this rank's, zeroed;
    :meth:`locked` is a lock its ranks share. How the file is made and checked:
    docs/internals.md, "faults/board.py".

    Example::

        board = Board(node, fields=4)
        board.mine[0] = os.getpid()
        others = [row for i, row in enumerate(board.rows) if i != board.index]
    """

    def __init__(self, node: MPI.Comm, fields: int, agree: Optional[MPI.Comm] = None) -> None:
        self.index = node.Get_rank()
        nbytes = node.Get_size() * fields * 8
        fd, why, directory = -1, "", ""
        if self.index == 0:
            try:
                directory, _ = private.make_directory(private.shared_directory())
                fd = private.create(directory, _FILE, nbytes)
            except OSError as error:
                why = f"could not make it in {private.shared_directory()}: {error}"
        directory, why = node.bcast((directory, why), root=0)
        if not why and self.index != 0:
            try:
                fd = private.open_checked(directory, _FILE)
            except (SharedFileRefused, OSError) as error:
                why = str(error)
        if fd >= 0:
            # The descriptor stays open (its flock is the lock of locked()) until the board goes.
            weakref.finalize(self, os.close, fd)
            self._fd = fd
            if not why:
                try:
                    self._map = mmap.mmap(fd, nbytes)
                except (OSError, ValueError) as error:
                    why = f"could not map {directory}/{_FILE}: {error}"
        agree = node if agree is None else agree
        refused = agree.allreduce(1 if why else 0, op=MPI.SUM)
        if self.index == 0 and directory:
            private.remove(directory)   # everyone has mapped it (or given up): the memory stays
        if refused:
            whys = agree.allgather(f"rank {agree.Get_rank()} ({_bootstrap.node_name()}, pid "
                                   f"{os.getpid()}): {why}" if why else "")
            raise SharedFileRefused("the node board (shared memory) was refused or could not "
                                    "be made: " + "; ".join(w for w in whys if w))
        self.rows = np.frombuffer(self._map, np.int64).reshape(node.Get_size(), fields)
        self.mine = self.rows[self.index]

    @contextlib.contextmanager
    def locked(self, wait: float = 0.5) -> Iterator[bool]:
        """Hold the lock the board's ranks share while inside (yields True); a peer that holds
        it for longer than ``wait`` s (a stopped process) is not waited for: yields False,
        without it. A rank that dies holding it releases it."""
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.005)
        try:
            yield True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


# The fields of a NodeBoard row; the GONE_* fields are used on the leader's row only, and
# REPORTED_AT on the first row only (by any rank: the leader may be dead).
(RANK, PID, LEFT, SEQ, BUSY, BUSY_SEQ, LEFT_AT, GONE, GONE_STATE, GONE_SEQ, GONE_AT,
 REPORTED_AT) = range(12)
FIELDS = REPORTED_AT + 1
CLOSED, EXITING = 1, 2   # LEFT: why the rank left (0: it has not)


class NodeBoard(Board):
    """A communicator's board: per rank its rank, pid, how many collectives it has issued,
    which collective it is blocked in, and whether it has left (closed the communicator, or
    started to exit) and when. The watchdog thread writes this rank's row and reads the
    others; the rank itself writes its row once more as it leaves, so that a peer knows how
    far it got before it went. The node's leader (the first row) also relays there what its
    heartbeats learnt of ranks on other nodes (:mod:`cupycomm.faults.heartbeat`), and the board
    says which rank prints the node's flight-recorder block (:meth:`first_to_report`)."""

    def __init__(self, node: MPI.Comm, rank: int, comm: Optional[MPI.Comm] = None) -> None:
        """``rank``: this rank in ``comm``, the communicator (which agrees on the board)."""
        super().__init__(node, FIELDS, comm)
        self.mine[RANK], self.mine[PID] = rank, os.getpid()

    def publish(self, seq: int, busy: int, busy_seq: int) -> None:
        """This rank's progress (busy: 0 when not blocked, else the call's code in
        ``cupycomm._collectives.CALLS``)."""
        mine = self.mine
        mine[SEQ], mine[BUSY], mine[BUSY_SEQ] = seq, busy, busy_seq

    def leave(self) -> None:
        """Say that this rank is leaving (its SEQ is then final: the collectives it issued
        before it went), why, and when (``time.monotonic()``, in ns: the clock is the
        node's)."""
        mine = self.mine
        mine[LEFT_AT] = time.monotonic_ns()
        mine[LEFT] = EXITING if _bootstrap.exiting() else CLOSED

    def relay(self, gone: int, state: int, seq: int, since_ns: int) -> None:
        """The leader's relay of a departure on another node (gone: 0 for none), written
        with ``gone`` last so that a reader that sees it sees the rest."""
        mine = self.mine
        mine[GONE] = 0
        mine[GONE_STATE], mine[GONE_SEQ], mine[GONE_AT] = state, seq, since_ns
        mine[GONE] = gone

    def relayed(self) -> tuple:
        """(gone, state, seq, since in ns) as the node's leader relays them."""
        leader = self.rows[0]
        gone = int(leader[GONE])
        return gone, int(leader[GONE_STATE]), int(leader[GONE_SEQ]), int(leader[GONE_AT])

    def first_to_report(self, within: float) -> bool:
        """Whether no rank of this node has reported in the last ``within`` s (then this
        rank is the one, and the board says so from now): one rank per node, whichever
        comes first, prints where every rank of the node is. True also where the lock is
        not to be had (better the block twice than never)."""
        first = self.rows[0]
        with self.locked() as held:
            now = time.monotonic_ns()   # the node's clock
            if held and first[REPORTED_AT] and now - int(first[REPORTED_AT]) < within * 1e9:
                return False
            first[REPORTED_AT] = now
            return True

    def peers(self) -> np.ndarray:
        """A snapshot of the other rows."""
        return np.array([row for i, row in enumerate(self.rows) if i != self.index])
