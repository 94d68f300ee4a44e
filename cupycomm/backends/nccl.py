"""Device backend: CuPy arrays through ``cupy.cuda.nccl.NcclCommunicator``.

A synchronous collective runs on the caller's current stream itself (or on ``stream=``), in
that stream's order, and records one event, ``_finished``, for the watchdog (as
torch.distributed since pytorch#150398); ``async_op=True`` runs on the backend's comm stream
between events, a ``batch()`` block as one NCCL group there. Every launch makes the
communicator's device current and sets the previous one back, except in a thread with no
CUDA context yet (:meth:`NcclBackend._switch`). A call inside a CUDA graph capture is
captured. One lock, ``_lifetime``, keeps every use of the NCCL communicator apart (it is not
thread-safe), and one thread at a time uses it (:meth:`NcclBackend._take_over`). Data
movement is described to NCCL as bytes; reductions use the dtype table's NCCL datatype and
count factor. The streams, events, captures and threads in full: docs/internals.md,
"backends/nccl.py".
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import importlib
import threading
from typing import Any, Callable, Iterator, Optional, Tuple

from .._bootstrap import at_safe_point, broadcast_unique_id
from .._dtypes import DTYPES, NCCL_INT8, NCCL_OPS
from .shapes import offsets
from ..errors import CollectiveTimeout, NcclError, PeerLost
from ..work import DeviceWork, poll_until

__all__ = ["NcclBackend", "library_version", "nccl_module"]


def nccl_module(cupy: Any) -> Any:
    """``cupy.cuda.nccl``, imported: ``import cupy`` does not create it (CuPy's ``cuda``
    package has no ``nccl`` attribute until the submodule is imported).

    Raises RuntimeError when CuPy's NCCL module is there but libnccl could not load
    (``cupy.cuda.nccl.available`` is False)::

        nccl = nccl_module(cupy)
        unique_id = nccl.get_unique_id()
    """
    module = importlib.import_module(f"{cupy.__name__}.cuda.nccl")
    if not getattr(module, "available", True):
        raise RuntimeError(
            f"{cupy.__name__}.cuda.nccl.available is False: libnccl could not load, so "
            f"device collectives cannot run; install NCCL for this CUDA (e.g. pip install "
            f"nvidia-nccl-cu12) or put libnccl.so.2 on LD_LIBRARY_PATH")
    return module


_RELAXED = 2   # cudaStreamCaptureModeRelaxed (CUDA's enum; CuPy's runtime has it too)


@contextlib.contextmanager
def _relaxed_capture_mode(runtime: Any) -> Iterator[None]:
    """This thread in relaxed stream-capture mode inside the block (as torch's watchdog does):
    its event queries are then never refused for another thread's capture in global mode.
    CuPy does not wrap cudaThreadExchangeStreamCaptureMode: the driver's function is called
    (a module with ``threadExchangeStreamCaptureMode``, as the stand-in, provides its own)."""
    exchange = getattr(runtime, "threadExchangeStreamCaptureMode", None)
    if exchange is None:
        exchange = _driver_capture_mode_exchange()
    previous = exchange(_RELAXED)
    try:
        yield
    finally:
        exchange(previous)


@functools.lru_cache(maxsize=None)
def _driver_capture_mode_exchange() -> Any:
    """``exchange(mode) -> previous mode`` through the driver's
    cuThreadExchangeStreamCaptureMode; without a driver nothing can capture: a no-op."""
    try:
        call = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    except OSError:
        return lambda mode: mode

    def exchange(mode: int) -> int:
        value = ctypes.c_int(mode)
        call(ctypes.byref(value))
        return value.value
    return exchange


@functools.lru_cache(maxsize=None)
def _revoker(nccl: Any) -> Optional[Callable[[int, int], None]]:
    """``comm_revoke(handle, flags)``, ncclCommRevoke through NVIDIA's nccl4py (an optional
    extra: CuPy has no binding), or None where nccl4py is missing or its NCCL is not the
    one ``nccl`` (CuPy's module) runs, at least 2.28.9 (a handle is only valid in its own
    library)."""
    try:
        bindings = importlib.import_module("nccl.bindings.nccl")
        same = bindings.get_version() == nccl.get_version() >= _REVOKE_SINCE
        return bindings.comm_revoke if same else None
    except Exception:   # not installed, or a libnccl it cannot load
        return None


def library_version(cupy: Any) -> str:
    """NCCL's version, e.g. ``"2.23.4"``, as ``cupy``'s NCCL module reports it; ``""`` where
    CuPy has no NCCL module or libnccl cannot load."""
    try:
        code = nccl_module(cupy).get_version()
    except Exception:   # no NCCL module in this CuPy, or its library fails to load
        return ""
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def _reduction_table() -> dict:
    """dtype -> requested op -> (NCCL datatype, NCCL elements per array element, NCCL op)."""
    table = {}
    for dtype, row in DTYPES.items():
        if row.nccl_type is not None:
            table[dtype] = {op: (row.nccl_type, row.nccl_count, NCCL_OPS[applied])
                            for op, applied in row.ops.items()}
    return table


_REDUCTIONS = _reduction_table()
# The legacy null stream's handles. It cannot capture (CuPy's begin_capture refuses it), and
# cudaStreamIsCapturing of it fails while another stream of its device captures: whether a
# stream captures is asked as ``stream.ptr not in _LEGACY and stream.is_capturing()``.
_LEGACY = (0, 1)
_MOVEMENTS = {dtype: None for dtype in DTYPES}   # NCCL moves bytes: every dtype as it is
# NCCL communicators closed or aborted while CUDA graphs may replay their calls (or while a
# launch is blocked inside NCCL): never destroyed nor aborted, not even by CuPy's destructor
# at exit (both wait until every such graph is destroyed: NCCL init.cc, commDestroySync), so
# the list is never freed.
_KEPT_FOR_GRAPHS: list = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT_FOR_GRAPHS))
_REVOKE_SINCE = 22809   # ncclCommRevoke: NCCL 2.28.9
_LAUNCH_GRACE = 1.0     # seconds an abort waits for a launch to leave NCCL before it is "blocked"
# Backends whose communicator was collected unclosed (NcclBackend.drop), to close at a safe
# point: CuPy's destructor would run ncclCommDestroy in the collecting thread, at any moment.
_DROPPED: list = []
_thread = threading.get_ident


class _CutShort:
    """What a cut-short async Work holds in place of its event and backend (see
    :meth:`NcclBackend._end`): never done; each wait raises the abort's error (PeerLost for a
    loss, CollectiveTimeout for a timeout) rather than return the undefined output."""

    done = False   # as an event's: the Work never completes

    def __init__(self, backend: "NcclBackend", label: str, seq: int) -> None:
        self._backend, self._label, self._seq = backend, label, seq

    def _error(self) -> Exception:
        return self._backend._cut_short_error(self._label, self._seq)

    def stream_wait(self, event: Any, captured: bool = False, label: str = "wait") -> None:
        raise self._error()

    def check_errors(self, label: str) -> None:
        raise self._error()

    def expired(self, label: str, timeout: float) -> None:
        raise self._error()


class NcclBackend:
    """Collectives on one device over one NCCL communicator, created collectively.

    ``cupy`` is the CuPy module, or in tests a host-memory stand-in with the same interface.
    """

    name = "nccl"
    movements = _MOVEMENTS
    reductions = _REDUCTIONS

    def __init__(self, mpi_comm: Any, device_id: int, cupy: Any, tracker: Any,
                 nccl_comm: Any = None) -> None:
        cuda = cupy.cuda
        nccl = nccl_module(cupy)
        self._cupy = cupy
        self._nccl_module = nccl
        self._raw_error = nccl.NcclError
        self.array_type = cupy.ndarray
        self.device_id = device_id
        self._get_device = cuda.runtime.getDevice
        self._set_device = cuda.runtime.setDevice
        self._context = cuda.driver.ctxGetCurrent
        self._rank = mpi_comm.Get_rank()
        self._size = mpi_comm.Get_size()
        self._tracker = tracker
        self._flight, self._slots = tracker.flight.calls, tracker.flight.size   # its ring
        self._current_stream = cuda.get_current_stream
        self._runtime = cuda.runtime
        self._new_event = cuda.Event
        self._inflight: collections.deque = collections.deque()
        self._spare_events: list = []   # events of completed async Works, to record again
        # (event, arrays) of synchronous calls on a ``stream=``: kept until the event is done
        self._held: collections.deque = collections.deque()
        self._owner: Any = None   # the thread of the last call (one thread at a time)
        self._inside = False      # whether a thread is inside a launch (not in a group)
        self._captures = 0        # collectives captured in CUDA graphs
        self._replays = (0, 0)    # (graph replays by launch_graph, the collective before the last)
        self._group: Any = None   # the open batch() block, if any
        self._aborted = ""        # why the NCCL communicator can no longer be used
        self._lost: Optional[Tuple[int, ...]] = None   # the world ranks whose death aborted it
        self._late: Optional[Tuple[int, ...]] = None   # the ranks a timeout that aborted it named
        # Every use of the NCCL communicator (launches, the watchdog's, abort, close): NCCL's
        # communicator is not thread-safe, and ncclCommAbort frees what a launch uses.
        self._lifetime = threading.Lock()
        with self.on_device():
            if nccl_comm is None:   # both wait for every rank: watched, as a call
                with tracker.inside(f"init_device #{tracker.seq + 1}"):
                    unique_id = broadcast_unique_id(mpi_comm, nccl.get_unique_id)
                    nccl_comm = self._nccl(lambda: nccl.NcclCommunicator(
                        self._size, unique_id, self._rank), "init")
            self._comm = nccl_comm
            self._stream = cuda.Stream(non_blocking=True)
            self._ready = cuda.Event(disable_timing=True)      # caller's stream, async calls
            self._finished = cuda.Event(disable_timing=True)   # after synchronous calls

    @property
    def stream(self) -> Any:
        """The comm stream: where every collective without ``stream=`` runs."""
        return self._stream

    # -- the shared step: order, launch, complete -------------------------------------------------
    def _failed(self, label: str, error: Exception) -> NcclError:
        return NcclError(f"{label}: NCCL failed on rank {self._rank}: {error}")

    def _launch_failed(self, label: str, error: Exception) -> NcclError:
        """The error of launch ``label`` (under ``_lifetime``), which NCCL refused with
        ``error``: where the communicator has an asynchronous error, the one NCCL hands every
        launch after it (NCCL's ``enqueue.cc``, ncclEnqueueCheck: ncclCommEnsureReady), the
        communicator is broken (:meth:`_broken`); else the call's own NcclError."""
        try:
            self._comm.check_async_error()
        except self._raw_error as reported:
            return self._broken(label, self._tracker.seq, reported)
        return self._failed(label, error)

    def _broken(self, call: str, seq: int, error: Exception) -> NcclError:
        """NCCL's asynchronous ``error`` met ``call`` #``seq`` (under ``_lifetime``): the NCCL
        communicator is aborted here (its kernels end; the Works they cut short raise), and
        the error says why: PeerLost naming the lost world ranks where the process survives
        losses and the tracker names them within its loss bound (the node board, the
        heartbeats, MPI's ULFM: ``Tracker.lost_ranks``), else NcclError. The watchdog leaves
        an aborted communicator alone, so that wait holds up no one."""
        self._end(f"NCCL reported an asynchronous error: {error}")
        lost = self._tracker.lost_ranks(seq)
        if lost:
            self._lost = lost
        return self._was_aborted(call, seq)

    def _nccl(self, call, label: str) -> Any:
        try:
            return call()
        except self._raw_error as error:
            raise self._failed(label, error) from error

    def _launch(self, call, args: tuple, result, keep: tuple, label: str, async_op: bool,
                stream: Any, unpack=()) -> Any:
        """Run ``call(*args, stream_ptr)``. A synchronous call: on the caller's stream (or
        ``stream``) itself, then ``_finished`` recorded after it for the watchdog; none in a
        capture (the watchdog must never query an event recorded there). An ``async_op``
        call: see :meth:`_launch_async`."""
        if _thread() != self._owner:
            self._take_over(label)
        with self._lifetime:   # (not while the watchdog aborts it)
            if self._aborted:
                raise self._was_aborted(label, self._tracker.seq + 1)
            tracker = self._tracker
            tracker.seq = seq = tracker.seq + 1
            self._flight[seq % self._slots] = (label, "nccl")
            if self._group is not None:
                return self._launch_grouped(call, args, result, keep, label, stream, unpack)
            # Handles 0 and 2 mean the current device's default streams, and a CUDA runtime
            # call makes a context on the current device: the communicator's device is made
            # current, and only where it is not (see _switch).
            previous = self._get_device()
            back = self._switch(previous) if previous != self.device_id else -1
            self._inside = True
            try:
                if async_op:
                    return self._launch_async(call, args, result, keep, label, stream, unpack,
                                              seq)
                here = self._current_stream(self.device_id) if stream is None else stream
                captured = here.ptr not in _LEGACY and here.is_capturing()
                self._run(call, args, here, label, unpack)
                if captured:
                    self._captures += 1
                else:
                    self._finished.record(here)
                    if stream is not None:
                        self._hold(keep, here)
                return result
            finally:
                self._inside = False
                if back >= 0:
                    self._set_device(back)

    def _switch(self, previous: int) -> int:
        """Make the communicator's device current in this thread, where ``previous`` is;
        returns the device to set back after the call: ``previous``, or -1 (none) where this
        thread has no CUDA context yet (a new thread, its device 0 unused): setting 0 back
        would make a context on GPU 0 (cudaSetDevice initializes it, CUDA 12), hundreds of
        MiB per rank. That thread stays on the communicator's device, as the watchdog's
        does (torch's device guard sets no device back without a context either)."""
        back = previous if self._context() else -1
        self._set_device(self.device_id)
        return back

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The communicator's device current inside the block (see :meth:`_switch`)."""
        previous = self._get_device()
        back = self._switch(previous) if previous != self.device_id else -1
        try:
            yield
        finally:
            if back >= 0:
                self._set_device(back)

    def _take_over(self, label: str) -> None:
        """A call from another thread than the last call's: refused while that thread is
        inside a call on the communicator or its batch() block is open (NCCL forbids
        concurrent host calls on one communicator: interleaved differently on the ranks,
        their calls would reduce each other's buffers), else this thread's from now on.
        The first thread's kernels in flight do not matter (a hand-off after its call
        returned is ordered on every rank alike; whether kernels are done is timing).
        (Checked before ``_lifetime``, which a launch inside holds.)"""
        if self._owner is not None:
            busy = ("its batch() block is open" if self._group is not None else
                    "it is inside a call on it" if self._inside else "")
            if busy:
                raise RuntimeError(
                    f"{label}: this communicator is in use by another thread ({busy}) on rank "
                    f"{self._rank}; NCCL forbids using one communicator from two threads at "
                    f"once: use one communicator per thread (comm.split), or hold one lock "
                    f"around each thread's calls until they return")
        self._owner = _thread()

    def _in_flight(self) -> bool:
        """Whether collectives launched outside captures have not completed yet."""
        inflight = self._inflight
        return not self._finished.done or bool(
            inflight and inflight[-1]._event is not None and not inflight[-1]._event.done)

    def _hold(self, keep: tuple, stream: Any) -> None:
        """Keep ``keep`` alive until ``stream`` has got past the call just launched there:
        memory allocated on the caller's stream goes back to that stream's pool when dropped,
        which may hand it out again before ``stream`` reads it (torch's recordStream does
        this for tensors). Those of earlier calls that are done are let go first."""
        held, spare = self._held, self._spare_events
        while held and held[0][0].done:
            spare.append(held.popleft()[0])
        event = spare.pop() if spare else self._new_event(disable_timing=True)
        event.record(stream)
        held.append((event, keep))

    def _launch_async(self, call, args: tuple, result, keep: tuple, label: str, stream: Any,
                      unpack, seq: int) -> DeviceWork:
        """An ``async_op`` call: on the comm stream after an event of the caller's stream
        (so kernels that wrote the input first are seen), or on ``stream`` itself. Its Work
        stays in ``_inflight`` outside a capture (which keeps the arrays alive even if the
        caller drops the Work) until it completes; a captured one is never queried, nor
        watched. Its event comes from those of completed Works, and is only made new when
        there is none. (One frame for launch and Work: this is the async call's hot path.)"""
        if stream is None:
            caller = self._current_stream(self.device_id)
            captured = caller.ptr not in _LEGACY and caller.is_capturing()
            self._ready.record(caller)
            stream = self._stream
            stream.wait_event(self._ready)
        else:
            captured = stream.ptr not in _LEGACY and stream.is_capturing()
        self._run(call, args, stream, label, unpack)
        inflight, spare = self._inflight, self._spare_events
        # (``_done`` first: a Work already waited for is not asked again, in a frame of its own)
        while not captured and inflight and (inflight[0]._done or inflight[0].is_completed()):
            done = inflight.popleft()
            if done._number:   # (a batch() block's Works share theirs: not reused)
                spare.append(done._event)   # a completed Work never reads it again
                done._event = None
        event = spare.pop() if spare else self._new_event(disable_timing=True)
        event.record(stream)
        work = DeviceWork(event, result, keep, self, label, captured, seq)
        if captured:
            self._captures += 1
        else:
            inflight.append(work)
        return work

    def _run(self, call, args: tuple, stream: Any, label: str, unpack) -> None:
        """``call(*args, stream_ptr)`` on ``stream``, then all_gather's list parts copied out
        of the gathered array there. The launch is marked busy: it can block the host (NCCL
        connects a peer inside the first call that needs it, and waits for it there), and
        the watchdog then names it."""
        tracker = self._tracker
        tracker.busy = label
        try:
            call(*args, stream.ptr)
        except self._raw_error as error:
            raise self._launch_failed(label, error) from error
        finally:
            tracker.busy = None
        if unpack:
            with stream:
                for dst, src in unpack:
                    dst[...] = src

    def _launch_grouped(self, call, args: tuple, result, keep: tuple, label: str,
                        stream: Any, unpack) -> DeviceWork:
        """A call inside a batch() block: queued, to be part of one NCCL group on the comm
        stream when the block ends."""
        group = self._group
        if stream is not None:
            raise TypeError(f"{label}: stream= cannot be used inside a batch() block (the "
                            f"block runs on the comm stream) on rank {self._rank}")
        group.claim("device", label)
        if group.caller is None:   # the stream whose earlier work the block must see
            group.caller = self._current_stream(self.device_id)
        group.calls.append((call, args, unpack))
        work = DeviceWork(None, result, keep, self, label)   # its event comes with the block's end
        group.works.append(work)
        return work

    def begin_group(self, group: Any) -> None:
        if _thread() != self._owner:   # the block's calls are this thread's
            self._take_over("batch")
        self._group = group

    def end_group(self, group: Any, cancel: bool) -> None:
        """Launch the block's calls as one NCCL group after the caller's earlier work, then
        make the caller's stream wait for it. If the block raised (``cancel``), launch none."""
        self._group = None
        if group.kind != "device" or cancel:
            return
        with self._lifetime:
            if self._aborted:
                raise self._was_aborted("batch", self._tracker.seq)
            with self.on_device():
                self._launch_group(group)

    def _launch_group(self, group: Any) -> None:
        stream = self._stream
        captured = group.caller.ptr not in _LEGACY and group.caller.is_capturing()
        self._ready.record(group.caller)
        stream.wait_event(self._ready)
        nccl = self._nccl_module
        try:
            with self._tracker.inside("batch"):   # groupEnd connects peers: it may block
                nccl.groupStart()
                try:
                    for call, args, _ in group.calls:
                        call(*args, stream.ptr)
                finally:
                    nccl.groupEnd()
        except self._raw_error as error:
            raise self._launch_failed("batch", error) from error
        with stream:   # all_gather's list parts, copied out after the group
            for _, _, unpack in group.calls:
                for dst, src in unpack:
                    dst[...] = src
        event = self._new_event(disable_timing=True)
        event.record(stream)
        group.caller.wait_event(event)
        self._captures += captured
        for work in group.works:
            work._event, work._captured = event, captured
            if not captured:
                self._inflight.append(work)

    def _in_group(self, calls, stream_ptr: int) -> None:
        """Issue ``calls(stream_ptr)`` (several sends and receives) as one NCCL group."""
        nccl = self._nccl_module
        nccl.groupStart()
        try:
            calls(stream_ptr)
        finally:
            nccl.groupEnd()

    # -- collectives ------------------------------------------------------------------------------
    def all_reduce(self, x, recv, spec, async_op, stream):
        datatype, factor, op = spec
        args = (x.data.ptr, recv.data.ptr, x.size * factor, datatype, op)
        return self._launch(self._comm.allReduce, args, recv, (x, recv), "all_reduce",
                            async_op, stream)

    def reduce(self, x, recv, spec, root, async_op, stream):
        datatype, factor, op = spec
        into = recv if self._rank == root else x   # NCCL ignores recvbuff off the root
        args = (x.data.ptr, into.data.ptr, x.size * factor, datatype, op, root)
        result = recv if self._rank == root else None
        return self._launch(self._comm.reduce, args, result, (x, recv), "reduce",
                            async_op, stream)

    def broadcast(self, x, spec, root, async_op, stream):
        args = (x.data.ptr, x.nbytes, NCCL_INT8, root)
        return self._launch(self._comm.bcast, args, x, (x,), "broadcast", async_op, stream)

    def all_gather(self, x, recv, spec, async_op, stream, unpack=()):
        args = (x.data.ptr, recv.data.ptr, x.nbytes, NCCL_INT8)
        result = [dst for dst, _ in unpack] if unpack else recv
        return self._launch(self._comm.allGather, args, result, (x, recv), "all_gather",
                            async_op, stream, unpack)

    def reduce_scatter(self, x, recv, spec, async_op, stream, pack=()):
        if pack:
            self._pack(pack, stream)
        datatype, factor, op = spec
        args = (x.data.ptr, recv.data.ptr, recv.size * factor, datatype, op)
        return self._launch(self._comm.reduceScatter, args, recv, (x, recv), "reduce_scatter",
                            async_op, stream)

    def all_to_all(self, x, recv, spec, async_op, stream):
        chunk = x.nbytes // self._size
        return self.all_to_all_v(x, recv, spec, [chunk] * self._size, [chunk] * self._size,
                                 async_op, stream)

    def all_to_all_v(self, x, recv, spec, send_bytes, recv_bytes, async_op, stream):
        """Part ``j`` (``send_bytes[j]`` bytes) to rank ``j``: one group of sends and receives."""
        sends = list(zip(offsets(send_bytes, x.data.ptr), send_bytes, range(self._size)))
        receives = list(zip(offsets(recv_bytes, recv.data.ptr), recv_bytes, range(self._size)))
        return self._exchange(sends, receives, recv, (x, recv), "all_to_all", async_op, stream)

    def scatter(self, x, recv, spec, root, async_op, stream):
        chunk = recv.nbytes
        sends = ([(x.data.ptr + peer * chunk, chunk, peer) for peer in range(self._size)]
                 if self._rank == root else [])
        return self._exchange(sends, [(recv.data.ptr, chunk, root)], recv, (x, recv),
                              "scatter", async_op, stream)

    def gather(self, x, recv, spec, root, async_op, stream):
        chunk = x.nbytes
        receives = ([(recv.data.ptr + peer * chunk, chunk, peer) for peer in range(self._size)]
                    if self._rank == root else [])
        return self._exchange([(x.data.ptr, chunk, root)], receives, recv, (x, recv), "gather",
                              async_op, stream)

    def send(self, x, spec, peer, async_op, stream):
        args = (x.data.ptr, x.nbytes, NCCL_INT8, peer)
        return self._launch(self._comm.send, args, None, (x,), "send", async_op, stream)

    def recv(self, x, spec, peer, async_op, stream):
        args = (x.data.ptr, x.nbytes, NCCL_INT8, peer)
        return self._launch(self._comm.recv, args, x, (x,), "recv", async_op, stream)

    def sendrecv(self, x, spec, dst, buf, src, async_op, stream):
        return self._exchange([(x.data.ptr, x.nbytes, dst)], [(buf.data.ptr, buf.nbytes, src)],
                              buf, (x, buf), "sendrecv", async_op, stream)

    def _pack(self, pack, stream: Any) -> None:
        """``dst[...] = src`` for each pair (a list's parts into the array a call sends), on
        this device and on the stream the call is ordered after: ``stream``, else this
        device's current stream (a synchronous call runs there, an async one or a batch()
        block waits for it), whatever device is current."""
        with self.on_device(), (self._current_stream(self.device_id) if stream is None
                                else stream):
            for dst, src in pack:
                dst[...] = src

    def _exchange(self, sends: list, receives: list, result, keep: tuple, label: str,
                  async_op: bool, stream: Any) -> Any:
        """(address, bytes, peer) transfers out and in, as one NCCL group."""
        send, receive = self._comm.send, self._comm.recv

        def transfers(s):
            for ptr, nbytes, peer in sends:
                send(ptr, nbytes, NCCL_INT8, peer, s)
            for ptr, nbytes, peer in receives:
                receive(ptr, nbytes, NCCL_INT8, peer, s)
        return self._launch(self._in_group, (transfers,), result, keep, label, async_op, stream)

    def split(self, color: Any, key: int) -> Any:
        """``ncclCommSplit`` (collective over this communicator; None where ``color`` is None),
        or None for every rank where this NCCL has no split (before 2.18): the subgroup then
        makes its own communicator from a new unique id when it first needs one."""
        if not hasattr(self._comm, "commSplit") or self._nccl_module.get_version() < 21801:
            return None
        if self._aborted:
            raise self._was_aborted("split", self._tracker.seq)
        # CuPy's docstring of commSplit: collectives still in flight may deadlock it.
        self._synchronize()
        with self._lifetime, self.on_device():
            if self._aborted:
                raise self._was_aborted("split", self._tracker.seq)
            return self._nccl(lambda: self._comm.commSplit(-1 if color is None else color, key),
                              "split")

    def launch_graph(self, graph: Any, stream: Any) -> None:
        """Launch ``graph`` on ``stream`` (None: the caller's current stream), then record
        the watchdog's event after it, so that a replay that does not complete (a peer that
        never launches its graph) is aborted after the timeout and named. NCCL serializes
        the graph launches of a communicator with its other calls, so that one event still
        covers all of them. Refused once the communicator was aborted (its memory freed, or
        its kernels revoked)."""
        with self._lifetime:
            if self._aborted:
                raise self._was_aborted("launch_graph", self._tracker.seq)
            with self.on_device():
                here = self._current_stream(self.device_id) if stream is None else stream
                with self._tracker.inside("launch_graph"):   # cudaGraphLaunch may block
                    graph.launch(here)
                if not (here.ptr not in _LEGACY and here.is_capturing()):
                    self._finished.record(here)
                    self._replays = (self._replays[0] + 1, self._tracker.seq)

    def pending(self, seq: int) -> str:
        """What the watchdog names when device work up to collective ``seq`` is late."""
        replays, after = self._replays
        if replays and after == seq:
            return (f"the CUDA graph replay #{replays} (launch_graph) after device collective "
                    f"#{seq} has")
        return f"device collectives up to #{seq} have"

    # -- memory, Work support, faults, lifetime ---------------------------------------------------
    def empty(self, shape: tuple, dtype: Any, stream: Any = None) -> Any:
        """A new array; with ``stream``, from that stream's memory pool, so that the memory
        is only reused after what ``stream`` does with it."""
        with self.on_device():
            if stream is None:
                return self._cupy.empty(shape, dtype)
            with stream:
                return self._cupy.empty(shape, dtype)

    def stream_wait(self, event: Any, captured: bool = False, label: str = "wait") -> None:
        """The caller's stream waits for ``event``: one recorded in a capture (``captured``)
        only in that capture, one recorded outside only outside any capture (CUDA refuses
        both others: an event of an ended capture cannot be used, and a capture cannot wait
        on outside work)."""
        caller = self._current_stream(self.device_id)
        # (handle 2, the per-thread stream, is the current device's; no context manager on
        # this hot path: as in _launch)
        previous = self._get_device()
        back = self._switch(previous) if previous != self.device_id else -1
        try:
            if (caller.ptr not in _LEGACY and caller.is_capturing()) == captured:
                caller.wait_event(event)
                return
        finally:
            if back >= 0:
                self._set_device(back)
        raise RuntimeError(
            f"{label}: wait() of a collective launched in a CUDA graph capture must be "
            f"called in that capture, and wait() of one launched outside must not be "
            f"called inside a capture (wait for it before begin_capture), on rank "
            f"{self._rank}" if captured else
            f"{label}: wait() inside a CUDA graph capture of a collective launched before "
            f"it began: the capture cannot wait on outside work; call wait() before "
            f"begin_capture(), on rank {self._rank}")

    def check_errors(self, label: str) -> None:
        """Raise :class:`NcclError` if NCCL reported an asynchronous error or the communicator
        was aborted (:class:`PeerLost` if that was for a peer that died,
        :class:`CollectiveTimeout` for a timeout), while the Work ``label`` ("all_reduce
        #12") waits."""
        with self._lifetime:   # not while the watchdog aborts it
            name, _, number = label.partition(" #")
            seq = int(number) if number.isdigit() else self._tracker.seq
            if self._aborted:   # it cut the Work short (a Work launched later cannot be)
                raise self._cut_short_error(name, seq)
            try:
                self._comm.check_async_error()
            except self._raw_error as error:
                raise self._broken(name, seq, error) from error

    def settle(self, label: str) -> None:
        """Block until every collective launched outside captures has completed (device calls
        return at launch), then raise what cut any short, as :meth:`check_errors` does
        (PeerLost for a loss): what a caller that must trust the results first waits for
        (:func:`cupycomm.resilient`'s vote, ``State.sync``'s commit). A collective that
        never completes is the watchdog's: it aborts it after the timeout."""
        check = functools.partial(self.check_errors, label)
        with _relaxed_capture_mode(self._runtime):
            poll_until(lambda: not self._in_flight(), None, check)
        check()

    def _was_aborted(self, call: str, seq: int) -> NcclError:
        """The error of ``call`` #``seq`` (the number it has, or would have had) once the
        communicator is aborted: PeerLost naming the lost world ranks where a death was
        the reason, as the host path's (:mod:`cupycomm.survivors`)."""
        message = f"the NCCL communicator was aborted ({self._aborted}) on rank {self._rank}"
        if self._lost is None:
            return NcclError(f"{call}: {message}")
        return PeerLost(f"{call} #{seq}: {message}: lost world rank(s) {list(self._lost)}",
                        ranks=self._lost, call=call, seq=seq)

    def _cut_short_error(self, call: str, seq: int) -> Exception:
        """What a Work that the abort cut short raises: the cause, a CollectiveTimeout naming
        the ranks that had not issued the call where a timeout aborted the communicator, else
        as :meth:`_was_aborted` (PeerLost for a loss)."""
        if self._lost is not None or self._late is None:
            return self._was_aborted(call, seq)
        return CollectiveTimeout(
            f"{call} #{seq}: cut short on rank {self._rank}: the NCCL communicator was aborted "
            f"({self._aborted}); ranks of this node that had not issued it: "
            f"{list(self._late)}", collective=call, seq=seq, missing=self._late)

    def expired(self, label: str, timeout: float) -> None:
        name, at, late, arrivals = self._tracker.arrivals(label)
        self.abort(f"{name} #{at} timed out after {timeout:g} s", late=tuple(late))
        raise CollectiveTimeout(
            f"{name} #{at}: not completed after {timeout:g} s on rank {self._rank}; "
            f"{arrivals}; the NCCL communicator was aborted ({self._aborted}), this "
            f"communicator cannot run device collectives any more",
            collective=name, seq=at, missing=late)

    def abort(self, reason: str, lost: Optional[Tuple[int, ...]] = None,
              late: Optional[Tuple[int, ...]] = None) -> bool:
        """Abort the NCCL communicator: its pending operations end, it cannot be used again
        (``lost``: because these world ranks died; later calls raise PeerLost naming them;
        ``late``: a timeout, these ranks had not issued the call; the Works it cuts short
        raise CollectiveTimeout naming them).
        Returns whether this call aborted it (False if it already was). Never waits on what
        it cannot bound: one whose calls CUDA graphs captured (ncclCommAbort would wait until
        the user drops them: NCCL ``init.cc``, commDestroySync), or whose launch has been
        inside NCCL on another thread for ``_LAUNCH_GRACE`` s (blocked: NCCL connects a peer
        inside the first call that needs it), is revoked instead, where nccl4py can, and
        kept (:meth:`_keep`)."""
        lost = None if lost is None else tuple(sorted(lost))
        if not self._lifetime.acquire(timeout=_LAUNCH_GRACE):
            if self._aborted:
                return False
            self._aborted, self._lost, self._late = reason, lost, late   # (read at entry)
            self._keep("a launch is blocked inside NCCL on another thread")
            return True
        try:
            if self._aborted:
                return False
            self._late = late
            self._end(reason, lost)
        finally:
            self._lifetime.release()
        return True

    def _end(self, reason: str, lost: Optional[Tuple[int, ...]] = None) -> None:
        """Abort the NCCL communicator for ``reason`` (under ``_lifetime``), or keep it where
        ncclCommAbort would wait on CUDA graphs (:meth:`_keep`); each async Work not completed
        is cut short (:class:`_CutShort`, raising :meth:`_was_aborted`'s error), since the
        abort completes its event with an undefined output (NCCL's user guide, "Error handling
        and communicator abort"; an H200 wrote zeros). The flight recorder says so."""
        cut = self._unfinished()
        self._aborted, self._lost = reason, lost
        if self._captures:
            self._keep("CUDA graphs captured its calls (drop them)")
        else:
            self._comm.abort()
        if cut:
            seq = self._tracker.seq   # (a batch() block's Works have no number of their own)
            self._tracker.flight.aborted(work._number for work in cut if work._number)
            for work in cut:
                work._owner = work._event = _CutShort(self, work._label, work._number or seq)

    def _unfinished(self) -> list:
        """The async Works launched outside captures whose collectives have not completed
        (no CUDA call where there is none: the abort may come from any thread)."""
        if not self._inflight:
            return []
        with _relaxed_capture_mode(self._runtime):
            return [work for work in self._inflight if not work._done
                    and work._event is not None and not work._event.done]

    def _keep(self, why: str) -> None:
        """End the NCCL communicator without ncclCommAbort, which would wait (``why``): its
        kernels are stopped by ncclCommRevoke where nccl4py has it, else they run on until
        they complete or the process ends; it is kept, never freed."""
        revoke = _revoker(self._nccl_module)
        if revoke is not None:
            try:
                revoke(self._comm.comm, 0)
                why = ""
            except Exception as error:   # nccl4py's own errors: say so, and keep it
                why += f"; ncclCommRevoke failed: {error}"
        if why:
            self._aborted += f"; kept, not aborted: {why}"
        _KEPT_FOR_GRAPHS.append(self._comm)

    # -- what the watchdog thread asks (no MPI, no blocking) --------------------------------------
    def has_pending_work(self) -> bool:
        """Whether collectives launched on the comm stream outside captures have not
        finished yet."""
        if self._aborted:
            return False
        try:
            last = self._inflight[-1]._event if self._inflight else None
        except IndexError:   # emptied by the main thread meanwhile
            last = None
        runtime = self._runtime
        # The watchdog thread's device is set once and never set back: a new thread's
        # device is 0, and setting it back (as CuPy's Device.__exit__ does) would make a
        # context on GPU 0 for every rank.
        if runtime.getDevice() != self.device_id:
            runtime.setDevice(self.device_id)
        with _relaxed_capture_mode(runtime):
            return not self._finished.done or (last is not None and not last.done)

    def async_error(self) -> str:
        """NCCL's asynchronous error, if it reported one, else ''. Not asked while a launch,
        an abort or close uses the communicator (asked again at the next look)."""
        if not self._lifetime.acquire(blocking=False):
            return ""
        try:
            if self._aborted:   # aborted, or closing: the communicator is (being) freed
                return ""
            self._comm.check_async_error()
        except self._raw_error as error:
            return str(error)
        finally:
            self._lifetime.release()
        return ""

    def _synchronize(self) -> None:
        """Block until every collective launched outside captures has completed: those on the
        comm stream, and the last synchronous one (which NCCL's order makes the last of
        theirs)."""
        self._stream.synchronize()
        self._finished.synchronize()

    def drop(self) -> None:
        """Its communicator was collected unclosed, in whichever thread the garbage collector
        ran: CuPy's destructor would destroy the NCCL communicator there, at any moment,
        waiting for its kernels and its graphs (NCCL ``init.cc``, commDestroySync). It is
        kept, and this backend closed at exit on the main thread (:func:`_close_dropped`),
        where close() keeps it instead if CUDA graphs captured its calls."""
        _DROPPED.append(self)

    def close(self) -> None:
        """Wait for the collectives in flight, then destroy the NCCL communicator (unless the
        watchdog aborted it meanwhile). One whose collectives were captured in CUDA graphs
        is kept instead, until the process ends: a graph replayed after close() would
        otherwise run kernels on its freed memory, and cupycomm cannot know when the last
        graph is gone."""
        if self._aborted:
            return
        self._synchronize()
        with self._lifetime:
            if self._aborted:
                return
            self._aborted = "closed"   # the closing mark: the watchdog leaves it alone
            self._inflight.clear()
            self._spare_events.clear()
            self._held.clear()
            if self._captures:
                _KEPT_FOR_GRAPHS.append(self._comm)
            else:
                self._comm.destroy()


def _close_dropped() -> None:
    """Close the backends of the communicators collected unclosed (see
    :meth:`NcclBackend.drop`): at exit, on the main thread, after the live ones. Any point
    reached alike on every rank, between collectives, would be as safe."""
    while _DROPPED:
        _DROPPED.pop().close()


at_safe_point(_close_dropped)
