"""Host backend: NumPy arrays through mpi4py's buffer-protocol (upper-case) calls, never pickled.

Blocking calls for the synchronous form, nonblocking ones (``Iallreduce``...) wrapped in a
:class:`~cupycomm.work.HostWork` for ``async_op=True``. Data movement is described to MPI as
bytes; reductions use the MPI datatype and op of the dtype table. ``op="avg"`` is a sum
followed by a division on the receiving ranks.
"""
from __future__ import annotations

import collections
from functools import partial
from types import MappingProxyType
from typing import Any, Callable, Deque, Dict, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from .._dtypes import DTYPES, ReduceOp
from .shapes import offsets
from ..survivors.lost import peer_lost
from ..work import HostWork
from . import HostBackend, Marks

__all__ = ["MPIBackend", "PreparedCalls", "PREPARED", "OP_NAMES"]

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


class Spec(tuple):
    """A reduction's spec: (MPI datatype, MPI op, divide by size afterwards, the view to hand
    MPI). Hashed by identity (mpi4py's Datatype and Op are unhashable): the tables below make
    each once for the life of the process, and the backend finds its calls by it."""

    __slots__ = ()
    __hash__ = object.__hash__


def _tables() -> Tuple[Dict[np.dtype, Optional[np.dtype]], Dict[np.dtype, Dict[ReduceOp, Spec]]]:
    """(movements, reductions): dtype -> the view to hand MPI (None: the array itself);
    dtype -> requested op -> its :data:`Spec`."""
    movements: Dict[np.dtype, Optional[np.dtype]] = {}
    reductions: Dict[np.dtype, Dict[ReduceOp, Spec]] = {}
    for dtype, row in DTYPES.items():
        native = row.mpi_type is not None and _exports_buffer(dtype)
        movements[dtype] = None if _exports_buffer(dtype) else row.carrier
        if native:
            reductions[dtype] = {op: Spec((row.mpi_type, _MPI_OPS[applied],
                                           applied is ReduceOp.AVG, None))
                                 for op, applied in row.ops.items()}
        elif row.carrier is not None:
            carrier_type = from_numpy_dtype(row.carrier)
            reductions[dtype] = {op: Spec((carrier_type, _emulated_op(dtype, row.carrier, applied),
                                           applied is ReduceOp.AVG, row.carrier))
                                 for op, applied in row.ops.items()}
    return movements, reductions


_MOVEMENTS, _REDUCTIONS = _tables()


# -- each MPI call, written once ----------------------------------------------------------------
# One factory per argument shape (after mpi4py's util/pkl5.py, whose bodies take the MPI call
# as a parameter): it binds ``call`` (the blocking mpi4py method, the nonblocking one, or a
# batch() block's queue) with the datatype and op, and returns ``run``, one interpreter
# frame, which makes the watchdog's marks (see ``Marks`` in backends/__init__.py: ``seq``
# counts the call, one slot of the flight recorder's ring names it, ``busy`` names it while
# the mpi4py call runs) and the call. A blocking call returns None and ``run`` its result; a
# started one returns a request, which ``started`` turns into a HostWork. The prepared calls
# and the general path (MPIBackend's methods) both run these. A helper for the marks would
# cost every call a second frame: each body writes them alike, and
# tests/faults/test_watchdog.py checks every prepared one. Their ``except`` clause costs
# nothing until an MPI call fails (CPython 3.11's exception tables): then a lost peer
# becomes PeerLost (cupycomm.survivors.lost) where the process survives losses.
Started = Callable[[Any, Any, tuple, str], HostWork]


def _reduction(call: Callable, datatype: Any, op: Any, label: str, marks: Marks,
               started: Started) -> Callable:
    """all_reduce, reduce_scatter: ``run(x, recv)``, in place when ``recv is x``."""
    ring, slots = marks.flight.calls, marks.flight.size

    def run(x, recv):
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:
            request = call(_IN_PLACE if recv is x else [x, datatype], [recv, datatype], op)
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return recv if request is None else started(request, recv, (x, recv), label)
    return run


