"""Communicator: the collectives users call, on NumPy (MPI) and CuPy (NCCL) arrays.

What every method shares (the backend by array type, results returned, ``async_op``,
streams, the checks made before any communication, the leading-axis layouts, zero-size and
0-d arrays) is written once in the guide, :doc:`/guide/collectives`; how a call runs (the
common-case test at the top of a method and its prepared host call, else the general path,
``self._general``) in :doc:`/internals`, "The call path".
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from mpi4py import MPI

from .. import _bootstrap, _env
from . import coalesce
from ..faults import debug as _debug
from .parts import Parts, watched
from .route import Router
from .._dtypes import ReduceOp
from .general import GeneralPath
from .layouts import Layouts
from ..backends.shapes import JoinedShapes, PartShapes
from .checks import Checks
from ..faults.watchdog import Tracker, unwatch
from .batch import Batch
from ..backends.mpi import Calls
from .objects import Objects
from ..errors import PeerLost
from ..run import exit_records
from ..survivors import grow as _grow
from ..survivors.numbering import keep
from ..survivors.state import Survival, survival_for
from ..work import Work

__all__ = ["Communicator", "Parts", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT: float = _env.default("CUPYCOMM_TIMEOUT")
"""Seconds a collective may wait before it is declared hung (torch's NCCL default: 10 min).
Set per communicator by ``init(timeout=)`` or the CUPYCOMM_TIMEOUT environment variable."""

Op = Union[ReduceOp, str]
_SUM = "sum"
# An op the host's calls are looked up by: a str or ReduceOp (hashed as its string), so that
# an unhashable op, or one whose == is not a bool, reaches the general path's error.
_OP_TYPES = (str, ReduceOp)
_HOST = np.ndarray   # arrays of exactly this type may take the host's calls directly
_NO_CALLS = Calls()   # (empty) the common case's tables in a batch() block and once closed
# Whether out and x may overlap (the general path refuses them, or takes another view of x's
# memory as in place), asked only of views: arrays that own their memory (base None) never do.
_SHARES = np.may_share_memory


class Communicator:
    """A group of ranks that run collectives together; made by :func:`cupycomm.init`. Its
    ``rank``, its ``size``, and its ``local_rank`` (among the ranks on this node).

    Example (2 ranks)::

        comm = cupycomm.init()
        x = numpy.array([1.0, 2.0]) * (comm.rank + 1)
        comm.all_reduce(x)   # Rank 0: array([3., 6.])   Rank 1: array([3., 6.])
    """

    @classmethod
    def create(cls, mpi_comm: MPI.Comm, *, name: str, timeout: float = DEFAULT_TIMEOUT,
               **options: Any) -> "Communicator":
        """A communicator over ``mpi_comm`` (which it owns from now on: it frees it on close),
        watched by the watchdog; collective. ``options`` are the constructor's."""
        tracker, local_rank = watched(mpi_comm, name, timeout)
        return cls(mpi_comm, tracker, local_rank, **options)

    def __init__(self, mpi_comm: MPI.Comm, tracker: Tracker, local_rank: int, *,
                 device: Optional[int] = None, device_module: Any = None, debug: bool = False,
                 device_rank: Optional[int] = None, nccl_comm: Any = None) -> None:
        """Use :func:`cupycomm.init`, ``split`` or ``new_group``, not this constructor (or
        :meth:`create`, which makes the ``tracker`` and finds the ``local_rank``).
        ``device_rank`` is the local rank the device is chosen by (a subgroup keeps its
        parent's); ``nccl_comm``, an NCCL communicator already made for these ranks."""
        self._mpi = mpi_comm
        self.rank: int = tracker.rank
        self.size: int = tracker.size
        self.local_rank = local_rank
        self.timeout = tracker.timeout
        self.name = tracker.name
        self._checks = checks = Checks(self.rank, self.size)
        self._router = router = Router(mpi_comm, tracker, checks, device,
                                       local_rank if device_rank is None else device_rank,
                                       device_module)
        self._blocking, self._started = router.host.calls   # read by the common case
        self._joined = joined = JoinedShapes(self.size)
        self._part_shapes = PartShapes(self.size)
        self._general = GeneralPath(checks, router, Layouts(checks, router, joined), joined)
        self._objects = Objects(mpi_comm, tracker, checks)
        #: The parts that cupycomm's own modules use, a ``Parts`` (checks, router, tracker and
        #: staging); not a public API.
        self.parts = Parts(checks, router, tracker, coalesce.Staging(),
                           survival_for(mpi_comm, tracker, router))
        if nccl_comm is not None:
            router.init_device(nccl_comm)
        self.debug = debug
        if debug:
            _debug.install(self, self.parts)
        _bootstrap.track_for_exit(self)
        # collected unclosed: warn, and free nothing in the collecting thread (any thread)
        self._unclosed = weakref.finalize(self, _collected_unclosed, self.name, self.rank,
                                          router)
        self._unclosed.atexit = False   # (close_all closes it at exit)

    # -- properties and the device ----------------------------------------------------------------
    @property
    def mpi_comm(self) -> MPI.Comm:
        """The MPI communicator underneath (a duplicate owned by this communicator)."""
        return self._mpi

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._checks.closed

    @property
    def device(self) -> Any:
        """This rank's CuPy device (``cupy.cuda.Device``: ``init(device=)``, else round-robin
        by local rank), or None where there is no GPU. Reading it loads CuPy and CUDA."""
        device_id = self._router.device_number()
        return None if device_id is None else self._router.cupy.cuda.Device(device_id)

    @property
    def xp(self) -> Any:
        """This rank's array module, CuPy (with this rank's device made current) when a GPU is
        present and NumPy otherwise, so that one program runs on GPUs and on CPUs unchanged."""
        device = self.device
        if device is None:
            return np
        device.use()
        return self._router.cupy

    def init_device(self) -> Any:
        """Create the NCCL communicator now, on every rank (else the first collective on
        device arrays does; device send, recv and sendrecv need it first). Returns the device
        backend. Example: ``comm.init_device()`` before a ring of ``comm.send(x, right)``."""
        self._checks.check_open("init_device")
        return self._router.init_device()

    def launch_graph(self, graph: Any, stream: Any = None) -> None:
        """Replay on ``stream`` (default: the current one) a CUDA graph that captured this
        communicator's collectives, watched: one that does not complete within the timeout
        aborts the NCCL communicator (a plain ``graph.launch()`` is not watched)::

            with stream:
                stream.begin_capture()
                comm.all_reduce(x)
                graph = stream.end_capture()
            comm.launch_graph(graph, stream)
        """
        self._checks.check_open("launch_graph")
        self.init_device().launch_graph(graph, stream)

    # -- collectives ------------------------------------------------------------------------------
    def all_reduce(self, x: Any, *, op: Op = _SUM, out: Any = None, async_op: bool = False,
                   stream: Any = None) -> Any:
        """Reduce ``x`` over all ranks; every rank gets the result (in ``x``, or ``out``).

        Example (2 ranks)::

            x = numpy.array([1, 2]) + 2 * comm.rank   # Rank 0: [1, 2]  Rank 1: [3, 4]
            comm.all_reduce(x, op="max")              # Rank 0: [3, 4]  Rank 1: [3, 4]
        """
        if (type(x) is _HOST and stream is None
                and (op is _SUM or type(op) in _OP_TYPES)
                and (x.flags.carray if out is None else x.flags.c_contiguous
                     and type(out) is _HOST and out.dtype is x.dtype and out.shape == x.shape
                     and out.flags.carray
                     and (out is x or x.base is None is out.base or not _SHARES(x, out)))):
            try:
                run = (self._started if async_op else self._blocking).all_reduce[x.dtype][op]
            except KeyError:   # not made yet (the general path makes it), or no such call
                pass
            else:
                return run(x, x if out is None else out)
        return self._general.all_reduce(x, op, out, async_op, stream)

    def reduce(self, x: Any, root: int = 0, *, op: Op = _SUM, out: Any = None,
               async_op: bool = False, stream: Any = None) -> Any:
        """Reduce ``x`` over all ranks onto ``root`` (into ``x`` there, or ``out``); None
        elsewhere, where ``out`` is not read.

        Example (2 ranks)::

            x = numpy.array([1, 2]) * (comm.rank + 1)
            comm.reduce(x, root=0)   # Rank 0: array([3, 6])   Rank 1: None
        """
        if (type(x) is _HOST and stream is None and type(root) is int
                and 0 <= root < self.size
                and (op is _SUM or type(op) in _OP_TYPES)
                and (x.flags.carray if out is None else x.flags.c_contiguous
                     and type(out) is _HOST and out.dtype is x.dtype and out.shape == x.shape
                     and out.flags.carray
                     and (out is x or x.base is None is out.base or not _SHARES(x, out)))):
            try:
                run = (self._started if async_op else self._blocking).reduce[x.dtype][op]
            except KeyError:
                pass
            else:
                return run(x, (x if out is None else out) if root == self.rank else None, root)
        return self._general.reduce(x, root, op, out, async_op, stream)

    def broadcast(self, x: Any, root: int = 0, *, async_op: bool = False,
                  stream: Any = None) -> Any:
        """Copy ``x`` of ``root`` into ``x`` of every rank; returns ``x``.

        Example (2 ranks)::

            x = numpy.arange(3) if comm.rank == 0 else numpy.empty(3, int)
            comm.broadcast(x, root=0)   # Rank 0: [0, 1, 2]  Rank 1: [0, 1, 2]
        """
        if (type(x) is _HOST and stream is None and type(root) is int
                and 0 <= root < self.size and x.flags.carray):
            try:
                run = (self._started if async_op else self._blocking).broadcast[x.dtype]
            except KeyError:
                pass
            else:
                return run(x, root)
        return self._general.broadcast(x, root, async_op, stream)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False,
                   stream: Any = None) -> Any:
        """Gather ``x`` of every rank on every rank, rank ``j``'s part at index ``j``: into
        ``out``, an array of either layout or a list of ``size`` arrays, or a new array.

        Example (2 ranks)::

            g = comm.all_gather(numpy.array([comm.rank, 10]))
            # Rank 0: array([[0, 10], [1, 10]])   Rank 1: the same
        """
        if (type(x) is _HOST and stream is None and x.flags.c_contiguous
                and (out is None or type(out) is _HOST and out.dtype is x.dtype
                     and out.shape in self._joined[x.shape] and out.flags.carray
                     and (out is not x and x.base is None is out.base or not _SHARES(x, out)))):
            try:
                run = (self._started if async_op else self._blocking).all_gather[x.dtype]
            except KeyError:
                pass
            else:
                return run(x, np.empty(self._joined[x.shape][0], x.dtype) if out is None
                           else out)
        return self._general.all_gather(x, out, async_op, stream)

    def reduce_scatter(self, x: Any, *, op: Op = _SUM, out: Any = None,
                       async_op: bool = False, stream: Any = None) -> Any:
        """Reduce over all ranks and give rank ``j`` part ``j`` of the result: ``x`` splits
        into ``size`` parts along its leading axis, or is a list of ``size`` arrays.

        Example (2 ranks)::

            x = numpy.array([1, 2, 3, 4]) * (comm.rank + 1)
            comm.reduce_scatter(x)   # Rank 0: array([3, 6])   Rank 1: array([9, 12])
        """
        if (type(x) is _HOST and stream is None
                and (op is _SUM or type(op) in _OP_TYPES)
                and x.flags.c_contiguous and (part := self._part_shapes[x.shape]) is not None
                and (out is None or type(out) is _HOST and out.dtype is x.dtype
                     and out.shape == part and out.flags.carray
                     and (out is not x and x.base is None is out.base or not _SHARES(x, out)))):
            try:
                run = (self._started if async_op else self._blocking).reduce_scatter[x.dtype][op]
            except KeyError:
                pass
            else:
                return run(x, np.empty(part, x.dtype) if out is None else out)
        return self._general.reduce_scatter(x, op, out, async_op, stream)

    def all_to_all(self, x: Any, *, out: Any = None, in_splits: Optional[Sequence[int]] = None,
                   out_splits: Optional[Sequence[int]] = None, async_op: bool = False,
                   stream: Any = None) -> Any:
        """Send part ``j`` of ``x``'s leading axis to rank ``j``; part ``i`` of the result
        comes from rank ``i``. Parts are equal unless ``in_splits`` gives the rows sent to each
        rank (and ``out_splits`` those received: else the ranks exchange ``in_splits``).

        Example (2 ranks)::

            x = numpy.array([10, 11]) + 10 * comm.rank   # Rank 0: [10, 11]  Rank 1: [20, 21]
            comm.all_to_all(x)                            # Rank 0: [10, 20]  Rank 1: [11, 21]
            comm.all_to_all(x, in_splits=[2, 0] if comm.rank == 0 else [1, 1])
            # Rank 0: [10, 11, 20]   Rank 1: [21]
        """
        if (type(x) is _HOST and stream is None and in_splits is None
                and out_splits is None and x.flags.c_contiguous and x.ndim
                and not x.shape[0] % self.size
                and (out is None or type(out) is _HOST and out.dtype is x.dtype
                     and out.shape == x.shape and out.flags.carray
                     and (out is not x and x.base is None is out.base or not _SHARES(x, out)))):
            try:
                run = (self._started if async_op else self._blocking).all_to_all[x.dtype]
            except KeyError:
                pass
            else:
                return run(x, np.empty(x.shape, x.dtype) if out is None else out)
        return self._general.all_to_all(x, out, in_splits, out_splits, async_op, stream)

    def scatter(self, x: Any, root: int = 0, *, out: Any, async_op: bool = False,
                stream: Any = None) -> Any:
        """Give rank ``j`` part ``j`` of root's ``x`` (leading axis) in ``out``, required on
        every rank; ``x`` is read on the root only (None elsewhere, or checked where given).

        Example (2 ranks)::

            x = numpy.array([[1, 2], [3, 4]]) if comm.rank == 0 else None
            comm.scatter(x, root=0, out=numpy.empty(2, int))
            # Rank 0: array([1, 2])   Rank 1: array([3, 4])
        """
        if (type(out) is _HOST and stream is None and type(root) is int
                and 0 <= root < self.size and out.flags.carray
                and (x is None and root != self.rank
                     or type(x) is _HOST and x.dtype is out.dtype
                     and x.shape in self._joined[out.shape] and x.flags.c_contiguous
                     and (out is not x and x.base is None is out.base or not _SHARES(x, out)))):
            try:
                run = (self._started if async_op else self._blocking).scatter[out.dtype]
            except KeyError:
                pass
            else:
                return run(x if root == self.rank else None, out, root)
        return self._general.scatter(x, root, out, async_op, stream)

    def gather(self, x: Any, root: int = 0, *, out: Any = None, async_op: bool = False,
               stream: Any = None) -> Any:
        """Gather ``x`` of every rank on ``root``, rank ``j``'s part at index ``j``: a new
        array ``(size, *x.shape)`` or ``out`` there; None elsewhere, where ``out`` is not read.

        Example (2 ranks)::

            comm.gather(numpy.array([comm.rank]), root=0)
            # Rank 0: array([[0], [1]])   Rank 1: None
        """
        if (type(x) is _HOST and stream is None and type(root) is int
                and 0 <= root < self.size and x.flags.c_contiguous
                and (out is None or type(out) is _HOST and out.dtype is x.dtype
                     and out.shape in self._joined[x.shape] and out.flags.carray
                     and (out is not x and x.base is None is out.base or not _SHARES(x, out)))):
            try:
                run = (self._started if async_op else self._blocking).gather[x.dtype]
            except KeyError:
                pass
            else:
                if root != self.rank:
                    out = None
                elif out is None:
                    out = np.empty(self._joined[x.shape][0], x.dtype)
                return run(x, out, root)
        return self._general.gather(x, root, out, async_op, stream)

    # -- point to point ---------------------------------------------------------------------------
    def send(self, x: Any, dst: int, *, async_op: bool = False, stream: Any = None) -> Any:
        """Send ``x`` to rank ``dst``, which receives it with ``recv``, in the order sent;
        None (or a Work). Example: ``comm.send(x, 1)`` on 0, ``comm.recv(x, 0)`` on 1."""
        return self._general.send(x, dst, async_op, stream)

    def recv(self, buf: Any, src: int, *, async_op: bool = False, stream: Any = None) -> Any:
        """Receive into ``buf`` (of the sent array's size) what rank ``src`` sent; returns
        ``buf``. Example: ``comm.recv(numpy.empty(3), src=0)``."""
        return self._general.recv(buf, src, async_op, stream)

    def sendrecv(self, x: Any, dst: int, buf: Any, src: int, *, async_op: bool = False,
                 stream: Any = None) -> Any:
        """Send ``x`` to ``dst`` and receive into ``buf`` from ``src`` at once, without the
        deadlock two blocking calls could make (a ring shift, a halo); returns ``buf``.

        Example (2 ranks)::

            right, left = (comm.rank + 1) % 2, (comm.rank - 1) % 2
            comm.sendrecv(numpy.array([comm.rank]), right, numpy.empty(1, int), left)
            # Rank 0: array([1])   Rank 1: array([0])
        """
        size = self.size
        if (type(x) is _HOST and stream is None and type(dst) is int
                and type(src) is int and 0 <= dst < size and 0 <= src < size
                and x.flags.c_contiguous and type(buf) is _HOST and buf.dtype is x.dtype
                and buf.flags.carray):
            try:
                run = (self._started if async_op else self._blocking).sendrecv[x.dtype]
            except KeyError:
                pass
            else:
                return run(x, dst, buf, src)
        return self._general.sendrecv(x, dst, buf, src, async_op, stream)

    def isend(self, x: Any, dst: int, *, stream: Any = None) -> Work:
        """``send(x, dst, async_op=True)``: a Work that completes once ``x`` may be reused."""
        return self.send(x, dst, async_op=True, stream=stream)

    def irecv(self, buf: Any, src: int, *, stream: Any = None) -> Work:
        """``recv(buf, src, async_op=True)``: a Work whose ``wait()`` returns ``buf``."""
        return self.recv(buf, src, async_op=True, stream=stream)

    @contextlib.contextmanager
    def batch(self) -> Iterator[Batch]:
        """Issue the calls inside the block together when it ends (one set of MPI requests,
        or one NCCL group), so that sends and receives in any order cannot deadlock. Each
        call is checked as it is made and returns a Work; a block that raises issues nothing.

        Example (3 ranks)::

            right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
            mine, from_left = numpy.full(2, comm.rank), numpy.empty(2, int)
            with comm.batch():                  # a ring of any size
                comm.irecv(from_left, left)
                comm.isend(mine, right)
            # from_left now holds the left neighbour's array: Rank 0: [2, 2]  Rank 1: [0, 0]
        """
        checks = self._checks
        checks.check_open("batch")
        if checks.batch is not None:
            raise checks.fail(RuntimeError, "batch", "batch() blocks do not nest")
        group = Batch(checks.rank)
        # (the device's first: it refuses a block while another thread is inside a launch)
        backends = [b for b in (self._router.device, self._router.host) if b is not None]
        for backend in backends:
            backend.begin_group(group)
        checks.batch = group
        self._blocking = self._started = _NO_CALLS   # every call inside: the general path
        cancel = True   # unless the block ends without an exception
        try:
            yield group
            cancel = False
        finally:
            checks.batch = None
            if not checks.closed:
                self._blocking, self._started = self._router.host.calls
            for backend in backends:
                backend.end_group(group, cancel)

    def scan(self, x: Any, *, op: Op = _SUM, out: Any = None, async_op: bool = False) -> Any:
        """The reduction of ``x`` over ranks 0 to this one (MPI_Scan), in ``x`` or ``out``.
        Host arrays only (NCCL has no scan); ``op`` as :meth:`all_reduce`'s, but "avg".

        Example (3 ranks)::

            comm.scan(numpy.array([comm.rank]))   # Rank 0: [0]  Rank 1: [1]  Rank 2: [3]
        """
        return self._general.scan(x, op, out, async_op, None)

    def exscan(self, x: Any, *, op: Op = _SUM, out: Any = None, async_op: bool = False) -> Any:
        """The reduction of ``x`` over the ranks before this one (MPI_Exscan), in a new array
        or ``out`` (not ``x``); None on rank 0, which has none before it. Host arrays only;
        ``op`` as :meth:`scan`'s.

        Example (3 ranks)::

            comm.exscan(numpy.array([comm.rank]))   # Rank 0: None  Rank 1: [0]  Rank 2: [1]
        """
        return self._general.exscan(x, op, out, async_op, None)

    def barrier(self, *, async_op: bool = False) -> Optional[Work]:
        """Wait until every rank has called barrier (processes, not CUDA streams: synchronize
        device work first if needed). Example: ``comm.barrier()``."""
        self._checks.check_open("barrier")
        return self._router.host.barrier(async_op)

    # -- many small arrays (see cupycomm.comm.coalesce) -------------------------------------------
    def all_reduce_coalesced(self, arrays: Sequence[Any], *, op: Op = _SUM,
                             bucket_bytes: Optional[int] = None,
                             async_op: bool = False) -> Union[List[Any], Work]:
        """All-reduce many arrays in few calls (grouped by dtype, packed into buffers of at
        most ``bucket_bytes``, default 25 MiB); returns them, reduced in place (or a Work).

        Example (2 ranks)::

            grads = [numpy.full(3, comm.rank + 1.0), numpy.ones((2, 2), numpy.float32)]
            comm.all_reduce_coalesced(grads, op="avg")   # grads[0] == [1.5, 1.5, 1.5]
        """
        return coalesce.all_reduce_coalesced(self, arrays, op, bucket_bytes, async_op)

    def bucket(self, arrays: Sequence[Any]) -> coalesce.Bucket:
        """A :class:`~cupycomm.comm.coalesce.Bucket`: the arrays copied once into one flat
        buffer per dtype; use ``bucket.arrays`` (views of it) from then on, so that every
        ``bucket.all_reduce()`` is one call per dtype without packing."""
        return coalesce.Bucket(self, arrays)

    # -- Python objects (pickled: for trusted peers only; see cupycomm.comm.objects) --------------
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Root's ``obj`` on every rank (``obj`` is only read on the root).

        Example (2 ranks)::

            comm.broadcast_object({"lr": 0.1} if comm.rank == 0 else None)
            # Rank 0: {'lr': 0.1}   Rank 1: {'lr': 0.1}
        """
        return self._objects.broadcast(obj, root)

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, as a list indexed by rank, on every rank.

        Example (2 ranks)::

            comm.all_gather_object(f"host{comm.rank}")   # both: ['host0', 'host1']
        """
        return self._objects.all_gather(obj)

    def gather_object(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        """Every rank's ``obj`` as a list on the root; None elsewhere."""
        return self._objects.gather(obj, root)

    def scatter_object(self, objs: Optional[Sequence[Any]], root: int = 0) -> Any:
        """Rank ``j`` gets ``objs[j]`` of the root (``objs`` is only read on the root)."""
        return self._objects.scatter(objs, root)

    # -- subgroups --------------------------------------------------------------------------------
    def split(self, color: Optional[int], key: Optional[int] = None) -> Optional["Communicator"]:
        """A communicator of the ranks that pass the same ``color``, ordered by ``key``
        (default: their rank here); None where ``color`` is None. Collective. Its NCCL
        communicator comes from ``ncclCommSplit`` where this one has one (NCCL 2.18+).

        Example (4 ranks)::

            half = comm.split(comm.rank % 2)    # ranks 0, 2 and ranks 1, 3
            half.rank, half.size                # Rank 0: (0, 2)  Rank 1: (0, 2)  Rank 2: (1, 2)
        """
        self._checks.check_open("split")
        self._checks.check_split(color, key)
        return self._subgroup(None if color is None else int(color),
                              self.rank if key is None else int(key), f"split({color})")

    def new_group(self, ranks: Sequence[int]) -> Optional["Communicator"]:
        """A communicator of ``ranks`` (ordered by rank), None on the others; collective, with
        the same list on every rank (torch.distributed.new_group).

        Example (3 ranks)::

            group = comm.new_group([0, 2])   # Rank 0: rank 0 of 2   Rank 1: None   Rank 2: 1 of 2
        """
        self._checks.check_open("new_group")
        ordered = self._checks.check_members(ranks)
        mine = self.rank in ordered
        return self._subgroup(0 if mine else None, ordered.index(self.rank) if mine else 0,
                              f"group{ordered}")

    def _subgroup(self, color: Optional[int], key: int, label: str
                  ) -> Optional["Communicator"]:
        """The communicator over an MPI split of this one (and an NCCL split where this one has
        an NCCL communicator); collective. shrink() retires it with its parent."""
        router = self._router
        sub = self._mpi.Split(MPI.UNDEFINED if color is None else color, key)
        raw = router.device.split(color, key) if router.device is not None else None
        if color is None:
            return None
        child = type(self).create(sub, name=f"{self.name}/{label}", timeout=self.timeout,
                                  device=router.device_choice, device_module=router.cupy,
                                  debug=self.debug, device_rank=router.device_rank,
                                  nccl_comm=raw)
        if self.parts.survival is not None:
            self.parts.survival.adopt(child)
        return child

    # -- after a peer is lost (init(on_peer_loss="raise"); see cupycomm.survivors) ---------------
    @property
    def world_ranks(self) -> Tuple[int, ...]:
        """The rank in the job's world (``MPI.COMM_WORLD``) of each rank of this communicator,
        kept by ``shrink()``: after world rank 1 of 4 is lost, ``(0, 2, 3)``."""
        return self.parts.tracker.world_ranks

    def failed_ranks(self) -> List[int]:
        """The world ranks of this communicator known to be lost (sorted): those the survivors
        agreed on when a call raised PeerLost, and any this rank's MPI noticed since. Always
        empty in the default mode, where a loss ends the job."""
        self._checks.check_open("failed_ranks")
        survival = self.parts.survival
        return [] if survival is None else survival.failed_ranks()

    def agree(self, flag: bool) -> bool:
        """The AND of ``flag`` over the ranks (the survivors, after a loss: ULFM's agreement,
        the same answer on each); collective. Example: ``comm.agree(step_ok)``."""
        self._checks.check_open("agree")
        survival = self.parts.survival
        with self.parts.tracker.inside("agree"):
            if survival is not None:
                return survival.agree(flag)
            return bool(self._mpi.allreduce(bool(flag), op=MPI.LAND))

    def shrink(self) -> "Communicator":
        """The survivors' communicator, after a PeerLost (host and device; world ranks kept:
        :attr:`world_ranks`); collective over the survivors. This one, its subgroups and
        buckets refuse every call from then on (:class:`~cupycomm.errors.CommShrunkError`).
        Needs ``init(on_peer_loss="raise")``. RuntimeError on every survivor, this one kept,
        where they stand at different calls (agree first: :meth:`agree`).

        Example (4 ranks, world rank 1 killed)::

            try:
                comm.all_reduce(x)
            except cupycomm.PeerLost:
                comm = comm.shrink()   # comm.size == 3, comm.world_ranks == (0, 2, 3)
        """
        survival = self._survival("shrink")
        router = self._router
        with self.parts.tracker.inside("shrink"):
            had_device = router.device is not None
            successor = survival.successor("shrink")   # refused where survivors disagree
            exit_records.note_survived(survival.lost or ())   # cupycomm.run: it recovered
            self._retire(survival, "shrink")
            shrunk = self.create(successor, name=f"{self.name}-shrunk", timeout=self.timeout,
                                 device=router.device_choice, device_module=router.cupy,
                                 debug=self.debug, device_rank=router.device_rank)
            if had_device:   # as this one had: collective, a fresh unique id
                shrunk.init_device()
            keep(shrunk)   # after a grow: see survivors.numbering.keep
            return shrunk

    def grow(self, n: int, *, command: Optional[Sequence[str]] = None) -> "Communicator":
        """This communicator's ranks and ``n`` new processes (MPI's Spawn and Merge), ranks
        in world-rank order: the newcomers take the lost world ranks, lowest first, then new
        ones; collective over this communicator's ranks, whose ``cupycomm.init()`` in each new
        process joins (:func:`cupycomm.joined_late` is True there). ``command``: the argv the
        new processes run (default: this program again, ``sys.executable`` and
        ``sys.argv``). This one, its subgroups and buckets refuse every call from then on
        (:class:`~cupycomm.errors.CommShrunkError`). Needs ``init(on_peer_loss="raise")``.
        See :mod:`cupycomm.survivors.grow`.

        Example (4 ranks, world rank 1 killed)::

            comm = comm.shrink()   # comm.world_ranks == (0, 2, 3)
            comm = comm.grow(1)    # comm.world_ranks == (0, 1, 2, 3); rank 1 is new
        """
        survival = self._survival("grow")
        grown = _grow.grow(self, self.parts, n, command)
        self._retire(survival, "grow")
        router = self._router
        made = self.create(grown.mpi_comm, name=grown.name, timeout=grown.timeout,
                           device=grown.device, device_module=router.cupy, debug=grown.debug,
                           device_rank=router.device_rank)
        keep(made)
        return made

    def _survival(self, call: str) -> Survival:
        """This communicator's state for ``call`` (shrink, grow), which needs the "raise"
        mode: CommClosedError where it is closed, RuntimeError where a loss ends the job."""
        self._checks.check_open(call)
        if self.parts.survival is None:
            raise RuntimeError(f"{call}: this communicator ends the job when a peer is lost; "
                               f"{call}() needs cupycomm.init(on_peer_loss='raise') (rank "
                               f"{self.rank})")
        return self.parts.survival

    def _retire(self, survival: Survival, by: str) -> None:
        """Close this communicator and its subgroups for good (every later call:
        CommShrunkError naming ``by``), their NCCL communicators aborted, never destroyed:
        after an abortive shrink NCCL >= 2.31 hangs in ncclCommDestroy (pytorch#194679)."""
        for child in survival.children():
            if child.parts.survival is not None:
                child._retire(child.parts.survival, by)
        survival.discard()
        survival.revoke()
        self._checks.shrunk = by
        device = self._router.device
        if device is not None:
            device.abort(f"the communicator was replaced by {by}()", survival.lost or ())
        try:
            self.close()
        except (PeerLost, MPI.Exception):
            pass   # its calls in flight failed: the peers they waited for are gone

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the NCCL communicator and the MPI duplicate. Closing twice is harmless; any
        other call afterwards raises :class:`~cupycomm.errors.CommClosedError`."""
        if self._checks.closed:
            return
        self._checks.closed = True
        self._unclosed.detach()
        self._blocking = self._started = _NO_CALLS
        tracker = self.parts.tracker
        try:   # calls still in flight are waited for while the watchdog still looks
            self._router.close()
        finally:
            unwatch(tracker)
            tracker.leave()
            if not MPI.Is_finalized():
                self._objects.close()
                if self.parts.survival is not None:
                    self.parts.survival.discard()
                self._mpi.Free()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"device={self._router.device_id}"
        return f"<cupycomm.Communicator {self.name} rank {self.rank} of {self.size}, {state}>"


def _collected_unclosed(name: str, rank: int, router: Router) -> None:
    """A communicator was collected without close(), in whichever thread the garbage collector
    ran: say so, as an unclosed file does, and leave its NCCL communicator to a safe point
    (:meth:`Router.drop`)."""
    warnings.warn(f"communicator {name} was collected unclosed on rank {rank}: close() it (or "
                  f"use it as a context manager); its NCCL communicator is kept until exit",
                  ResourceWarning)
    router.drop()
