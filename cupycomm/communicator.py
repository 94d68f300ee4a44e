"""Communicator: the collectives users call, on NumPy (MPI) and CuPy (NCCL) arrays.

Semantics shared by every method (documented here once):

- **Backend by array type.** NumPy arrays go through MPI, CuPy arrays through NCCL on the
  communicator's device. All arrays of one call are of one kind. The NCCL communicator is
  created the first time a collective gets a device array (every rank takes part), so
  host-only programs never touch CUDA; ``init_device()`` creates it beforehand.
- **Results are returned.** ``y = comm.all_reduce(x)`` reduces in place and returns ``x``;
  with ``out=`` the result goes there and ``out`` is returned; collectives that make a new
  shape allocate their result when ``out`` is None. ``reduce`` and ``gather`` return None
  off the root.
- **async_op=True** returns a :class:`~cupycomm.work.Work`; ``work.wait()`` gives the result.
- **Streams (device).** A synchronous call runs on the caller's current stream, an
  ``async_op`` one on the comm stream after an event of the caller's; the host never blocks;
  ``stream=`` launches on that stream instead (the code: ``backends/nccl.py``).
- **Validation.** Every argument is checked before any communication: array kind, dtype,
  contiguity, device, ``out`` shape and dtype, root and peer ranks, op for the dtype. A bad
  argument raises TypeError or ValueError naming the collective, the argument, the value and
  the rank; the communicator stays usable. What cannot be seen locally (ranks passing
  different counts) is caught by debug mode or by the timeout.
- **Leading-axis layout.** Collectives that join or split per-rank parts (all_gather, gather,
  scatter, reduce_scatter) accept the whole array either stacked, ``(size, *part.shape)``,
  or concatenated along axis 0, ``(size * part.shape[0], *part.shape[1:])``.
- **Zero-size and 0-d arrays** are valid wherever their shape is: a 0-d array reduces,
  broadcasts and is gathered into shape ``(size,)``; it has no leading axis to split.

How a call runs (for contributors): a call on NumPy arrays whose every argument passes the
common-case test written at the top of each method (exact ``numpy.ndarray``, C-contiguous,
writable (and aligned) where written, ``out`` of the same dtype and an accepted shape, an int
root or peer in range) takes the backend's *prepared call* for its (collective, dtype, op),
made once and kept (``cupycomm.backends.mpi.PreparedCalls``; looked up in ``_blocking``, or
``_started`` for async_op, which returns a :class:`~cupycomm.work.Work`): the raw typed
mpi4py call inside the watchdog's marks, two interpreter frames in all. Anything else (a
failed test, a dtype or op with no prepared call, stream, a ``batch()`` block, a closed
communicator, device and foreign arrays) takes the general path, which makes every check and
raises the errors; so the fast path rejects exactly what the general path does
(``tests/test_prepared.py`` runs the bad-input suite through it, blocking and async).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

from . import _bootstrap, _env, coalesce, objects
from .faults import abort, debug as _debug, endings, flight
from ._dtypes import ReduceOp
from .faults.board import NodeBoard
from .faults.heartbeat import Heartbeats
from ._dispatch import Dispatch
from ._parts import JoinedShapes, PartShapes
from ._validate import Validation
from .faults.watchdog import Tracker, unwatch, watch
from .batch import Batch
from .backends.mpi import MPIBackend, PreparedCalls
from .work import Work

__all__ = ["Communicator", "init", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT: float = _env.default("CUPYCOMM_TIMEOUT")
"""Seconds a collective may wait before it is declared hung (torch's NCCL default: 10 min).
Set per communicator by ``init(timeout=)`` or the CUPYCOMM_TIMEOUT environment variable."""

Op = Union[ReduceOp, str]
_SUM = "sum"
_HOST = np.ndarray   # arrays of exactly this type may take the prepared calls (see below)


class Communicator(Dispatch, Validation):
    """A group of ranks that run collectives together; made by :func:`cupycomm.init`.

    Attributes:
        rank: this process's rank in the communicator.
        size: the number of ranks.
        local_rank: this process's rank among the ranks on its node.

    Example (2 ranks)::

        comm = cupycomm.init()
        x = numpy.array([1.0, 2.0]) * (comm.rank + 1)
        comm.all_reduce(x)
        # Rank 0: array([3., 6.])
        # Rank 1: array([3., 6.])
    """

    def __init__(self, mpi_comm: MPI.Comm, *, device: Optional[int] = None,
                 device_module: Any = None, timeout: float = DEFAULT_TIMEOUT,
                 debug: bool = False, name: str = "world", device_rank: Optional[int] = None,
                 nccl_comm: Any = None) -> None:
        """Collective over ``mpi_comm``, which the communicator owns from now on (it frees it
        on close). Use :func:`cupycomm.init`, ``split`` or ``new_group``, not this constructor.
        ``device_rank`` is the local rank the device is chosen by (a subgroup keeps its
        parent's); ``nccl_comm``, an NCCL communicator already made for these ranks.

        State that helper modules may read or write (and nothing else of it):

        - ``rank``, ``size``, ``timeout``, ``debug``, ``name``: read by all.
        - ``_backends`` (array type -> backend), ``_host`` (the MPI backend), ``_nccl`` (the
          NCCL backend once made by ``init_device``), ``_cupy`` (the device module, loaded
          lazily): read by ``_dispatch`` (which adds array types to ``_backends`` and loads
          ``_cupy``), ``coalesce`` and ``faults.debug`` (the host backend's control calls).
        - ``_batch`` (the open ``batch()`` block) and ``_closed``: read by ``_dispatch`` and
          ``_validate``. ``_prepared``: the host's prepared calls (its tables ``blocking``
          and ``started`` also as ``_blocking`` and ``_started``), off while a batch()
          block is open and once closed.
        - ``_tracker`` (the watchdog's :class:`~cupycomm.faults.watchdog.Tracker`):
          ``objects`` counts its calls there; ``faults.debug`` reads the count.
        - ``_staging``: ``coalesce``'s buffers; ``_objects``: ``objects``' pickle transport (a
          duplicate MPI communicator it makes on first use).
        - ``faults.debug`` replaces the checked collectives by instance attributes.
        """
        self._mpi = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.timeout = timeout
        self.name = name
        node = _bootstrap.node_comm(mpi_comm)
        self.local_rank: int = node.Get_rank()
        self._device_rank = self.local_rank if device_rank is None else device_rank
        board = NodeBoard(node, self.rank) if self.size > 1 else None
        beats = Heartbeats.connect(mpi_comm, node, board, name) if board is not None else None
        node.Free()
        self._tracker = Tracker(name, self.rank, self.size, timeout, board, beats)
        if self.size > 1:
            watch(self._tracker)
        self._host = MPIBackend(mpi_comm, self._tracker)
        self._prepared = PreparedCalls(self._host)
        self._blocking, self._started = self._prepared.blocking, self._prepared.started
        self._backends: dict = {np.ndarray: self._host}
        self._joined = JoinedShapes(self.size)
        self._parts = PartShapes(self.size)
        self._device_choice = device
        self._cupy = device_module
        self._device_id: Optional[int] = None
        self._nccl: Any = None
        self._objects: Any = None   # the pickle transport of cupycomm.objects, made on first use
        self._batch: Optional[Batch] = None   # the open batch() block
        self._staging = coalesce.Staging()     # all_reduce_coalesced's buffers, kept
        self._closed = False
        if nccl_comm is not None:
            self.init_device(nccl_comm)
        self.debug = debug
        if debug:
            _debug.install(self)
        _bootstrap.track_for_exit(self)

    # -- properties -------------------------------------------------------------------------------
    @property
    def mpi_comm(self) -> MPI.Comm:
        """The MPI communicator underneath (a duplicate owned by this communicator)."""
        return self._mpi

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    @property
    def device(self) -> Any:
        """This rank's CuPy device (``cupy.cuda.Device``), or None where there is no GPU.

        Chosen by ``init(device=)``, else round-robin by local rank over the node's GPUs.
        Reading it loads CuPy and CUDA; host-only programs need not.
        """
        device_id = self._resolve_device()
        return None if device_id is None else self._cupy.cuda.Device(device_id)

    @property
    def xp(self) -> Any:
        """This rank's array module, CuPy (with this rank's device made current) when a GPU is
        present and NumPy otherwise, so that one program runs on GPUs and on CPUs unchanged."""
        device = self.device
        if device is None:
            return np
        device.use()
        return self._cupy

    def _resolve_device(self) -> Optional[int]:
        if self._device_id is None:
            if self._cupy is None:
                self._cupy = _bootstrap.import_cupy()
            if self._cupy is not None:
                if self._device_choice is not None:
                    self._device_id = self._device_choice
                else:
                    self._device_id = _bootstrap.choose_device(self._device_rank, self._cupy)
        return self._device_id

    def init_device(self, _nccl_comm: Any = None) -> Any:
        """Create the NCCL communicator now (collective: every rank must call it).

        Otherwise the first collective on device arrays creates it. Device point-to-point
        calls (send, recv, sendrecv) need it to exist, since only some ranks take part in
        them. Returns the device backend.
        """
        self._check_open("init_device")
        if self._nccl is None:
            device_id = self._resolve_device()
            if device_id is None:
                raise RuntimeError(f"init_device: no GPU is usable on rank {self.rank} "
                                   f"(CuPy {'is missing' if self._cupy is None else 'sees none'})")
            from .backends.nccl import NcclBackend
            self._nccl = NcclBackend(self._mpi, device_id, self._cupy, self._tracker,
                                     _nccl_comm)
            self._backends[self._nccl.array_type] = self._nccl
            self._tracker.device = self._nccl
        return self._nccl

    def launch_graph(self, graph: Any, stream: Any = None) -> None:
        """Replay a CUDA graph that captured this communicator's collectives, watched as an
        uncaptured collective is: a replay that does not complete within the timeout (a
        peer that never launches its graph) aborts the NCCL communicator, naming it. A plain
        ``graph.launch()`` is not watched. ``stream``: where to launch (default: the current
        stream)::

            with stream:
                stream.begin_capture()
                comm.all_reduce(x)
                graph = stream.end_capture()
            comm.launch_graph(graph, stream)
        """
        self._check_open("launch_graph")
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
                and (x.flags.carray if out is None else x.flags.c_contiguous
                     and type(out) is _HOST and out.dtype is x.dtype and out.shape == x.shape
                     and out.flags.carray)):
            try:
                run = (self._started if async_op else self._blocking)["all_reduce"][x.dtype][op]
            except (KeyError, TypeError):
                run = self._prepared.find("all_reduce", x.dtype, op, async_op)
            if run is not None:
                return run(x, x if out is None else out)
        b, x, spec = self._take("all_reduce", "x", x, op, writes=out is None)
        if stream is not None:
            self._check_stream("all_reduce", b, stream)
        if out is None:
            out = x
        else:
            out = self._check_out("all_reduce", "out", b, out, x, (x.shape,))
        return b.all_reduce(x, out, spec, async_op, stream)

    def reduce(self, x: Any, root: int = 0, *, op: Op = _SUM, out: Any = None,
               async_op: bool = False, stream: Any = None) -> Any:
        """Reduce ``x`` over all ranks onto ``root`` (into ``x`` there, or ``out``).

        Returns the result on the root and None elsewhere; ``out`` is only read on the root.

        Example (2 ranks)::

            x = numpy.array([1, 2]) * (comm.rank + 1)
            comm.reduce(x, root=0)   # Rank 0: array([3, 6])   Rank 1: None
        """
        if (type(x) is _HOST and stream is None and type(root) is int
                and 0 <= root < self.size
                and (x.flags.carray if out is None else x.flags.c_contiguous
                     and type(out) is _HOST and out.dtype is x.dtype and out.shape == x.shape
                     and out.flags.carray)):
            try:
                run = (self._started if async_op else self._blocking)["reduce"][x.dtype][op]
            except (KeyError, TypeError):
                run = self._prepared.find("reduce", x.dtype, op, async_op)
            if run is not None:
                return run(x, (x if out is None else out) if root == self.rank else None, root)
        b, x, spec = self._take("reduce", "x", x, op, writes=out is None)
        if stream is not None:
            self._check_stream("reduce", b, stream)
        self._check_rank("reduce", "root", root)
        if out is not None:   # checked wherever given, so that every rank fails alike
            out = self._check_out("reduce", "out", b, out, x, (x.shape,))
        if self.rank != root:
            out = None
        elif out is None:
            out = x
        return b.reduce(x, out, spec, root, async_op, stream)

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
                run = (self._started if async_op else self._blocking)["broadcast"][x.dtype]
            except KeyError:
                run = self._prepared.find("broadcast", x.dtype, None, async_op)
            if run is not None:
                return run(x, root)
        b, x, spec = self._take("broadcast", "x", x, writes=True)
        if stream is not None:
            self._check_stream("broadcast", b, stream)
        self._check_rank("broadcast", "root", root)
        return b.broadcast(x, spec, root, async_op, stream)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False,
                   stream: Any = None) -> Any:
        """Gather ``x`` of every rank on every rank, rank ``j``'s part at index ``j``.

        ``out`` is None (a new array of shape ``(size, *x.shape)``), an array of either
        leading-axis layout, or a list of ``size`` arrays shaped like ``x``.

        Example (2 ranks)::

            g = comm.all_gather(numpy.array([comm.rank, 10]))
            # Rank 0: array([[0, 10], [1, 10]])   Rank 1: the same
        """
        if (type(x) is _HOST and stream is None and x.flags.c_contiguous
                and (out is None or type(out) is _HOST and out.dtype is x.dtype
                     and out.shape in self._joined[x.shape] and out.flags.carray)):
            try:
                run = (self._started if async_op else self._blocking)["all_gather"][x.dtype]
            except KeyError:
                run = self._prepared.find("all_gather", x.dtype, None, async_op)
            if run is not None:
                return run(x, np.empty(self._joined[x.shape][0], x.dtype) if out is None
                           else out)
        b, x, spec = self._take("all_gather", "x", x)
        if stream is not None:
            self._check_stream("all_gather", b, stream)
        shapes = self._joined[x.shape]
        if out is None:
            return b.all_gather(x, b.empty(shapes[0], x.dtype, stream), spec, async_op, stream)
        if type(out) is not type(x) and isinstance(out, (list, tuple)):
            return self._all_gather_list(b, x, spec, out, async_op, stream)
        out = self._check_out("all_gather", "out", b, out, x, shapes,
                              " (size parts shaped like x)")
        return b.all_gather(x, out, spec, async_op, stream)

    def _all_gather_list(self, b: Any, x: Any, spec: Any, out: Sequence, async_op: bool,
                         stream: Any) -> Any:
        """all_gather into a list of ``size`` arrays: into one array, then copied to them."""
        out = self._check_parts("all_gather", "out", b, out, x)
        whole = b.empty(self._joined[x.shape][0], x.dtype, stream)
        parts = [whole[j, ...] for j in range(self.size)]   # views, 0-d ones too
        return b.all_gather(x, whole, spec, async_op, stream, list(zip(out, parts)))


    def reduce_scatter(self, x: Any, *, op: Op = _SUM, out: Any = None,
                       async_op: bool = False, stream: Any = None) -> Any:
        """Reduce over all ranks and give rank ``j`` part ``j`` of the result.

        ``x`` is an array whose leading axis splits into ``size`` equal parts, or a list
        of ``size`` arrays of one shape (part ``j`` is the list's array ``j``).

        Example (2 ranks)::

            x = numpy.array([1, 2, 3, 4]) * (comm.rank + 1)
            comm.reduce_scatter(x)   # Rank 0: array([3, 6])   Rank 1: array([9, 12])
        """
        if (type(x) is _HOST and stream is None and x.flags.c_contiguous
                and (part := self._parts[x.shape]) is not None
                and (out is None or type(out) is _HOST and out.dtype is x.dtype
                     and out.shape == part and out.flags.carray)):
            try:
                run = (self._started if async_op else self._blocking)["reduce_scatter"][
                    x.dtype][op]
            except (KeyError, TypeError):
                run = self._prepared.find("reduce_scatter", x.dtype, op, async_op)
            if run is not None:
                return run(x, np.empty(part, x.dtype) if out is None else out)
        if isinstance(x, (list, tuple)):
            return self._reduce_scatter_list(x, op, out, async_op, stream)
        b, x, spec = self._take("reduce_scatter", "x", x, op)
        if stream is not None:
            self._check_stream("reduce_scatter", b, stream)
        self._check_leading_axis("reduce_scatter", "x", x)
        part = (x.shape[0] // self.size,) + x.shape[1:]
        if out is None:
            out = b.empty(part, x.dtype, stream)
        else:
            shapes = (part, x.shape[1:]) if x.shape[0] == self.size else (part,)
            out = self._check_out("reduce_scatter", "out", b, out, x, shapes)
        return b.reduce_scatter(x, out, spec, async_op, stream)

    def _reduce_scatter_list(self, xs: Sequence, op: Op, out: Any, async_op: bool,
                             stream: Any) -> Any:
        name = "reduce_scatter"
        if not xs:
            raise self._fail(ValueError, name, f"x is an empty list, expected {self.size} "
                                               f"arrays (one per rank)")
        b, first, spec = self._take(name, "x[0]", xs[0], op)
        if stream is not None:
            self._check_stream(name, b, stream)
        xs = self._check_parts(name, "x", b, xs, first, writes=False)
        if out is None:
            out = b.empty(first.shape, first.dtype, stream)
        else:
            out = self._check_out(name, "out", b, out, first, (first.shape,))
        whole = b.empty((self.size,) + first.shape, first.dtype, stream)
        with stream if stream is not None else contextlib.nullcontext():   # ordered before NCCL
            for j, part in enumerate(xs):
                whole[j] = part
        return b.reduce_scatter(whole, out, spec, async_op, stream)

    def all_to_all(self, x: Any, *, out: Any = None, in_splits: Optional[Sequence[int]] = None,
                   out_splits: Optional[Sequence[int]] = None, async_op: bool = False,
                   stream: Any = None) -> Any:
        """Send part ``j`` of ``x``'s leading axis to rank ``j``; part ``i`` of the result
        comes from rank ``i``.

        Parts are equal (the result has ``x``'s shape) unless ``in_splits`` says how many rows
        go to each rank and ``out_splits`` how many come from each (zeros allowed); without
        ``out_splits`` the ranks first exchange their ``in_splits`` to learn it.

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
                     and out.shape == x.shape and out.flags.carray)):
            try:
                run = (self._started if async_op else self._blocking)["all_to_all"][x.dtype]
            except KeyError:
                run = self._prepared.find("all_to_all", x.dtype, None, async_op)
            if run is not None:
                return run(x, np.empty(x.shape, x.dtype) if out is None else out)
        b, x, spec = self._take("all_to_all", "x", x)
        if stream is not None:
            self._check_stream("all_to_all", b, stream)
        if in_splits is None and out_splits is None:
            self._check_leading_axis("all_to_all", "x", x)
            if out is None:
                out = b.empty(x.shape, x.dtype, stream)
            else:
                out = self._check_out("all_to_all", "out", b, out, x, (x.shape,))
            return b.all_to_all(x, out, spec, async_op, stream)
        return self._all_to_all_v(b, x, spec, out, in_splits, out_splits, async_op, stream)

    def _all_to_all_v(self, b: Any, x: Any, spec: Any, out: Any,
                      in_splits: Optional[Sequence[int]], out_splits: Optional[Sequence[int]],
                      async_op: bool, stream: Any) -> Any:
        """all_to_all with uneven parts (``in_splits`` or ``out_splits`` given)."""
        if x.ndim == 0:
            raise self._fail(ValueError, "all_to_all", "x is 0-d: it has no leading axis to "
                                                       "split")
        if in_splits is None:
            self._check_leading_axis("all_to_all", "x", x)
            in_splits = [x.shape[0] // self.size] * self.size
        sent = self._check_splits("in_splits", in_splits, x.shape[0])
        if out_splits is not None:
            received = self._check_splits("out_splits", out_splits, None)
            shape = (sum(received),) + x.shape[1:]
            if out is None:
                out = b.empty(shape, x.dtype, stream)
            else:
                out = self._check_out("all_to_all", "out", b, out, x, (shape,),
                                      " (sum(out_splits) rows)")
        else:
            received, out = self._received_splits(b, x, sent, out, stream)
        row = x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        return b.all_to_all_v(x, out, spec, [n * row for n in sent], [n * row for n in received],
                              async_op, stream)

    def _received_splits(self, b: Any, x: Any, sent: List[int], out: Any,
                         stream: Any) -> tuple:
        """(rows from each rank, out or a new array) when only ``in_splits`` is known: the
        ranks gather every rank's in_splits and out rows, so that each knows what it
        receives and every rank finds a wrong ``out`` alike, before any data moves."""
        rows = -1
        if out is not None:
            out = self._check_kind("all_to_all", "out", b, out, x)
            if out.ndim == 0 or out.shape[1:] != x.shape[1:]:
                raise self._fail(ValueError, "all_to_all", f"out has shape {out.shape}, "
                                                           f"expected (rows, *{x.shape[1:]})")
            rows = out.shape[0]
        table = self._host.gather_ints(sent + [rows], "all_to_all")
        expected = table[:, :-1].sum(axis=0)   # rank j receives column j
        for j, (given, want) in enumerate(zip(table[:, -1].tolist(), expected.tolist())):
            if given not in (-1, want):
                raise self._fail(ValueError, "all_to_all", f"out of rank {j} has {given} rows, "
                                                           f"but the ranks' in_splits send it "
                                                           f"{want}")
        received = table[:, self.rank].tolist()
        if out is None:
            out = b.empty((sum(received),) + x.shape[1:], x.dtype, stream)
        return received, out

    def scatter(self, x: Any, root: int = 0, *, out: Any, async_op: bool = False,
                stream: Any = None) -> Any:
        """Give rank ``j`` part ``j`` of root's ``x`` (leading axis); returns ``out``.

        ``x`` is only read on the root (pass None elsewhere, or an array of its shape and
        dtype: where given it is checked, so that a bad ``x`` fails on every rank alike);
        ``out``, the part, is required on every rank.

        Example (2 ranks)::

            x = numpy.array([[1, 2], [3, 4]]) if comm.rank == 0 else None
            comm.scatter(x, root=0, out=numpy.empty(2, int))
            # Rank 0: array([1, 2])   Rank 1: array([3, 4])
        """
        if (type(out) is _HOST and stream is None and type(root) is int
                and 0 <= root < self.size and out.flags.carray
                and (x is None and root != self.rank
                     or type(x) is _HOST and x.dtype is out.dtype
                     and x.shape in self._joined[out.shape] and x.flags.c_contiguous)):
            try:
                run = (self._started if async_op else self._blocking)["scatter"][out.dtype]
            except KeyError:
                run = self._prepared.find("scatter", out.dtype, None, async_op)
            if run is not None:
                return run(x if root == self.rank else None, out, root)
        b, out, spec = self._take("scatter", "out", out, writes=True)
        if stream is not None:
            self._check_stream("scatter", b, stream)
        self._check_rank("scatter", "root", root)
        if x is not None or self.rank == root:   # checked wherever given: alike on every rank
            x = self._check_out("scatter", "x", b, x, out, self._joined[out.shape],
                                " (size parts shaped like out)", writes=False)
        return b.scatter(x, out, spec, root, async_op, stream)

    def gather(self, x: Any, root: int = 0, *, out: Any = None, async_op: bool = False,
               stream: Any = None) -> Any:
        """Gather ``x`` of every rank on ``root``, rank ``j``'s part at index ``j``.

        Returns an array of shape ``(size, *x.shape)`` (or ``out``) on the root, None
        elsewhere; ``out`` is only read on the root.

        Example (2 ranks)::

            comm.gather(numpy.array([comm.rank]), root=0)
            # Rank 0: array([[0], [1]])   Rank 1: None
        """
        if (type(x) is _HOST and stream is None and type(root) is int
                and 0 <= root < self.size and x.flags.c_contiguous
                and (out is None or type(out) is _HOST and out.dtype is x.dtype
                     and out.shape in self._joined[x.shape] and out.flags.carray)):
            try:
                run = (self._started if async_op else self._blocking)["gather"][x.dtype]
            except KeyError:
                run = self._prepared.find("gather", x.dtype, None, async_op)
            if run is not None:
                if root != self.rank:
                    out = None
                elif out is None:
                    out = np.empty(self._joined[x.shape][0], x.dtype)
                return run(x, out, root)
        b, x, spec = self._take("gather", "x", x)
        if stream is not None:
            self._check_stream("gather", b, stream)
        self._check_rank("gather", "root", root)
        shapes = self._joined[x.shape]
        if out is not None:   # checked wherever given, so that every rank fails alike
            out = self._check_out("gather", "out", b, out, x, shapes,
                                  " (size parts shaped like x)")
        if self.rank != root:
            out = None
        elif out is None:
            out = b.empty(shapes[0], x.dtype, stream)
        return b.gather(x, out, spec, root, async_op, stream)

    # -- point to point ---------------------------------------------------------------------------
    def send(self, x: Any, dst: int, *, async_op: bool = False, stream: Any = None) -> Any:
        """Send ``x`` to rank ``dst``, which receives it with ``recv``. Returns None (or a
        Work). Messages between two ranks arrive in the order they were sent."""
        self._check_peer("send", "dst", dst)
        b, x, spec = self._take("send", "x", x, collective=False)
        if stream is not None:
            self._check_stream("send", b, stream)
        return b.send(x, spec, dst, async_op, stream)

    def recv(self, buf: Any, src: int, *, async_op: bool = False, stream: Any = None) -> Any:
        """Receive into ``buf`` what rank ``src`` sent; returns ``buf``. Its size must match
        the sent array's."""
        self._check_peer("recv", "src", src)
        b, buf, spec = self._take("recv", "buf", buf, collective=False, writes=True)
        if stream is not None:
            self._check_stream("recv", b, stream)
        return b.recv(buf, spec, src, async_op, stream)

    def sendrecv(self, x: Any, dst: int, buf: Any, src: int, *, async_op: bool = False,
                 stream: Any = None) -> Any:
        """Send ``x`` to ``dst`` and receive into ``buf`` from ``src`` at once, without the
        deadlock two blocking calls could make (a ring shift, a halo exchange); returns
        ``buf``.

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
                run = (self._started if async_op else self._blocking)["sendrecv"][x.dtype]
            except KeyError:
                run = self._prepared.find("sendrecv", x.dtype, None, async_op)
            if run is not None:
                return run(x, dst, buf, src)
        self._check_rank("sendrecv", "dst", dst)
        self._check_rank("sendrecv", "src", src)
        b, x, spec = self._take("sendrecv", "x", x, collective=False)
        if stream is not None:
            self._check_stream("sendrecv", b, stream)
        buf = self._check_kind("sendrecv", "buf", b, buf, x)
        return b.sendrecv(x, spec, dst, buf, src, async_op, stream)

    def isend(self, x: Any, dst: int, *, stream: Any = None) -> Work:
        """``send(x, dst, async_op=True)``: a Work that completes once ``x`` may be reused."""
        return self.send(x, dst, async_op=True, stream=stream)

    def irecv(self, buf: Any, src: int, *, stream: Any = None) -> Work:
        """``recv(buf, src, async_op=True)``: a Work whose ``wait()`` returns ``buf``."""
        return self.recv(buf, src, async_op=True, stream=stream)

    @contextlib.contextmanager
    def batch(self) -> Iterator[Batch]:
        """Issue the calls inside the block together; they complete when it ends.

        Each call is checked as it is made and queued. At the end of the block, on the host
        the calls start as nonblocking MPI requests and the block waits for all; on the
        device they form one NCCL group and the caller's stream waits for it. So sends and
        receives to both neighbours, in any order, cannot deadlock; a block that raises
        issues nothing. Every call inside returns a Work. See :mod:`cupycomm.batch`.

        Example (3 ranks)::

            right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
            mine, from_left = numpy.full(2, comm.rank), numpy.empty(2, int)
            with comm.batch():                  # a ring of any size
                comm.irecv(from_left, left)
                comm.isend(mine, right)
            # from_left now holds the left neighbour's array: Rank 0: [2, 2]  Rank 1: [0, 0]
        """
        self._check_open("batch")
        if self._batch is not None:
            raise self._fail(RuntimeError, "batch", "batch() blocks do not nest")
        group = Batch(self.rank)
        backends = [b for b in (self._host, self._nccl) if b is not None]
        for backend in backends:
            backend.begin_group(group)
        self._batch = group
        self._prepared.disable()   # every call inside is queued by the general path
        cancel = True   # unless the block ends without an exception
        try:
            yield group
            cancel = False
        finally:
            self._batch = None
            if not self._closed:
                self._prepared.enable()
            for backend in backends:
                backend.end_group(group, cancel)


    def barrier(self, *, async_op: bool = False) -> Optional[Work]:
        """Wait until every rank has called barrier (host processes, not CUDA streams: finish
        device work first with ``work.synchronize()`` or a stream synchronize if needed)."""
        self._check_open("barrier")
        return self._host.barrier(async_op)

    # -- many small arrays (see cupycomm.coalesce) ------------------------------------------------
    def all_reduce_coalesced(self, arrays: Sequence[Any], *, op: Op = _SUM,
                             bucket_bytes: Optional[int] = None,
                             async_op: bool = False) -> Union[List[Any], Work]:
        """All-reduce many arrays in few calls: grouped by dtype, packed into buffers of at
        most ``bucket_bytes`` (default 25 MiB), results written back in place. Returns the
        arrays (or a Work whose ``wait()`` writes them back and returns them).

        Example (2 ranks)::

            grads = [numpy.full(3, comm.rank + 1.0), numpy.ones((2, 2), numpy.float32)]
            comm.all_reduce_coalesced(grads, op="avg")   # grads[0] == [1.5, 1.5, 1.5]
        """
        return coalesce.all_reduce_coalesced(self, arrays, op, bucket_bytes, async_op)

    def bucket(self, arrays: Sequence[Any]) -> coalesce.Bucket:
        """A :class:`~cupycomm.coalesce.Bucket`: the arrays copied once into one flat buffer per
        dtype; use ``bucket.arrays`` (views of it) from then on, so that every
        ``bucket.all_reduce()`` is one call per dtype without packing."""
        return coalesce.Bucket(self, arrays)


    # -- Python objects (pickled: for trusted peers only; see cupycomm.objects) -------------------
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Root's ``obj`` on every rank (``obj`` is only read on the root).

        Example (2 ranks)::

            comm.broadcast_object({"lr": 0.1} if comm.rank == 0 else None)
            # Rank 0: {'lr': 0.1}   Rank 1: {'lr': 0.1}
        """
        return objects.broadcast_object(self, obj, root)

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, as a list indexed by rank, on every rank.

        Example (2 ranks)::

            comm.all_gather_object(f"host{comm.rank}")   # both: ['host0', 'host1']
        """
        return objects.all_gather_object(self, obj)

    def gather_object(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        """Every rank's ``obj`` as a list on the root; None elsewhere."""
        return objects.gather_object(self, obj, root)

    def scatter_object(self, objs: Optional[Sequence[Any]], root: int = 0) -> Any:
        """Rank ``j`` gets ``objs[j]`` of the root (``objs`` is only read on the root)."""
        return objects.scatter_object(self, objs, root)

    # -- subgroups --------------------------------------------------------------------------------
    def split(self, color: Optional[int], key: Optional[int] = None) -> Optional["Communicator"]:
        """A communicator of the ranks that pass the same ``color``, ordered by ``key``
        (default: their rank here); None where ``color`` is None. Collective.

        The subgroup is a full communicator: every collective, on host and device arrays.
        Its NCCL communicator comes from ``ncclCommSplit`` now if this communicator has one
        and NCCL is 2.18 or newer, else from a new unique id on its first device use.

        Example (4 ranks)::

            half = comm.split(comm.rank % 2)    # ranks 0, 2 and ranks 1, 3
            half.rank, half.size                # Rank 0: (0, 2)  Rank 1: (0, 2)  Rank 2: (1, 2)
        """
        self._check_open("split")
        if color is not None and (isinstance(color, bool)
                                  or not isinstance(color, (int, np.integer)) or color < 0):
            raise self._fail(ValueError, "split", f"color must be an int >= 0 or None, got "
                                                  f"{color!r}")
        if key is not None and (isinstance(key, bool) or not isinstance(key, (int, np.integer))):
            raise self._fail(TypeError, "split", f"key must be an int or None, got {key!r}")
        return self._subgroup(None if color is None else int(color),
                              self.rank if key is None else int(key), f"split({color})")

    def new_group(self, ranks: Sequence[int]) -> Optional["Communicator"]:
        """A communicator of ``ranks`` (ordered by rank), None on the other ranks. Collective:
        every rank calls it with the same list, as torch.distributed.new_group.

        Example (3 ranks)::

            group = comm.new_group([0, 2])   # Rank 0: rank 0 of 2   Rank 1: None   Rank 2: 1 of 2
        """
        self._check_open("new_group")
        members = list(ranks) if isinstance(ranks, (list, tuple, range)) else None
        if not members:
            raise self._fail(ValueError, "new_group", f"ranks must be a non-empty list of "
                                                      f"ranks, got {ranks!r}")
        for member in members:
            self._check_rank("new_group", "ranks", member)
        if len(set(members)) != len(members):
            repeated = sorted({r for r in members if members.count(r) > 1})
            raise self._fail(ValueError, "new_group", f"ranks repeats {repeated}: each rank "
                                                      f"may appear once")
        ordered = sorted(members)
        mine = self.rank in ordered
        return self._subgroup(0 if mine else None, ordered.index(self.rank) if mine else 0,
                              f"group{ordered}")

    def _subgroup(self, color: Optional[int], key: int, label: str) -> Optional["Communicator"]:
        sub = self._mpi.Split(MPI.UNDEFINED if color is None else color, key)
        raw = self._nccl.split(color, key) if self._nccl is not None else None
        if color is None:
            return None
        return Communicator(sub, device=self._device_choice, device_module=self._cupy,
                            timeout=self.timeout, debug=self.debug,
                            name=f"{self.name}/{label}", device_rank=self._device_rank,
                            nccl_comm=raw)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the NCCL communicator and the MPI duplicate. Closing twice is harmless; any
        other call afterwards raises :class:`~cupycomm.errors.CommClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._backends = {}
        self._prepared.disable()
        try:   # calls still in flight are waited for while the watchdog still looks
            if not MPI.Is_finalized():
                self._host.close()
            if self._nccl is not None:
                self._nccl.close()
        finally:
            unwatch(self._tracker)
            self._tracker.leave()
            if not MPI.Is_finalized():
                if self._objects is not None:
                    self._objects.Free()
                self._mpi.Free()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"device={self._device_id}"
        return f"<cupycomm.Communicator {self.name} rank {self.rank} of {self.size}, {state}>"


# -- init -----------------------------------------------------------------------------------------
_default: Optional[Communicator] = None


def init(mpi_comm: Optional[MPI.Comm] = None, *, device: Optional[int] = None,
         timeout: Optional[float] = None, abort_on_exception: Optional[bool] = None,
         debug: Optional[bool] = None, device_module: Any = None) -> Communicator:
    """Start cupycomm in this process and return a :class:`Communicator`.

    Args:
        mpi_comm: an mpi4py communicator to build on (it is duplicated: cupycomm's traffic
            never mixes with yours). Default: every rank of the job, and then ``init()`` is
            idempotent: later calls return the same communicator until it is closed.
        device: the CUDA device of this rank; default: local rank modulo the node's GPUs.
        timeout: seconds before a blocked collective is declared hung (default
            :data:`DEFAULT_TIMEOUT`, or the CUPYCOMM_TIMEOUT environment variable).
        abort_on_exception: abort the whole MPI job when an exception escapes on any rank
            (default on; CUPYCOMM_ABORT_ON_EXCEPTION=0 turns it off).
        debug: before each collective, check across ranks that every rank calls the same
            collective with matching arguments (default off; CUPYCOMM_DEBUG=1 turns it on).
        device_module: the module that provides device arrays, streams and NCCL; default
            CuPy. The test suite passes its host-memory NCCL stand-in here.

    Example (2 ranks)::

        from mpi4py import MPI
        comm = cupycomm.init()                  # every rank of the job
        alone = MPI.COMM_WORLD.Split(comm.rank)  # an mpi4py communicator of your own
        with cupycomm.init(alone) as sub:       # built on a duplicate of it
            sub.all_reduce(numpy.ones(2))       # Rank 0: array([1., 1.])  Rank 1: the same
        alone.Free()
    """
    global _default
    if timeout is not None and not timeout > 0:
        raise ValueError(f"init: timeout must be a positive number of seconds, got {timeout!r}")
    if device is not None and (type(device) is not int or device < 0):
        raise ValueError(f"init: device must be a CUDA device number >= 0, got {device!r}")
    if mpi_comm is None and _default is not None and not _default.closed:
        asked = {"device": (device, _default._device_choice),
                 "timeout": (timeout, _default.timeout), "debug": (debug, _default.debug)}
        for name, (wanted, current) in asked.items():
            if wanted is not None and wanted != current:
                raise ValueError(f"init: already initialized with {name}={current!r}, now "
                                 f"asked for {name}={wanted!r}; close() the communicator first")
        return _default
    if timeout is None:
        timeout = _env.read("CUPYCOMM_TIMEOUT")
    if debug is None:
        debug = _env.read("CUPYCOMM_DEBUG")
    if abort.abort_enabled(abort_on_exception):
        abort.install_abort_handler()
    endings.start()   # under python -m cupycomm.run: this rank's end will be known
    flight.install_signal()
    parent = _bootstrap.world() if mpi_comm is None else mpi_comm
    if not isinstance(parent, MPI.Comm) or parent == MPI.COMM_NULL:
        raise TypeError(f"init: mpi_comm must be an mpi4py communicator, got {parent!r}")
    comm = Communicator(parent.Dup(), device=device, device_module=device_module,
                        timeout=timeout, debug=debug,
                        name="world" if mpi_comm is None else "mpi_comm")
    if mpi_comm is None:
        _default = comm
    return comm