def _rooted_reduction(call: Callable, datatype: Any, op: Any, label: str, marks: Marks,
                      started: Started) -> Callable:
    """reduce: ``run(x, recv, root)``, ``recv`` None off the root, in place when ``recv is x``."""
    ring, slots = marks.flight.calls, marks.flight.size

    def run(x, recv, root):
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:
            request = call(_IN_PLACE if recv is x else [x, datatype],
                           None if recv is None else [recv, datatype], op, root)
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return recv if request is None else started(request, recv, (x, recv), label)
    return run


def _rooted(call: Callable, datatype: Any, op: Any, label: str, marks: Marks,
            started: Started) -> Callable:
    """gather, scatter: ``run(x, recv, root)``, ``recv`` (gather) or ``x`` (scatter) None
    off the root."""
    ring, slots = marks.flight.calls, marks.flight.size

    def run(x, recv, root):
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:
            request = call(None if x is None else [x, datatype],
                           None if recv is None else [recv, datatype], root)
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return recv if request is None else started(request, recv, (x, recv), label)
    return run


def _two_buffers(call: Callable, datatype: Any, op: Any, label: str, marks: Marks,
                 started: Started) -> Callable:
    """all_gather, all_to_all: ``run(x, recv)``."""
    ring, slots = marks.flight.calls, marks.flight.size

    def run(x, recv):
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:
            request = call([x, datatype], [recv, datatype])
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return recv if request is None else started(request, recv, (x, recv), label)
    return run


def _one_buffer(call: Callable, datatype: Any, op: Any, label: str, marks: Marks,
                started: Started) -> Callable:
    """broadcast, send, recv: ``run(x, rank)`` (the root, or the peer)."""
    ring, slots = marks.flight.calls, marks.flight.size

    def run(x, rank):
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:
            request = call([x, datatype], rank)
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return x if request is None else started(request, x, (x,), label)
    return run


def _sendrecv(call: Callable, datatype: Any, op: Any, label: str, marks: Marks,
              started: Started) -> Callable:
    """sendrecv: ``run(x, dst, buf, src)``."""
    ring, slots = marks.flight.calls, marks.flight.size

    def run(x, dst, buf, src):
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:
            request = call([x, datatype], dst, 0, [buf, datatype], src, 0)
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return buf if request is None else started(request, buf, (x, buf), label)
    return run


def _vectors(call: Callable, datatype: Any, op: Any, label: str, marks: Marks,
             started: Started) -> Callable:
    """all_to_all_v: ``run(x, send_counts, recv, recv_counts)``, counts in ``datatype``."""
    ring, slots = marks.flight.calls, marks.flight.size

    def run(x, send_counts, recv, recv_counts):
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:
            request = call([x, (send_counts, offsets(send_counts)), datatype],
                           [recv, (recv_counts, offsets(recv_counts)), datatype])
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return recv if request is None else started(request, recv, (x, recv), label)
    return run


def _no_buffer(call: Callable, datatype: Any, op: Any, label: str, marks: Marks,
               started: Started) -> Callable:
    """barrier: ``run()``."""
    ring, slots = marks.flight.calls, marks.flight.size

    def run():
        marks.seq = seq = marks.seq + 1
        ring[seq % slots] = label
        marks.busy = label
        try:
            request = call()
        except _MPI_ERROR as error:
            peer_lost(error, marks, label, seq)   # raises PeerLost where the process survives
            raise
        finally:
            marks.busy = None
        return None if request is None else started(request, None, (), label)
    return run


# Each call's shape and its blocking and nonblocking mpi4py methods; the prepared calls are
# those the Communicator looks up (PREPARED).
_CALLS: Dict[str, Tuple[Callable[..., Callable], str, str]] = {
    "all_reduce": (_reduction, "Allreduce", "Iallreduce"),
    "reduce_scatter": (_reduction, "Reduce_scatter_block", "Ireduce_scatter_block"),
    "reduce": (_rooted_reduction, "Reduce", "Ireduce"),
    "gather": (_rooted, "Gather", "Igather"),
    "scatter": (_rooted, "Scatter", "Iscatter"),
    "all_gather": (_two_buffers, "Allgather", "Iallgather"),
    "all_to_all": (_two_buffers, "Alltoall", "Ialltoall"),
    "all_to_all_v": (_vectors, "Alltoallv", "Ialltoallv"),
    "broadcast": (_one_buffer, "Bcast", "Ibcast"),
    "send": (_one_buffer, "Send", "Isend"),
    "recv": (_one_buffer, "Recv", "Irecv"),
    "sendrecv": (_sendrecv, "Sendrecv", "Isendrecv"),
    "barrier": (_no_buffer, "Barrier", "Ibarrier"),
}
PREPARED = ("all_reduce", "reduce_scatter", "reduce", "gather", "scatter", "all_gather",
            "all_to_all", "broadcast", "sendrecv")
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
OP_NAMES = tuple(op.value for op in ReduceOp)
"""The op strings, ``"sum"`` first: a reduction's prepared calls have one key for each."""
_NO_CALLS = MappingProxyType(dict.fromkeys(OP_NAMES))
_LABELS = {"all_to_all_v": "all_to_all"}   # what the watchdog calls a call, where not its name


