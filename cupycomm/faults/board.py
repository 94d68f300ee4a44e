"""A status board in node-local shared memory: what each rank of a communicator on this node
is doing, readable by its peers without any MPI call (so it works while they are blocked).

One row per rank of the communicator on this node: its rank, pid, how many collectives it has
issued, which collective it is blocked in, and whether it has left (closed the communicator,
or started to exit) and when. Each rank's watchdog thread writes its own row and reads the
others; the rank itself writes the row once more as it leaves, so that a peer knows how far
it got before it went. Ranks on other nodes are not on this board; timeouts cover them.
"""
from __future__ import annotations

import itertools
import mmap
import os
import tempfile
import time

import numpy as np
from mpi4py import MPI

from .. import _bootstrap

__all__ = ["NodeBoard", "alive", "shared_directory", "RANK", "PID", "LEFT", "SEQ", "BUSY",
           "BUSY_SEQ", "LEFT_AT", "CLOSED", "EXITING"]

RANK, PID, LEFT, SEQ, BUSY, BUSY_SEQ, LEFT_AT = range(7)
CLOSED, EXITING = 1, 2   # LEFT: why the rank left (0: it has not)
_FIELDS = 8
_names = itertools.count()


def shared_directory() -> str:
    """Where node-local shared memory files go."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class NodeBoard:
    """The board of one communicator on this node; created collectively over ``node``
    (its ranks on this node), which this call does not keep."""

    def __init__(self, node: MPI.Comm, rank: int) -> None:
        me = node.Get_rank()
        nbytes = node.Get_size() * _FIELDS * 8
        path = None
        if me == 0:
            path = os.path.join(shared_directory(), f"cupycomm-{os.getpid()}-{next(_names)}")
            with open(path, "wb") as f:
                f.truncate(nbytes)
        path = node.bcast(path, root=0)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), nbytes)
        node.Barrier()   # everyone has mapped it: the name can go, the memory stays
        if me == 0:
            os.unlink(path)
        self.rows = np.frombuffer(self._map, np.int64).reshape(node.Get_size(), _FIELDS)
        self.mine = self.rows[me]
        self.mine[RANK], self.mine[PID] = rank, os.getpid()

    def publish(self, seq: int, busy: int, busy_seq: int) -> None:
        """This rank's progress (busy: 0 when not blocked, else the collective's code: 1 + its
        index in ``cupycomm._collectives.CALLS``)."""
        mine = self.mine
        mine[SEQ], mine[BUSY], mine[BUSY_SEQ] = seq, busy, busy_seq

    def leave(self) -> None:
        """Say that this rank is leaving (its SEQ is then final: the collectives it issued
        before it went), why, and when (``time.monotonic()``, in ns: the clock is the
        node's)."""
        mine = self.mine
        mine[LEFT_AT] = time.monotonic_ns()
        mine[LEFT] = EXITING if _bootstrap.exiting() else CLOSED

    def peers(self) -> np.ndarray:
        """A snapshot of the other rows."""
        return np.array([row for row in self.rows if row[PID] != self.mine[PID]])


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
