"""How each rank of a ``python -m cupycomm.run`` job ended, as it recorded it, and reading it back.

``cupycomm.run`` names its job directory in ``CUPYCOMM_RUN_DIR``; there :func:`start` (called
by ``init()``) writes ``rank-<r>.json`` for its world rank: ``running`` at once, then
``ended``, ``raised`` or ``aborted`` (why, in ``detail``), with the rank's node, host and
pid, and in ``survived`` the world ranks it went on without (:func:`note_survived`). A record
still ``running`` after the job belongs to a rank that ended without finishing. Each write
replaces the file whole; the launcher side holds the directory by its descriptor
(:class:`JobDirectory`). Strays and the rest: docs/internals.md, "run/exit_records.py".

Example (what the launcher side reads after the job)::

    records = job_directory.read(4)   # one dict per rank, or None where none was written
    records[2]["state"]               # 'running': rank 2 never reached its end
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
from typing import List, Optional, Sequence

from .. import _bootstrap, _env
from .. import _private as private
from ..errors import SharedFileRefused

__all__ = ["start", "record", "note_survived", "watch_before_init", "JobDirectory", "RUNNING",
           "ENDED", "RAISED", "ABORTED"]

RUNNING, ENDED, RAISED, ABORTED = "running", "ended", "raised", "aborted"

_path: Optional[str] = None   # this rank's record, once start() has written it
_state = RUNNING              # what it says
_survived: List[int] = []     # the world ranks this rank went on without


def _record_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.json")


def start() -> None:
    """Write this rank's ``running`` record and record its end at exit; only under
    ``cupycomm.run`` (CUPYCOMM_RUN_DIR set), once per process; a stray record where the
    world is not of the job's size."""
    global _path
    directory = _env.read("CUPYCOMM_RUN_DIR")
    if _path is not None or not directory:
        return
    if _bootstrap.world().Get_size() != _env.read("CUPYCOMM_RUN_SIZE"):
        _path = os.path.join(directory, f"stray-{socket.gethostname()}-{os.getpid()}.json")
    else:
        _path = _record_path(directory, _bootstrap.world().Get_rank())
    record(RUNNING)
    atexit.register(_at_exit)
    _record_uncaught()


def _write(path: str, rank: int, size: Optional[int], state: str, detail: str,
           **more: bool) -> None:
    """Replace the record at ``path`` whole (OSError or SharedFileRefused where it cannot)."""
    private.replace_file(path, json.dumps({
        "rank": rank, "size": size, "node": _bootstrap.node_name(), "host": socket.gethostname(),
        "pid": os.getpid(), "state": state, "detail": detail, "survived": _survived, **more}))


def watch_before_init() -> None:
    """Under ``cupycomm.run``, record an exception that ends this process before ``init()``,
    as ``raised`` with ``before_init`` set (``import cupycomm`` calls it there): where MPI
    had started, ``MPI_Finalize`` keeps such a rank alive while its peers wait in ``init()``,
    so no process of it is seen gone (``cupycomm.run.ranks``)."""
    directory = os.environ.get("CUPYCOMM_RUN_DIR")
    rank = _bootstrap.launcher_number("rank")
    if not directory or rank is None:
        return
    previous, me = sys.excepthook, os.getpid()

    def record_before_init(kind, value, tb):
        # init() has not written this rank's record; a forked child is not the rank
        if _path is None and os.getpid() == me:
            try:
                _write(_record_path(directory, rank), rank, _bootstrap.launcher_number("size"),
                       RAISED, f"{kind.__name__}: {value}", before_init=True)
            except (OSError, SharedFileRefused):
                pass   # the job's end still names this rank: its peers wait until the timeout
        previous(kind, value, tb)

    sys.excepthook = record_before_init


def record(state: str, detail: str = "") -> None:
    """Replace this rank's record by ``state`` (with ``detail``); nothing if :func:`start`
    has not written one."""
    global _state
    if _path is None:
        return
    _state = state
    world = _bootstrap.world()
    try:
        _write(_path, world.Get_rank(), world.Get_size(), state, detail)
    except (OSError, SharedFileRefused) as error:   # gone (the launcher ended), or not the
        # job's (another user's in its place): say so, go on
        sys.stderr.write(f"cupycomm: could not record this rank's end in {_path}: {error}\n")


def note_survived(ranks: Sequence[int]) -> None:
    """This rank went on without world ``ranks`` (lost peers): its record says so from now on
    (``shrink()`` calls it)."""
    _survived[:] = sorted(set(_survived) | set(ranks))
    if _state == RUNNING:
        record(RUNNING)


def _record_uncaught() -> None:
    """Record "raised" when an exception escapes: the interpreter calls ``sys.excepthook``
    only for one that ends the program (``sys.last_value`` is no sign of it: pytest and
    IPython set it for exceptions they handled, an xfail's)."""
    previous = sys.excepthook

    def record_uncaught(kind, value, tb):
        record(RAISED, f"{kind.__name__}: {value}")
        previous(kind, value, tb)

    sys.excepthook = record_uncaught


def _at_exit() -> None:
    if _state == RUNNING:   # not "raised" (the hook above, or the abort handler) or "aborted"
        record(ENDED)


def _forked() -> None:
    """In a child that ``os.fork()`` made of a rank: it is not the rank, and records
    nothing (its end would replace the rank's record)."""
    global _path
    _path = None


os.register_at_fork(after_in_child=_forked)


class JobDirectory:
    """The job's directory as ``cupycomm.run`` holds it: ``path`` (the ranks'
    ``CUPYCOMM_RUN_DIR``), open by its descriptor from its making to its removal and checked
    there (this user's, mode 0700: ``cupycomm._private.hold_directory``), so that a
    directory swapped in under its name (where others may write its parent) is never read;
    each record is read only if it is this user's.

    Example::

        job = JobDirectory(tempfile.mkdtemp(prefix=".cupycomm-run-"))
        job.read(2)   # [None, None] until the ranks' init() writes their records
        job.remove()
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = private.hold_directory(path)

    def _record(self, name: str) -> Optional[dict]:
        try:
            return json.loads(private.read_own(self._fd, name, self.path))
        except (OSError, ValueError, SharedFileRefused):   # none, half, or not this user's
            return None

    def read(self, size: int) -> List[Optional[dict]]:
        """The records of world ranks ``0 .. size - 1`` (None: none written)."""
        return [self._record(_record_path("", rank)) for rank in range(size)]

    def read_strays(self) -> List[dict]:
        """The stray records: processes whose world was not of the job's size."""
        found = (self._record(name) for name in sorted(os.listdir(self._fd))
                 if name.startswith("stray-") and name.endswith(".json"))
        return [record for record in found if record is not None]

    def close(self) -> None:
        """Let go of it, leaving it there (a rank that only read it)."""
        os.close(self._fd)

    def remove(self) -> None:
        """Remove the directory and its records; let go of it."""
        private.remove(self.path, self._fd)
        self.close()