def _queue(start: Callable, *args: Any) -> tuple:
    """A batch() block's stand-in for the nonblocking ``start``: the call to make when the
    block ends (:meth:`MPIBackend.end_group`), in place of its request."""
    return start, args


class MadeCalls(dict):
    """One collective's calls in one mode (blocking, started, or queued in a batch() block) by
    the spec the route gives (a reduction's :class:`Spec`, a movement's view): made on the
    first lookup of a spec (``__missing__``, by :meth:`MPIBackend._call`), then one subscript."""

    __slots__ = ("_backend", "_name", "_started", "_label")

    def __init__(self, backend: "MPIBackend", name: str, started: bool) -> None:
        super().__init__()
        self._backend = backend
        self._name = name
        self._started = started
        self._label = _LABELS.get(name, name)

    def __missing__(self, spec: Any) -> Callable:
        datatype, op = (spec[0], spec[1]) if type(spec) is Spec else (_BYTE, None)
        made = self[spec] = self._backend._call(self._name, self._started, datatype, op,
                                                self._label)
        return made


def _general_calls(backend: "MPIBackend", started: bool) -> Dict[str, MadeCalls]:
    """The general path's calls of one mode: each call of ``_CALLS`` -> its
    :class:`MadeCalls`. :class:`MPIBackend` holds the blocking and started ones, or while a
    batch() block is open the queued ones, as ``_runs`` (blocking) and ``_started_runs``."""
    return {name: MadeCalls(backend, name, started) for name in _CALLS}


def _viewed(a: Any, view: Any) -> Any:
    """``a`` as the carrier dtype ``view`` (None: as it is; ``a`` None stays None)."""
    return a if view is None or a is None else a.view(view)


class PreparedByDtype(dict):
    """One collective's prepared calls by dtype, blocking or started: a plain dict lookup on
    the hit path; the first lookup of a dtype makes its calls (``__missing__``) and keeps
    them, or keeps what says there is none (None; for a reduction, a dict whose every op
    string in OP_NAMES maps to None), so that every lookup finds an answer in one subscript.
    While the prepared calls are disabled, a lookup answers "none" and keeps nothing."""

    __slots__ = ("_prepared", "_name", "_reduces", "_async_op")

    def __init__(self, prepared: "PreparedCalls", name: str, async_op: bool) -> None:
        super().__init__()
        self._prepared = prepared
        self._name = name
        self._reduces = name in _REDUCING
        self._async_op = async_op

    def __missing__(self, dtype: Any) -> Any:
        prepared = self._prepared
        if not prepared.enabled:
            return _NO_CALLS if self._reduces else None
        made = self[dtype] = prepared.backend.prepare(self._name, dtype, self._reduces,
                                                      self._async_op)
        return made


class PreparedTables:
    """The prepared calls of each collective in PREPARED, blocking or started, as one
    attribute each (a :class:`PreparedByDtype`)."""

    __slots__ = PREPARED
    all_reduce: PreparedByDtype
    reduce_scatter: PreparedByDtype
    reduce: PreparedByDtype
    gather: PreparedByDtype
    scatter: PreparedByDtype
    all_gather: PreparedByDtype
    all_to_all: PreparedByDtype
    broadcast: PreparedByDtype
    sendrecv: PreparedByDtype

    def __init__(self, prepared: "PreparedCalls", async_op: bool) -> None:
        for name in PREPARED:
            setattr(self, name, PreparedByDtype(prepared, name, async_op))

    def clear(self) -> None:
        for name in PREPARED:
            getattr(self, name).clear()


