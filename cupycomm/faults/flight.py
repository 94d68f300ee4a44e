"""The flight recorder: each communicator's last calls, and one block saying where every rank is.

Each communicator's :class:`Recorder` is a preallocated ring of slots
(``CUPYCOMM_FLIGHT_RECORDER_SIZE``, default 64), one written per call by the backends; the
watchdog thread stamps the times. On a timeout, a dead peer, an abort and on a signal
(:func:`report_signal`) a rank prints one block: its node's ranks (the first of the node to
report), then its own last calls. With ``CUPYCOMM_FLIGHT_RECORDER=DIR`` every rank also
writes its ring to ``DIR``, which ``python -m cupycomm.tools.flight DIR`` merges. The guide:
docs/guide/faults-and-timeouts.md, "The flight recorder"; the details: docs/internals.md.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, cast

from .. import _env
from .._bootstrap import node_name
from .._collectives import CALLS
from .. import _private as private
from ..errors import SharedFileRefused

__all__ = ["Recorder", "outcome", "summarize", "report_all", "install_signal", "report_signal",
           "DUMP_AFTER", "DUMP_EVERY", "REPORT_WINDOW"]

DUMP_AFTER = 1.0
"""Seconds a call waits before this rank writes its file (CUPYCOMM_FLIGHT_RECORDER)."""
DUMP_EVERY = 10.0
"""Seconds between two writes of it while the call goes on waiting."""
REPORT_WINDOW = 2.0
"""Seconds after a rank printed its node's ranks during which the node's other ranks print
only their own (the ranks of a node report within a look or two of each other)."""

_recorders: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


class Recorder:
    """The last ``size`` calls of one communicator (``calls``, written by the backends), with
    the watchdog's stamps.

    Example (what the host backend does per call)::

        tracker.seq = seq = tracker.seq + 1
        recorder.calls[seq % recorder.size] = "all_reduce"
    """

    __slots__ = ("calls", "size", "rank", "name", "board", "progress", "_issued", "_done",
                 "_seen", "_completed", "_wait", "_dumped", "_aborted", "__weakref__")

    def __init__(self, name: str, rank: int, board: Any = None,
                 progress: Optional[Callable[[], tuple]] = None) -> None:
        self.size = _env.read("CUPYCOMM_FLIGHT_RECORDER_SIZE")
        self.calls: List[Any] = [None] * self.size
        self.rank, self.name, self.board = rank, name, board
        self.progress = progress   # () -> (seq, busy, at) now: a report is up to date
        self._issued = [0.0] * self.size   # time.time() the watchdog saw each call issued
        self._done = [0.0] * self.size     # ... and completed (0: not yet)
        self._seen = 0          # the last call stamped as issued
        self._completed = 0     # the last call stamped as completed
        self._wait: Optional[tuple] = None   # (call, its number, since: time.time())
        self._dumped = 0.0
        self._aborted: set = set()   # the calls an abort cut short
        _recorders.add(self)

    # -- the watchdog thread ----------------------------------------------------------------------
    def look(self, seq: int, busy: Optional[str], at: int) -> None:
        """Stamp what changed since the last look: ``seq`` calls issued, the one numbered
        ``at`` blocked in ``busy`` (None: none); write this rank's file if a wait has gone
        on DUMP_AFTER s. Also answers the report signal (see :func:`install_signal`)."""
        wall = self._stamp(seq, busy, at)
        if busy is not None and wall - cast(Tuple[Any, ...], self._wait)[2] > DUMP_AFTER \
                and wall - self._dumped > DUMP_EVERY:
            self.dump()
        if _signalled():
            report_all(signal.Signals(cast(int, _signal)).name)   # set: it was signalled

    def _stamp(self, seq: int, busy: Optional[str], at: int) -> float:
        wall = time.time()
        size = self.size
        for number in range(max(self._seen + 1, seq - size + 1), seq + 1):
            self._issued[number % size], self._done[number % size] = wall, 0.0
        self._seen = seq
        completed = seq if busy is None else min(at - 1, seq)
        for number in range(max(self._completed + 1, completed - size + 1), completed + 1):
            self._done[number % size] = wall
        self._completed = max(self._completed, completed)
        if busy is None:
            self._wait = None
        elif self._wait is None or self._wait[1] != at or self._wait[0] != busy:
            self._wait = (busy, at, wall)
        return wall

    def aborted(self, numbers: Iterable[int]) -> None:
        """The calls ``numbers`` were cut short by an abort of their communicator (the device
        backend's): they never completed, whatever their events say."""
        self._aborted.update(numbers)

    # -- what it says -----------------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """This rank's state and its ring, as plain data (what its JSON file holds)."""
        if self.progress is not None:
            self._stamp(*self.progress())
        seq, size, now = self._seen, self.size, time.time()
        calls = []
        for number in range(max(1, seq - size + 1), seq + 1):
            slot = self.calls[number % size]
            name, backend = (slot, "mpi") if isinstance(slot, str) else (slot or ("?", "?"))
            done, aborted = self._done[number % size], number in self._aborted
            calls.append({"seq": number, "call": name, "backend": backend,
                          "issued_s_ago": round(now - self._issued[number % size], 1),
                          "completed": bool(done) and not aborted, "aborted": aborted})
        wait = None
        if self._wait is not None:
            wait = {"call": self._wait[0].partition(" #")[0], "seq": self._wait[1],
                    "for_s": round(now - self._wait[2], 1)}
        return {"rank": self.rank, "communicator": self.name, "node": node_name(),
                "pid": os.getpid(), "issued": seq, "completed": self._completed,
                "waiting": wait, "calls": calls, "written_at": now}

    def node_states(self, peers: bool = True) -> List[Dict[str, Any]]:
        """This rank's state and, from the node board, its node peers' (their progress
        only; none unless ``peers``)."""
        states = [self.state()]
        if self.board is not None and peers:
            from .board import BUSY, BUSY_SEQ, RANK, SEQ
            for row in self.board.peers():
                busy = CALLS[row[BUSY] - 1].name if row[BUSY] else None
                states.append({"rank": int(row[RANK]), "communicator": self.name,
                               "node": states[0]["node"], "issued": int(row[SEQ]),
                               "completed": int(row[BUSY_SEQ]) - 1 if busy else int(row[SEQ]),
                               "waiting": ({"call": busy, "seq": int(row[BUSY_SEQ])}
                                           if busy else None)})
        return states

    def history(self) -> str:
        """This rank's last calls, one line."""
        calls = self.state()["calls"][-8:]
        return "; ".join(f"#{c['seq']} {c['call']} {c['backend']}, {outcome(c)}"
                         for c in calls) or "none"

    def report(self, trigger: str, stream: Any) -> None:
        """Print this communicator's block to ``stream`` (where its node's ranks are, if this
        rank is its node's first to report; ``trigger`` says why) and write this rank's file."""
        whole_node = self.board is None or self.board.first_to_report(REPORT_WINDOW)
        lines = summarize(self.node_states(peers=whole_node))
        stream.write(f"cupycomm flight recorder ({trigger}; communicator {self.name}, "
                     f"seen from rank {self.rank} on {node_name()}):\n"
                     + "".join(f"  {line}\n" for line in lines)
                     + f"  rank {self.rank}'s last calls: {self.history()}\n")
        self.dump()

    def close(self) -> None:
        """The communicator closed: write this rank's file a last time; no more reports."""
        self.dump()
        _recorders.discard(self)

    def dump(self) -> None:
        """Write this rank's file, if CUPYCOMM_FLIGHT_RECORDER names a directory."""
        directory = _env.read("CUPYCOMM_FLIGHT_RECORDER")
        if not directory:
            return
        self._dumped = time.time()
        try:
            prefix = "" if self.name == "world" else "".join(
                c if c.isalnum() else "_" for c in self.name) + "."
            path = os.path.join(directory, f"{prefix}rank-{self.rank}.json")
            private.replace_file(path, json.dumps(self.state()), make=True)
        except (OSError, SharedFileRefused) as error:
            sys.stderr.write(f"cupycomm flight recorder: could not write {directory}: {error}\n")


def outcome(call: Dict[str, Any]) -> str:
    """How a call of a rank's ring (its state's ``calls``) ended: done, aborted or not done."""
    return "aborted" if call.get("aborted") else "done" if call["completed"] else "not done"


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _where(state: Dict[str, Any]) -> str:
    wait, completed = state["waiting"], state["completed"]
    if wait is None:
        return f"completed #{completed} and is in no call"
    return f"completed #{completed}, wait in {wait['call']} #{wait['seq']}"


def summarize(states: Iterable[Dict[str, Any]]) -> List[str]:
    """One line per group of ranks on one node in the same place, for example
    ``ranks 0-2 (nodeA) completed #41, wait in all_reduce #42 (rank 0 for 12 s)``."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for state in sorted(states, key=lambda s: s["rank"]):
        groups.setdefault((state["node"], _where(state)), []).append(state)
    lines = []
    for (node, where), members in groups.items():
        ranks = [m["rank"] for m in members]
        if len(members) == 1:
            where = where.replace("wait in", "waits in")
        since = [m for m in members if (m.get("waiting") or {}).get("for_s") is not None]
        suffix = ""
        if since:
            longest = max(since, key=lambda m: m["waiting"]["for_s"])
            suffix = f" (rank {longest['rank']} for {longest['waiting']['for_s']:.0f} s)"
        lines.append(f"{_ranks_text(ranks)} ({node}) {where}{suffix}")
    return lines


def report_all(trigger: str, stream: Any = None) -> None:
    """Print each live communicator's block (:meth:`Recorder.report`) and write this rank's
    files; ``trigger`` says why."""
    stream = stream or sys.stderr
    for recorder in list(_recorders):
        recorder.report(trigger, stream)
    stream.flush()


# -- SIGUSR1 --------------------------------------------------------------------------------------
# A Python signal handler runs only on the main thread, which a hang keeps inside a C call; the
# interpreter's C handler also writes the signal's number to the wakeup descriptor at once, and
# the watchdog thread reads it there at its next look.
_wakeup: Optional[tuple] = None   # (reader, writer): the signal numbers come to reader
_signal: Optional[int] = None     # the signal that asks for a report


def report_signal() -> Optional[int]:
    """The signal that makes every rank report (``signal.SIGUSR1``, or ``SIGUSR2`` where the
    MPI library handles SIGUSR1 itself, as MPICH does), or None before ``init()`` or where
    neither is free."""
    return _signal


def _free(number: int) -> bool:
    """Whether signal ``number`` has its default action, in C: MPI libraries install
    handlers that Python's own record does not show."""
    if signal.getsignal(number) is not signal.SIG_DFL:
        return False
    try:
        import ctypes
        old = ctypes.create_string_buffer(256)   # struct sigaction; sa_handler comes first
        if ctypes.CDLL(None).sigaction(number, None, old) != 0:
            return False
        return not ctypes.c_void_p.from_buffer(old).value   # SIG_DFL is 0
    except (OSError, AttributeError):   # no sigaction (not POSIX): leave signals alone
        return False


def install_signal() -> None:
    """Report on SIGUSR1 (SIGUSR2 where SIGUSR1 is the MPI library's; from ``init()``, on the
    main thread), unless something else uses both or the wakeup descriptor (an asyncio
    loop, the pytest plugin's stack requests)."""
    global _wakeup, _signal
    from .stacks import PeerStacks
    if _wakeup is not None or PeerStacks.active:
        return
    number = next((n for n in (signal.SIGUSR1, signal.SIGUSR2) if _free(n)), None)
    if number is None:
        return
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:   # someone else's: leave it be
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return
    signal.signal(number, lambda number, frame: None)
    _wakeup, _signal = (reader, writer), number


def _signalled() -> bool:
    if _wakeup is None:
        return False
    try:
        data = _wakeup[0].recv(64)
    except (BlockingIOError, InterruptedError):
        return False
    return _signal in data
