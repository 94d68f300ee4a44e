"""Ending a test that cannot finish: why, each rank's failure and Python stack, then MPI_Abort.

A thread on each rank watches a deadline armed for each test, and a board in shared memory
(:class:`HostBoard`) on which every rank of its host says where it is: which test, running it
or waiting in one of the plugin's rounds, and with which outcome. The job is ended

- at the deadline (the test's timeout);
- when a rank of the host has died (its process ended before it finished the session:
  ``os._exit``, a signal, a crash), at once;
- when a rank has finished a phase of a test with a failure, a skip or an expected failure
  and waits in the round that follows, while another rank is still running that phase
  ``FAILED_WAIT`` s later: that one is almost certainly blocked in a collective the first
  will never enter. (A test whose other ranks go on computing that long after one rank
  failed ends the job too; the failure is reported either way.)

The first rank of the host to notice prints why, then for each rank of the host its failure
of the test (if it has one) and its stack, then the tests that failed before, and aborts the
job. The other ranks act later (``_GRACE`` plus the time the first needs), in case the
first one's thread cannot run. A rank writes its stack when asked through the board (its
thread writes it, then an end marker, so that the reader never takes half a stack); a rank
whose thread does not answer (its main thread holds the GIL) is sent SIGUSR1 instead, and
faulthandler writes its stack from the signal handler, which works even then.
"""
from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import socket
import tempfile
import threading
import time
from typing import Dict, List, Optional, TextIO, Tuple

import numpy as np

from ..faults.board import alive, shared_directory
from .._bootstrap import abort_world
from ._outcomes import Kind, ranks_label

__all__ = ["HangGuard", "HostBoard", "EXIT_CODE", "FAILED_WAIT", "RUNNING", "IN_ROUND",
           "FINISHED", "position", "END_OF_SESSION"]

EXIT_CODE = 1  # a hang is a test failure
FAILED_WAIT = 5.0  # seconds a rank may stay inside a test after another failed it
_GRACE = 2.0
_STACK_WAIT = 1.0  # the longest wait for one rank's stack
_LOOK = 0.1  # seconds between two looks at the board
_END_MARK = "-- end of stack --\n"

# A row of the board: the rank's pid, its position in the session, its state there, the
# outcome it waits with (a Kind) and since when (time.monotonic_ns(); the host's clock), and
# how many stacks were asked of it and how many it has written.
PID, POS, STATE, KIND, SINCE, ASKED, WRITTEN = range(7)
_FIELDS = 8
RUNNING, IN_ROUND, FINISHED = range(3)
# Outcomes that stop a rank's test body part way: its peers may wait for what it never did.
_STOPPED_EARLY = (Kind.FAILED, Kind.SKIPPED, Kind.XFAILED)
END_OF_SESSION = 2 ** 62  # the position of the last round


def position(test: int, step: int) -> int:
    """Where a rank is: in test number ``test`` (1, 2, ...; 0 before the first), at ``step``
    0 (setup), 1 (the setup's round), 2 (call and teardown) or 3 (their round)."""
    return 4 * test + step


def _stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"cupycomm-stack-{pid}.txt")


class HostBoard:
    """The rows of the job's ranks on this host, in node-local shared memory.

    Made by every rank of the host at the start of the session: each opens (or creates) the
    same file, named after the pid of the host's first rank, and writes its own row; once
    every rank has done so, :meth:`unlink` removes the name.
    """

    def __init__(self, host_ranks: Dict[int, int], rank: int) -> None:
        ranks = sorted(host_ranks)
        self.ranks = ranks
        self.index = ranks.index(rank)
        self._path = os.path.join(shared_directory(),
                                  f"cupycomm-pytest-{host_ranks[ranks[0]]}")
        nbytes = len(ranks) * _FIELDS * 8
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.rows = np.frombuffer(self._map, np.int64).reshape(len(ranks), _FIELDS)
        self.mine = self.rows[self.index]
        self.mine[:] = 0
        self.mine[PID] = os.getpid()

    def unlink(self) -> None:
        """Remove the file's name (the host's first rank, once every rank has mapped it)."""
        if self.index == 0:
            os.unlink(self._path)

    def publish(self, pos: int, state: int, kind: int = Kind.PASSED) -> None:
        mine = self.mine
        mine[SINCE] = time.monotonic_ns()
        mine[POS], mine[STATE], mine[KIND] = pos, state, kind


