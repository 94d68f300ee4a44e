"""Host backend: NumPy arrays through mpi4py's buffer-protocol (upper-case) calls, never pickled.

Blocking calls for the synchronous form, nonblocking ones (``Iallreduce``...) wrapped in a
:class:`~cupycomm.work.HostWork` for ``async_op=True``. Data movement is described to MPI as
bytes; reductions use the MPI datatype and op of the dtype table. ``op="avg"`` is a sum
followed by a division on the receiving ranks.
"""
from __future__ import annotations

import collections
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from .._dtypes import DTYPES, ReduceOp
from .shapes import offsets
from ..survivors.lost import peer_lost
from ..work import HostWork
from . import HostBackend, Marks

__all__ = ["MPIBackend", "Calls", "Spec"]

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.AVG: MPI.SUM}
_NUMPY_OPS = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
              ReduceOp.MAX: np.maximum, ReduceOp.AVG: np.add}
_BYTE = MPI.BYTE
_IN_PLACE = MPI.IN_PLACE
_MPI_ERROR = MPI.Exception


def _exports_buffer(dtype: np.dtype) -> bool:
    try:
        np.empty(1, dtype).data   # a memoryview of the array
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


class Spec(NamedTuple):
    """A reduction's spec: what MPI is handed, and its keys in a :class:`Calls` table (under
    the dtype): ``key``, the op's string, which the Communicator's common case looks up;
    ``call``, its MPI call's: the same, but sum's for ``"avg"`` and a tuple (which no op
    string is) for an op of ours, on a dtype MPI takes as a carrier view."""

    datatype: Any            # the MPI datatype
    op: Any                  # the MPI op
    avg: bool                # divided by the size afterwards
    view: Optional[np.dtype]   # the carrier dtype the buffers are viewed as, or None
    key: str
    call: Any


def _tables() -> Tuple[Dict[np.dtype, Optional[np.dtype]], Dict[np.dtype, Dict[ReduceOp, Spec]]]:
    """(movements, reductions): dtype -> the view to hand MPI (None: the array itself);
    dtype -> requested op -> its :class:`Spec`."""
    movements: Dict[np.dtype, Optional[np.dtype]] = {}
    reductions: Dict[np.dtype, Dict[ReduceOp, Spec]] = {}
    for dtype, row in DTYPES.items():
        movements[dtype] = None if _exports_buffer(dtype) else row.carrier
        if row.mpi_type is not None and _exports_buffer(dtype):
            view, datatype = None, row.mpi_type
        elif row.carrier is not None:
            view, datatype = row.carrier, from_numpy_dtype(row.carrier)
        else:
            continue
        specs = reductions[dtype] = {}
        for op, applied in row.ops.items():
            avg = applied is ReduceOp.AVG
            call = "sum" if avg else op.value   # (avg's call is sum's)
            specs[op] = (Spec(datatype, _MPI_OPS[applied], avg, None, op.value, call)
                         if view is None else Spec(datatype, _emulated_op(dtype, view, applied),
                                                   avg, view, op.value, (call,)))
    return movements, reductions


_MOVEMENTS, _REDUCTIONS = _tables()


# -- each MPI call, written once ----------------------------------------------------------------
# One factory (after mpi4py's util/pkl5.py, whose bodies take the MPI call as a parameter): it
# binds ``call`` (the blocking mpi4py method, the nonblocking one, or a batch() block's queue)
# with the datatype, op and argument shape, and returns ``run``, one interpreter frame, which
# makes the watchdog's marks (see ``Marks`` in backends/__init__.py: ``seq`` counts the call,
# one slot of the flight recorder's ring names it, ``busy`` names it while the mpi4py call
# runs) and the call, in its shape's branch. A blocking call returns None and ``run`` its
# result; a started one returns a request, which ``started`` turns into a HostWork.
# MPIBackend makes each once (``_call``), into its :class:`Calls`, which the general path
# (MPIBackend's methods) and the Communicator's common case both run. A helper for the marks,
# or one per shape for the arguments, would cost every call a second frame; the branches
# cost 15 to 55 ns a call against one body per shape (benchmarks/callpath_ab.py).
# tests/faults/test_watchdog.py checks the marks of those the common case runs. The
# ``except`` clause costs nothing until an MPI call fails (CPython 3.11's exception tables):
# then a lost peer becomes PeerLost (cupycomm.survivors.lost) where the process survives.
Started = Callable[[Any, Any, tuple, str], HostWork]


