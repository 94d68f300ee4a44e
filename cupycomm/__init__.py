"""cupycomm: move arrays between processes and GPUs.

``comm = cupycomm.init()`` under ``mpiexec -n N``; then the torch.distributed family of
collectives on NumPy arrays (through MPI) and CuPy arrays (through NCCL).
"""
from ._dtypes import DTYPES, ReduceOp
from .communicator import DEFAULT_TIMEOUT, Communicator
from ._init import init
from .errors import (CollectiveMismatch, CollectiveTimeout, CommClosedError, NcclError,
                     PeerLost)
from . import devices
from .devices import prefetch
from .work import Work

__version__ = "0.1.0"

__all__ = [
    "init", "Communicator", "ReduceOp", "Work", "DTYPES", "DEFAULT_TIMEOUT",
    "CommClosedError", "CollectiveTimeout", "CollectiveMismatch", "NcclError", "PeerLost",
    "devices", "prefetch",
]
