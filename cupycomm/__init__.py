"""cupycomm: move arrays between processes and GPUs.

``comm = cupycomm.init()`` under ``mpiexec -n N``; then the torch.distributed family of
collectives on NumPy arrays (through MPI) and CuPy arrays (through NCCL).
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, List

from .errors import (CollectiveMismatch, CollectiveTimeout, CommClosedError, CommShrunkError,
                     LocalRankWarning, NcclError, PeerLost, TooFewSurvivors)

if TYPE_CHECKING:
    from . import devices
    from ._dtypes import DTYPES, ReduceOp
    from ._init import init
    from .comm.communicator import DEFAULT_TIMEOUT, Communicator
    from .survivors.committed import State
    from .survivors.numbering import joined_late
    from .survivors.resilient import resilient
    from .work import Work
    prefetch = devices.prefetch

__version__ = "0.1.0"

__all__ = [
    "init", "Communicator", "ReduceOp", "Work", "DTYPES", "DEFAULT_TIMEOUT",
    "CommClosedError", "CommShrunkError", "CollectiveTimeout", "CollectiveMismatch", "NcclError",
    "PeerLost", "TooFewSurvivors", "LocalRankWarning", "devices", "prefetch", "resilient",
    "State", "joined_late",
]

# The module of each name imported at its first use. Importing mpi4py.MPI starts MPI, and the
# tools that need none (python -m cupycomm.run, cupycomm.tools.flight, cupycomm.run.launchers)
# import this package too, also from inside a rank, whose launcher's variables MPI_Init would read.
_HOMES = {"init": "_init", "Communicator": "comm.communicator",
          "DEFAULT_TIMEOUT": "comm.communicator", "ReduceOp": "_dtypes", "DTYPES": "_dtypes",
          "devices": "devices", "prefetch": "devices", "Work": "work",
          "resilient": "survivors.resilient", "State": "survivors.committed",
          "joined_late": "survivors.numbering"}


if os.environ.get("CUPYCOMM_RUN_DIR"):   # a rank of cupycomm.run: an exception before init()
    from .run import exit_records as _exit_records   # is recorded (no MPI started here)
    _exit_records.watch_before_init()


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_HOMES[name]}", __name__)
    value = module if name == _HOMES[name] else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
