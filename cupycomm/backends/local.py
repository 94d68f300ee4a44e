"""One process, several GPUs: NCCL across the devices this process drives (the NCCL side of
:mod:`cupycomm.devices`).

One communicator per device, made by ``NcclCommunicator.initAll`` the first time a tuple of
devices is used and kept for later calls. A call issues one NCCL operation per device inside
``groupStart()``/``groupEnd()`` (one thread driving several GPUs would deadlock otherwise), on
the stream given for each device, with that device current. The caller orders those streams
with the rest of its work (:class:`cupycomm.devices.copies.Order`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

from .._dtypes import DTYPES, NCCL_INT8, NCCL_OPS, ReduceOp
from ..errors import NcclError
from .nccl import nccl_module

__all__ = ["broadcast", "reduce_sum", "can_sum"]

# dtype -> (NCCL datatype, NCCL elements per array element, NCCL op) of a sum
_SUM = {dtype: (row.nccl_type, row.nccl_count, NCCL_OPS[row.ops[ReduceOp.SUM]])
        for dtype, row in DTYPES.items() if row.nccl_type is not None}
_communicators: Dict[tuple, list] = {}   # (device module, devices) -> initAll's communicators


def can_sum(dtype: Any) -> bool:
    """Whether NCCL has a type to add ``dtype`` (it has no 16-bit integers)."""
    return dtype in _SUM


def broadcast(name: str, xp: Any, devices: Tuple[int, ...], streams: Sequence[Any], root: int,
              sends: Sequence[Any], outs: Sequence[Sequence[Any]]) -> None:
    """``outs[rank][k]`` (on ``devices[rank]``) receives ``sends[k]`` of ``devices[root]``."""
    def calls(comms: list) -> None:
        for rank, (comm, stream, row) in enumerate(zip(comms, streams, outs)):
            with xp.cuda.Device(devices[rank]):
                for send, out in zip(sends, row):
                    sendbuff = send.data.ptr if rank == root else out.data.ptr
                    comm.broadcast(sendbuff, out.data.ptr, out.nbytes, NCCL_INT8, root,
                                   stream.ptr)
    _group(name, xp, devices, calls)


def reduce_sum(name: str, xp: Any, devices: Tuple[int, ...], streams: Sequence[Any], root: int,
               jobs: Sequence[Sequence[Any]], results: Sequence[Any]) -> None:
    """``results[j]`` (on ``devices[root]``) receives the sum of ``jobs[j][rank]`` (each on
    ``devices[rank]``), for every job; each job's dtype must pass :func:`can_sum`."""
    def calls(comms: list) -> None:
        for rank, (comm, stream) in enumerate(zip(comms, streams)):
            with xp.cuda.Device(devices[rank]):
                for job, result in zip(jobs, results):
                    send = job[rank]
                    recv = result if rank == root else send   # NCCL ignores it off the root
                    datatype, factor, op = _SUM[send.dtype]
                    comm.reduce(send.data.ptr, recv.data.ptr, send.size * factor, datatype, op,
                                root, stream.ptr)
    _group(name, xp, devices, calls)


def _group(name: str, xp: Any, devices: Tuple[int, ...],
           calls: Callable[[List[Any]], None]) -> None:
    """``calls(communicators)`` as one NCCL group over the communicators of ``devices``."""
    nccl = nccl_module(xp)
    try:
        key = (xp, devices)
        if key not in _communicators:
            _communicators[key] = nccl.NcclCommunicator.initAll(list(devices))
        nccl.groupStart()
        try:
            calls(_communicators[key])
        finally:
            nccl.groupEnd()
    except nccl.NcclError as error:
        raise NcclError(f"{name}: NCCL failed on devices {list(devices)}: {error}") from error
