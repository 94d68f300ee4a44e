"""Every thread's Python stack: this process's own, and those of its peers on this node.

- :func:`dump`: this process's threads, now, to a stream that has a file descriptor
  (faulthandler writes to descriptors: under Jupyter or pytest's capsys ``sys.stderr`` has
  none, so the first of the given stream, ``sys.stderr`` and ``sys.__stderr__`` that has one).
- :class:`PeerStacks`: ask a peer on this node for its stacks through a
  :class:`~cupycomm.faults.board.Board`. The peer's watcher thread writes them into a file
  named after its pid, then an end mark, so that the reader never takes half a stack. A
  peer whose thread does not answer (its main thread holds the GIL) is sent SIGUSR1, and
  faulthandler writes its stacks from the signal handler, which works even then.
"""
from __future__ import annotations

import faulthandler
import glob
import os
import signal
import sys
import tempfile
import time
from typing import Any, Optional, TextIO

from .board import Board, alive

__all__ = ["dump", "with_descriptor", "PeerStacks", "WAIT"]

_END_MARK = "-- end of stack --\n"
WAIT = 1.0   # seconds: the longest wait for one peer's stacks


def with_descriptor(*streams: Any) -> Optional[TextIO]:
    """The first of ``streams``, ``sys.stderr`` and ``sys.__stderr__`` with a real file
    descriptor, or None."""
    for stream in (*streams, sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
        except (AttributeError, ValueError, OSError):
            continue
        return stream
    return None


def dump(stream: Any = None) -> None:
    """This process's threads' stacks, to ``stream`` (see :func:`with_descriptor`)."""
    target = with_descriptor(stream) if stream is not None else with_descriptor()
    if target is not None:
        target.flush()
        faulthandler.dump_traceback(file=target, all_threads=True)


def _stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"cupycomm-stack-{pid}.txt")


def _remove_stale_stack_files() -> None:
    """Remove the stack files of processes that are gone: a rank that was killed, or left
    with ``os._exit``, never closed its :class:`PeerStacks`."""
    for path in glob.glob(_stack_file(0).replace("-0.txt", "-*.txt")):
        pid = path.rsplit("-", 1)[1][:-len(".txt")]
        if pid.isdigit() and not alive(int(pid)):
            try:
                os.unlink(path)
            except OSError:   # another rank removed it first, or it is not ours to remove
                pass


class PeerStacks:
    """Stacks on request between the processes of one :class:`Board`, whose rows hold the
    fields ``asked`` (requests made of that row's process) and ``written`` (requests it has
    answered). While it exists, SIGUSR1 makes this process write its stacks to its file.

    Example::

        peers = PeerStacks(board, asked=ASKED, written=WRITTEN)
        peers.answer("")                  # on this process's watcher thread, at every look
        text = peers.ask(index)           # another process's stacks, or why there are none
        peers.close()
    """

    active = 0   # how many exist: SIGUSR1 is theirs meanwhile

    def __init__(self, board: Board, asked: int, written: int) -> None:
        PeerStacks.active += 1
        self._board, self._asked, self._written = board, asked, written
        _remove_stale_stack_files()
        self._fd = os.open(_stack_file(os.getpid()), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        faulthandler.register(signal.SIGUSR1, file=self._fd, all_threads=True)

    def answer(self, preface: str) -> None:
        """Write this process's stacks, after ``preface``, if a peer asked for them."""
        mine = self._board.mine
        asked = int(mine[self._asked])
        if asked == mine[self._written]:
            return
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.ftruncate(self._fd, 0)
        if preface:
            os.write(self._fd, f"{preface.rstrip()}\n\n".encode())
        faulthandler.dump_traceback(file=self._fd, all_threads=True)
        os.write(self._fd, _END_MARK.encode())
        mine[self._written] = asked

    def ask(self, index: int, pid: int) -> str:
        """The stacks of the process of row ``index`` (``pid``), or a line saying why not."""
        if not alive(pid):
            return "(the process has exited)\n"
        row = self._board.rows[index]
        row[self._asked] += 1
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if row[self._written] == row[self._asked]:
                return _read(_stack_file(pid), 0).replace(_END_MARK, "")
        return _by_signal(pid)

    def close(self) -> None:
        PeerStacks.active -= 1
        faulthandler.unregister(signal.SIGUSR1)
        os.close(self._fd)
        try:
            os.unlink(_stack_file(os.getpid()))
        except FileNotFoundError:
            pass


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


def _by_signal(pid: int) -> str:
    """Signal ``pid`` to dump its stacks from faulthandler's handler; return what it wrote by
    the time the file stops growing."""
    path = _stack_file(pid)
    start = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(the process has exited)\n"
    deadline, seen = time.monotonic() + WAIT, start
    while time.monotonic() < deadline:
        time.sleep(0.1)
        size = os.path.getsize(path) if os.path.exists(path) else 0
        if size > start and size == seen:
            break
        seen = size
    text = _read(path, start)
    if not text:
        return f"(no stack arrived within {WAIT:g} s)\n"
    return ("(its thread did not answer, its main thread may hold the GIL: this stack was "
            "written from a signal handler and may be cut short)\n" + text)
