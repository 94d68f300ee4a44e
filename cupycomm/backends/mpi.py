"""Host backend: NumPy arrays through mpi4py's buffer-protocol (upper-case) calls, never pickled.

Blocking calls for the synchronous form, nonblocking ones (``Iallreduce``...) wrapped in a
:class:`~cupycomm.work.HostWork` for ``async_op=True``. Data movement is described to MPI as
bytes; reductions use the MPI datatype and op of the dtype table. ``op="avg"`` is a sum
followed by a division on the receiving ranks.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from .._dtypes import DTYPES, ReduceOp
from .._parts import offsets
from ..work import HostWork

__all__ = ["MPIBackend", "PreparedCalls"]

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.AVG: MPI.SUM}
_NUMPY_OPS = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
              ReduceOp.MAX: np.maximum, ReduceOp.AVG: np.add}
_BYTE = MPI.BYTE
_IN_PLACE = MPI.IN_PLACE


def _exports_buffer(dtype: np.dtype) -> bool:
    try:
        memoryview(np.empty(1, dtype))
    except (ValueError, TypeError):   # "cannot include dtype 'E' in a buffer"
        return False
    return True


def _emulated_op(dtype: np.dtype, carrier: np.dtype, op: ReduceOp) -> MPI.Op:
    """An MPI op that reduces ``dtype`` values sent as ``carrier`` bits, computing in NumPy
    (in float32 for 16-bit floats), for dtypes the MPI library has no type for."""
    ufunc = _NUMPY_OPS[op]
    wide = np.dtype(np.float32) if dtype.kind in "fV" and dtype.itemsize == 2 else dtype

    def reduce(invec, inoutvec, datatype):
        into = np.frombuffer(inoutvec, carrier).view(dtype)
        result = ufunc(np.frombuffer(invec, carrier).view(dtype).astype(wide), into.astype(wide))
        into[...] = result.astype(dtype)
    return MPI.Op.Create(reduce, commute=True)


def _tables() -> tuple:
    """(movements, reductions): dtype -> the view to hand MPI (None: the array itself);
    dtype -> requested op -> (MPI datatype, MPI op, divide by size afterwards, view)."""
    movements, reductions = {}, {}
    for dtype, row in DTYPES.items():
        native = row.mpi_type is not None and _exports_buffer(dtype)
        movements[dtype] = None if _exports_buffer(dtype) else row.carrier
        if native:
            reductions[dtype] = {op: (row.mpi_type, _MPI_OPS[applied], applied is ReduceOp.AVG,
                                      None) for op, applied in row.ops.items()}
        elif row.carrier is not None:
            carrier_type = from_numpy_dtype(row.carrier)
            reductions[dtype] = {op: (carrier_type, _emulated_op(dtype, row.carrier, applied),
                                      applied is ReduceOp.AVG, row.carrier)
                                 for op, applied in row.ops.items()}
    return movements, reductions


_MOVEMENTS, _REDUCTIONS = _tables()


_NO_SPEC = (None, None, False, None)


# -- prepared calls: one maker per shape of MPI call. The watchdog's marks are written out in
# each (``seq`` counts the call, ``busy`` names it while it blocks, one slot of the flight
# recorder's ring holds it; see faults/watchdog.py):
# a shared helper would cost every call one more interpreter frame.
def _paired(backend: "MPIBackend", name: str, datatype: Any, op: Any) -> Callable:
    """``call(send, recv[, op])``: all_reduce (in place when ``recv is x``),
    reduce_scatter, all_gather, all_to_all."""
    call = getattr(backend._comm, _MPI_CALLS[name])
    tail = () if op is None else (op,)
    tracker = backend._tracker
    ring, slots = tracker.flight.calls, tracker.flight.size   # the flight recorder's

    def run(x, recv):
        tracker.seq = seq = tracker.seq + 1
        ring[seq % slots] = name
        tracker.busy = name
        try:
            call(_IN_PLACE if recv is x else [x, datatype], [recv, datatype], *tail)
        finally:
            tracker.busy = None
        return recv
    return run


def _rooted(backend: "MPIBackend", name: str, datatype: Any, op: Any) -> Callable:
    """``call(send, recv[, op], root)``: reduce, gather (``recv`` None off the root), scatter
    (``x`` None off the root); the root reduces in place when ``recv is x``."""
    call = getattr(backend._comm, _MPI_CALLS[name])
    tail = () if op is None else (op,)
    tracker = backend._tracker
    ring, slots = tracker.flight.calls, tracker.flight.size   # the flight recorder's

    def run(x, recv, root):
        send = (None if x is None else _IN_PLACE if recv is x and op is not None
                else [x, datatype])
        tracker.seq = seq = tracker.seq + 1
        ring[seq % slots] = name
        tracker.busy = name
        try:
            call(send, None if recv is None else [recv, datatype], *tail, root)
        finally:
            tracker.busy = None
        return recv
    return run


def _broadcast(backend: "MPIBackend", name: str, datatype: Any, op: Any) -> Callable:
    call = backend._comm.Bcast
    tracker = backend._tracker
    ring, slots = tracker.flight.calls, tracker.flight.size   # the flight recorder's

    def run(x, root):
        tracker.seq = seq = tracker.seq + 1
        ring[seq % slots] = name
        tracker.busy = name
        try:
            call([x, datatype], root)
        finally:
            tracker.busy = None
        return x
    return run


def _sendrecv(backend: "MPIBackend", name: str, datatype: Any, op: Any) -> Callable:
    call = backend._comm.Sendrecv
    tracker = backend._tracker
    ring, slots = tracker.flight.calls, tracker.flight.size   # the flight recorder's

    def run(x, dst, buf, src):
        tracker.seq = seq = tracker.seq + 1
        ring[seq % slots] = name
        tracker.busy = name
        try:
            call([x, datatype], dst, 0, [buf, datatype], src, 0)
        finally:
            tracker.busy = None
        return buf
    return run


_MPI_CALLS = {"all_reduce": "Allreduce", "reduce_scatter": "Reduce_scatter_block",
              "all_gather": "Allgather", "all_to_all": "Alltoall", "reduce": "Reduce",
              "gather": "Gather", "scatter": "Scatter"}
_PREPARED: Dict[str, Callable] = {
    "all_reduce": _paired, "reduce_scatter": _paired, "all_gather": _paired,
    "all_to_all": _paired, "reduce": _rooted, "gather": _rooted, "scatter": _rooted,
    "broadcast": _broadcast, "sendrecv": _sendrecv}


class PreparedCalls(dict):
    """(collective, dtype, op) -> the backend's prepared blocking call (or None where it has
    none), made on first use and then only looked up. ``enabled`` False (a ``batch()`` block
    is open, or the communicator closed): every lookup answers None, so that every call
    takes the general path.

    Example::

        run = PreparedCalls(backend)["all_reduce", numpy.dtype("float32"), "sum"]
        run(x, x)   # Allreduce(IN_PLACE, [x, MPI.FLOAT], MPI.SUM), watched
    """

    def __init__(self, backend: "MPIBackend") -> None:
        super().__init__()
        self._backend = backend
        self.enabled = True

    def __missing__(self, key: tuple) -> Optional[Callable]:
        if not self.enabled:
            return None
        run = self[key] = self._backend.prepare(*key)
        return run

    def disable(self) -> None:
        self.enabled = False
        self.clear()

    def enable(self) -> None:
        self.enabled = True


class MPIBackend:
    """Collectives on host memory over one MPI communicator (owned by the Communicator).

    Each collective prepares its buffers and makes its MPI call through one of two small
    steps: :meth:`_block`, the blocking call, which also tells the watchdog what this rank
    waits in; or :meth:`_start`, the nonblocking one, for ``async_op`` and batch() blocks.
    """

    name = "mpi"
    array_type = np.ndarray
    device_id = None
    movements = _MOVEMENTS
    reductions = _REDUCTIONS

    def __init__(self, comm: MPI.Comm, tracker: Any) -> None:
        self._comm = comm
        self._size = comm.Get_size()
        self._rank = comm.Get_rank()
        self._tracker = tracker   # counts this rank's collectives, for the watchdog
        self._flight, self._slots = tracker.flight.calls, tracker.flight.size   # its ring
        self._group: Any = None   # the open batch() block, if any
        # Started nonblocking calls, oldest first: they keep their arrays (and requests)
        # alive even if the caller drops the Work, since MPI writes into them until done.
        self._inflight: collections.deque = collections.deque()

    # -- the blocking and the nonblocking MPI call, and what finishes one -------------------------
    def _start(self, call: Callable, args: tuple, result: Any, keep: tuple, label: str,
               finish: Optional[Callable[[], None]] = None) -> HostWork:
        """Start the nonblocking ``call`` for async_op; inside a batch() block, queue it to
        start when the block ends."""
        tracker = self._tracker
        tracker.seq = seq = tracker.seq + 1
        self._flight[seq % self._slots] = label
        group = self._group
        if group is not None:
            group.claim("host", label)
            work = HostWork(None, result, keep, self, label, finish)
            group.works.append(work)
            group.calls.append((call, args))
            return work
        work = HostWork([call(*args)], result, keep, self, label, finish)
        self._keep_until_done(work)
        return work

    def _keep_until_done(self, work: HostWork) -> None:
        inflight = self._inflight
        while inflight and inflight[0].is_completed():
            inflight.popleft()
        inflight.append(work)

    def _block(self, label: str, call: Callable, *args: Any) -> None:
        """Make the blocking MPI ``call``, its name in the tracker's ``busy`` while it lasts
        (the watchdog judges hangs by it)."""
        tracker = self._tracker
        tracker.seq = seq = tracker.seq + 1
        self._flight[seq % self._slots] = label
        tracker.busy = label
        try:
            call(*args)
        finally:
            tracker.busy = None

    def _divide(self, recv: np.ndarray) -> Callable[[], None]:
        # Complex values divide as pairs of reals, as NCCL's average does.
        reals = recv.reshape(-1).view(recv.real.dtype) if recv.dtype.kind == "c" else recv
        size = self._size
        return lambda: np.true_divide(reals, size, out=reals)

    @staticmethod
    def _unpack(pairs) -> Callable[[], None]:
        def finish():
            for dst, src in pairs:
                dst[...] = src
        return finish

    # -- prepared blocking calls: the Communicator's fast path ------------------------------------
    def prepare(self, name: str, dtype: np.dtype, op: Any = None) -> Optional[Callable]:
        """The blocking call of collective ``name`` on arrays of ``dtype`` (reduced with
        ``op``), made once and kept by the Communicator (:class:`PreparedCalls`): the typed
        mpi4py call with its datatype and op bound, inside the watchdog's marks. None where a
        call needs more (a dtype MPI takes as a carrier view, an average to divide) or the
        dtype or op is not valid: the general path (the methods below) does those, and says
        what is wrong. Arguments, checked by the caller: ``(x, recv)``, ``recv is x`` in
        place; rooted calls ``(x, recv, root)``, ``recv`` or ``x`` None where the rank does
        not use it; broadcast ``(x, root)``; sendrecv ``(x, dst, buf, src)``."""
        make = _PREPARED.get(name)
        if make is None:
            return None
        if op is None:
            if dtype not in _MOVEMENTS or _MOVEMENTS[dtype] is not None:
                return None
            datatype, mpi_op = _BYTE, None
        else:
            datatype, mpi_op, avg, view = self.reductions.get(dtype, {}).get(op, _NO_SPEC)
            if datatype is None or avg or view is not None:
                return None
        return make(self, name, datatype, mpi_op)

    # -- collectives ------------------------------------------------------------------------------
    # The movement spec, and ``view`` in a reduction's spec, is None for the dtypes MPI takes
    # as they are, else the carrier dtype that the buffers are viewed as (bfloat16 -> uint16).
    def all_reduce(self, x, recv, spec, async_op, stream):
        datatype, op, avg, view = spec
        send = _IN_PLACE if recv is x else [x if view is None else x.view(view), datatype]
        into = [recv if view is None else recv.view(view), datatype]
        if async_op or self._group is not None:
            return self._start(self._comm.Iallreduce, (send, into, op), recv, (x, recv),
                               "all_reduce", self._divide(recv) if avg else None)
        self._block("all_reduce", self._comm.Allreduce, send, into, op)
        if avg:
            self._divide(recv)()
        return recv

    def reduce(self, x, recv, spec, root, async_op, stream):
        datatype, op, avg, view = spec
        if self._rank != root:
            send, into = [x if view is None else x.view(view), datatype], None
            result = finish = None
        else:
            send = _IN_PLACE if recv is x else [x if view is None else x.view(view), datatype]
            into = [recv if view is None else recv.view(view), datatype]
            result, finish = recv, (self._divide(recv) if avg else None)
        if async_op or self._group is not None:
            return self._start(self._comm.Ireduce, (send, into, op, root), result, (x, recv),
                               "reduce", finish)
        self._block("reduce", self._comm.Reduce, send, into, op, root)
        if finish is not None:
            finish()
        return result

    def broadcast(self, x, spec, root, async_op, stream):
        buf = [x if spec is None else x.view(spec), _BYTE]
        if async_op or self._group is not None:
            return self._start(self._comm.Ibcast, (buf, root), x, (x,), "broadcast")
        self._block("broadcast", self._comm.Bcast, buf, root)
        return x

    def all_gather(self, x, recv, spec, async_op, stream, unpack=()):
        send = [x if spec is None else x.view(spec), _BYTE]
        into = [recv if spec is None else recv.view(spec), _BYTE]
        # With unpack, the result is the list the parts are copied into.
        result = [dst for dst, _ in unpack] if unpack else recv
        finish = self._unpack(unpack) if unpack else None
        if async_op or self._group is not None:
            return self._start(self._comm.Iallgather, (send, into), result, (x, recv),
                               "all_gather", finish)
        self._block("all_gather", self._comm.Allgather, send, into)
        if finish is not None:
            finish()
        return result

    def reduce_scatter(self, x, recv, spec, async_op, stream):
        datatype, op, avg, view = spec
        send = [x if view is None else x.view(view), datatype]
        into = [recv if view is None else recv.view(view), datatype]
        if async_op or self._group is not None:
            return self._start(self._comm.Ireduce_scatter_block, (send, into, op), recv,
                               (x, recv), "reduce_scatter", self._divide(recv) if avg else None)
        self._block("reduce_scatter", self._comm.Reduce_scatter_block, send, into, op)
        if avg:
            self._divide(recv)()
        return recv

    def all_to_all(self, x, recv, spec, async_op, stream):
        send = [x if spec is None else x.view(spec), _BYTE]
        into = [recv if spec is None else recv.view(spec), _BYTE]
        if async_op or self._group is not None:
            return self._start(self._comm.Ialltoall, (send, into), recv, (x, recv),
                               "all_to_all")
        self._block("all_to_all", self._comm.Alltoall, send, into)
        return recv

    def all_to_all_v(self, x, recv, spec, send_bytes, recv_bytes, async_op, stream):
        """Uneven parts: ``send_bytes[j]`` go to rank ``j``, ``recv_bytes[i]`` come from ``i``."""
        send = [x if spec is None else x.view(spec), (send_bytes, offsets(send_bytes)), _BYTE]
        into = [recv if spec is None else recv.view(spec), (recv_bytes, offsets(recv_bytes)),
                _BYTE]
        if async_op or self._group is not None:
            return self._start(self._comm.Ialltoallv, (send, into), recv, (x, recv),
                               "all_to_all")
        self._block("all_to_all", self._comm.Alltoallv, send, into)
        return recv

    def scatter(self, x, recv, spec, root, async_op, stream):
        send = None if self._rank != root else [x if spec is None else x.view(spec), _BYTE]
        into = [recv if spec is None else recv.view(spec), _BYTE]
        if async_op or self._group is not None:
            return self._start(self._comm.Iscatter, (send, into, root), recv, (x, recv),
                               "scatter")
        self._block("scatter", self._comm.Scatter, send, into, root)
        return recv

    def gather(self, x, recv, spec, root, async_op, stream):
        send = [x if spec is None else x.view(spec), _BYTE]
        into = None if self._rank != root else [recv if spec is None else recv.view(spec), _BYTE]
        if async_op or self._group is not None:
            return self._start(self._comm.Igather, (send, into, root), recv, (x, recv),
                               "gather")
        self._block("gather", self._comm.Gather, send, into, root)
        return recv

    def send(self, x, spec, peer, async_op, stream):
        buf = [x if spec is None else x.view(spec), _BYTE]
        if async_op or self._group is not None:
            return self._start(self._comm.Isend, (buf, peer), None, (x,), "send")
        self._block("send", self._comm.Send, buf, peer)
        return None

    def recv(self, x, spec, peer, async_op, stream):
        buf = [x if spec is None else x.view(spec), _BYTE]
        if async_op or self._group is not None:
            return self._start(self._comm.Irecv, (buf, peer), x, (x,), "recv")
        self._block("recv", self._comm.Recv, buf, peer)
        return x

    def sendrecv(self, x, spec, dst, buf, src, async_op, stream):
        send = [x if spec is None else x.view(spec), _BYTE]
        into = [buf if spec is None else buf.view(spec), _BYTE]
        if async_op or self._group is not None:
            return self._start(self._comm.Isendrecv, (send, dst, 0, into, src, 0), buf,
                               (x, buf), "sendrecv")
        self._block("sendrecv", self._comm.Sendrecv, send, dst, 0, into, src, 0)
        return buf

    def barrier(self, async_op: bool = False):
        if async_op or self._group is not None:
            return self._start(self._comm.Ibarrier, (), None, (), "barrier")
        self._block("barrier", self._comm.Barrier)
        return None

    # -- control traffic: what sizes or checks the next call -------------------------------------
    def gather_ints(self, values: Sequence[int], label: str) -> np.ndarray:
        """Every rank's ``values`` (int64), row ``i`` from rank ``i``. Blocking, also inside a
        batch() block; the wait counts as part of the next call (``label`` #seq + 1), which
        it sizes or checks (uneven all_to_all counts, debug mode's checksums)."""
        mine = np.asarray(values, np.int64)
        table = np.empty((self._size, mine.size), np.int64)
        self._control(label, self._comm.Allgather, mine, table)
        return table

    def gather_objects(self, obj: Any, label: str) -> list:
        """Every rank's picklable ``obj``, as :meth:`gather_ints` (debug mode's fingerprints,
        sent only when the checksums differ)."""
        return self._control(label, self._comm.allgather, obj)

    def _control(self, label: str, call: Callable, *args: Any) -> Any:
        tracker = self._tracker
        tracker.busy = f"{label} #{tracker.seq + 1}"
        try:
            return call(*args)
        finally:
            tracker.busy = None

    # -- batch() blocks: the calls start together when the block ends, which waits for them ------
    def begin_group(self, group: Any) -> None:
        self._group = group

    def end_group(self, group: Any, cancel: bool) -> None:
        """Start the block's calls and wait for all of them; if the block raised
        (``cancel``), start none: no rank is left matching half a block."""
        self._group = None
        if group.kind != "host" or cancel:
            return
        for work, (call, args) in zip(group.works, group.calls):
            work._requests = [call(*args)]
            self._keep_until_done(work)
        self.wait_all([work._requests[0] for work in group.works], "batch")
        for work in group.works:
            work._complete()

    # -- memory, Work support, lifetime -----------------------------------------------------------
    def empty(self, shape: tuple, dtype: Any, stream: Any = None) -> np.ndarray:
        return np.empty(shape, dtype)

    def test_all(self, requests: list) -> bool:
        return MPI.Request.Testall(requests)

    def wait_all(self, requests: list, label: str) -> None:
        tracker = self._tracker
        tracker.busy = label     # waiting on calls that already counted in seq
        try:
            MPI.Request.Waitall(requests)
        finally:
            tracker.busy = None

    def check_errors(self) -> None:
        """MPI reports errors synchronously; nothing to poll."""

    def expired(self, label: str, timeout: float) -> None:
        self._tracker.expired(label, timeout)

    def close(self) -> None:
        """Wait for the started calls whose Work was dropped (MPI may still write into their
        arrays); the communicator owns, and frees, the MPI communicator."""
        pending = [request for work in self._inflight if not work._done
                   for request in work._requests]
        self._inflight.clear()
        if pending:
            self.wait_all(pending, "close")
