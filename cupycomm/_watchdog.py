"""The watchdog: no rank waits forever, and the one that gives up says why.

The call path writes two attributes of a communicator's :class:`Tracker`: ``seq`` (how many
collectives this rank has issued on it) and, for as long as a blocking MPI call lasts,
``busy`` (that call's name). No other thread's stack or locals are read: in CPython 3.11,
reading the locals of a frame that another thread is running can crash the interpreter. One
daemon thread per process (started by the first communicator of more than one rank) looks
ten times a second and:

- publishes the tracker to the communicator's node board (:mod:`cupycomm._board`), so that
  peers on this node can see how far this rank has got;
- when a blocking host call has waited longer than the communicator's timeout: prints which
  collective, its sequence number and which ranks on this node have not arrived, with this
  rank's Python stacks, and aborts the job (MPI cannot cancel a collective);
- when a blocking host call waits and a peer on this node has died: aborts the job naming
  that peer at once; when the peer is only exiting (its program ended, or it called
  sys.exit, even with code 0), after a grace period of 2 s (it may have finished this very
  collective before it left);
- when the device backend has work that has not finished for longer than the timeout, or NCCL
  reports an asynchronous error: aborts the NCCL communicator (its kernels end, every later
  device call raises :class:`~cupycomm.errors.NcclError`) and says so;
- re-arms a C-level timer (``faulthandler.dump_traceback_later``): if the main thread holds
  the GIL past the largest timeout plus a margin (that timeout again, at least 10 s and at
  most 30 s, so that a loaded machine delaying this thread is not taken for a hang) — a hung
  call that never releases it, so that no Python thread can run — the timer prints every
  thread's stack and ends the process, and mpiexec then ends the job.

The thread only reads Python attributes, CUDA events and shared memory; it makes no MPI call
except ``MPI_Abort``.
"""
from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
import weakref
from typing import Any, Iterator, Optional


from . import _board
from ._board import BUSY, BUSY_SEQ, LEFT, PID, RANK, SEQ, NodeBoard
from ._bootstrap import abort_world, describe_rank

__all__ = ["Tracker", "watch", "unwatch", "abort_job",
           "COLLECTIVES", "GRACE", "INTERVAL", "HOLD_MARGIN"]

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
               "all_to_all", "scatter", "gather", "send", "recv", "sendrecv", "barrier",
               "batch", "debug check", "broadcast_object", "all_gather_object",
               "gather_object", "scatter_object")
_CODE = {name: code for code, name in enumerate(COLLECTIVES, start=1)}
INTERVAL = 0.1       # seconds between two looks
GRACE = 2.0          # seconds a wait may go on after a peer has started to exit
HOLD_MARGIN = (10.0, 30.0)   # the GIL may be held this much (bounds) past the largest timeout


