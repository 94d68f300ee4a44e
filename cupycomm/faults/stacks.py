"""Every thread's Python stack: this process's own, and those of its peers on this node.

- :func:`dump`: this process's threads, now, to a stream that has a file descriptor
  (faulthandler writes to descriptors: under Jupyter or pytest's capsys ``sys.stderr`` has
  none, so the first of the given stream, ``sys.stderr`` and ``sys.__stderr__`` that has one).
- :class:`PeerStacks`: ask a peer on this node for its stacks through a
  :class:`~cupycomm.faults.board.Board`. The peer's watcher thread writes them into its
  stack file, then an end mark, so that the reader never takes half a stack. The file is in
  a private directory of the peer's (:mod:`cupycomm._private`, in the temporary
  directory) whose name only the board tells; the reader opens it only if it is its own
  user's, mode 0600. A peer whose thread does not answer (its main thread holds the GIL) is
  sent SIGUSR1, and faulthandler writes its stacks from the signal handler, which works
  even then.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from typing import Any, Optional, TextIO

from ..errors import SharedFileRefused
from .. import _private as private
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


_FILE = "stacks.txt"   # its name in its process's private directory


class PeerStacks:
    """Stacks on request between the processes of one :class:`Board`, whose rows hold the
    fields ``asked`` (requests made of that row's process), ``written`` (requests it has
    answered) and ``where`` (the token of its stack file's private directory). While it
    exists, SIGUSR1 makes this process write its stacks to its file.

    Example::

        peers = PeerStacks(board, asked=ASKED, written=WRITTEN, where=WHERE)
        peers.answer("")                  # on this process's watcher thread, at every look
        text = peers.ask(index, pid)      # another process's stacks, or why there are none
        peers.close()
    """

    active = 0   # how many exist: SIGUSR1 is theirs meanwhile

    def __init__(self, board: Board, asked: int, written: int, where: int) -> None:
        self._board, self._asked, self._written, self._where = board, asked, written, where
        self._directory, token = private.make_directory(private.temporary_directory())
        self._fd = private.create(self._directory, _FILE)
        board.mine[where] = token
        PeerStacks.active += 1
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
        if not row[self._where]:
            return "(it has not made its stack file yet)\n"
        directory = private.directory_of(private.temporary_directory(), pid,
                                         int(row[self._where]))
        row[self._asked] += 1
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if row[self._written] == row[self._asked]:
                return _read(directory, 0).replace(_END_MARK, "")
        return _by_signal(pid, directory)

    def close(self) -> None:
        PeerStacks.active -= 1
        faulthandler.unregister(signal.SIGUSR1)
        os.close(self._fd)
        private.remove(self._directory)


def _read(directory: str, start: int) -> str:
    """The stack file in ``directory`` from ``start`` on; the directory is removed (the job is
    about to end)."""
    try:
        with os.fdopen(private.open_checked(directory, _FILE, os.O_RDONLY)) as f:
            f.seek(start)
            text = f.read()
    except (OSError, SharedFileRefused) as error:
        return f"(its stack file in {directory} could not be read: {error})\n"
    private.remove(directory)
    return text


def _size(directory: str) -> int:
    try:
        return os.stat(os.path.join(directory, _FILE)).st_size
    except OSError:
        return 0


def _by_signal(pid: int, directory: str) -> str:
    """Signal ``pid`` to dump its stacks from faulthandler's handler; return what it wrote by
    the time the file stops growing."""
    start = _size(directory)
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(the process has exited)\n"
    deadline, seen = time.monotonic() + WAIT, start
    while time.monotonic() < deadline:
        time.sleep(0.1)
        size = _size(directory)
        if size > start and size == seen:
            break
        seen = size
    text = _read(directory, start)
    if not text:
        return f"(no stack arrived within {WAIT:g} s)\n"
    return ("(its thread did not answer, its main thread may hold the GIL: this stack was "
            "written from a signal handler and may be cut short)\n" + text)
