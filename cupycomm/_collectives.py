"""The one table of cupycomm's calls: each one's name and what the rest of the package knows
of it.

The watchdog names the call a rank waits in (the board stores ``code``), debug mode
fingerprints ``data``, :class:`~cupycomm.comm.foreign.Foreign` wraps exactly the backend
``methods``, and the docs print the table (``python -m cupycomm.tools.docs``). Nothing else
keeps a list of collectives. ``kind`` says who takes part: ``collective`` (every rank),
``point-to-point`` (two ranks: the watchdog does not end such a wait for a peer that left
cleanly, which need not be the partner), ``object`` (every rank, with pickled objects) or
``internal`` (a wait of cupycomm's own: the end of a ``batch()`` block is point-to-point
traffic; the debug check, ``close``, ``agree``, ``shrink``, the making of the NCCL
communicator and a graph's launch are collective).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple

__all__ = ["Call", "CALLS", "BY_NAME", "BACKEND_METHODS", "POINT_TO_POINT", "CHECKED",
           "COLLECTIVE", "POINT", "OBJECT", "INTERNAL"]

COLLECTIVE, POINT, OBJECT, INTERNAL = "collective", "point-to-point", "object", "internal"


@dataclass(frozen=True)
class Call:
    """One call.

    ``data`` is the argument every rank passes alike (debug mode fingerprints it; None: no
    array argument, or not checked); ``checked``: debug mode compares this call across ranks;
    ``methods``: the backend methods that run it; ``mpi_call``/``nccl_call``: what they call.
    """

    name: str
    kind: str
    data: Optional[str] = None
    checked: bool = False
    methods: Tuple[str, ...] = ()
    mpi_call: str = ""
    nccl_call: str = ""

    @property
    def code(self) -> int:
        """The call's number on the watchdog's board (0 means no call)."""
        return _CODES[self.name]


CALLS: Tuple[Call, ...] = (
    Call("all_reduce", COLLECTIVE, "x", True, ("all_reduce",), "Allreduce", "allReduce"),
    Call("reduce", COLLECTIVE, "x", True, ("reduce",), "Reduce", "reduce"),
    Call("broadcast", COLLECTIVE, "x", True, ("broadcast",), "Bcast", "bcast"),
    Call("all_gather", COLLECTIVE, "x", True, ("all_gather",), "Allgather", "allGather"),
    Call("reduce_scatter", COLLECTIVE, "x", True, ("reduce_scatter",), "Reduce_scatter_block",
         "reduceScatter"),
    Call("all_to_all", COLLECTIVE, "x", True, ("all_to_all", "all_to_all_v"),
         "Alltoall, Alltoallv", "grouped send/recv"),
    Call("scatter", COLLECTIVE, "out", True, ("scatter",), "Scatter", "grouped send/recv"),
    Call("gather", COLLECTIVE, "x", True, ("gather",), "Gather", "grouped send/recv"),
    Call("scan", COLLECTIVE, "x", True, ("scan",), "Scan"),
    Call("exscan", COLLECTIVE, "x", True, ("exscan",), "Exscan"),
    Call("barrier", COLLECTIVE, None, True, (), "Barrier", "(MPI)"),
    Call("send", POINT, methods=("send",), mpi_call="Send", nccl_call="send"),
    Call("recv", POINT, methods=("recv",), mpi_call="Recv", nccl_call="recv"),
    Call("sendrecv", POINT, methods=("sendrecv",), mpi_call="Sendrecv",
         nccl_call="grouped send/recv"),
    Call("broadcast_object", OBJECT, checked=True, mpi_call="bcast (pickle)"),
    Call("all_gather_object", OBJECT, checked=True, mpi_call="allgather (pickle)"),
    Call("gather_object", OBJECT, checked=True, mpi_call="gather (pickle)"),
    Call("scatter_object", OBJECT, checked=True, mpi_call="scatter (pickle)"),
    Call("new_group", COLLECTIVE, checked=True, mpi_call="Comm_split",
         nccl_call="ncclCommSplit"),
    Call("batch", INTERNAL),
    Call("debug check", INTERNAL),
    Call("close", INTERNAL),
    Call("agree", INTERNAL),
    Call("shrink", INTERNAL),
    Call("grow", INTERNAL),
    Call("init_device", INTERNAL, nccl_call="ncclGetUniqueId, ncclCommInitRank"),
    Call("launch_graph", INTERNAL, nccl_call="cudaGraphLaunch"),
)

_CODES: Dict[str, int] = {call.name: code for code, call in enumerate(CALLS, start=1)}
BY_NAME: Dict[str, Call] = {call.name: call for call in CALLS}
BACKEND_METHODS: FrozenSet[str] = frozenset(m for call in CALLS for m in call.methods)
POINT_TO_POINT: FrozenSet[str] = frozenset(c.name for c in CALLS if c.kind == POINT) | {"batch"}
CHECKED: Tuple[Call, ...] = tuple(call for call in CALLS if call.checked)