def _made(call: Callable, shape: str, datatype: Any, op: Any, label: str, marks: Marks,
          started: Started) -> Callable:
    """``run`` of one call, its arguments by ``shape`` (see ``_CALLS``): "pair"
    ``run(x, recv)``, in place when ``recv is x``; "rooted" ``run(x, recv, root)``, ``x`` or
    ``recv`` None where the rank does not use it; "one" ``run(x, rank)`` (the root, or the
    peer); "sendrecv" ``run(x, dst, buf, src)``; "vectors" ``run(x, send_counts, recv,
    recv_counts)`` (counts in ``datatype``); "none" ``run()``."""
    ring, slots = marks.flight.calls, marks.flight.size
    reduces, rooted = op is not None, shape == "rooted"
    pair, one, sendrecv = shape == "pair", shape == "one", shape == "sendrecv"

    def run(x=None, a=None, b=None, c=None):
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:   # (the branches in the order that costs the common calls the fewest tests)
            if reduces:   # a: recv, b: the root
                send = _IN_PLACE if a is x else [x, datatype]
                if rooted:
                    request = call(send, None if a is None else [a, datatype], op, b)
                else:
                    request = call(send, [a, datatype], op)
            elif pair:   # a: recv
                request = call([x, datatype], [a, datatype])
            elif one:   # a: the rank
                request = call([x, datatype], a)
                a = x
            elif rooted:   # a: recv, b: the root
                request = call(None if x is None else [x, datatype],
                               None if a is None else [a, datatype], b)
            elif sendrecv:   # a: dst, b: buf, c: src
                request = call([x, datatype], a, 0, [b, datatype], c, 0)
                a = b
            elif x is not None:   # vectors (a, c: the counts, b: recv); a barrier has no x
                request = call([x, (a, offsets(a)), datatype], [b, (c, offsets(c)), datatype])
                a = b
            else:
                request = call()
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return a if request is None else started(request, a, (x, a), label)
    return run


# Each call's shape and its blocking and nonblocking mpi4py methods.
_CALLS: Dict[str, Tuple[str, str, str]] = {
    "all_reduce": ("pair", "Allreduce", "Iallreduce"),
    "reduce_scatter": ("pair", "Reduce_scatter_block", "Ireduce_scatter_block"),
    "reduce": ("rooted", "Reduce", "Ireduce"),
    "gather": ("rooted", "Gather", "Igather"),
    "scatter": ("rooted", "Scatter", "Iscatter"),
    "all_gather": ("pair", "Allgather", "Iallgather"),
    "all_to_all": ("pair", "Alltoall", "Ialltoall"),
    "all_to_all_v": ("vectors", "Alltoallv", "Ialltoallv"),
    "broadcast": ("one", "Bcast", "Ibcast"),
    "send": ("one", "Send", "Isend"),
    "recv": ("one", "Recv", "Irecv"),
    "sendrecv": ("sendrecv", "Sendrecv", "Isendrecv"),
    "barrier": ("none", "Barrier", "Ibarrier"),
    "scan": ("pair", "Scan", "Iscan"),
    "exscan": ("pair", "Exscan", "Iexscan"),
}
_LABELS = {"all_to_all_v": "all_to_all"}   # what the watchdog calls a call, where not its name


def _queue(start: Callable, *args: Any) -> tuple:
    """A batch() block's stand-in for the nonblocking ``start``: the call to make when the
    block ends (:meth:`MPIBackend.end_group`), in place of its request."""
    return start, args


def _viewed(a: Any, view: Any) -> Any:
    """``a`` as the carrier dtype ``view`` (None: as it is; ``a`` None stays None)."""
    return a if view is None or a is None else a.view(view)


