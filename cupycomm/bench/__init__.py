"""``python -m cupycomm.bench``: nccl-tests-style tables of cupycomm's collectives, side by side
with the raw libraries.

Run it under MPI, for example ``mpiexec -n 2 python -m cupycomm.bench all_reduce -b 8 -e 64M
-f 4 --compare``: for each size, the nccl-tests columns (size, count, type, redop, root, time,
algbw, busbw, #wrong; out-of-place and in-place), and with ``--compare`` the same calls through
mpi4py (host) or a raw NcclCommunicator, cupyx.distributed and torch.distributed (device),
interleaved call for call, with the time ratio and the µs cupycomm adds per call.

Modules: :mod:`.cli` (command line), :mod:`.collectives` (the table), :mod:`.libraries` (the
implementations), :mod:`.timing`, :mod:`.report` (table, summary, files), :mod:`.plot`,
:mod:`.run` (the run itself).
"""
from .run import main

__all__ = ["main"]
