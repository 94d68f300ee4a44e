"""What losing a peer does in this process (``init(on_peer_loss=)``), and whether the MPI can
go on without one.

``"abort"`` (the default): a lost peer ends the whole job, named. ``"raise"``: survivors
get :class:`~cupycomm.errors.PeerLost` and may ``comm.shrink()``; that needs ULFM, which only
Open MPI 5 under ``mpiexec --with-ft ulfm`` gives (docs/internals.md, "survivors/policy.py").

Example::

    choose("raise", MPI.Get_library_version())   # under mpiexec --with-ft ulfm: no error
    raising()                                    # True
"""
from __future__ import annotations

import os
import re

from ..run.launchers import KINDS, library_kind

__all__ = ["MODES", "NEEDED", "FLAGS", "check_mode", "choose", "raising", "unsupported"]

MODES = ("abort", "raise")
#: What Open MPI 5's ``mpiexec`` is given to let survivors go on (the launcher table's, which
#: says why each): ULFM, the TCP transport, no fence at the start of MPI_Finalize.
FLAGS = next(row.survivors for row in KINDS.values() if row.survivors)
NEEDED = FLAGS[:5]   # ULFM and the TCP transport: what the refusal names

_raising = False   # this process's mode, set by init()


def check_mode(value: object) -> str:
    """``value`` if it is a mode; else ValueError naming init's argument."""
    if value not in MODES:
        raise ValueError(f"init: on_peer_loss must be one of {', '.join(map(repr, MODES))}, "
                         f"got {value!r}")
    return str(value)


def unsupported(library_version: str) -> str:
    """Why this process's MPI (``MPI.Get_library_version()``) cannot let survivors go on, or
    '' where it can."""
    needed = (f"on_peer_loss='raise' needs MPI's fault tolerance (ULFM): Open MPI 5 with "
              f"mpi4py >= 4.1, started with `mpiexec {' '.join(NEEDED)}` (or python -m "
              f"cupycomm.run --survivors)")
    from mpi4py import MPI
    row = next(row for row in KINDS.values() if row.mpi == library_kind(library_version))
    if not hasattr(MPI.Comm, "Revoke"):
        return f"{needed}; this mpi4py ({MPI.Get_version()}) has no Comm.Revoke"
    if not row.survivors:
        return f"{needed}; {row.mpi_name} has none ({library_version.splitlines()[0][:60]!r})"
    major = re.search(r"v(\d+)\.", library_version)
    if major is None or int(major.group(1)) < 5:
        return f"{needed}; this is {library_version.splitlines()[0][:40]!r}"
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() not in ("1", "true",
                                                                             "yes", "on"):
        return f"{needed}; this job was started without it (OMPI_MCA_mpi_ft_enable is unset)"
    return ""


def choose(mode: str, library_version: str) -> None:
    """Set this process's mode (``mode`` checked by :func:`check_mode`); RuntimeError where
    it is "raise" and the MPI cannot (:func:`unsupported`): the same on every rank, before
    any communication."""
    global _raising
    if mode == "raise":
        reason = unsupported(library_version)
        if reason:
            raise RuntimeError(f"init: {reason}")
    _raising = mode == "raise"


def raising() -> bool:
    """Whether this process raises PeerLost on a lost peer (else the job ends)."""
    return _raising
