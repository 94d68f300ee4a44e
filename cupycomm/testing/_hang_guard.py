"""Ending a test that cannot finish: why, each rank's failure and Python stack, then MPI_Abort.

The process's watchdog thread looks at each rank's :class:`HangGuard`: a deadline armed for
each test, and a :class:`~cupycomm.faults.board.Board` on which every rank of its node says
where it is (which test, running it or waiting in one of the plugin's rounds, its outcome).
The job is ended at the deadline, at once when a rank of the node has died, and when a rank
that failed a phase waits while another still runs it ``FAILED_WAIT`` s later. The first
rank of the node to notice reports and aborts. The rules, and why: docs/internals.md,
"testing/_hang_guard.py".
"""
from __future__ import annotations

import os
import socket
import time
from typing import Dict, List, Optional, TextIO, Tuple

import numpy as np

from ..faults import stacks
from ..faults.abort import abort_world
from ..faults.board import Board, alive
from ..faults.watchdog import unwatch, watch
from ._outcomes import Kind, ranks_label

__all__ = ["HangGuard", "EXIT_CODE", "FAILED_WAIT", "FIELDS", "RUNNING", "IN_ROUND",
           "FINISHED", "ABORTING", "position", "END_OF_SESSION"]

EXIT_CODE = 1  # a hang is a test failure
FAILED_WAIT = 5.0  # seconds a rank may stay inside a test after another failed it
_GRACE = 2.0

# A row of the board: the rank's pid, its position in the session, its state there, the
# outcome it waits with (a Kind) and since when (time.monotonic_ns(); the node's clock), and
# how many stacks were asked of it and how many it has written, and where its stack file is.
PID, POS, STATE, KIND, SINCE, ASKED, WRITTEN, STACKS = range(8)
FIELDS = 8
# ABORTING: the rank is ending the job (its report printed, MPI_Abort under way); its death
# then is no new fault for its peers to report (Open MPI kills them a moment after it died).
RUNNING, IN_ROUND, FINISHED, ABORTING = range(4)
# Outcomes that stop a rank's test body part way: its peers may wait for what it never did.
_STOPPED_EARLY = (Kind.FAILED, Kind.SKIPPED, Kind.XFAILED)
END_OF_SESSION = 2 ** 62  # the position of the last round


def position(test: int, step: int) -> int:
    """Where a rank is: in test number ``test`` (1, 2, ...; 0 before the first), at ``step``
    0 (setup), 1 (the setup's round), 2 (call and teardown) or 3 (their round)."""
    return 4 * test + step


