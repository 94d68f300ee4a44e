"""Ending a test that hangs: every rank's Python stack, then MPI_Abort of the whole job.

A thread on each rank watches a deadline armed for each test. When it passes, the first rank
of a host to notice prints the test and its own stack, then asks the host's other ranks for
theirs with SIGUSR1: faulthandler writes a stack from the signal handler itself, so this works
while a rank's main thread is blocked inside MPI, even holding the GIL. Each rank's signal
dump goes to a file of its own, which the first rank prints under the rank's number, so the
stacks read in order. Then it aborts the job.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import tempfile
import threading
import time
from typing import Dict, Optional, TextIO

from mpi4py import MPI

__all__ = ["HangGuard", "EXIT_CODE"]

EXIT_CODE = 1  # a hang is a test failure
# Every rank arms at the same moment; only the lowest rank of a host acts at the deadline, the
# others later (this, plus the time the first needs to collect the stacks), in case the first
# one's thread cannot run (its main thread holds the GIL in C code).
_GRACE = 2.0
_STACK_WAIT = 1.0  # the longest wait for one rank's stack


def _stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"cupycomm-stack-{pid}.txt")


class HangGuard:
    """A per-rank deadline; past it, every rank's stack is printed and the job is aborted.

    Args:
        rank: this rank in COMM_WORLD.
        out: where the stacks go: the terminal's stderr, not pytest's capture of it.

    Example::

        guard = HangGuard(rank, sys.stderr)
        guard.know_host({0: 4242, 1: 4243})
        guard.arm(60, "tests/test_x.py::test_y")
        ...                                   # the test
        guard.disarm()
    """

    def __init__(self, rank: int, out: TextIO) -> None:
        self._rank = rank
        self._peers: Dict[int, int] = {}
        self._late = 0.0
        self._out = out
        self._own_file = open(_stack_file(os.getpid()), "w+")
        faulthandler.register(signal.SIGUSR1, file=self._own_file, all_threads=True)
        self._cond = threading.Condition()
        self._deadline: Optional[float] = None
        self._what = ""
        self._seconds = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="cupycomm-hang-guard",
                                        daemon=True)
        self._thread.start()

    def know_host(self, host_ranks: Dict[int, int]) -> None:
        """{rank: pid} of the ranks on this host, this one included."""
        self._peers = {r: pid for r, pid in host_ranks.items() if r != self._rank}
        if self._rank != min(host_ranks):
            self._late = _GRACE + _STACK_WAIT * len(self._peers)

    def arm(self, seconds: float, what: str) -> None:
        """Abort the job unless :meth:`disarm` comes within ``seconds`` (0: never)."""
        with self._cond:
            self._deadline = time.monotonic() + seconds + self._late if seconds > 0 else None
            self._what, self._seconds = what, seconds
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        faulthandler.unregister(signal.SIGUSR1)
        self._own_file.close()
        os.unlink(self._own_file.name)
        self._out.close()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                elif time.monotonic() < self._deadline:
                    self._cond.wait(self._deadline - time.monotonic())
                else:
                    break
            else:
                return
        self._expire()

    def _expire(self) -> None:
        out, host = self._out, socket.gethostname()
        out.write(f"\n{' cupycomm.testing: timeout ':=^79}\n{self._what} did not finish within "
                  f"{self._seconds:g} s (mpi_timeout); the Python stack of each rank on host "
                  f"{host} follows, then the MPI job is aborted\n"
                  f"{f' rank {self._rank} (pid {os.getpid()}) ':-^79}\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        for rank, pid in sorted(self._peers.items()):
            out.write(f"{f' rank {rank} (pid {pid}) ':-^79}\n{_ask_for_stack(pid)}")
            out.flush()
        out.write(f"cupycomm.testing: aborting the MPI job (exit status {EXIT_CODE})\n")
        out.flush()
        self._own_file.close()
        os.unlink(self._own_file.name)
        MPI.COMM_WORLD.Abort(EXIT_CODE)


def _ask_for_stack(pid: int) -> str:
    """Signal ``pid`` to dump its stack into its file; return what it wrote."""
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
    try:
        with open(path) as f:
            f.seek(start)
            text = f.read()
        os.unlink(path)
    except OSError as error:
        return f"(its stack file {path} could not be read: {error})\n"
    return text or f"(no stack arrived within {_STACK_WAIT:g} s)\n"