class Tracker:
    """One communicator's progress, and what the watchdog needs to judge it."""

    __slots__ = ("seq", "busy", "name", "rank", "size", "timeout", "board", "device",
                 "_waiting", "__weakref__")

    def __init__(self, name: str, rank: int, size: int, timeout: float,
                 board: Optional[NodeBoard] = None) -> None:
        self.seq = 0
        self.busy: Optional[str] = None   # the blocking call in progress, set by the call path
        self.name = name
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.board = board
        self.device: Any = None    # the NCCL backend, once there is one
        self._waiting: Optional[tuple] = None   # ((seq, busy) or "device", since when)

    # -- called by the backends on the main thread ------------------------------------------------
    @contextlib.contextmanager
    def inside(self, label: str) -> Iterator[None]:
        """Mark a blocking call outside the backends' call path (object collectives, the
        debug check). The backends write ``busy`` themselves: a with-block costs too much
        there."""
        self.busy = label
        try:
            yield
        finally:
            self.busy = None

    def expired(self, label: str, timeout: float) -> None:
        """``Work.wait(timeout=)`` ran out on the host: MPI cannot cancel, so end the job."""
        abort_job(f"{label} #{self.seq} on communicator {self.name} did not complete within "
                  f"the {timeout:g} s given to wait() on {describe_rank()}; "
                  f"{self._arrivals(self.seq)}; MPI cannot cancel a collective")

    # -- called by the watchdog thread ------------------------------------------------------------
    def check(self, now: float) -> None:
        """Judge this communicator at time ``now``: publish its progress, end a wait that has
        gone on too long or whose peer is gone, abort device work that stopped progressing."""
        seq, busy = self.seq, self.busy
        if self.board is not None:
            self.board.publish(seq, _CODE.get(busy, 0) if busy else 0, seq if busy else 0)
        if busy is not None:
            waited = self._waited((seq, busy), now)
            if waited > self.timeout:
                abort_job(f"{busy} #{seq} on communicator {self.name} has waited "
                          f"{waited:.0f} s (timeout {self.timeout:g} s) on {describe_rank()}; "
                          f"{self._arrivals(seq)}; MPI cannot cancel a collective")
            elif self.board is not None:
                self._check_peers(busy, seq, waited)
        elif self.device is not None and self.device.has_pending_work():
            waited = self._waited(("device", seq), now)
            if waited > self.timeout:
                self._abort_device(f"device collectives up to #{seq} on communicator "
                                   f"{self.name} have not finished after {waited:.0f} s "
                                   f"(timeout {self.timeout:g} s)")
        else:
            self._waiting = None
        if self.device is not None:
            error = self.device.async_error()
            if error:
                self._abort_device(f"NCCL reported an asynchronous error: {error}")

    def _check_peers(self, busy: str, seq: int, waited: float) -> None:
        """End the job if a peer this rank may be waiting for is gone: at once if its process
        has ended, after the grace period if it is only exiting (it may have finished this
        very collective before it left)."""
        for row in self.board.peers():
            if not _board.alive(int(row[PID])):
                state = "has died"
            elif row[LEFT] and waited > GRACE:
                state = "is exiting (its program ended or called sys.exit)"
            else:
                continue
            abort_job(f"rank {row[RANK]} of communicator {self.name} (pid {row[PID]}) {state} "
                      f"while {describe_rank()} waits in {busy} #{seq}")

    def _waited(self, key: tuple, now: float) -> float:
        if self._waiting is None or self._waiting[0] != key:
            self._waiting = (key, now)
        return now - self._waiting[1]

    def _abort_device(self, reason: str) -> None:
        if self.device.abort(reason):
            sys.stderr.write(f"cupycomm watchdog: {reason} on {describe_rank()}; the NCCL "
                             f"communicator was aborted: later device calls raise NcclError\n")
            sys.stderr.flush()
        self._waiting = None

    def _arrivals(self, seq: int) -> str:
        """Which ranks on this node have not issued collective ``seq`` yet."""
        if self.board is None:
            return "no other rank's progress is known"
        late, behind = [], []
        for row in self.board.peers():
            if row[SEQ] < seq:
                doing = (f"blocked in {COLLECTIVES[row[BUSY] - 1]} #{row[BUSY_SEQ]}"
                         if row[BUSY] else "not in a collective")
                late.append(int(row[RANK]))
                behind.append(f"rank {row[RANK]} is at #{row[SEQ]}, {doing}")
        others = self.size - len(self.board.rows)
        text = (f"ranks not arrived: {late} ({'; '.join(behind)})" if late
                else "every rank on this node has arrived")
        if others:
            text += f"; {others} ranks on other nodes: not known here"
        return text


def abort_job(message: str) -> None:
    """Print ``message`` and this rank's stacks, then end every rank of the job."""
    sys.stderr.write(f"cupycomm watchdog: {message}: aborting the job\n")
    sys.stderr.flush()
    stream = _backstop_file()
    if stream is not None:
        faulthandler.dump_traceback(file=stream, all_threads=True)
    abort_world()


def _backstop_file() -> Any:
    """A stream with a real file descriptor for faulthandler (under Jupyter or pytest's capsys
    sys.stderr has none), else None."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
        except (AttributeError, ValueError, OSError):
            continue
        return stream
    return None


class _Watchdog(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="cupycomm-watchdog", daemon=True)
        self.trackers: "weakref.WeakSet[Tracker]" = weakref.WeakSet()
        self.armed = False

    def run(self) -> None:
        while True:
            now = time.monotonic()
            trackers = list(self.trackers)
            for tracker in trackers:
                tracker.check(now)
            self.arm_backstop(trackers)
            time.sleep(INTERVAL)

    def arm_backstop(self, trackers: list) -> None:
        stream = _backstop_file() if trackers else None
        if stream is not None:
            longest = max(t.timeout for t in trackers)
            low, high = HOLD_MARGIN
            limit = longest + max(low, min(longest, high))
            faulthandler.dump_traceback_later(limit, exit=True, file=stream)
            self.armed = True
        elif self.armed:
            faulthandler.cancel_dump_traceback_later()
            self.armed = False


_watchdog: Optional[_Watchdog] = None
_lock = threading.Lock()


def watch(tracker: Tracker) -> None:
    """Have the watchdog look after ``tracker`` (starting the watchdog the first time)."""
    global _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = _Watchdog()
            _watchdog.start()
        _watchdog.trackers.add(tracker)
        # Armed here too: the thread may not get the GIL before the main thread holds it.
        _watchdog.arm_backstop(list(_watchdog.trackers))


def unwatch(tracker: Tracker) -> None:
    if _watchdog is not None:
        _watchdog.trackers.discard(tracker)
