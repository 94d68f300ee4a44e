"""Heartbeats between nodes: a rank on another node that dies, leaves, or whose whole node
goes silent is known here within seconds, without any port of ours.

A communicator spanning several nodes makes a private MPI communicator of its node leaders,
on which each leader's watchdog thread exchanges BEAT (every ``bound / 10`` s: its node
board's rows), BYE (at close) and ACK (the answer to a BYE, so that no message outlives the
communicator). A leader silent for longer than ``CUPYCOMM_HEARTBEAT_TIMEOUT`` (5 s) has its
node taken as dead. The protocol in full: docs/internals.md, "faults/heartbeat.py".

Example (what a Communicator does)::

    beats = Heartbeats.connect(mpi_comm, node, board, "world")   # collective; None: one node
    beats.poll(time.monotonic())   # the watchdog thread, ten times a second
    beats.close()                  # the communicator's close
"""
from __future__ import annotations

import sys
import time
from typing import Dict, List, NamedTuple, Optional, Tuple, cast

import numpy as np
from mpi4py import MPI

from .. import _bootstrap, _env
from ..survivors import policy
from ..survivors.lost import FAILURES, failed_in
from . import board as _board
from .board import LEFT, NodeBoard, PID, RANK, SEQ, BUSY, BUSY_SEQ

__all__ = ["Heartbeats", "Departure", "BEAT", "BYE", "ACK", "DIED", "SILENT"]

BEAT, BYE, ACK = 1, 2, 3              # message kinds
DIED, SILENT = 3, 4                   # row states beyond the board's CLOSED and EXITING
_FIELDS = (RANK, PID, LEFT, SEQ, BUSY, BUSY_SEQ)   # a row in a message: these, then the state
_WIDTH = len(_FIELDS)
_STATE, _SEQ, _PID = _FIELDS.index(LEFT), _FIELDS.index(SEQ), _FIELDS.index(PID)
_TAG = 0


class Departure(NamedTuple):
    """A rank or node on another node that this node's leader knows is gone."""
    who: str        # "rank 3 of communicator world (node nodeB)"
    left: int       # board.CLOSED or board.EXITING; 0: died, or its node went silent
    seq: int        # the collectives it issued before it left
    since: float    # time.monotonic() when the leader learnt it
    how: str        # for a death: what happened
    ranks: Tuple[int, ...]   # the ranks gone, in the communicator's numbering