class PreparedCalls:
    """The backend's prepared calls, made on first use and then only looked up, in one
    subscript chain: ``blocking`` (and ``started``, for async_op) ``.<collective>[dtype]``
    gives the call, or None; for a reduction, a dict of every op string (OP_NAMES) to the
    call or None. Disabled (a ``batch()`` block is open, or the communicator closed), the
    tables are empty and every lookup answers None, so that every call takes the general
    path.

    Example::

        prepared = PreparedCalls(backend)
        run = prepared.blocking.all_reduce[numpy.dtype("float32")]["sum"]
        run(x, x)   # Allreduce(IN_PLACE, [x, MPI.FLOAT], MPI.SUM), watched
    """

    __slots__ = ("blocking", "started", "enabled", "backend")

    def __init__(self, backend: "MPIBackend") -> None:
        self.backend = backend
        self.blocking = PreparedTables(self, False)
        self.started = PreparedTables(self, True)
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False
        self.blocking.clear()
        self.started.clear()

    def enable(self) -> None:
        self.enabled = True


class MPIBackend(HostBackend):
    """Collectives on host memory over one MPI communicator (owned by the Communicator).

    Each method views its buffers as MPI takes them and runs the call that
    :meth:`_call` makes from the call's shape (the same calls the prepared table holds),
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
        self._calls: Dict[tuple, Callable] = {}   # see _call
        # The general path's calls by spec: blocking and started, or queued in a batch() block.
        self._direct_runs = (_general_calls(self, False), _general_calls(self, True))
        self._runs, self._started_runs = self._direct_runs
        self._queued_runs = _general_calls(self, True)

    # -- the calls, and what finishes one -------------------------------------------------------
    def _call(self, name: str, started: bool, datatype: Any = _BYTE, op: Any = None,
              label: str = "") -> Callable:
        """Collective ``name``'s call (see the shapes above) with ``datatype`` and ``op``:
        blocking, or started (``started``), or inside a batch() block queued to start when
        the block ends; made once. ``label`` (default ``name``) is what the watchdog calls
        it."""
        # Keyed by identity: mpi4py's Datatype and Op are unhashable, and the tables above
        # hold the ones passed here for the life of the process.
        key = (name, started if self._group is None else None, id(datatype), id(op))
        try:
            return self._calls[key]
        except KeyError:
            pass
        factory, blocking, nonblocking = _CALLS[name]
        keep: Started
        if self._group is not None:
            call, keep = partial(_queue, getattr(self._comm, nonblocking)), self._queued
        else:
            call = getattr(self._comm, nonblocking if started else blocking)
            keep = self._started
        run = self._calls[key] = factory(call, datatype, op, label or name, self._tracker, keep)
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

    # -- prepared calls: the Communicator's fast path ---------------------------------------------
    def prepare(self, name: str, dtype: np.dtype, reduces: bool = False,
                async_op: bool = False) -> Any:
        """Collective ``name``'s prepared calls on arrays of ``dtype``, made once and kept by
        the Communicator (:class:`PreparedCalls`): the call of its shape with the datatype
        (and op) bound; blocking, or for ``async_op`` started and returning a
        :class:`~cupycomm.work.HostWork`. For a reduction (``reduces``), a dict op's string
        -> call. None (a reduction's op: None) where a call needs more (a dtype MPI takes as
        a carrier view, an average to divide) or the dtype is not valid: the general path
        (the methods below) does those, and says what is wrong. Arguments, checked by the
        caller: ``(x, recv)``, ``recv is x`` in place; rooted calls ``(x, recv, root)``,
        ``recv`` or ``x`` None where the rank does not use it; broadcast ``(x, root)``;
        sendrecv ``(x, dst, buf, src)``."""
        if name not in PREPARED:
            return None
        if not reduces:
            if dtype not in _MOVEMENTS or _MOVEMENTS[dtype] is not None:
                return None
            return self._call(name, async_op)
        # Every op's string (a ReduceOp member, a str, finds it as fast), None where it has
        # no call, so that a lookup misses only on a value that is not an op.
        calls: Dict[str, Optional[Callable]] = dict.fromkeys(OP_NAMES)
        for op, (datatype, mpi_op, avg, view) in self.reductions.get(dtype, {}).items():
            if not avg and view is None:
                calls[op.value] = self._call(name, async_op, datatype, mpi_op)
        return calls

    # -- collectives: the general path ------------------------------------------------------------
    # The movement spec, and ``view`` in a reduction's spec, is None for the dtypes MPI takes
    # as they are, else the carrier dtype that the buffers are viewed as (bfloat16 -> uint16).
    # Each finds its call by the spec, in the mode's table (``_runs`` or ``_started_runs``).
    def all_reduce(self, x, recv, spec, async_op, stream):
        _, _, avg, view = spec
        run = (self._started_runs if async_op else self._runs)["all_reduce"][spec]
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

    def reduce(self, x, recv, spec, root, async_op, stream):
        _, _, avg, view = spec
        send = _viewed(x, view)
        done = (self._started_runs if async_op else self._runs)["reduce"][spec](
            send, send if recv is x else _viewed(recv, view), root)
        return self._finish(done, recv, partial(self._divide, recv) if avg and recv is not None
                            else None)

    def broadcast(self, x, spec, root, async_op, stream):
        run = (self._started_runs if async_op else self._runs)["broadcast"][spec]
        return self._finish(run(_viewed(x, spec), root), x)

    def all_gather(self, x, recv, spec, async_op, stream, unpack=()):
        run = (self._started_runs if async_op else self._runs)["all_gather"][spec]
        done = run(_viewed(x, spec), _viewed(recv, spec))
        if not unpack:
            return self._finish(done, recv)
        # The result is the list the parts are copied into.
        return self._finish(done, [dst for dst, _ in unpack], self._unpack(unpack))

    def reduce_scatter(self, x, recv, spec, async_op, stream, pack=()):
        for dst, src in pack:   # (a list's parts, into x)
            dst[...] = src
        _, _, avg, view = spec
        run = (self._started_runs if async_op else self._runs)["reduce_scatter"][spec]
        done = run(_viewed(x, view), _viewed(recv, view))
        return self._finish(done, recv, partial(self._divide, recv) if avg else None)

    def all_to_all(self, x, recv, spec, async_op, stream):
        run = (self._started_runs if async_op else self._runs)["all_to_all"][spec]
        return self._finish(run(_viewed(x, spec), _viewed(recv, spec)), recv)

    def all_to_all_v(self, x, recv, spec, send_bytes, recv_bytes, async_op, stream):
        """Uneven parts: ``send_bytes[j]`` go to rank ``j``, ``recv_bytes[i]`` come from ``i``."""
        run = (self._started_runs if async_op else self._runs)["all_to_all_v"][spec]
        return self._finish(run(_viewed(x, spec), send_bytes, _viewed(recv, spec), recv_bytes),
                            recv)

    def scatter(self, x, recv, spec, root, async_op, stream):
        run = (self._started_runs if async_op else self._runs)["scatter"][spec]
        send = _viewed(x, spec) if self._rank == root else None
        return self._finish(run(send, _viewed(recv, spec), root), recv)

    def gather(self, x, recv, spec, root, async_op, stream):
        run = (self._started_runs if async_op else self._runs)["gather"][spec]
        into = _viewed(recv, spec) if self._rank == root else None
        return self._finish(run(_viewed(x, spec), into, root), recv)

    def send(self, x, spec, peer, async_op, stream):
        run = (self._started_runs if async_op else self._runs)["send"][spec]
        return self._finish(run(_viewed(x, spec), peer), None)

    def recv(self, x, spec, peer, async_op, stream):
        run = (self._started_runs if async_op else self._runs)["recv"][spec]
        return self._finish(run(_viewed(x, spec), peer), x)

    def sendrecv(self, x, spec, dst, buf, src, async_op, stream):
        run = (self._started_runs if async_op else self._runs)["sendrecv"][spec]
        return self._finish(run(_viewed(x, spec), dst, _viewed(buf, spec), src), buf)

    def barrier(self, async_op: bool = False):
        return self._finish((self._started_runs if async_op else self._runs)["barrier"][None](),
                            None)

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
        self._runs = self._started_runs = self._queued_runs

    def end_group(self, group: Any, cancel: bool) -> None:
        """Start the block's calls and wait for all of them; if the block raised
        (``cancel``), start none: no rank is left matching half a block."""
        self._group = None
        self._runs, self._started_runs = self._direct_runs
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
