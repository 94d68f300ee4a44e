"""The CUPYCOMM_* environment variables: every one of them, its meaning, default and parser.

Nothing else in the package reads a CUPYCOMM_* variable. Each is read when it is needed
(``init()`` reads the communicator's settings), so a program may set them before that.
A value that does not parse, or is out of range, raises ValueError naming the variable and
the value; ``init()`` reads every one it uses before any communication (:data:`AT_INIT`).

Example::

    CUPYCOMM_TIMEOUT=120 mpiexec -n 4 python train.py
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

__all__ = ["Variable", "VARIABLES", "AT_INIT", "read", "default"]


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError("is not a flag: expected 1/0, true/false, yes/no or on/off")


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number of seconds") from None
    if not value > 0:
        raise ValueError("must be positive")
    return value


def _at_least(minimum: float, why: str) -> Callable[[str], float]:
    """A parser of seconds, refusing fewer than ``minimum`` (``why``: what needs them)."""
    def seconds(raw: str) -> float:
        value = _seconds(raw)
        if value < minimum:
            raise ValueError(f"must be at least {minimum:g} s ({why})")
        return value
    return seconds


def _count(raw: str) -> int:
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError("is not a count >= 1")
    return int(raw)


def _count_to(most: int) -> Callable[[str], int]:
    """A parser of counts from 1 to ``most``."""
    def count(raw: str) -> int:
        if not raw.strip().isdigit() or not 1 <= int(raw) <= most:
            raise ValueError(f"is not a count from 1 to {most}")
        return int(raw)
    return count


def _text(raw: str) -> str:
    return raw.strip()


@dataclass(frozen=True)
class Variable:
    """One variable: ``parse`` turns its text into the value (ValueError saying why not);
    an unset or empty variable means ``default``."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    meaning: str


VARIABLES: Tuple[Variable, ...] = (
    Variable("CUPYCOMM_TIMEOUT", _seconds, 600.0,
             "seconds a collective may wait before it is declared hung; inf: no timeout "
             "(init(timeout=) wins)"),
    Variable("CUPYCOMM_DEBUG", _flag, False,
             "check before each collective that every rank calls it alike (init(debug=) wins)"),
    Variable("CUPYCOMM_ABORT_ON_EXCEPTION", _flag, True,
             "abort the MPI job when an exception escapes on one rank "
             "(init(abort_on_exception=) wins)"),
    Variable("CUPYCOMM_HEARTBEAT_TIMEOUT", _at_least(1.0, "ten of the 0.1 s beats"), 5.0,
             "seconds without a heartbeat after which a node of a multi-node job is taken "
             "as dead, at least 1 (see docs/guide/many-nodes.md)"),
    Variable("CUPYCOMM_FLIGHT_RECORDER", _text, "",
             "a directory where each rank writes its flight recorder (rank-<r>.json) when "
             "a call waits, on a fault or SIGUSR1, and at close"),
    Variable("CUPYCOMM_FLIGHT_RECORDER_SIZE", _count_to(100_000), 64,
             "how many of its last calls each communicator's flight recorder keeps, "
             "at most 100000"),
    Variable("CUPYCOMM_RUN_DIR", _text, "",
             "the job directory where each rank records how it ended (set by python -m "
             "cupycomm.run)"),
    Variable("CUPYCOMM_RUN_SIZE", _count, 0,
             "the number of ranks of that job: a process of another world size (a singleton, "
             "a program a rank starts) records a stray there (set by python -m cupycomm.run)"),
    Variable("CUPYCOMM_JOIN", _flag, False,
             "set by comm.grow() in the processes it starts: their cupycomm.init() joins "
             "the survivors (see docs/guide/survivors.md)"),
    Variable("CUPYCOMM_BENCH_COMMAND", _text, "",
             "the command line python -m cupycomm.bench records (set by benchmarks/run_matrix)"),
)
AT_INIT: Tuple[str, ...] = ("CUPYCOMM_HEARTBEAT_TIMEOUT", "CUPYCOMM_FLIGHT_RECORDER_SIZE")
"""The variables read while a communicator is made (the heartbeats only where it spans
nodes): ``init()`` reads them first, so that a bad value is refused on every rank alike."""
_BY_NAME: Dict[str, Variable] = {variable.name: variable for variable in VARIABLES}


def read(name: str) -> Any:
    """The value of variable ``name`` now: parsed, or its default when unset or empty."""
    variable = _BY_NAME[name]
    raw = os.environ.get(name, "")
    if not raw.strip():
        return variable.default
    try:
        return variable.parse(raw)
    except ValueError as why:
        raise ValueError(f"{name}={raw!r} {why}") from None


def default(name: str) -> Any:
    """What variable ``name`` means when it is not set."""
    return _BY_NAME[name].default