class Heartbeats:
    """One communicator's cross-node view. Made by :meth:`connect` on every rank; only a
    node leader has the leaders' communicator and talks. Every rank reads the leader's
    relayed departure (:meth:`departure`)."""

    def __init__(self, leaders: MPI.Comm, board: NodeBoard, name: str, nodes: List[str],
                 ranks: List[List[int]], node_of: List[int], bound: float) -> None:
        self.name = name
        self.board = board
        self.bound = bound
        self.interval = max(0.1, bound / 10)
        self.nodes = nodes            # node index -> name
        self.ranks = ranks            # node index -> its ranks
        self.node_of = node_of        # rank -> node index
        self._comm = leaders if leaders != MPI.COMM_NULL else None
        if self._comm is None:
            return
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)   # a failed send must not end the job
        me = self._comm.Get_rank()
        count = len(nodes)
        self._others = [j for j in range(count) if j != me]
        now = time.monotonic()
        self._heard = [now] * count
        self._said_bye = [False] * count
        self._acked = [False] * count
        self._silent = [False] * count
        self._sending: List[tuple] = []         # (leader, request, buffer) not yet completed
        self._rows: Dict[int, tuple] = {}       # remote rank -> (row, since)
        self._next_beat = now
        # One receive posted per other leader (not MPI_ANY_SOURCE, whose cancel is fragile).
        self._inbox = np.zeros((count, 2 + max(map(len, ranks)) * _WIDTH), np.int64)
        self._receiving = {j: self._comm.Irecv(self._inbox[j], j, _TAG) for j in self._others}
        self._relayed: tuple = ()              # what is on the board now
        self._broken = False

    @classmethod
    def connect(cls, mpi_comm: MPI.Comm, node: MPI.Comm, board: NodeBoard,
                name: str) -> Optional["Heartbeats"]:
        """Collective over ``mpi_comm`` (``node``: its ranks on this node, whose board is
        ``board``): the heartbeats of a communicator that spans nodes, else None (and None
        where MPI was not initialised with MPI_THREAD_MULTIPLE, mpi4py's default: the
        watchdog thread could not make MPI calls)."""
        if (node.Get_size() == mpi_comm.Get_size()
                or MPI.Query_thread() < MPI.THREAD_MULTIPLE):
            return None
        rank = mpi_comm.Get_rank()
        leader = node.bcast(rank, root=0)
        seen = mpi_comm.allgather((leader, _bootstrap.node_name()))
        leader_ranks = sorted({first for first, _ in seen})
        index = {first: i for i, first in enumerate(leader_ranks)}
        node_of = [index[first] for first, _ in seen]
        nodes = [seen[first][1] for first in leader_ranks]
        ranks = [[r for r, i in enumerate(node_of) if i == j] for j in range(len(nodes))]
        leaders = mpi_comm.Split(0 if leader == rank else MPI.UNDEFINED, rank)
        return cls(leaders, board, name, nodes, ranks, node_of,
                   _env.read("CUPYCOMM_HEARTBEAT_TIMEOUT"))

    # -- every rank ---------------------------------------------------------------------------
    def departure(self) -> Optional[Departure]:
        """The departure this node's leader relays, if any."""
        gone, left, seq, at_ns = self.board.relayed()
        if not gone:
            return None
        if gone < 0:
            node = -gone - 1
            return Departure(f"node {self.nodes[node]} (ranks {self.ranks[node]}) of "
                             f"communicator {self.name}", 0, seq, at_ns / 1e9,
                             f"has sent no heartbeat for more than {self.bound:g} s "
                             f"(CUPYCOMM_HEARTBEAT_TIMEOUT): it is taken as dead (every "
                             f"process of the job on it ended, or it lost the network)",
                             tuple(self.ranks[node]))
        rank = gone - 1
        return Departure(f"rank {rank} of communicator {self.name} (node "
                         f"{self.nodes[self.node_of[rank]]})", left if left != DIED else 0,
                         seq, at_ns / 1e9, "has died (its process ended: os._exit, a "
                         "signal or a crash), as its node's heartbeat says", (rank,))

    # -- the leader: its watchdog thread, then its close ----------------------------------------
    def poll(self, now: float) -> None:
        """Receive what has come, beat when due, judge silent nodes, relay (watchdog
        thread). Does nothing on a rank that is not a leader."""
        if self._comm is None or self._broken or MPI.Is_finalized():
            return   # (a program may finalize MPI itself before closing its communicators)
        try:
            self._receive(now)
            if now >= self._next_beat:
                self._send(BEAT, [j for j in self._others
                                  if not self._said_bye[j] and not self._silent[j]])
                self._next_beat = now + self.interval
            for j in self._others:
                self._silent[j] = (not self._said_bye[j]
                                   and now - self._heard[j] > self.bound)
            self._relay(now)
        except MPI.Exception as error:   # the watchdog must go on; the heartbeats cannot
            if self._lost_leaders(error, now):
                return
            self._broken = True
            sys.stderr.write(f"cupycomm heartbeat: stopped on {_bootstrap.describe_rank()} "
                             f"after an MPI error: {error}\n")

    def close(self) -> None:
        """Say BYE to every leader that has not left, wait for their ACKs (or their
        silence), then end every request and free the leaders' communicator. Call once the
        watchdog no longer polls, after the board says this rank left."""
        if self._comm is None or self._broken or MPI.Is_finalized():
            return
        try:
            waiting = [j for j in self._others if not self._said_bye[j] and not self._silent[j]]
            self._send(BYE, waiting)
            while True:
                now = time.monotonic()
                self._receive(now)
                waiting = [j for j in waiting
                           if not self._acked[j] and now - self._heard[j] <= self.bound]
                if not waiting:
                    break
                time.sleep(0.01)
            for receiving in self._receiving.values():
                receiving.Cancel()
                receiving.Wait()
            deadline = time.monotonic() + self.bound
            while self._sending and time.monotonic() < deadline:
                self._sent()
                time.sleep(0.01)
        except MPI.Exception as error:
            sys.stderr.write(f"cupycomm heartbeat: closing on {_bootstrap.describe_rank()} "
                             f"failed: {error}\n")
        finally:
            self._comm.Free()
            self._comm = None

    def _lost_leaders(self, error: MPI.Exception, now: float) -> bool:
        """Where ``error`` says leaders died (ULFM, in "raise" mode): relay each as a dead
        rank of its node and talk to it no more (no one relays the other ranks of its node
        then); return whether that was it."""
        if not policy.raising() or error.Get_error_class() not in FAILURES:
            return False
        failed = [j for j in failed_in(cast(MPI.Comm, self._comm)) if j in self._receiving]
        if not failed:
            return False
        for j in failed:
            del self._receiving[j]
            self._said_bye[j] = self._acked[j] = True   # no beat, no wait for its ACK
            leader = self.ranks[j][0]
            known = self._rows.get(leader)
            row = np.zeros(_WIDTH, np.int64) if known is None else known[0].copy()
            row[0], row[_STATE] = leader, DIED
            self._rows[leader] = (row, now)
        self._sending = [sent for sent in self._sending if sent[0] not in failed]
        self._relay(now)
        return True

    def _receive(self, now: float) -> None:
        for j, receiving in self._receiving.items():
            while receiving.Test():
                self._handle(j, self._inbox[j].copy(), now)
                comm = cast(MPI.Comm, self._comm)   # open: there is nothing to test once closed
                receiving = self._receiving[j] = comm.Irecv(self._inbox[j], j, _TAG)

    def _handle(self, j: int, message: np.ndarray, now: float) -> None:
        """What leader ``j`` said."""
        kind, count = int(message[0]), int(message[1])
        rows = message[2:2 + count * _WIDTH].reshape(count, _WIDTH)
        self._heard[j] = now
        if kind == ACK:
            self._acked[j] = True
            return
        for row in rows:
            rank = int(row[0])
            before = self._rows.get(rank)
            same = before is not None and before[0][_STATE] == row[_STATE]
            self._rows[rank] = (row, before[1] if same and before is not None else now)
        if kind == BYE:
            self._said_bye[j] = True
            self._send(ACK, [j])

    def _send(self, kind: int, to: List[int]) -> None:
        rows = self.board.rows
        message = np.empty(2 + len(rows) * _WIDTH, np.int64)
        message[0], message[1] = kind, len(rows)
        table = message[2:].reshape(len(rows), _WIDTH)
        table[:] = rows[:, list(_FIELDS)]
        for row in table:
            if not row[_STATE] and not _board.alive(int(row[_PID])):
                row[_STATE] = DIED
        busy = {j for j, _, _ in self._sent()}
        for j in to:
            if kind == BEAT and j in busy:
                continue   # a slow receiver: skip a beat rather than pile sends up
            comm = cast(MPI.Comm, self._comm)   # open: only an open one sends
            self._sending.append((j, comm.Isend(message, j, _TAG), message))

    def _sent(self) -> List[tuple]:
        """Forget the sends that have completed; return the others."""
        self._sending = [sent for sent in self._sending if not sent[1].Test()]
        return self._sending

    def _relay(self, now: float) -> None:
        """Put the departure that matters most on this node's board, when it changes."""
        notice = self._most_important(now)
        if (notice and notice[:3]) != self._relayed:
            self._relayed = notice and notice[:3]
            gone, left, seq, since = notice or (0, 0, 0, 0.0)
            self.board.relay(gone, left, seq, int(since * 1e9))

    def _most_important(self, now: float) -> tuple:
        """(who: rank + 1, or -(node + 1) for a silent node; state; seq; since) of a silent
        node, else of the lowest dead rank, else of the rank that left earliest; or ()."""
        for j in self._others:
            if self._silent[j]:
                return (-j - 1, SILENT, 0, now)
        gone = [(row[_STATE] != DIED, int(row[_SEQ]), rank)
                for rank, (row, _) in self._rows.items() if row[_STATE]]
        if not gone:
            return ()
        _, seq, rank = min(gone)
        row, since = self._rows[rank]
        return (rank + 1, int(row[_STATE]), seq, since)
