"""The processes of a ``cupycomm.run`` job's ranks on this host, as ``/proc`` shows them under
the launcher: how ``cupycomm.run`` sees a rank that ended before it recorded anything (it
failed before ``cupycomm.init()``), while its peers wait for it in ``MPI_Init`` or
``init()`` forever. A rank's process is a descendant of the launcher whose environment names
the job's directory and gives a rank and the number of ranks on this host; a rank whose
processes have all ended (or, where every rank is on this host, one never seen) is gone.
How each is told: docs/internals.md, "run/ranks.py".

Example (what ``cupycomm.run`` does once a second)::

    ranks = Ranks(launcher.pid, job_directory, 4)
    ranks.gone()   # [1]: rank 1 was started here, and no process of it is left
"""
from __future__ import annotations

import os
from typing import Dict, Iterator, List, Optional, Set, Tuple

__all__ = ["Ranks", "RANK_VARIABLES", "LOCAL_SIZE_VARIABLES"]

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")
"""How the launchers whose ranks run under them here tell a rank its number."""
LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
"""... and how many ranks they started on this host."""


class Ranks:
    """The ranks of the job under ``launcher`` (a pid) whose directory is ``directory``, of
    ``size`` ranks, as seen on this host from one look to the next."""

    def __init__(self, launcher: int, directory: str, size: int) -> None:
        self._launcher, self._size = launcher, size
        self._directory = directory.encode()
        self.pids: Dict[int, int] = {}   # rank -> the first process seen of it
        self._here = 0                   # how many ranks the launcher started on this host

    def gone(self) -> List[int]:
        """The ranks started on this host of which no process is left now (docs/internals.md)."""
        alive: Set[int] = set()
        for pid, rank, here in self._processes():
            self.pids.setdefault(rank, pid)
            alive.add(rank)
            self._here = max(self._here, here)
        if not self.pids:
            return []   # not started yet, or nothing of the job on this host
        gone = set(self.pids) - alive
        if self._here == self._size and len(self.pids) < self._size:
            gone |= set(range(self._size)) - set(self.pids)   # ended before any look
        return sorted(gone)

    def _processes(self) -> Iterator[Tuple[int, int, int]]:
        """(pid, rank, ranks on this host) of each live process of the job's ranks."""
        for pid in _descendants(self._launcher):
            said = _environment(pid)
            if said.get(b"CUPYCOMM_RUN_DIR") != self._directory:
                continue
            rank, here = _number(said, RANK_VARIABLES), _number(said, LOCAL_SIZE_VARIABLES)
            if rank is not None and 0 <= rank < self._size:
                yield pid, rank, here or 0


def _descendants(root: int) -> List[int]:
    """The live processes under ``root`` (zombies left out: they have ended)."""
    children: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue   # it has just ended
        if fields and fields[0] not in (b"Z", b"X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _environment(pid: int) -> Dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(item.partition(b"=")[::2] for item in raw.split(b"\0") if item)


def _number(said: Dict[bytes, bytes], names: Tuple[str, ...]) -> Optional[int]:
    for name in names:
        value = said.get(name.encode(), b"")
        if value.isdigit():
            return int(value)
    return None