class HangGuard:
    """A per-rank deadline and look-out; past the one or on what the other sees, every rank's
    failure and stack are printed and the job is aborted.

    Args:
        rank: this rank in COMM_WORLD.
        out: where the report goes: the terminal's stderr, not pytest's capture of it.

    Example::

        guard = HangGuard(rank, sys.stderr)
        guard.know_host({0: 4242, 1: 4243}, board)
        guard.arm(60, "tests/test_x.py::test_y")
        guard.at(position(1, 0), RUNNING)
        ...                                   # the test
        guard.disarm()
    """

    def __init__(self, rank: int, out: TextIO) -> None:
        self._rank = rank
        self._peers: Dict[int, int] = {}
        self._board: Optional[HostBoard] = None
        self._late = 0.0
        self._out = out
        self._failure = ""
        self.earlier: List[str] = []  # the tests that failed before, for the report
        self.tests: List[str] = []  # the session's tests, in order (test n is tests[n - 1])
        self._dead_since: Dict[int, float] = {}
        self._stack_fd = os.open(_stack_file(os.getpid()),
                                 os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        faulthandler.register(signal.SIGUSR1, file=self._stack_fd, all_threads=True)
        self._cond = threading.Condition()
        self._deadline: Optional[float] = None
        self._what = ""
        self._seconds = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="cupycomm-hang-guard",
                                        daemon=True)
        self._thread.start()

    def know_host(self, host_ranks: Dict[int, int], board: HostBoard) -> None:
        """{rank: pid} of the ranks on this host, this one included, and their board."""
        self._peers = {r: pid for r, pid in host_ranks.items() if r != self._rank}
        if self._rank != min(host_ranks):
            self._late = _GRACE + _STACK_WAIT * len(self._peers)
        self._board = board

    def arm(self, seconds: float, what: str) -> None:
        """Abort the job unless :meth:`disarm` comes within ``seconds`` (0: no deadline; the
        board is looked at all the same)."""
        with self._cond:
            self._deadline = (time.monotonic() + seconds + self._late if seconds > 0
                              else float("inf"))
            self._what, self._seconds = what, seconds
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def at(self, pos: int, state: int, kind: Kind = Kind.PASSED, failure: str = "") -> None:
        """Say where this rank is (see :func:`position`); ``failure``: what went wrong, for
        the report, when ``kind`` is not PASSED."""
        self._failure = failure
        if self._board is not None:
            self._board.publish(pos, state, kind)

    def close(self) -> None:
        if self._board is not None:
            self._board.publish(END_OF_SESSION, FINISHED)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        faulthandler.unregister(signal.SIGUSR1)
        os.close(self._stack_fd)
        os.unlink(_stack_file(os.getpid()))
        self._out.close()

    # -- the guard's thread -----------------------------------------------------------------------
    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                self._cond.wait(_LOOK)
                self._write_stack_if_asked()
                verdict = self._verdict(time.monotonic())
                if verdict is not None:
                    break
            else:
                return
        self._expire(*verdict)

    def _verdict(self, now: float) -> Optional[Tuple[str, str]]:
        """(title, why) when the job must end now, else None."""
        if self._deadline is None:
            return None
        if now >= self._deadline:
            return "timeout", (f"{self._what} did not finish within {self._seconds:g} s "
                               f"(mpi_timeout)")
        if self._board is None:
            return None
        rows, ranks = self._board.rows.copy(), self._board.ranks
        return (self._a_rank_died(rows, ranks, now)
                or self._stuck_after_a_failure(rows, ranks, now))

    def _a_rank_died(self, rows: np.ndarray, ranks: List[int],
                     now: float) -> Optional[Tuple[str, str]]:
        dead = [i for i, row in enumerate(rows)
                if row[STATE] != FINISHED and row[PID] and not alive(int(row[PID]))]
        for i in dead:
            self._dead_since.setdefault(i, now)
        if not dead:
            return None
        living = [ranks[i] for i in range(len(ranks)) if i not in dead]
        # The first living rank of the host acts at once; the others later, as at a deadline.
        delay = 0.0 if living and self._rank == living[0] else _GRACE + _STACK_WAIT * len(ranks)
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

    def _write_stack_if_asked(self) -> None:
        if self._board is None:
            return
        mine = self._board.mine
        asked = int(mine[ASKED])
        if asked == mine[WRITTEN]:
            return
        fd = self._stack_fd
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        if self._failure:
            os.write(fd, f"{self._failure.rstrip()}\n\n".encode())
        faulthandler.dump_traceback(file=fd, all_threads=True)
        os.write(fd, _END_MARK.encode())
        mine[WRITTEN] = asked

    def _expire(self, title: str, why: str) -> None:
        out, host = self._out, socket.gethostname()
        out.write(f"\n{f' cupycomm.testing: {title} ':=^79}\n{why}; the failure (if any) and "
                  f"the Python stack of each rank on host {host} follow, then the MPI job is "
                  f"aborted\n{f' rank {self._rank} (pid {os.getpid()}) ':-^79}\n")
        if self._failure:
            out.write(f"{self._failure.rstrip()}\n\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        for rank, pid in sorted(self._peers.items()):
            out.write(f"{f' rank {rank} (pid {pid}) ':-^79}\n{self._ask_for_stack(rank, pid)}")
            out.flush()
        if self.earlier:
            out.write(f"{' tests that failed before it ':-^79}\n"
                      + "".join(f"FAILED {nodeid}\n" for nodeid in self.earlier))
        out.write(f"cupycomm.testing: aborting the MPI job (exit status {EXIT_CODE})\n")
        out.flush()
        os.close(self._stack_fd)
        os.unlink(_stack_file(os.getpid()))
        abort_world(EXIT_CODE)

    def _ask_for_stack(self, rank: int, pid: int) -> str:
        """Ask rank ``rank`` (process ``pid``) for its failure and stack; return them."""
        if not alive(pid):
            return "(the process has exited)\n"
        board = self._board
        if board is not None:
            row = board.rows[board.ranks.index(rank)]
            row[ASKED] += 1
            deadline = time.monotonic() + _STACK_WAIT
            while row[WRITTEN] != row[ASKED] and time.monotonic() < deadline:
                time.sleep(0.02)
            if row[WRITTEN] == row[ASKED]:
                return _read(_stack_file(pid), 0).replace(_END_MARK, "")
        return _stack_by_signal(pid)


def _read(path: str, start: int) -> str:
    """The file from ``start`` on; the file is removed (the job is about to end)."""
    try:
        with open(path) as f:
            f.seek(start)
            text = f.read()
        os.unlink(path)
    except OSError as error:
        return f"(its stack file {path} could not be read: {error})\n"
    return text


def _stack_by_signal(pid: int) -> str:
    """Signal ``pid`` to dump its stack from faulthandler's handler; return what it wrote by
    the time the file stops growing."""
    path = _stack_file(pid)
    start = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(the process has exited)\n"
    deadline, seen = time.monotonic() + _STACK_WAIT, start
    while time.monotonic() < deadline:
        time.sleep(0.1)
        size = os.path.getsize(path) if os.path.exists(path) else 0
        if size > start and size == seen:
            break
        seen = size
    text = _read(path, start)
    if not text:
        return f"(no stack arrived within {_STACK_WAIT:g} s)\n"
    return ("(its thread did not answer, its main thread may hold the GIL: this stack was "
            "written from a signal handler and may be cut short)\n" + text)
