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
import itertools
import mmap
import os
import tempfile
import time
import weakref
from typing import Iterator

import numpy as np
from mpi4py import MPI

from .. import _bootstrap

__all__ = ["Board", "NodeBoard", "alive", "shared_directory", "RANK", "PID", "LEFT", "SEQ",
           "BUSY", "BUSY_SEQ", "LEFT_AT", "GONE", "GONE_STATE", "GONE_SEQ", "GONE_AT",
           "REPORTED_AT", "CLOSED", "EXITING"]

_names = itertools.count()


def shared_directory() -> str:
    """Where node-local shared memory files go."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Board:
    """``fields`` int64 per rank of ``node`` (the ranks of one communicator on this node), in
    shared memory; made collectively over ``node``, which it does not keep.

    ``rows[i]`` is the row of ``node``'s rank ``i``; ``mine`` is this rank's, and starts zeroed.
    :meth:`locked` is a lock its ranks share.

    Example::

        board = Board(node, fields=4)
        board.mine[0] = os.getpid()
        others = [row for i, row in enumerate(board.rows) if i != board.index]
    """

    def __init__(self, node: MPI.Comm, fields: int) -> None:
        self.index = node.Get_rank()
        nbytes = node.Get_size() * fields * 8
        path = None
        if self.index == 0:
            path = os.path.join(shared_directory(), f"cupycomm-{os.getpid()}-{next(_names)}")
            with open(path, "wb") as f:
                f.truncate(nbytes)
        path = node.bcast(path, root=0)
        # The descriptor stays open (its flock is the lock of locked()) until the board goes.
        self._fd = os.open(path, os.O_RDWR)
        weakref.finalize(self, os.close, self._fd)
        self._map = mmap.mmap(self._fd, nbytes)
        node.Barrier()   # everyone has mapped it: the name can go, the memory stays
        if self.index == 0:
            os.unlink(path)
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

    def __init__(self, node: MPI.Comm, rank: int) -> None:
        super().__init__(node, FIELDS)
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


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    try:   # a zombie has exited; its parent has just not reaped it yet
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:   # no /proc (not Linux): trust kill()
        return True
