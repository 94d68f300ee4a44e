"""Rounds: each rank tells rank 0 where it is and how it went; rank 0 tells every rank.

The plugin's only communication, on its own duplicate of ``COMM_WORLD``. Waits poll
nonblocking point-to-point requests with a short, growing sleep: a blocking MPI wait
busy-spins, and with more ranks than cores it would take the CPU from the ranks still running
a test. (Nonblocking collectives are no better here: each of their steps advances only while
the rank that owns it polls, so a sleeping rank stalls the others.)
"""
from __future__ import annotations

import enum
import pickle
from typing import Any, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from ..work import poll_until

__all__ = ["Point", "Round", "Rounds", "wait"]

_TAG_RECORD, _TAG_DETAIL, _TAG_TABLE = 1, 2, 3


class Point(enum.IntEnum):
    """Where in the session a round happens; every rank must be at the same point."""
    MARKS = 0  # a test's skipif/xfail conditions, before its fixtures
    SETUP = 1
    END = 2  # a test's call and teardown
    COLLECT = 3
    COLLECT_IDS = 4
    FINAL = 5


# A record is one rank's line of the table: int64 fields, in this order. EXTRA is a second
# number whose meaning depends on the point (a digest of the collected tests, an outcome).
POINT, SEQ, CODE, EXTRA, NBYTES = range(5)


def wait(requests: List[MPI.Request]) -> None:
    """Wait for ``requests`` without spinning (sleeps growing to 10 ms: see poll_until), but
    with as many looks between two sleeps as there are requests.

    MPICH's progress engine completes about one incoming message a look: rank 0, receiving
    a record from each rank, needed a look (and a sleep) per rank, and a round took 100 ms
    at 16 ranks on 2 cores (benchmarks/plugin_cost.py).
    """
    looks = range(max(1, len(requests)))
    poll_until(lambda: any(MPI.Request.Testall(requests) for _ in looks), longest=0.01)


class Round:
    """One exchange: ``table[r]`` is rank r's record, on every rank; ``details[r]`` is what
    rank r sent along (rank 0 only). Resumable: :meth:`finish` may be called again after a
    KeyboardInterrupt stopped it, and goes on where it was."""

    def __init__(self, comm: MPI.Comm, record: np.ndarray, detail: Any) -> None:
        self._comm = comm
        self._payload = b"" if detail is None else pickle.dumps(detail)
        record[NBYTES] = len(self._payload)
        self.table = np.empty((comm.Get_size(), record.size), np.int64)
        self.details: Dict[int, Any] = {}
        self._peers = range(1, comm.Get_size())
        if comm.Get_rank() == 0:
            self.table[0] = record
            if detail is not None:
                self.details[0] = detail
            self._records = [comm.Irecv(self.table[r], r, _TAG_RECORD) for r in self._peers]
            self._inbox: Optional[Dict[int, bytearray]] = None
            self._replies: Optional[List[MPI.Request]] = None
        else:
            self._record = record
            self._requests = [comm.Isend(record, 0, _TAG_RECORD)]
            if self._payload:
                self._requests.append(comm.Isend(self._payload, 0, _TAG_DETAIL))
            self._requests.append(comm.Irecv(self.table, 0, _TAG_TABLE))

    def finish(self) -> "Round":
        if self._comm.Get_rank() != 0:
            wait(self._requests)
            return self
        wait(self._records)
        if self._inbox is None:
            self._inbox = {r: bytearray(int(self.table[r, NBYTES])) for r in self._peers
                           if self.table[r, NBYTES]}
            self._inbox_requests = [self._comm.Irecv(buf, r, _TAG_DETAIL)
                                    for r, buf in self._inbox.items()]
        wait(self._inbox_requests)
        if self._replies is None:
            self.details.update((r, pickle.loads(buf)) for r, buf in self._inbox.items())
            self._replies = [self._comm.Isend(self.table, r, _TAG_TABLE) for r in self._peers]
        wait(self._replies)
        return self

    def column(self, field: int) -> np.ndarray:
        return self.table[:, field]

    def final_ranks(self) -> List[int]:
        """The ranks whose record says they have left the session (point FINAL)."""
        return [int(r) for r in np.flatnonzero(self.column(POINT) == Point.FINAL)]


class Rounds:
    """The plugin's private communicator and its sequence of rounds.

    Example::

        rounds = Rounds(MPI.COMM_WORLD.Dup())
        done = rounds.exchange(Point.END, seq=7, code=0)
        failed_somewhere = done.column(CODE).any()
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._pending: Optional[Round] = None

    def exchange(self, point: Point, seq: int = 0, code: int = 0, extra: int = 0,
                 detail: Any = None) -> Round:
        """Send this rank's record (and ``detail``, any picklable object, to rank 0 only)
        and return the round once every rank's record is known here."""
        record = np.array([point, seq, code, extra, 0], np.int64)
        self._pending = Round(self.comm, record, detail)
        done = self._pending.finish()
        self._pending = None
        return done

    def finish_pending(self) -> Optional[Round]:
        """Complete a round that an interrupt left half done, so the next one lines up."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.finish()

    def allgather_ints(self, values: List[int]) -> np.ndarray:
        """Every rank's ``values`` (a row each), by a polled nonblocking allgather: once a
        session, so the multi-step cost of a nonblocking collective does not matter."""
        mine = np.array(values, np.int64)
        table = np.empty((self.size, mine.size), np.int64)
        wait([self.comm.Iallgather(mine, table)])
        return table