# A call's entry for the common case where its MPI call views the buffers or divides after:
# the backend's method, with the spec and mode bound, taking the common case's arguments.
_THROUGH: Dict[str, Callable[[Callable, Any, bool], Callable]] = {
    "pair": lambda method, spec, started: lambda x, recv: method(x, recv, spec, started, None),
    "rooted": lambda method, spec, started: lambda x, recv, root: method(x, recv, spec, root,
                                                                         started, None),
    "one": lambda method, spec, started: lambda x, rank: method(x, spec, rank, started, None),
    "sendrecv": lambda method, spec, started: lambda x, dst, buf, src: method(
        x, spec, dst, buf, src, started, None),
}


class Calls:
    """The calls of one mode (blocking, started, or queued in a batch() block), each made
    once: an attribute per call of ``_CALLS``, a dict by dtype (a reduction's: then by
    :attr:`Spec.key`, the op's string) that gives its call, run as the common case passes
    its arguments. Where the MPI call views the buffers or divides after, that entry runs the
    backend's method (``_THROUGH``), and the MPI call has its own: by the carrier dtype, or
    by :attr:`Spec.call`. The general path fills it (:meth:`MPIBackend._call`); the
    Communicator's common case reads it, ``calls.all_reduce[x.dtype][op]``, and takes the
    general path on a KeyError."""

    __slots__ = tuple(_CALLS)

    def __init__(self) -> None:
        for name in _CALLS:
            setattr(self, name, {})

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Dict[Any, Any]: ...