class HangGuard:
    """A per-rank deadline and look-out, looked at by the watchdog thread; past the one or on
    what the other sees, every rank's failure and stack are printed and the job is aborted.

    Args:
        rank: this rank in the plugin's communicator (the world).
        out: where the report goes: the terminal's stderr, not pytest's capture of it.

    Example::

        guard = HangGuard(rank, sys.stderr)
        guard.arm(60, "the start of the session")   # covers the collective set-up below
        guard.know_node(Board(node, FIELDS), ranks_of_the_node)
        guard.arm(60, "tests/test_x.py::test_y")
        guard.at(position(1, 0), RUNNING)
        ...                                   # the test
        guard.disarm()
    """

    timeout = 0.0   # the guard never waits itself: the GIL backstop is the collectives' affair

    def __init__(self, rank: int, out: TextIO) -> None:
        self._rank = rank
        self._board: Optional[Board] = None
        self._ranks: List[int] = []
        self._stacks: Optional[stacks.PeerStacks] = None
        self._late = 0.0
        self._out = out
        self._failure = ""
        self.earlier: List[str] = []  # the tests that failed before, for the report
        self.tests: List[str] = []  # the session's tests, in order (test n is tests[n - 1])
        self._dead_since: Dict[int, float] = {}
        self._deadline: Optional[float] = None
        self._what = ""
        self._seconds = 0.0
        self._expired = False
        watch(self)

    def know_node(self, board: Board, ranks: List[int]) -> None:
        """The board of this node's ranks (``ranks``: their ranks, by row of the board)."""
        board.mine[PID] = os.getpid()
        self._ranks = ranks
        self._stacks = stacks.PeerStacks(board, ASKED, WRITTEN, STACKS)
        if self._rank != min(ranks):
            self._late = _GRACE + stacks.WAIT * (len(ranks) - 1)
        self._board = board

    def arm(self, seconds: float, what: str) -> None:
        """Abort the job unless :meth:`disarm` comes within ``seconds`` (0: no deadline; the
        board is looked at all the same)."""
        self._what, self._seconds = what, seconds
        self._deadline = (time.monotonic() + seconds + self._late if seconds > 0
                          else float("inf"))

    def disarm(self) -> None:
        self._deadline = None

    def at(self, pos: int, state: int, kind: Kind = Kind.PASSED, failure: str = "") -> None:
        """Say where this rank is (see :func:`position`); ``failure``: what went wrong, for
        the report, when ``kind`` is not PASSED."""
        self._failure = failure
        if self._board is not None:
            mine = self._board.mine
            mine[SINCE] = time.monotonic_ns()
            mine[POS], mine[STATE], mine[KIND] = pos, state, kind

    def close(self) -> None:
        unwatch(self)
        if self._board is not None:
            self.at(END_OF_SESSION, FINISHED)
        if self._stacks is not None:
            self._stacks.close()
        self._out.close()

    # -- on the watchdog thread -------------------------------------------------------------------
    def check(self, now: float) -> bool:
        if self._expired:
            return False
        if self._stacks is not None:
            self._stacks.answer(self._failure)
        verdict = self._verdict(now)
        if verdict is not None:
            self._expired = True
            self._expire(*verdict)
        return False

    def _verdict(self, now: float) -> Optional[Tuple[str, str]]:
        """(title, why) when the job must end now, else None."""
        if self._deadline is None:
            return None
        if now >= self._deadline:
            return "timeout", (f"{self._what} did not finish within {self._seconds:g} s "
                               f"(mpi_timeout)")
        if self._board is None:
            return None
        rows, ranks = self._board.rows.copy(), self._ranks
        return (self._a_rank_died(rows, ranks, now)
                or self._stuck_after_a_failure(rows, ranks, now))

    def _a_rank_died(self, rows: np.ndarray, ranks: List[int],
                     now: float) -> Optional[Tuple[str, str]]:
        dead = [i for i, row in enumerate(rows) if row[STATE] not in (FINISHED, ABORTING)
                and row[PID] and not alive(int(row[PID]))]
        for i in dead:
            self._dead_since.setdefault(i, now)
        if not dead:
            return None
        living = [ranks[i] for i in range(len(ranks)) if i not in dead]
        # The first living rank of the host acts at once; the others later, as at a deadline.
        delay = 0.0 if living and self._rank == living[0] else _GRACE + stacks.WAIT * len(ranks)
        if now - min(self._dead_since[i] for i in dead) < delay:
            return None
        named = ", ".join(f"rank {ranks[i]} (pid {rows[i, PID]})" for i in dead)
        return "a rank died", (f"{named} died during {self._what}: its process ended (os._exit, "
                               f"a signal, a crash) before the end of the session")

    def _stuck_after_a_failure(self, rows: np.ndarray, ranks: List[int],
                               now: float) -> Optional[Tuple[str, str]]:
        waiting = [i for i, row in enumerate(rows)
                   if row[STATE] == IN_ROUND and row[KIND] in _STOPPED_EARLY]
        for i in waiting:
            stuck = [ranks[j] for j, row in enumerate(rows)
                     if row[STATE] == RUNNING and row[POS] < rows[i, POS]]
            since = rows[i, SINCE] / 1e9
            if stuck and now - since >= FAILED_WAIT + self._late:
                rank, verb = ranks[i], "is" if len(stuck) == 1 else "are"
                test = self._test_at(int(min(r[POS] for r in rows if r[STATE] == RUNNING)))
                if rows[i, POS] == END_OF_SESSION:
                    title, what = "a rank left", f"rank {rank} left the session, and"
                    inside = test
                else:
                    outcome = Kind(rows[i, KIND]).name.lower()
                    title = f"a rank {outcome} while others wait"
                    what, inside = f"{test} {outcome} on rank {rank}, and", "it"
                return title, (f"{what} {ranks_label(stuck)} {verb} still inside {inside} "
                               f"{now - since:.0f} s later: most likely blocked in a "
                               f"collective that rank {rank} will never enter")
        return None

    def _test_at(self, pos: int) -> str:
        number = pos // 4
        return self.tests[number - 1] if 0 < number <= len(self.tests) else self._what

    def _expire(self, title: str, why: str) -> None:
        out, host = self._out, socket.gethostname()
        out.write(f"\n{f' cupycomm.testing: {title} ':=^79}\n{why}; the failure (if any) and "
                  f"the Python stack of each rank on host {host} follow, then the MPI job is "
                  f"aborted\n{f' rank {self._rank} (pid {os.getpid()}) ':-^79}\n")
        if self._failure:
            out.write(f"{self._failure.rstrip()}\n\n")
        stacks.dump(out)
        if self._board is not None:
            for index, (rank, row) in enumerate(zip(self._ranks, self._board.rows)):
                if rank != self._rank:
                    pid = int(row[PID])
                    out.write(f"{f' rank {rank} (pid {pid}) ':-^79}\n"
                              f"{self._stacks.ask(index, pid)}")
                    out.flush()
        if self.earlier:
            out.write(f"{' tests that failed before it ':-^79}\n"
                      + "".join(f"FAILED {nodeid}\n" for nodeid in self.earlier))
        out.write(f"cupycomm.testing: aborting the MPI job (exit status {EXIT_CODE})\n")
        out.flush()
        if self._stacks is not None:
            self._stacks.close()
        if self._board is not None:
            self._board.mine[STATE] = ABORTING
        abort_world(EXIT_CODE)
