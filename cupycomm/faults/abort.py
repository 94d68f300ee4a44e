"""Ending the whole job: the one place that calls ``MPI_Abort``, and where its explanation goes.

- :func:`install_abort_handler`: ``init()`` installs it (unless turned off): an exception that
  escapes on one rank prints that rank's traceback, with its rank and host, and aborts the
  job, so that its peers never wait forever in a collective (as ``python -m mpi4py`` does).
- :func:`abort_job`: the watchdog's end of a job: its message and this rank's stacks.
- :func:`abort_world`: ``MPI_Abort`` after the explanation has had time to reach mpiexec.
- :func:`report_to`: where the explanations go (the pytest plugin points it at the terminal:
  pytest's capture of stderr is lost when the job aborts).
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Optional, TextIO

from .. import _bootstrap, _env
from . import flight, stacks
from ..run import exit_records

__all__ = ["install_abort_handler", "abort_enabled", "abort_job", "abort_world", "report_to",
           "report_stream"]

_report: Optional[TextIO] = None


def report_to(stream: Optional[TextIO]) -> None:
    """Write abort messages and stacks to ``stream`` (a file with a descriptor of its own),
    not to ``sys.stderr``; None: back to ``sys.stderr``."""
    global _report
    _report = stream


def report_stream() -> TextIO:
    """Where abort messages go (see :func:`report_to`)."""
    return _report if _report is not None else sys.stderr


def abort_enabled(requested: Optional[bool]) -> bool:
    """The init() argument wins; else CUPYCOMM_ABORT_ON_EXCEPTION (on by default)."""
    return requested if requested is not None else _env.read("CUPYCOMM_ABORT_ON_EXCEPTION")


def install_abort_handler(joined: bool = False) -> None:
    """Abort the MPI job when an exception escapes on this rank (only if the world has peers,
    or ``joined``: a process that ``comm.grow()`` started, whose world is only the processes
    started with it; aborting it ends those, which the others then see lost)."""
    if (_bootstrap.world().Get_size() == 1 and not joined) \
            or getattr(sys.excepthook, "_cupycomm", False):
        return
    previous, rank_pid = sys.excepthook, os.getpid()

    def abort_on_exception(kind, value, tb):
        if os.getpid() != rank_pid:   # a child that os.fork() made of the rank: not the rank
            previous(kind, value, tb)
            return
        text = "".join(traceback.format_exception(kind, value, tb))
        report_stream().write(f"cupycomm: uncaught exception on {_bootstrap.describe_rank()}; "
                              f"aborting the MPI job\n{text}")
        exit_records.record(exit_records.RAISED, f"{kind.__name__}: {value}")
        flight.report_all("uncaught exception", report_stream())
        # No close_all() here: closing waits for calls in flight (a dropped receive whose
        # sender will never send would hold the abort until the timeout); MPI_Abort ends
        # every process, which frees what they hold.
        abort_world()
        previous(kind, value, tb)  # only reached if Abort returned

    abort_on_exception._cupycomm = True  # type: ignore[attr-defined]
    sys.excepthook = abort_on_exception


def abort_job(message: str) -> None:
    """Print ``message`` and this rank's stacks, then end every rank of the job."""
    exit_records.record(exit_records.ABORTED, message)
    stream = report_stream()
    stream.write(f"cupycomm watchdog: {message}: aborting the job\n")
    flight.report_all("abort", stream)
    stacks.dump(report_stream())
    abort_world()


def abort_world(code: int = 1) -> None:
    """MPI_Abort on every rank of the job, after a pause that lets mpiexec forward what this
    rank has just written (an abort kills the job at once: the explanation must arrive)."""
    report_stream().flush()
    time.sleep(0.3)
    _bootstrap.world().Abort(code)