class MPIBackend(HostBackend):
    """Collectives on host memory over one MPI communicator (owned by the Communicator).

    Each method views its buffers as MPI takes them and runs their call (:meth:`_call`):
    blocking, started for ``async_op``, or queued in a batch() block; then it finishes the
    call (``op="avg"``'s division, all_gather's list parts) or has its Work finish it.

    Example::

        backend = MPIBackend(MPI.COMM_WORLD.Dup(), tracker)
        spec = backend.reductions[numpy.dtype("float32")][ReduceOp.SUM]
        backend.all_reduce(x, x, spec, False, None)   # Allreduce(IN_PLACE, [x, MPI.FLOAT], SUM)
    """

    name = "mpi"
    array_type = np.ndarray
    device_id = None
    movements = _MOVEMENTS
    reductions = _REDUCTIONS

    def __init__(self, comm: MPI.Comm, tracker: Marks) -> None:
        self._comm = comm
        self._size = comm.Get_size()
        self._rank = comm.Get_rank()
        self._tracker = tracker   # counts this rank's collectives, for the watchdog
        self._group: Any = None   # the open batch() block, if any
        # Started nonblocking calls, oldest first: they keep their arrays (and requests)
        # alive even if the caller drops the Work, since MPI writes into them until done.
        self._inflight: Deque[HostWork] = collections.deque()
        #: The calls made, blocking and started (the Communicator's common case reads them).
        self.calls = (Calls(), Calls())
        self._modes = self.calls   # the tables in use: the queued one in a batch() block
        self._queued_calls = Calls()

    # -- the calls, and what finishes one -------------------------------------------------------
    def _call(self, name: str, started: bool, dtype: Any, spec: Any = None) -> Callable:
        """Call ``name``'s MPI call on arrays of ``dtype`` with ``spec`` (its view, or its
        :class:`Spec`): blocking, or started (``started``), or inside a batch() block queued
        to start when the block ends; found in the mode's :class:`Calls`, or made there, and
        the common case's entry with it."""
        calls = getattr(self._modes[started], name)
        if type(spec) is Spec:
            calls = calls.get(dtype) or calls.setdefault(dtype, {})
            key, common, datatype, op = spec.call, spec.key, spec.datatype, spec.op
        else:
            key, common, datatype, op = dtype if spec is None else spec, dtype, _BYTE, None
        shape, blocking, nonblocking = _CALLS[name]
        run = calls.get(key)
        if run is None:
            keep: Started
            if self._group is not None:
                call, keep = partial(_queue, getattr(self._comm, nonblocking)), self._queued
            else:
                call = getattr(self._comm, nonblocking if started else blocking)
                keep = self._started
            run = calls[key] = _made(call, shape, datatype, op, _LABELS.get(name, name),
                                     self._tracker, keep)
        if common not in calls and shape in _THROUGH:   # (this MPI call views or divides)
            calls[common] = _THROUGH[shape](getattr(self, name), spec, started)
        return run

    def _started(self, request: Any, result: Any, keep: tuple, label: str) -> HostWork:
        """The Work of a started call, kept in ``_inflight`` until it completes (the oldest
        that completed are let go here)."""
        work = HostWork([request], result, keep, self, label)
        inflight = self._inflight
        while inflight and (inflight[0]._done or inflight[0].is_completed()):
            inflight.popleft()
        inflight.append(work)
        return work

    def _queued(self, queued: tuple, result: Any, keep: tuple, label: str) -> HostWork:
        """The Work of a call queued in the open batch() block (``queued``: what starts it)."""
        group = self._group
        group.claim("host", label)
        work = HostWork(None, result, keep, self, label)
        group.works.append(work)
        group.calls.append(queued)
        return work

    @staticmethod
    def _finish(done: Any, result: Any, finish: Optional[Callable[[], None]] = None) -> Any:
        """What a general-path call returns once its call ran (``done``, what the call
        returned: a HostWork if it started): ``result`` after ``finish``, or the Work that
        gives ``result`` and runs ``finish`` when it completes."""
        if type(done) is HostWork:
            done._result, done._finish = result, finish
            return done
        if finish is not None:
            finish()
        return result

    def _divide(self, recv: np.ndarray) -> None:
        """``op="avg"``'s finish: ``recv`` divided by the size, in place."""
        # Complex values divide as pairs of reals, as NCCL's average does.
        reals = recv.reshape(-1).view(recv.real.dtype) if recv.dtype.kind == "c" else recv
        np.true_divide(reals, self._size, out=reals)

    @staticmethod
    def _unpack(pairs) -> Callable[[], None]:
        def finish():
            for dst, src in pairs:
                dst[...] = src
        return finish

    # -- collectives: the general path ------------------------------------------------------------
    # A movement's spec is None for the dtypes MPI takes as they are, else the carrier dtype
    # the buffers are viewed as (bfloat16 -> uint16); a reduction's, its Spec.
    def all_reduce(self, x, recv, spec, async_op, stream):
        _, _, avg, view, _, _ = spec
        run = self._call("all_reduce", async_op, x.dtype, spec)
        if view is None:
            done = run(x, recv)
        else:
            send = x.view(view)
            done = run(send, send if recv is x else recv.view(view))
        if type(done) is HostWork:
            return self._finish(done, recv, partial(self._divide, recv) if avg else None)
        if avg:   # (the blocking call's finish, without _finish's frame: op="avg" is common)
            self._divide(recv)
        return recv

    def scan(self, x, recv, spec, async_op, stream):
        send = _viewed(x, spec.view)
        return self._finish(self._call("scan", async_op, x.dtype, spec)(
            send, send if recv is x else _viewed(recv, spec.view)), recv)

    def exscan(self, x, recv, spec, async_op, stream):
        done = self._call("exscan", async_op, x.dtype, spec)(_viewed(x, spec.view),
                                                             _viewed(recv, spec.view))
        return self._finish(done, recv if self._rank else None)   # rank 0's is undefined

    def reduce(self, x, recv, spec, root, async_op, stream):
        send = _viewed(x, spec.view)
        done = self._call("reduce", async_op, x.dtype, spec)(
            send, send if recv is x else _viewed(recv, spec.view), root)
        return self._finish(done, recv, partial(self._divide, recv)
                            if spec.avg and recv is not None else None)

    def broadcast(self, x, spec, root, async_op, stream):
        run = self._call("broadcast", async_op, x.dtype, spec)
        return self._finish(run(_viewed(x, spec), root), x)

    def all_gather(self, x, recv, spec, async_op, stream, unpack=()):
        run = self._call("all_gather", async_op, x.dtype, spec)
        done = run(_viewed(x, spec), _viewed(recv, spec))
        if not unpack:
            return self._finish(done, recv)
        # The result is the list the parts are copied into.
        return self._finish(done, [dst for dst, _ in unpack], self._unpack(unpack))

    def reduce_scatter(self, x, recv, spec, async_op, stream, pack=()):
        for dst, src in pack:   # (a list's parts, into x)
            dst[...] = src
        run = self._call("reduce_scatter", async_op, x.dtype, spec)
        done = run(_viewed(x, spec.view), _viewed(recv, spec.view))
        return self._finish(done, recv, partial(self._divide, recv) if spec.avg else None)

    def all_to_all(self, x, recv, spec, async_op, stream):
        run = self._call("all_to_all", async_op, x.dtype, spec)
        return self._finish(run(_viewed(x, spec), _viewed(recv, spec)), recv)

    def all_to_all_v(self, x, recv, spec, send_bytes, recv_bytes, async_op, stream):
        """Uneven parts: ``send_bytes[j]`` go to rank ``j``, ``recv_bytes[i]`` come from ``i``."""
        run = self._call("all_to_all_v", async_op, x.dtype, spec)
        return self._finish(run(_viewed(x, spec), send_bytes, _viewed(recv, spec), recv_bytes),
                            recv)

    def scatter(self, x, recv, spec, root, async_op, stream):
        run = self._call("scatter", async_op, recv.dtype, spec)
        send = _viewed(x, spec) if self._rank == root else None
        return self._finish(run(send, _viewed(recv, spec), root), recv)

    def gather(self, x, recv, spec, root, async_op, stream):
        run = self._call("gather", async_op, x.dtype, spec)
        into = _viewed(recv, spec) if self._rank == root else None
        return self._finish(run(_viewed(x, spec), into, root), recv)

    def send(self, x, spec, peer, async_op, stream):
        run = self._call("send", async_op, x.dtype, spec)
        return self._finish(run(_viewed(x, spec), peer), None)

    def recv(self, x, spec, peer, async_op, stream):
        run = self._call("recv", async_op, x.dtype, spec)
        return self._finish(run(_viewed(x, spec), peer), x)

    def sendrecv(self, x, spec, dst, buf, src, async_op, stream):
        run = self._call("sendrecv", async_op, x.dtype, spec)
        return self._finish(run(_viewed(x, spec), dst, _viewed(buf, spec), src), buf)

    def barrier(self, async_op: bool = False):
        return self._finish(self._call("barrier", async_op, None)(), None)

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
        except _MPI_ERROR as error:
            peer_lost(error, tracker, label, tracker.seq + 1)
            raise
        finally:
            tracker.busy = None

    # -- batch() blocks: the calls start together when the block ends, which waits for them ------
    def begin_group(self, group: Any) -> None:
        self._group = group
        self._modes = (self._queued_calls, self._queued_calls)

    def end_group(self, group: Any, cancel: bool) -> None:
        """Start the block's calls and wait for all of them; if the block raised
        (``cancel``), start none: no rank is left matching half a block."""
        self._group = None
        self._modes = self.calls
        if group.kind != "host" or cancel:
            return
        for work, (start, args) in zip(group.works, group.calls):
            work._requests = [start(*args)]
            self._inflight.append(work)
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
        except _MPI_ERROR as error:
            peer_lost(error, tracker, label, tracker.seq)
            raise
        finally:
            tracker.busy = None

    def check_errors(self, label: str) -> None:
        """MPI reports errors synchronously; nothing to poll."""

    def expired(self, label: str, timeout: float) -> None:
        self._tracker.expired(label, timeout)

    def close(self) -> None:
        """Wait for the started calls whose Work was dropped (MPI may still write into their
        arrays); the communicator owns, and frees, the MPI communicator."""
        pending = [request for work in self._inflight if not work._done
                   for request in work._requests or ()]
        self._inflight.clear()
        if pending:
            self.wait_all(pending, "close")
