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


# -- prepared calls: the Communicator's fast path ------------------------------------------------
# One row per collective: (the blocking and the nonblocking mpi4py call, the prepared call's
# parameters, the mpi4py call's arguments, what it returns, what a started call keeps alive).
# Each row and the two templates below make the blocking call and the started one (async_op):
# the watchdog's marks (``seq`` counts the call, one slot of the flight recorder's ring names
# it, ``busy`` names it while it blocks; see faults/watchdog.py) are written once, yet each
# prepared call is one interpreter frame, which a shared helper would double.
_SHAPES: Dict[str, tuple] = {
    "all_reduce": ("Allreduce", "Iallreduce", "x, recv",
                   "_IN_PLACE if recv is x else [x, datatype], [recv, datatype], op",
                   "recv", "x, recv"),
    "reduce_scatter": ("Reduce_scatter_block", "Ireduce_scatter_block", "x, recv",
                       "[x, datatype], [recv, datatype], op", "recv", "x, recv"),
    "all_gather": ("Allgather", "Iallgather", "x, recv", "[x, datatype], [recv, datatype]",
                   "recv", "x, recv"),
    "all_to_all": ("Alltoall", "Ialltoall", "x, recv", "[x, datatype], [recv, datatype]",
                   "recv", "x, recv"),
    # Rooted: ``recv`` is None off the root (``x`` for scatter); the root reduces in place
    # when ``recv is x``.
    "reduce": ("Reduce", "Ireduce", "x, recv, root",
               "_IN_PLACE if recv is x else [x, datatype], "
               "None if recv is None else [recv, datatype], op, root", "recv", "x, recv"),
    "gather": ("Gather", "Igather", "x, recv, root",
               "[x, datatype], None if recv is None else [recv, datatype], root",
               "recv", "x, recv"),
    "scatter": ("Scatter", "Iscatter", "x, recv, root",
                "None if x is None else [x, datatype], [recv, datatype], root",
                "recv", "x, recv"),
    "broadcast": ("Bcast", "Ibcast", "x, root", "[x, datatype], root", "x", "x,"),
    "sendrecv": ("Sendrecv", "Isendrecv", "x, dst, buf, src",
                 "[x, datatype], dst, 0, [buf, datatype], src, 0", "buf", "x, buf"),
}
_BLOCKING = """
def {name}({params}):
    tracker.seq = seq = tracker.seq + 1
    ring[seq % slots] = name
    tracker.busy = name
    try:
        call({args})
    finally:
        tracker.busy = None
    return {result}
"""
_STARTED = """
def {name}({params}):
    tracker.seq = seq = tracker.seq + 1
    ring[seq % slots] = name
    work = HostWork([call({args})], {result}, ({keep}), backend, name)
    while inflight and (inflight[0]._done or inflight[0].is_completed()):
        popleft()   # the oldest calls that completed; see MPIBackend._keep_until_done
    inflight.append(work)
    return work
"""


def _make(backend: "MPIBackend", name: str, datatype: Any, op: Any, async_op: bool) -> Callable:
    """Collective ``name``'s prepared call (blocking, or started for ``async_op``) with
    ``datatype`` and ``op`` bound; see :meth:`MPIBackend.prepare` for its arguments."""
    blocking, started, params, args, result, keep = _SHAPES[name]
    tracker = backend._tracker
    scope = {"call": getattr(backend._comm, started if async_op else blocking),
             "datatype": datatype, "op": op, "name": name, "tracker": tracker,
             "ring": tracker.flight.calls, "slots": tracker.flight.size,
             "_IN_PLACE": _IN_PLACE, "HostWork": HostWork, "backend": backend,
             "inflight": backend._inflight, "popleft": backend._inflight.popleft}
    source = (_STARTED if async_op else _BLOCKING).format(
        name=name, params=params, args=args, result=result, keep=keep)
    exec(compile(source, f"<cupycomm prepared {name}>", "exec"), scope)
    return scope[name]


class PreparedCalls:
    """The backend's prepared calls, made on first use and then only looked up:
    ``blocking`` (and ``started``, for async_op) maps collective -> dtype -> the call, or for
    a reduction -> dtype -> op -> the call; a dtype or op without one is None or absent.
    ``find`` answers a lookup that missed. Disabled (a ``batch()`` block is open, or the
    communicator closed), the tables are empty and ``find`` answers None, so that every call
    takes the general path.

    Example::

        prepared = PreparedCalls(backend)
        run = prepared.find("all_reduce", numpy.dtype("float32"), "sum")
        run(x, x)   # Allreduce(IN_PLACE, [x, MPI.FLOAT], MPI.SUM), watched
        prepared.blocking["all_reduce"][numpy.dtype("float32")]["sum"] is run   # True
    """

    __slots__ = ("blocking", "started", "enabled", "_backend")

    def __init__(self, backend: "MPIBackend") -> None:
        self._backend = backend
        self.blocking: Dict[str, dict] = {name: {} for name in _SHAPES}
        self.started: Dict[str, dict] = {name: {} for name in _SHAPES}
        self.enabled = True

    def find(self, name: str, dtype: Any, op: Any = None,
             async_op: bool = False) -> Optional[Callable]:
        """The prepared call that a lookup in ``blocking`` or ``started`` missed (making the
        dtype's calls if it has none yet), or None where the general path must run."""
        if not self.enabled:
            return None
        by_dtype = (self.started if async_op else self.blocking)[name]
        if dtype not in by_dtype:
            by_dtype[dtype] = self._backend.prepare(name, dtype, op is not None, async_op)
        calls = by_dtype[dtype]
        if op is None:
            return calls
        try:
            return calls.get(op)
        except TypeError:   # an unhashable op: the general path says what is wrong
            return None

    def disable(self) -> None:
        self.enabled = False
        for tables in (self.blocking, self.started):
            for by_dtype in tables.values():
                by_dtype.clear()

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
    def prepare(self, name: str, dtype: np.dtype, reduces: bool = False,
                async_op: bool = False) -> Any:
        """Collective ``name``'s prepared calls on arrays of ``dtype``, made once and kept by
        the Communicator (:class:`PreparedCalls`): the typed mpi4py call with its datatype
        (and op) bound, inside the watchdog's marks; blocking, or for ``async_op`` started
        and returning a :class:`~cupycomm.work.HostWork`. For a reduction (``reduces``), a
        dict op's string -> call. None (a reduction's op: None) where a call needs more (a
        dtype MPI takes as a carrier view, an average to divide) or the dtype is not valid:
        the general path (the methods below) does those, and says what is wrong. Arguments,
        checked by the caller: ``(x, recv)``, ``recv is x`` in place; rooted calls ``(x,
        recv, root)``, ``recv`` or ``x`` None where the rank does not use it; broadcast
        ``(x, root)``; sendrecv ``(x, dst, buf, src)``."""
        if name not in _SHAPES:
            return None
        if not reduces:
            if dtype not in _MOVEMENTS or _MOVEMENTS[dtype] is not None:
                return None
            return _make(self, name, _BYTE, None, async_op)
        # Every op's string (a ReduceOp member, a str, finds it as fast), None where it has
        # no call, so that a lookup misses only on a value that is not an op.
        calls: Dict[str, Optional[Callable]] = dict.fromkeys(op.value for op in ReduceOp)
        for op, (datatype, mpi_op, avg, view) in self.reductions.get(dtype, {}).items():
            if not avg and view is None:
                calls[op.value] = _make(self, name, datatype, mpi_op, async_op)
        return calls

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
            if len(requests) == 1:   # an async_op call's: Wait costs less than Waitall
                requests[0].Wait()
            else:
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
