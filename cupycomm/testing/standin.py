"""STAND-IN for CUDA and NCCL: the subset of CuPy that the NCCL backend uses, on host memory.

A test double, not a GPU path: it lets the real device backend (``cupycomm/backends/nccl.py``)
run in CI on machines without a GPU. ``ndarray`` is a NumPy array that claims to live on a
device, and each NCCL call checks its byte ranges against the live allocations;
``cuda.Stream`` runs work in order, a deferred one (every one under
``CUPYCOMM_STANDIN_DEFER_ALL=1``) only once something waits for it;
``cuda.nccl.NcclCommunicator`` has CuPy's signatures and does the work with MPI.

It enforces numbered rules where cupycomm depends on CUDA and NCCL, each with its source and
each broken on purpose by ``tests/testing/test_standin_rules.py``; tests cite them by number
("stand-in rule 22"). The rules, and how the stand-in works: docs/internals.md, "The
stand-in's rules". ``NO_WORK = True`` turns the data movement off (every call still
validates and enqueues), so a benchmark can time the backend's own Python cost.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib.abc
import importlib.util
import itertools
import operator
import os
import socket
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..survivors.lost import FAILURES
from ..survivors.policy import unsupported

DEVICE_COUNT = 1
NO_WORK = False
# Every stream holds its work back until something waits for it (CUDA orders two streams only
# by events): CUPYCOMM_STANDIN_DEFER_ALL=1 runs a suite that way.
DEFER_ALL = os.environ.get("CUPYCOMM_STANDIN_DEFER_ALL") == "1"

# -- memory ---------------------------------------------------------------------------------------
_allocations: dict = {}   # base address -> size in bytes, of every live stand-in allocation


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class Device:
    """cupy.cuda.Device: a device id and a context that makes it current."""

    _local = threading.local()

    def __init__(self, device: Optional[int] = None) -> None:
        self.id = Device.current_id() if device is None else int(device)
        if not 0 <= self.id < DEVICE_COUNT:
            raise RuntimeError(f"stand-in: invalid device ordinal {self.id}")

    @staticmethod
    def current_id() -> int:
        return getattr(Device._local, "id", 0)

    def use(self) -> None:
        setDevice(self.id)

    def __enter__(self) -> "Device":
        # CuPy keeps the devices to restore on the object (one stack per Device object)
        previous = getDevice()
        self.__dict__.setdefault("_previous", []).append(previous)
        if previous != self.id:
            self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        setDevice(self._previous.pop())   # CuPy: always, even to a device never set

    def synchronize(self) -> None:
        """cudaDeviceSynchronize: every stream's work (a potentially unsafe call)."""
        _runtime_call("cudaDeviceSynchronize", unsafe=True)
        for stream in list(Stream._registry.values()) + list(_NullStream._queues.values()):
            stream.run_until(stream.enqueued)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<stand-in Device {self.id}>"


class ndarray(np.ndarray):
    """A NumPy array that stands for a device array of ``device`` (cupy.ndarray)."""

    _device_id = 0

    def __array_finalize__(self, parent: Any) -> None:
        self._device_id = getattr(parent, "_device_id", Device.current_id())
        if self.base is None:   # new memory (a copy, an arithmetic result): a new allocation
            _track(self)

    @property
    def device(self) -> Device:  # type: ignore[override]
        return Device(self._device_id)

    @property
    def data(self) -> _Pointer:  # type: ignore[override]
        return _Pointer(self.__array_interface__["data"][0])

    def get(self) -> np.ndarray:
        """cupy.ndarray.get: a host copy, after the current stream's work (see asnumpy)."""
        return asnumpy(self)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """NumPy's ufuncs on device arrays (arithmetic, comparisons, reductions): computed at
        once, after the current stream's queued work (rule 6)."""
        _caught_up()
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_plain(o) for o in out)
        result = getattr(ufunc, method)(*[_plain(x) for x in inputs], **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if isinstance(result, tuple):
            return tuple(_device_result(r) for r in result)
        return _device_result(result)

    def copy(self, order: str = "C") -> "ndarray":  # type: ignore[override]
        """cupy.ndarray.copy: a new array, written by a copy kernel on the current stream."""
        out = empty(self.shape, self.dtype)
        source = self.view(np.ndarray)
        _kernel(lambda: np.copyto(out.view(np.ndarray), source), "copy")
        return out

    def __setitem__(self, key: Any, value: Any) -> None:
        """A copy kernel on the current stream (rule 6)."""
        host = value if isinstance(value, ndarray) else np.array(value)   # copied at the call
        _kernel(lambda: np.ndarray.__setitem__(self, key, host), "copy")


def getDevice() -> int:
    """cudaGetDevice: this thread's current device (0 when new); makes no context."""
    return Device.current_id()


def setDevice(device: int) -> None:
    """cudaSetDevice: makes ``device`` current in this thread and, since CUDA 12, creates its
    primary context in this process (rule 14)."""
    Device(device)
    Device._local.id = device
    _runtime_call("cudaSetDevice")


def context_devices() -> set:
    """The devices on which this process has a CUDA context (see :data:`contexts`)."""
    return {device for _, device in contexts}


def _track(array: np.ndarray) -> None:
    _runtime_call("cudaMalloc", unsafe=True)
    address = array.__array_interface__["data"][0]
    if array.nbytes:
        _allocations[address] = array.nbytes
        weakref.finalize(array, _allocations.pop, address, None)


def _register(array: np.ndarray) -> ndarray:
    """A new device array holding ``array``'s values, in memory from the pool of the current
    stream (see _Pool)."""
    if array.nbytes:
        block, address, stream_ref = _Pool.take(array.nbytes)
        memory = np.frombuffer(block, array.dtype, array.size).reshape(array.shape)
        memory[...] = array
        weakref.finalize(memory, _Pool.release, stream_ref, block, address)
        array = memory
    else:
        _track(array)
    device_array = array.view(ndarray)
    device_array._device_id = Device.current_id()
    return device_array


class _Pool:
    """CuPy's memory pool, as strict as CUDA allows it to be: memory freed by an array goes back
    to the pool of the stream that was current when it was allocated; in that stream's order
    it is poisoned (every byte 0xFF: NaN, -1) and may then be handed to the next allocation on
    that stream at once. Work still queued on another stream that reads or writes freed memory
    (an array not kept alive long enough) sees poison or corrupts the new owner's data, as on
    a GPU. The pool keeps every block it made (no use-after-free in the test process)."""

    free: dict = {}            # (stream id, size) -> blocks whose poison has run
    freed: collections.deque = collections.deque()   # (stream ref, block, address): to poison
    draining = False

    @staticmethod
    def take(nbytes: int) -> tuple:
        """(a block of ``nbytes``, its address, a reference to the stream it belongs to)."""
        _runtime_call("cudaMalloc", unsafe=True)
        _Pool.drain()
        stream = _resolved(get_current_stream())
        reusable = _Pool.free.get((id(stream), nbytes))
        block = reusable.pop() if reusable else bytearray(nbytes)
        address = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(block))
        _allocations[address] = nbytes
        return block, address, weakref.ref(stream)

    @staticmethod
    def drain() -> None:
        """Queue the poisoning of what was freed since the last look, each on its stream."""
        if _Pool.draining:
            return
        _Pool.draining = True
        try:
            while _Pool.freed:
                stream_ref, block, address = _Pool.freed.popleft()
                stream = stream_ref()

                def poison(block=block, key=(id(stream), len(block))):
                    block[:] = b"\xff" * len(block)
                    _Pool.free.setdefault(key, []).append(block)
                if stream is None or stream.capture is not None:
                    block[:] = b"\xff" * len(block)   # its stream is gone: never reused
                else:
                    stream.enqueue(poison, f"poison {len(block)} freed bytes")
        finally:
            _Pool.draining = False

    @staticmethod
    def release(stream_ref: Any, block: bytearray, address: int) -> None:
        """An array's memory was freed (a finalizer: at any moment, in any thread)."""
        _allocations.pop(address, None)
        _Pool.freed.append((stream_ref, block, address))


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return _register(np.empty(shape, dtype))


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    return _register(np.zeros(shape, dtype))


def asarray(a: Any, dtype: Any = None) -> ndarray:
    """cupy.asarray: a view of an object's device memory if it has __cuda_array_interface__
    (no copy, as CuPy), else a new stand-in device array holding a copy of host data."""
    interface = getattr(a, "__cuda_array_interface__", None)
    if interface is None:
        return _register(np.array(a, dtype=dtype, copy=True, order="C"))
    dtype = np.dtype(interface["typestr"])
    shape = tuple(interface["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    ptr = interface["data"][0]
    _check_range(ptr, nbytes, "__cuda_array_interface__ data")
    memory = (ctypes.c_char * max(nbytes, 1)).from_address(ptr) if ptr else bytearray(1)
    view = np.frombuffer(memory, dtype, count=nbytes // dtype.itemsize).reshape(shape)
    device_array = view.view(ndarray)
    device_array._device_id = Device.current_id()
    return device_array


def concatenate(arrays: Any, axis: Optional[int] = 0, out: Optional[ndarray] = None) -> ndarray:
    """cupy.concatenate: a new device array, or ``out``: one kernel on the current stream
    (rule 6)."""
    parts = [a.view(np.ndarray) if isinstance(a, ndarray) else np.array(a) for a in arrays]
    if out is None:
        shape = np.concatenate(parts, axis)   # (its shape and dtype: the kernel writes it)
        out = empty(shape.shape, shape.dtype)
    target = out.view(np.ndarray)
    _kernel(lambda: np.concatenate(parts, axis, out=target), "concatenate")
    return out


def _plain(a: Any) -> Any:
    return a.view(np.ndarray) if isinstance(a, ndarray) else a


def _device_result(result: Any) -> Any:
    """A ufunc's new array as a device array of the current device (scalars stay scalars)."""
    if not isinstance(result, np.ndarray):
        return result
    _track(result)
    device_array = result.view(ndarray)
    device_array._device_id = Device.current_id()
    return device_array


def _caught_up() -> None:
    """Before a stand-in kernel that computes at once: the current stream gets past its
    queued work (a legal order of that stream; the host waits where a GPU would queue)."""
    if getattr(_working, "depth", 0):
        return
    stream = _resolved(get_current_stream())
    if stream.capture is None and (stream.executed < stream.enqueued or stream.outstanding):
        with _asynchronous():
            stream.run_until(stream.enqueued)


def _kernel(run: Callable[[], Any], name: str) -> None:
    """A stand-in kernel (a NumPy operation on device arrays) on the current stream: queued
    behind work the stream has not run yet, else run at once (rule 6); captured on a
    capturing stream (a graph node, run at each replay); at once inside a stream's work (it
    is that work)."""
    stream = _resolved(get_current_stream())
    if not getattr(_working, "depth", 0) and (
            stream.capture is not None or stream.executed < stream.enqueued
            or stream.outstanding):
        def queued() -> None:
            run()
        stream.enqueue(queued, name)
    else:
        run()


def asnumpy(a: Any) -> np.ndarray:
    """A host copy, as CuPy's ``ndarray.get`` makes it: on the current stream (handle 0
    meaning the null stream of the array's device, which CuPy makes current for the copy),
    after that stream's work (and, on the legacy null stream, after the blocking streams'
    of that device: rule 16) [CuPy v14.2.0 ``cupy/_core/core.pyx``, ``get``:
    ``copy_to_host_async`` on the current stream, then ``stream.synchronize()``]."""
    stream = get_current_stream()
    previous = Device.current_id()
    if isinstance(a, ndarray) and a._device_id != previous:
        setDevice(a._device_id)
    try:
        queue = _resolved(stream)
        _runtime_call("cudaMemcpy", unsafe=True, capturing=queue.capture)
        queue.run_until(queue.enqueued)
        queue._legacy_ordered(lambda: None)()
    finally:
        if Device.current_id() != previous:
            setDevice(previous)
    return np.array(np.asarray(a).view(np.ndarray) if isinstance(a, np.ndarray) else a)


def _check_range(ptr: int, nbytes: int, what: str) -> None:
    if nbytes == 0:
        return
    for base, size in _allocations.items():
        if base <= ptr and ptr + nbytes <= base + size:
            return
    raise NcclError(f"stand-in: {what} touches {nbytes} bytes at {ptr:#x}, outside every "
                    f"live device allocation (an out-of-bounds count or offset)")


def _view(ptr: int, count: int, datatype: int, what: str) -> np.ndarray:
    dtype = _NCCL_DTYPES[datatype]
    # a C size_t, as Cython hands it over: NumPy before 2 makes np.uint64 * int a float64
    nbytes = operator.index(count) * dtype.itemsize
    _check_range(ptr, nbytes, what)
    if nbytes == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype)


# -- streams and events ---------------------------------------------------------------------------
class CUDARuntimeError(RuntimeError):
    """cupy_backends' CUDARuntimeError: a CUDA runtime call failed."""


class _Stalled(Exception):
    """Work met a kernel that waits for a dead member while the host may not block (rule 22):
    it stays queued."""


_stalls = threading.local()   # depth: inside how many asynchronous calls this thread is
_working = threading.local()  # depth: inside how many pieces of streams' work this thread is


@contextlib.contextmanager
def _asynchronous():
    """An asynchronous call (a launch, an event wait, a query): work that would wait for a
    kernel that waits for a dead member stays queued (rule 22), the call returns."""
    depth = getattr(_stalls, "depth", 0)
    _stalls.depth = depth + 1
    try:
        yield
    except _Stalled:
        pass
    finally:
        _stalls.depth = depth


class Stream:
    """cupy.cuda.Stream: an in-order queue of work; ``deferred=True`` holds work back.

    A stream that is not deferred runs each piece of work when it is enqueued, except that
    point-to-point transfers only start then (MPI requests) and complete when the stream
    must get past them: before its next piece of work, or when someone waits for it. Work
    behind a kernel that waits for a dead member (rule 22) stays queued at its enqueue (a
    launch never blocks the host) and runs when a synchronization gets past that kernel.
    """

    _registry: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()
    _ptrs = itertools.count(0x1000, 0x10)
    _local = threading.local()
    null: "Stream"
    ptds: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, *,
                 deferred: bool = False, handle: int = 0) -> None:
        self.ptr = handle if null else next(Stream._ptrs)   # (handles 0 and 2: see below)
        self.device_id = -1 if null else Device.current_id()   # CuPy: -1 for the null stream
        self.home = Device.current_id()
        self.blocking = not non_blocking   # ordered with the legacy null stream (rule 16)
        self.deferred = deferred or DEFER_ALL
        self.busy = DEFER_ALL and not deferred   # held back, but progresses when queried
        self.pending: List[Callable[[], Optional[list]]] = []
        self.outstanding: List[_Transfers] = []   # of the last piece of work run
        self.enqueued = 0   # pieces of work ever enqueued
        self.executed = 0   # pieces of work ever started
        self.log: List[str] = []
        self.capture: Optional[_Capture] = None
        # cupycomm's watchdog thread asks whether events are done while the main thread runs
        # work: MPI forbids two threads touching one request at once.
        self.lock = threading.RLock()
        if not null:   # handle 0 means the current device's own null stream: see _NullStream
            Stream._registry[self.ptr] = self

    # work
    def enqueue(self, op: Callable[[], Optional[list]], name: str) -> None:
        """``op`` runs when the stream gets there; it may return MPI requests it started.
        While the stream is being captured, ``op`` goes into the graph instead."""
        _Pool.drain()
        if self.capture is not None:
            self.capture.add(self, op, name)
            self.log.append(f"captured {name}")
            return
        self.log.append(name)
        op = self._legacy_ordered(op)
        self.enqueued += 1
        self.pending.append(op)
        if not self.deferred:
            with _asynchronous():
                self.run_until(self.enqueued, complete=False)

    def _legacy_ordered(self, op: Callable[[], Optional[list]]) -> Callable:
        """``op`` after the earlier work of the streams the legacy null stream orders it with
        (rule 16): the null stream's after every blocking stream of its device, a blocking
        stream's after the null stream."""
        if not self.blocking:
            return op
        others: List[Optional[Stream]]
        if self.ptr == 0:
            others = [s for s in list(Stream._registry.values()) + list(_PerThreadStream.all)
                      if s.blocking and s.home == self.home and s is not self]
        else:
            others = [_NullStream._queues.get(self.home)]
        before = [(s, s.enqueued) for s in others
                  if s is not None and (s.executed < s.enqueued or s.outstanding)]
        if not before:
            return op

        def ordered() -> Optional[list]:
            for stream, position in before:
                stream.run_until(position)
            return op()
        return ordered

    def run_until(self, position: int, complete: bool = True) -> None:
        """Run the work up to ``position`` (and complete it, with ``complete``). Inside an
        asynchronous call (:func:`_asynchronous`), work that would wait for a kernel that
        waits for a dead member stays queued instead (rule 22)."""
        with self.lock:
            while self.executed < position:
                self._complete()
                if not self.pending:   # work a test dropped (``pending.clear()``): never runs
                    self.executed = self.enqueued
                    break
                op = self.pending.pop(0)
                self.executed += 1
                _working.depth = getattr(_working, "depth", 0) + 1
                try:
                    self.outstanding = op() or []
                except _Stalled:   # it runs again when the kernel it waits for has ended
                    self.pending.insert(0, op)
                    self.executed -= 1
                    raise
                finally:
                    _working.depth -= 1
            if complete:
                self._complete()

    def _complete(self) -> None:
        while self.outstanding:
            self.outstanding[0].wait()
            self.outstanding.pop(0)

    def synchronize(self) -> None:
        """cudaStreamSynchronize: invalid on a capturing stream, unsafe during captures."""
        _runtime_call("cudaStreamSynchronize", unsafe=True, capturing=self.capture)
        self.run_until(self.enqueued)

    @property
    def done(self) -> bool:
        """cudaStreamQuery == cudaSuccess (False, with no exception, when CUDA refuses)."""
        try:
            _runtime_call("cudaStreamQuery", unsafe=True, capturing=self.capture)
        except CUDARuntimeError:
            return False
        return self.reached(self.enqueued)

    def reached(self, position: int) -> bool:
        """Whether the work up to ``position`` has completed; never blocks (work that another
        thread is running right now has not)."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.executed > position:
                return True
            if self.executed == position:
                return all(transfers.test() for transfers in self.outstanding)
            if self.busy and threading.current_thread() is threading.main_thread():
                with _asynchronous():   # a busy GPU gets on
                    self.run_until(self.executed + 1, complete=False)
            return False
        finally:
            self.lock.release()

    def wait_event(self, event: "Event") -> None:
        """cudaStreamWaitEvent (the event may be of another device)."""
        _runtime_call("cudaStreamWaitEvent")
        if event._capture is not None:   # recorded during a capture: fork into it or join it
            if not event._capture.ended:
                event._capture.wait(self, event)
            return
        if self.capture is not None and event._stream is not None:
            self.capture.invalidate(f"{self!r} waited on {event.name}, recorded outside")
            raise CUDARuntimeError(
                f"stand-in: cudaErrorStreamCaptureIsolation: a capturing stream waited on "
                f"{event.name}, recorded outside the capture (CUDA only allows that with "
                f"cudaEventWaitExternal)")
        source, position = event._stream, event._position
        self.enqueue(lambda: source.run_until(position) if source else None,
                     f"wait {event.name}")

    # CUDA graphs: a captured stream's work becomes a graph, replayed by Graph.launch
    def begin_capture(self, mode: Optional[int] = None) -> None:
        """CuPy's default mode is relaxed; torch's graphs capture in global mode."""
        if self.ptr == 0:
            raise CUDARuntimeError("stand-in: the legacy default stream cannot be captured")
        if self.capture is not None:
            raise CUDARuntimeError("stand-in: the stream is already capturing")
        self.capture = _Capture(self, streamCaptureModeRelaxed if mode is None else mode)

    def is_capturing(self) -> bool:
        """cudaStreamIsCapturing; CuPy raises RuntimeError for an invalidated capture."""
        _runtime_call("cudaStreamIsCapturing")
        if self.capture is not None and self.capture.invalidated:
            raise RuntimeError("the stream was capturing, but an error has invalidated the "
                               f"capture sequence ({self.capture.invalidated})")
        return self.capture is not None

    def end_capture(self) -> "Graph":
        capture = self.capture
        if capture is None or capture.origin is not self:
            raise CUDARuntimeError("stand-in: end_capture on a stream that did not begin a "
                                   "capture")
        capture.end()
        return Graph(capture.ops)

    def record(self, event: Optional["Event"] = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    # current stream
    def __enter__(self) -> "Stream":
        _check_stream_device(self)
        stack = Stream._stack()
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        Stream._stack().pop()

    def use(self) -> "Stream":
        _check_stream_device(self)
        Stream._stack()[:] = [self]
        return self

    @staticmethod
    def _stack() -> list:
        """The current device's stack of current streams (CuPy keeps one per device)."""
        return Stream._local.__dict__.setdefault("stacks", {}).setdefault(Device.current_id(), [])

    @staticmethod
    def from_ptr(ptr: int) -> "Stream":
        if ptr in (0, 2):
            return (Stream.null if ptr == 0 else Stream.ptds).queue()
        return Stream._registry[ptr]

    def __repr__(self) -> str:
        return f"<stand-in Stream {self.ptr:#x}{' deferred' if self.deferred else ''}>"


class _NullStream:
    """Stream.null, CuPy's singleton for handle 0: CUDA's legacy default stream, which is the
    *current device's* own (each device has one). Every use resolves to the null stream of
    the device current at that moment."""

    ptr = 0
    device_id = -1
    _queues: dict = {}   # device -> its null stream
    _creating = threading.Lock()

    def queue(self) -> Stream:
        device = Device.current_id()
        if device not in self._queues:
            with self._creating:
                self._queues.setdefault(device, Stream(null=True))
        return self._queues[device]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.queue(), name, value)

    __enter__, __exit__, use = Stream.__enter__, Stream.__exit__, Stream.use

    def __eq__(self, other: Any) -> bool:
        return getattr(other, "ptr", None) == self.ptr

    def __hash__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<stand-in Stream.{'null' if self.ptr == 0 else 'ptds'}>"


def _resolved(stream: Any) -> Stream:
    """The stream a handle means now: handle 0 is the current device's null stream, handle 2
    the calling thread's per-thread default stream."""
    return stream.queue() if isinstance(stream, _NullStream) else stream


class _PerThreadStream(_NullStream):
    """Stream.ptds, handle 2: CUDA's per-thread default stream, the *calling thread's* own on
    the current device; a blocking stream (rule 17)."""

    ptr = 2
    _threads = threading.local()
    all: "weakref.WeakSet[Stream]" = weakref.WeakSet()

    def queue(self) -> Stream:
        queues = self._threads.__dict__.setdefault("queues", {})
        device = Device.current_id()
        if device not in queues:
            queues[device] = Stream(null=True, handle=2)
            self.all.add(queues[device])
        return queues[device]


Stream.null = _NullStream()  # type: ignore[assignment]
Stream.ptds = _PerThreadStream()  # type: ignore[assignment]


def get_current_stream(device_id: int = -1) -> Stream:
    """CuPy's: the current stream of ``device_id`` (default: the current device) in this
    thread."""
    if device_id == -1:
        device_id = Device.current_id()
    Device(device_id)
    stack = Stream._local.__dict__.setdefault("stacks", {}).get(device_id)
    return stack[-1] if stack else Stream.null


class Event:
    """cupy.cuda.Event: marks a position in a stream's work."""

    _names = itertools.count()

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self._stream: Optional[Stream] = None
        self._position = 0
        self._capture: Optional[_Capture] = None
        self._captured_on: Optional[Stream] = None
        self.name = f"event{next(Event._names)}"
        self.device_id = Device.current_id()

    def record(self, stream: Optional[Stream] = None) -> None:
        stream = _resolved(stream or get_current_stream())
        _runtime_call("cudaEventRecord")
        _check_event_device(self, stream)
        stream.log.append(f"record {self.name}")
        if stream.capture is not None:   # a node of the graph, not a point in real work
            self._capture, self._captured_on = stream.capture, stream
            return
        self._capture = None
        self._stream, self._position = stream, stream.enqueued

    @property
    def done(self) -> bool:
        """CuPy's ``eventQuery(ptr) == 0``: False, with no exception, when CUDA refuses (an
        event last recorded in a capture answers cudaErrorCapturedEvent, for ever)."""
        try:
            self._check_query("cudaEventQuery")
        except CUDARuntimeError:
            return False
        return self._stream is None or self._stream.reached(self._position)

    def synchronize(self) -> None:
        """cudaEventSynchronize: raises where CUDA refuses."""
        self._check_query("cudaEventSynchronize")
        if self._stream is not None:
            self._stream.run_until(self._position)

    def _check_query(self, call: str) -> None:
        _runtime_call(call, unsafe=True)
        if self._capture is not None:
            if not self._capture.ended:
                self._capture.invalidate(f"{call} of {self.name}, recorded in the capture")
            raise CUDARuntimeError(f"stand-in: cudaErrorCapturedEvent: {call} of {self.name}, "
                                   f"last recorded in a capturing stream")


class _Capture:
    """One capture in progress: the work of every stream in it, in order, the streams forked
    into it that have not been joined back into the origin yet, its mode and thread, and why
    it was invalidated ('' while it is valid)."""

    live: List["_Capture"] = []   # captures in progress, in any thread

    def __init__(self, origin: Stream, mode: int) -> None:
        if mode not in (streamCaptureModeGlobal, streamCaptureModeThreadLocal,
                        streamCaptureModeRelaxed):
            raise CUDARuntimeError(f"stand-in: invalid capture mode {mode!r}")
        self.origin = origin
        self.mode = mode
        self.thread = threading.get_ident()
        self.ops: List[tuple] = []
        self.forked: List[Stream] = []
        self.ended = False
        self.invalidated = ""
        _Capture.live.append(self)

    def invalidate(self, why: str) -> None:
        self.invalidated = self.invalidated or why

    def add(self, stream: Stream, op: Callable, name: str) -> None:
        self.ops.append((op, name))

    def wait(self, waiter: Stream, event: "Event") -> None:
        if waiter.capture is None:          # fork: the waiter joins the capture
            waiter.capture = self
            self.forked.append(waiter)
        elif waiter is self.origin and event._captured_on in self.forked:   # join
            event._captured_on.capture = None
            self.forked.remove(event._captured_on)

    def end(self) -> None:
        _Capture.live.remove(self)
        self.ended = True
        self.origin.capture = None
        for stream in self.forked:
            stream.capture = None
        if self.invalidated:
            raise CUDARuntimeError(f"stand-in: cudaErrorStreamCaptureInvalidated: "
                                   f"{self.invalidated}")
        if self.forked:
            raise CUDARuntimeError(f"stand-in: capture ended with {len(self.forked)} forked "
                                   f"streams not joined back (cudaErrorStreamCaptureUnjoined)")


streamCaptureModeGlobal, streamCaptureModeThreadLocal, streamCaptureModeRelaxed = 0, 1, 2
_thread_modes = threading.local()   # this thread's capture interaction mode (global when new)
# (thread, device) of every runtime call: the device's primary context exists in this process
# from then on (context_devices() counts them per device); the thread says who made it
contexts: set = set()
_bound = threading.local()   # bound: whether this thread has a current context (rule 14)


def ctxGetCurrent() -> int:
    """cuCtxGetCurrent (CuPy's ``driver.ctxGetCurrent``): the calling thread's current
    context, 0 where none is bound to it: a new thread has none (cudaGetDevice binds none)
    until a runtime call binds its current device's primary context (rule 14)."""
    return 0xC0 + Device.current_id() if getattr(_bound, "bound", False) else 0


def threadExchangeStreamCaptureMode(mode: int) -> int:
    """cudaThreadExchangeStreamCaptureMode (CuPy has no wrapper; cupycomm calls the driver's
    cuThreadExchangeStreamCaptureMode, which the stand-in names like this): sets this
    thread's mode, returns the previous one."""
    previous = getattr(_thread_modes, "mode", streamCaptureModeGlobal)
    _thread_modes.mode = mode
    return previous


def _runtime_call(call: str, unsafe: bool = False, capturing: Optional[_Capture] = None) -> None:
    """A CUDA runtime call from this thread: it has a context on the current device; a
    potentially unsafe one (query, synchronize, cudaMalloc) is refused, and invalidates the
    capture that forbids it, when a capture forbids it; so is any query of a capturing stream
    (``capturing``)."""
    contexts.add((threading.get_ident(), Device.current_id()))
    _bound.bound = True
    if capturing is not None:
        capturing.invalidate(f"{call} of a capturing stream")
        raise CUDARuntimeError(f"stand-in: cudaErrorStreamCaptureUnsupported: {call} of a "
                               f"capturing stream")
    if not unsafe or not _Capture.live:
        return
    me = threading.get_ident()
    mode = getattr(_thread_modes, "mode", streamCaptureModeGlobal)
    if mode == streamCaptureModeRelaxed:
        return
    for capture in list(_Capture.live):
        own = capture.thread == me
        if ((own and capture.mode != streamCaptureModeRelaxed)
                or (not own and mode == streamCaptureModeGlobal
                    and capture.mode == streamCaptureModeGlobal)):
            whose = "this thread's" if own else "another thread's"
            capture.invalidate(f"{call} from a thread in mode {mode} during {whose} capture "
                               f"in mode {capture.mode}")
            raise CUDARuntimeError(f"stand-in: cudaErrorStreamCaptureUnsupported: {call} is "
                                   f"not allowed during {whose} capture in mode "
                                   f"{capture.mode} (this thread's mode: {mode})")


class Graph:
    """cupy.cuda.graph.Graph: the captured work, replayed in order by launch(). Each
    communicator whose calls it captured holds it (weakly) until it is collected: none of
    them can be freed before (rule 19)."""

    def __init__(self, ops: List[tuple]) -> None:
        self.ops = ops
        for op, _ in ops:
            for comm in _CapturedCall.communicators(op):
                comm._graphs.add(self)

    def launch(self, stream: Optional[Stream] = None) -> None:
        """Replay on ``stream``: the captured NCCL calls take their place in their
        communicator's order (rule 18)."""
        stream = _resolved(stream or get_current_stream())
        for op, name in self.ops:
            stream.enqueue(_CapturedCall.replayed(op, stream), f"graph {name}")


class _CapturedCall:
    """A captured NCCL call of ``comm``: a graph node. NCCL serializes the graph launches of
    one communicator with its other work (``strongstream.cc``: a captured launch is ordered
    after the communicator's serial event), so each replay takes its place in ``comm``'s
    order (rule 13) when the graph is launched."""

    def __init__(self, comm: "NcclCommunicator", op: Callable) -> None:
        self.comm, self.op = comm, op

    def __call__(self) -> Optional[list]:
        return self.op()

    @staticmethod
    def communicators(op: Callable) -> list:
        found = []
        while isinstance(op, _CapturedCall):
            found.append(op.comm)
            op = op.op
        return found

    @staticmethod
    def replayed(op: Callable, stream: Stream) -> Callable:
        """``op`` as launched on ``stream`` now: after its communicators' previous calls."""
        if not isinstance(op, _CapturedCall):
            return op
        return op.comm._in_order(stream, _CapturedCall.replayed(op.op, stream))


def launch(stream: Stream, kernel: Callable[[], None], name: str = "kernel") -> None:
    """Stand-in for a kernel launch: ``kernel`` runs when ``stream`` reaches it."""
    stream.enqueue(kernel, name)


# -- NCCL -----------------------------------------------------------------------------------------
class NcclError(RuntimeError):
    def __init__(self, message: str, status: int = 5) -> None:
        super().__init__(message)
        self.status = status


# CuPy's compiled signatures (cupy_backends/cuda/libs/nccl.pyx, cupy_backends/cuda/api/
# runtime.pyx): Cython converts each argument before anything runs: TypeError for what has no
# __index__ (a float, None), OverflowError outside the C type.
SIGNATURES = {
    "allReduce": "intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype, int op, "
                 "intptr_t stream",
    "reduce": "intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype, int op, "
              "int root, intptr_t stream",
    "broadcast": "intptr_t sendbuff, intptr_t recvbuff, size_t count, int datatype, int root, "
                 "intptr_t stream",
    "bcast": "intptr_t buff, size_t count, int datatype, int root, intptr_t stream",
    "reduceScatter": "intptr_t sendbuf, intptr_t recvbuf, size_t recvcount, int datatype, "
                     "int op, intptr_t stream",
    "allGather": "intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype, "
                 "intptr_t stream",
    "send": "intptr_t sendbuf, size_t count, int datatype, int peer, intptr_t stream",
    "recv": "intptr_t recvbuf, size_t count, int datatype, int peer, intptr_t stream",
    "commSplit": "int color, int key",
    "NcclCommunicator": "int ndev, bytes commId, int rank",
    "memcpyAsync": "intptr_t dst, intptr_t src, size_t size, int kind, intptr_t stream",
    "memcpy2DAsync": "intptr_t dst, size_t dpitch, intptr_t src, size_t spitch, "
                     "size_t width, size_t height, int kind, intptr_t stream",
    "deviceCanAccessPeer": "int device, int peerDevice",
    "_deviceEnsurePeerAccess": "int peerDevice",
}
_C_RANGES = {"intptr_t": (-2 ** 63, 2 ** 63 - 1), "size_t": (0, 2 ** 64 - 1),
             "int": (-2 ** 31, 2 ** 31 - 1)}


def _converted(function: str, *values: Any) -> None:
    """Check ``values`` as Cython converts the arguments of CuPy's ``function``."""
    parameters = [part.split() for part in SIGNATURES[function].split(", ")]
    if len(values) != len(parameters):
        raise TypeError(f"{function}() takes exactly {len(parameters)} positional arguments "
                        f"({len(values)} given)")
    for (ctype, name), value in zip(parameters, values):
        if ctype == "bytes":
            if type(value) is not bytes:
                raise TypeError(f"Argument '{name}' has incorrect type (expected bytes, got "
                                f"{type(value).__name__})")
            continue
        try:
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{function}: '{type(value).__name__}' object cannot be "
                            f"interpreted as an integer ({name}, a C {ctype})") from None
        low, high = _C_RANGES[ctype]
        if not low <= number <= high:
            raise OverflowError(f"{function}: {name}={number} does not fit a C {ctype}")


_NCCL_DTYPES = {0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32),
                3: np.dtype(np.uint32), 4: np.dtype(np.int64), 5: np.dtype(np.uint64),
                6: np.dtype(np.float16), 7: np.dtype(np.float32), 8: np.dtype(np.float64)}
_NUMPY_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}
try:
    import ml_dtypes
    _NCCL_DTYPES[9] = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    pass
_AVG = 4

# Stand-in traffic travels on its own duplicate of the world: every rank imports this module.
_WORLD = MPI.COMM_WORLD.Dup()
_ids = itertools.count()
# Under MPI's ULFM (Open MPI's mpiexec --with-ft ulfm) processes may die and the others go on:
# the members of a communicator then meet as NCCL's do, without the world's communicator.
_ULFM = not unsupported(MPI.Get_library_version())
#: MPI's error classes that say a member of a stand-in communicator is gone (rule 22): ULFM's,
#: where the MPI has it (MPICH's mpi4py gives those names the class of any unknown error).
LOSSES = FAILURES if _ULFM else frozenset()
# NCCL's group state is per thread: (stream pointer, issue, communicator) of each call of this
# thread's open group in ``calls``, how deeply groups nest in ``depth`` (rule 15)
_groups = threading.local()
_CONNECT_TAG = 0x5A17   # the messages of rule 24's connections, apart from the kernels'


def _open_group() -> Optional[list]:
    """This thread's open NCCL group's calls, or None outside a group."""
    return getattr(_groups, "calls", None)


def get_unique_id() -> bytes:
    """128 bytes naming the rank that made the id and a counter (NCCL: an address to meet at)."""
    raw = np.zeros(32, np.int32)
    raw[:3] = (0x5A17D1, _WORLD.Get_rank(), next(_ids))
    return raw.tobytes()


VERSION = 22304   # what get_version() reports: 2.23.4, which has ncclCommSplit


def get_version() -> int:
    return VERSION


def groupStart() -> None:
    """Groups nest, as in NCCL: only the outermost groupEnd launches."""
    depth = getattr(_groups, "depth", 0)
    if depth == 0:
        _groups.calls = []
    _groups.depth = depth + 1


def groupEnd() -> None:
    depth = getattr(_groups, "depth", 0)
    if depth == 0:
        raise NcclError("stand-in: groupEnd without groupStart")
    _groups.depth = depth - 1
    if depth > 1:
        return
    calls, _groups.calls = _groups.calls, None
    comms = {id(comm): comm for _, _, comm, _ in calls}.values()
    for comm in comms:
        comm._grouping = None
    _end_local_group()
    if not calls:
        return
    streams = {stream_ptr for stream_ptr, _, _, _ in calls}
    if len(streams) > 1:
        raise NcclError("stand-in: one group on several streams is not modelled")
    for comm in comms:   # rule 24: the group's launch connects the peers its calls need
        with comm._entered("ncclGroupEnd"):
            comm._connect({p for _, _, c, peers in calls if c is comm for p in peers})

    def run():
        requests: list = []
        for _, issue, _, _ in calls:
            requests.extend(issue() or [])
        return requests
    stream = Stream.from_ptr(streams.pop())
    op = lambda: None if NO_WORK else run()
    for comm in comms:
        op = comm._in_order(stream, op)
    stream.enqueue(op, f"nccl group of {len(calls)}")


def comm_revoke(comm: int, revoke_flags: int) -> None:
    """nccl4py's ``nccl.bindings.nccl.comm_revoke`` (ncclCommRevoke) on CuPy's handle
    ``comm``: the communicator's kernels in flight end now, output undefined, and it refuses
    later calls; nothing is freed, so it does not wait for graphs (rule 19)."""
    if revoke_flags != 0:
        raise NcclError(f"stand-in: ncclInvalidArgument: revoke_flags={revoke_flags} (must "
                        f"be 0)", status=4)
    for communicator in list(NcclCommunicator.handles):
        if communicator.comm == comm != 0:
            communicator._revoked = True
            return
    raise NcclError(f"stand-in: ncclInvalidArgument: no communicator {comm:#x}", status=4)


SHARED_GPUS = False   # True: the ranks of one host see the same GPUs (a real node)


def _gpu(device: int) -> tuple:
    """Which physical GPU ``device`` of this process stands for, and whether this rank allows
    sharing it: NCCL compares a host hash (of NCCL_HOSTID when set, else of the host) and the
    bus id. Unless SHARED_GPUS, each process stands for a node of its own."""
    host = os.environ.get("NCCL_HOSTID") or socket.gethostname()
    if not SHARED_GPUS:
        host = f"{host}/pid {os.getpid()}"
    return host, device, os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"


def _duplicate_gpu(gpus: list) -> str:
    seen: dict = {}
    for rank, (host, device, shared) in enumerate(gpus):
        other = seen.setdefault((host, device), rank)
        if other != rank and not (shared and gpus[other][2]):
            return (f"Duplicate GPU detected : rank {other} and rank {rank} both on CUDA "
                    f"device {device} (set distinct NCCL_HOSTIDs, or "
                    f"NCCL_MULTI_RANK_GPU_ENABLE=1)")
    return ""


def _cut_short(outputs: Sequence[np.ndarray]) -> None:
    """The outputs of a kernel that an abort ended, or that ran after it: garbage (rule 22;
    zeros, what an H200 left)."""
    for output in outputs:
        output[...] = 0


class _Transfers:
    """What a stand-in kernel of ``comm`` left running: MPI requests (its sends and receives),
    or, with ``lost``, nothing but the wait for a member that died (rule 22): that kernel
    ends only when ``comm`` is aborted, and its ``outputs`` are then garbage."""

    __slots__ = ("comm", "requests", "lost", "outputs")

    def __init__(self, comm: "NcclCommunicator", requests: list, lost: bool = False,
                 outputs: Sequence[np.ndarray] = ()) -> None:
        self.comm, self.requests, self.lost, self.outputs = comm, requests, lost, outputs

    def _ended(self) -> bool:
        """Whether the abort has ended the kernel that waits for a dead member (its outputs
        cut short)."""
        if not self.comm._ended:
            return False
        _cut_short(self.outputs)
        self.outputs = ()
        return True

    def test(self) -> bool:
        """Whether the kernel has ended (never blocks)."""
        if not self.lost:
            try:
                return MPI.Request.Testall(self.requests)
            except MPI.Exception as error:
                self.lost = self.comm._member_died(error)
        return self._ended()

    def wait(self) -> None:
        """Block until the kernel ends; inside an asynchronous call, raise _Stalled where it
        waits for a dead member."""
        if not self.lost:
            try:
                MPI.Request.Waitall(self.requests)
                return
            except MPI.Exception as error:
                self.lost = self.comm._member_died(error)
        while not self._ended():
            if getattr(_stalls, "depth", 0):
                raise _Stalled()
            time.sleep(0.005)


def _receive_any(tag: int) -> Any:
    """A message with ``tag`` from any rank of the world. NCCL's bootstrap hears only the
    members: a dead process of the job that is no member does not stop it. Under MPI's ULFM
    an any-source receive fails while a failure is not acknowledged, so it is, and the
    receive goes on."""
    while True:
        try:
            return _WORLD.recv(source=MPI.ANY_SOURCE, tag=tag)
        except MPI.Exception as error:
            if error.Get_error_class() != getattr(MPI, "ERR_PROC_FAILED", None):
                raise
            _WORLD.Ack_failed()


def join_world(mpi_comm: MPI.Intracomm) -> None:
    """Meet over a duplicate of ``mpi_comm`` from now on (collective over it). A communicator
    that ``comm.grow()`` made holds processes that MPI started later, in a world of their
    own, which the world the stand-in meets over does not reach; real NCCL needs no such
    call: its members meet over the sockets that the unique id names, which no MPI world
    limits."""
    global _WORLD
    _WORLD = mpi_comm.Dup()


class NcclCommunicator:
    """cupy.cuda.nccl.NcclCommunicator over MPI on host memory (see the module docstring)."""

    handles: "weakref.WeakSet[NcclCommunicator]" = weakref.WeakSet()   # for comm_revoke

    def __init__(self, ndev: int, commId: bytes, rank: int) -> None:
        _converted("NcclCommunicator", ndev, commId, rank)
        if len(commId) != 128:
            raise ValueError(f"commId length {len(commId)} != 128.")
        raw = np.frombuffer(commId, np.int32)
        if raw[0] != 0x5A17D1:
            raise NcclError("stand-in: not a stand-in unique id", status=4)
        if not 0 <= rank < ndev:
            raise NcclError(f"stand-in: rank {rank} not in 0..{ndev - 1}", status=4)
        self._device = Device.current_id()   # NCCL: the device current at ncclCommInitRank
        self._comm = self._meet(ndev, int(raw[1]), int(raw[2]), rank, _gpu(self._device))
        self._rank, self._size = rank, ndev
        self._alive = True
        self._last: Optional[tuple] = None   # (stream, position) of the last call not captured
        self._inside: list = []   # the NCCL calls other threads are inside now
        self._callers: list = []  # (thread, call) of each of those (rule 15)
        self._readers_lock = threading.Lock()
        self._grouping: Optional[int] = None  # the thread whose open group has a call of it
        self.async_error: Optional[str] = None   # tests set it to model an asynchronous error
        self.member_lost: Optional[str] = None   # tests set it to model a member's death
        self._waiting = False   # a kernel waits for a dead member (rule 22)
        self.unique_id = bytes(commId)   # what the members met by (tests compare them)
        self.freed_by = ""   # "ncclCommDestroy" or "ncclCommAbort", once ended (rule 21)
        self._graphs: "weakref.WeakSet[Graph]" = weakref.WeakSet()   # that captured it (rule 19)
        self._revoked = False   # comm_revoke ended its kernels (rule 19)
        self._connected: set = set()   # the peers connected by a call (rule 24)
        NcclCommunicator.handles.add(self)

    @staticmethod
    def _meet(ndev: int, host: int, counter: int, rank: int, gpu: tuple) -> MPI.Comm:
        """Meet the other members at the rank that made the id (NCCL's bootstrap); refuse,
        on every member, two ranks on one GPU (NCCL's init.cc: "Duplicate GPU detected")
        unless NCCL_MULTI_RANK_GPU_ENABLE=1."""
        tag = 100 + counter % 30000
        me = _WORLD.Get_rank()
        if me == host:
            members = {rank: (me, gpu)}
            for _ in range(ndev - 1):
                their_rank, their_world, their_gpu = _receive_any(tag)
                members[their_rank] = (their_world, their_gpu)
            order = [members[r][0] for r in range(ndev)]
            answer = (order, _duplicate_gpu([members[r][1] for r in range(ndev)]))
            for world_rank in order:
                if world_rank != me:
                    _WORLD.send(answer, dest=world_rank, tag=tag)
        else:
            _WORLD.send((rank, me, gpu), dest=host, tag=tag)
            answer = _WORLD.recv(source=host, tag=tag)
        order, duplicate = answer
        if duplicate:
            raise NcclError(f"stand-in: ncclInvalidUsage: {duplicate}", status=5)
        group = _WORLD.Get_group().Incl(order)
        if _ULFM:   # a rank that knows of a dead process fails MPI_Comm_create_group on _WORLD
            return MPI.Intracomm.Create_from_group(group, f"cupycomm.standin.{host}.{counter}",
                                                   errhandler=MPI.ERRORS_RETURN)
        return _WORLD.Create_group(group, tag)

    # -- queries and lifetime
    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def device_id(self) -> int:
        return self._device

    @property
    def comm(self) -> int:
        """CuPy's handle (``ncclComm_t`` as an integer), 0 once destroyed or aborted."""
        return id(self) if self._alive else 0

    @property
    def _ended(self) -> bool:
        """Whether its kernels end at once: freed or revoked (rule 19)."""
        return not self._alive or self._revoked

    def _check(self) -> None:
        if not self._alive:
            raise NcclError("stand-in: ncclInvalidArgument: communicator destroyed or aborted "
                            "(its memory is freed)", status=4)
        if self._revoked:
            raise NcclError("stand-in: ncclInvalidUsage: communicator revoked", status=5)

    @contextlib.contextmanager
    def _entered(self, call: str):
        """A thread inside NCCL's ``call`` on this communicator for the block (rule 11)."""
        with self._readers_lock:
            self._check()
            self._inside.append(call)
            self._callers.append((threading.get_ident(), call))
        try:
            yield
        finally:
            with self._readers_lock:
                self._inside.remove(call)
                self._callers.remove((threading.get_ident(), call))

    def check_async_error(self) -> None:
        with self._entered("ncclCommGetAsyncError"):
            if self.async_error:
                raise NcclError(f"stand-in asynchronous error: {self.async_error}", status=6)

    def _free(self, call: str) -> None:
        """ncclCommDestroy/ncclCommAbort: refused on a freed communicator, and while another
        thread is inside a call on it (ncclCommGetAsyncError takes no lock, a launch uses
        the communicator's memory: both would read freed memory)."""
        with self._readers_lock:
            if not self._alive:   # CuPy: a no-op once its handle is NULL
                return
            if self._graphs:
                raise NcclError(f"stand-in: {call} waits until every CUDA graph that captured "
                                f"a call of this communicator is destroyed ({len(self._graphs)} "
                                f"live): it would hang (NCCL init.cc, commDestroySync)",
                                status=5)
            if self._inside:
                raise NcclError(f"stand-in: {call} while another thread is inside "
                                f"{self._inside[0]} on this communicator (NCCL reads "
                                f"the memory {call} frees)", status=5)
            self._alive = False
            self.freed_by = call

    def _lost_member(self) -> str:
        """What says that a member of this communicator died, or '' (rule 21)."""
        if self.member_lost:
            return self.member_lost
        if self._waiting:
            return "a kernel waits for a dead member"
        failed = self._comm.Get_failed()   # ULFM's; always empty under an MPI without it
        try:
            return f"{failed.Get_size()} member(s) failed" if failed.Get_size() else ""
        finally:
            failed.Free()

    def destroy(self) -> None:
        if self._alive:
            lost = self._lost_member()
            if lost:
                raise NcclError(f"stand-in: ncclCommDestroy on a communicator that lost a "
                                f"member ({lost}) hangs (NCCL >= 2.31 after an abortive "
                                f"shrink, pytorch#194679): abort it (ncclCommAbort)", status=5)
            self._free("ncclCommDestroy")
            if not MPI.Is_finalized():
                self._comm.Free()

    def __del__(self) -> None:
        """CuPy's ``__dealloc__``: ``destroy()``, in whichever thread collects it (rule 23)."""
        if getattr(self, "_alive", False):   # (not one whose making failed)
            self.destroy()

    def abort(self) -> None:
        """MPI cannot cancel: the stand-in forbids further use, ends the kernels that wait for
        a dead member and, under ULFM, breaks this member's connections (rule 22)."""
        self._free("ncclCommAbort")
        if _ULFM and not self._comm.Is_revoked():
            self._comm.Revoke()

    def _member_died(self, error: MPI.Exception) -> bool:
        """``error``, of this communicator's MPI, says a member is gone: NCCL's proxy reports
        it asynchronously and the kernel waits (rule 22); any other error is raised."""
        if error.Get_error_class() not in LOSSES:
            raise error
        self._waiting = True
        self.async_error = self.async_error or (
            f"ncclRemoteError: a remote process exited or the network failed "
            f"({error.Get_error_string()})")
        return True

    def _kernel(self, work: Callable[[], Optional[list]],
                outputs: Sequence[np.ndarray]) -> Callable[[], Optional[list]]:
        """The kernel of a call doing ``work`` (which may return the MPI requests it started)
        and writing ``outputs``: on an aborted communicator it only leaves garbage there,
        and it waits where a member died (rule 22), as do the later kernels of the
        communicator."""
        def kernel() -> Optional[list]:
            if NO_WORK:
                return None
            if self._ended:
                _cut_short(outputs)
                return None
            if self._waiting:
                return [_Transfers(self, [], True, outputs)]
            try:
                requests = work()
            except MPI.Exception as error:
                return [_Transfers(self, [], self._member_died(error), outputs)]
            return [_Transfers(self, requests, outputs=outputs)] if requests else None
        return kernel

    def commSplit(self, color: int, key: int, config: Any = None) -> Optional["NcclCommunicator"]:
        _converted("commSplit", color, key)
        self._check()
        sub = self._comm.Split(MPI.UNDEFINED if color == -1 else color, key)
        if sub == MPI.COMM_NULL:
            return None
        split = object.__new__(NcclCommunicator)
        split._comm, split._rank, split._size = sub, sub.Get_rank(), sub.Get_size()
        split._device, split._alive, split.async_error = self._device, True, None
        split.member_lost, split.freed_by, split.unique_id = None, "", b""
        split._waiting = False
        split._last = split._grouping = None
        split._inside, split._callers, split._readers_lock = [], [], threading.Lock()
        split._graphs, split._revoked, split._connected = weakref.WeakSet(), False, set()
        NcclCommunicator.handles.add(split)
        return split

    # -- the work: every call validates now and runs when its stream gets there
    def _submit(self, stream_ptr: int, name: str, run: Callable[[], Optional[list]],
                nonblocking: Optional[Callable[[], list]] = None, peer: int = -1,
                outputs: Sequence[np.ndarray] = ()) -> None:
        """Validate now, run when the stream gets there; ``peer``: the one rank a send or
        receive needs (-1: a collective, every member); ``outputs``: what it writes."""
        peers = range(self._size) if peer == -1 else (peer,)
        with self._entered(f"nccl{name[0].upper()}{name[1:]}"):
            if self.async_error:   # ncclCommEnsureReady: every launch returns it (rule 22)
                raise NcclError(f"stand-in: nccl{name[0].upper()}{name[1:]}: the "
                                f"communicator's asynchronous error: {self.async_error}",
                                status=6)
            self._check_thread(name)
            group = _open_group()
            if group is not None:
                # In a group, sends and receives start as MPI requests and collectives run in
                # the order they were issued (NCCL requires every rank to issue them alike).
                group.append((stream_ptr, self._kernel(nonblocking or run, outputs), self,
                              peers))
                self._grouping = threading.get_ident()
                return
            self._connect(peers)
            self._enqueue(stream_ptr, name, run, outputs)

    def _connect(self, peers: Any) -> None:
        """NCCL's runtime connect (rule 24): block until each of ``peers`` not connected yet
        has made its own first call that needs this rank; a revoke ends the wait."""
        new = [p for p in peers if p != self._rank and p not in self._connected]
        if not new:
            return
        requests = [self._comm.Isend([b"", MPI.BYTE], p, _CONNECT_TAG) for p in new]
        requests += [self._comm.Irecv([bytearray(0), MPI.BYTE], p, _CONNECT_TAG) for p in new]
        try:
            while not MPI.Request.Testall(requests):
                if self._revoked:
                    raise NcclError("stand-in: ncclInvalidUsage: the communicator was revoked "
                                    "while connecting its peers", status=5)
                time.sleep(0.001)
        except MPI.Exception as error:   # a member died: its kernels will wait (rule 22)
            self._member_died(error)
        self._connected.update(new)

    def _check_thread(self, name: str) -> None:
        """Rule 15: a call while another thread is inside a call on this communicator, or
        while another thread's open group holds a call of it, is refused (NCCL: one
        communicator is not used from two threads at once; its group state is per thread).
        Its kernels in flight do not matter: they are the device's, not a thread's."""
        me = threading.get_ident()
        with self._readers_lock:   # (ncclCommGetAsyncError is made to be asked meanwhile)
            others = [call for thread, call in self._callers
                      if thread != me and call != "ncclCommGetAsyncError"]
        if others or self._grouping not in (None, me):
            raise NcclError(f"stand-in: ncclInvalidUsage: {name} from a second thread "
                            f"while another thread's call on this communicator is in "
                            f"progress (NCCL forbids concurrent use)", status=5)

    def _enqueue(self, stream_ptr: int, name: str, run: Callable[[], Optional[list]],
                 outputs: Sequence[np.ndarray]) -> None:
        stream = Stream.from_ptr(stream_ptr)
        stream.enqueue(self._in_order(stream, self._kernel(run, outputs)), f"nccl {name}")

    def _in_order(self, stream: Stream, op: Callable[[], Optional[list]]) -> Callable:
        """``op``, about to be enqueued on ``stream``, after this communicator's previous call
        (rule 13): it first runs that call's stream up to it. Captured, a graph node that
        is ordered so when the graph is launched (rule 18)."""
        last = self._last
        if stream.capture is not None:
            return _CapturedCall(self, op)
        self._last = (stream, stream.enqueued + 1)
        if last is None or last[0] is stream:
            return op
        before, position = last

        def ordered() -> Optional[list]:
            before.run_until(position)
            return op()
        return ordered

    def _reduced(self, send: np.ndarray, op: int) -> np.ndarray:
        """Every rank's ``send`` reduced elementwise with NCCL op ``op``: gathered as bytes and
        reduced in NumPy, so any NCCL datatype works (bfloat16 too, which MPI lacks)."""
        everyone = np.empty((self._size,) + send.shape, send.dtype)
        self._comm.Allgather(send.view(np.uint8), everyone.reshape(-1).view(np.uint8))
        result = _NUMPY_OPS[op].reduce(everyone, axis=0, dtype=send.dtype)
        if op == _AVG:
            result = np.true_divide(result, self._size).astype(send.dtype)
        return result

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        _converted("allReduce", sendbuf, recvbuf, count, datatype, op, stream)
        send = _view(sendbuf, count, datatype, "allReduce sendbuff")
        recv = _view(recvbuf, count, datatype, "allReduce recvbuff")
        self._submit(stream, "allReduce", lambda: recv.__setitem__(
            Ellipsis, self._reduced(send, op)), outputs=[recv])

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        _converted("reduce", sendbuf, recvbuf, count, datatype, op, root, stream)
        send = _view(sendbuf, count, datatype, "reduce sendbuff")
        recv = _view(recvbuf, count, datatype, "reduce recvbuff") if self._rank == root else None

        def run():
            result = self._reduced(send, op)
            if recv is not None:
                recv[...] = result
        self._submit(stream, "reduce", run, outputs=[] if recv is None else [recv])

    def bcast(self, buff, count, datatype, root, stream):
        _converted("bcast", buff, count, datatype, root, stream)
        buf = _view(buff, count, datatype, "bcast buff")
        self._submit(stream, "bcast", lambda: self._comm.Bcast(buf, root),
                     outputs=[] if self._rank == root else [buf])

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        _converted("broadcast", sendbuff, recvbuff, count, datatype, root, stream)
        send = _view(sendbuff, count, datatype, "broadcast sendbuff")
        recv = _view(recvbuff, count, datatype, "broadcast recvbuff")

        def run():
            if self._rank == root and sendbuff != recvbuff:
                recv[...] = send
            self._comm.Bcast(recv, root)
        written = self._rank != root or sendbuff != recvbuff
        self._submit(stream, "broadcast", run, outputs=[recv] if written else [])

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        _converted("allGather", sendbuf, recvbuf, count, datatype, stream)
        send = _view(sendbuf, count, datatype, "allGather sendbuff")
        recv = _view(recvbuf, count * self._size, datatype, "allGather recvbuff")
        self._submit(stream, "allGather", lambda: self._comm.Allgather(send, recv),
                     outputs=[recv])

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        _converted("reduceScatter", sendbuf, recvbuf, recvcount, datatype, op, stream)
        send = _view(sendbuf, recvcount * self._size, datatype, "reduceScatter sendbuff")
        recv = _view(recvbuf, recvcount, datatype, "reduceScatter recvbuff")
        mine = slice(self._rank * recvcount, (self._rank + 1) * recvcount)
        self._submit(stream, "reduceScatter", lambda: recv.__setitem__(
            Ellipsis, self._reduced(send, op)[mine]), outputs=[recv])

    def send(self, sendbuf, count, datatype, peer, stream):
        _converted("send", sendbuf, count, datatype, peer, stream)
        buf = _view(sendbuf, count, datatype, "send sendbuff")
        issue = lambda: [self._comm.Isend(buf, peer)]
        self._submit(stream, "send", issue, issue, peer)

    def recv(self, recvbuf, count, datatype, peer, stream):
        _converted("recv", recvbuf, count, datatype, peer, stream)
        buf = _view(recvbuf, count, datatype, "recv recvbuff")
        issue = lambda: [self._comm.Irecv(buf, peer)]
        self._submit(stream, "recv", issue, issue, peer, outputs=[buf])


# The module layout CuPy has: cupy.cuda and cupy.cuda.runtime are there once the package is
# imported; cupy.cuda.nccl only once imported itself (CuPy's cuda/__init__.py does not import
# it, and its __getattr__ raises AttributeError for it).
def _submodule(name: str, **names: Any) -> types.ModuleType:
    module = types.ModuleType(f"{__name__}.{name}")
    module.__dict__.update(names)
    return module


__path__: list = []   # a package, as cupy is: its submodules are imported by name
nccl = _submodule("cuda.nccl", available=True,
                  NcclCommunicator=NcclCommunicator, NcclError=NcclError,
                  get_unique_id=get_unique_id, get_version=get_version, groupStart=groupStart,
                  groupEnd=groupEnd)
runtime = _submodule("cuda.runtime", getDeviceCount=lambda: DEVICE_COUNT, getDevice=getDevice,
                     setDevice=setDevice)
driver = _submodule("cuda.driver", ctxGetCurrent=ctxGetCurrent)
cuda = _submodule("cuda", Device=Device, Stream=Stream, Event=Event, runtime=runtime,
                  driver=driver, get_current_stream=get_current_stream, __path__=[])


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``<stand-in>.cuda`` and ``<stand-in>.cuda.nccl``; Python's import system sets
    ``cuda.nccl`` only then, as for CuPy."""

    modules = {cuda.__name__: cuda, nccl.__name__: nccl, runtime.__name__: runtime,
               driver.__name__: driver}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self.modules:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return self.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
sys.modules[cuda.__name__] = cuda
sys.modules[runtime.__name__] = runtime


def forget_nccl_import() -> None:
    """Undo ``import <stand-in>.cuda.nccl``, as in a fresh interpreter (for tests)."""
    sys.modules.pop(nccl.__name__, None)
    cuda.__dict__.pop("nccl", None)


@contextlib.contextmanager
def deferred(stream: Stream):
    """Hold ``stream``'s work back inside the block (a GPU that is still busy)."""
    before, stream.deferred = stream.deferred, True
    try:
        yield stream
    finally:
        stream.deferred = before


# ==================================================================================================
# STAND-IN, continued: one process driving several devices (cupycomm.devices, cupycomm.prefetch)
#
# Tests choose the number of devices with ``monkeypatch.setattr(standin, "DEVICE_COUNT", 4)``.
# - CuPy's device checks: a stream is entered on its own device (streams remember theirs), an
#   event is recorded on a stream of its own device, and each device has its own current stream.
# - runtime.memcpyAsync and memcpy2DAsync with CUDA's host-memory rules: a copy between device
#   memory and pinned host memory runs when its stream gets there (so host code that rewrites a
#   pinned buffer too early shows up as wrong data); a copy from or to pageable host memory first
#   waits for its stream, then happens at once (CUDA stages it). The byte ranges are checked
#   against live allocations and against ``kind``.
# - alloc_pinned_memory, deviceCanAccessPeer, and _deviceEnsurePeerAccess (CuPy's own helper).
# - NcclCommunicator.initAll: one communicator per device of this process, without MPI. Their
#   calls must be inside groupStart()/groupEnd() (one thread driving several GPUs deadlocks
#   otherwise); groupEnd matches the k-th call of every member into one collective, which is one
#   piece of work on every member's stream. The first stream to get there runs the other
#   members' streams up to theirs (each NCCL kernel waits for its peers), then moves the data.
#   Stream handles 0 and 2 are each member's device's default streams (see _stream_on).
# ==================================================================================================
def _check_stream_device(stream: Stream) -> None:
    if stream.device_id not in (-1, Device.current_id()):
        raise RuntimeError(f"stand-in: the stream was created on device {stream.device_id}, but "
                           f"the current device is {Device.current_id()} (CuPy refuses it too)")


def _check_event_device(event: Event, stream: Stream) -> None:
    device = Device.current_id() if stream.device_id == -1 else stream.device_id
    if event.device_id != device:
        raise RuntimeError(f"stand-in: {event.name} of device {event.device_id} recorded on a "
                           f"stream of device {device} (cudaEventRecord fails)")


_pinned: dict = {}          # base address -> size in bytes, of every live pinned host buffer
peer_access: set = set()    # (device, peer) pairs that _deviceEnsurePeerAccess enabled
init_all_calls = 0          # how many times NcclCommunicator.initAll ran


class PinnedMemoryPointer(bytearray):
    """cupy.cuda.PinnedMemoryPointer: page-locked host memory that NumPy arrays can view."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size
        self.ptr = ctypes.addressof((ctypes.c_char * size).from_buffer(self)) if size else 0
        if size:
            _pinned[self.ptr] = size
            weakref.finalize(self, _pinned.pop, self.ptr, None)


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    return PinnedMemoryPointer(size)


def _memory(ptr: int, nbytes: int, what: str) -> str:
    """'device', 'pinned' or 'pageable' for ``nbytes`` at ``ptr``; a range that starts in an
    allocation must end in it."""
    for kind, registry in (("device", _allocations), ("pinned", _pinned)):
        for base, size in registry.items():
            if base <= ptr < base + size:
                if ptr + nbytes > base + size:
                    raise CUDARuntimeError(f"stand-in: {what} runs {ptr + nbytes - base - size} "
                                           f"bytes past the end of a {kind} allocation")
                return kind
    return "pageable"


memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice, memcpyDefault = \
    0, 1, 2, 3, 4
_KINDS = {memcpyHostToHost: ("host", "host"), memcpyHostToDevice: ("host", "device"),
          memcpyDeviceToHost: ("device", "host"), memcpyDeviceToDevice: ("device", "device")}


def memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):
    _converted("memcpy2DAsync", dst, dpitch, src, spitch, width, height, kind, stream)
    if width > dpitch or width > spitch:
        raise CUDARuntimeError(f"stand-in: width {width} exceeds a pitch ({dpitch}, {spitch})")
    if width == 0 or height == 0:
        return
    dst_memory = _memory(dst, dpitch * (height - 1) + width, "memcpy destination")
    src_memory = _memory(src, spitch * (height - 1) + width, "memcpy source")
    if kind != memcpyDefault:
        found = tuple("device" if m == "device" else "host" for m in (src_memory, dst_memory))
        if found != _KINDS[kind]:
            raise CUDARuntimeError(f"stand-in: memcpy kind {kind} means {_KINDS[kind]}, but the "
                                   f"pointers are {found} (source, destination)")

    def run():
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
    queue = Stream.from_ptr(stream)
    name = f"memcpy {src_memory}->{dst_memory} {height}x{width}"
    if "pageable" in (src_memory, dst_memory):
        _runtime_call("cudaMemcpyAsync (pageable host memory)", unsafe=True)
        queue.run_until(queue.enqueued)
        run()
        queue.log.append(f"{name} (at once)")
    else:
        queue.enqueue(run, name)


def memcpyAsync(dst, src, size, kind, stream):
    _converted("memcpyAsync", dst, src, size, kind, stream)
    memcpy2DAsync(dst, size, src, size, size, 1, kind, stream)


def deviceCanAccessPeer(device: int, peerDevice: int) -> int:
    _converted("deviceCanAccessPeer", device, peerDevice)
    Device(device), Device(peerDevice)
    return int(device != peerDevice)


def _deviceEnsurePeerAccess(peerDevice: int) -> None:
    _converted("_deviceEnsurePeerAccess", peerDevice)
    Device(peerDevice)
    if peerDevice == Device.current_id():
        raise CUDARuntimeError("stand-in: a device cannot be its own peer")
    peer_access.add((Device.current_id(), peerDevice))


class _Call:
    """One member's NCCL call: what it is, the arguments every member must agree on, its buffers."""

    def __init__(self, kind: str, key: tuple, stream: int, send: Any, recv: Any,
                 device: int) -> None:
        self.kind, self.key, self.stream, self.send, self.recv = kind, key, stream, send, recv
        self.device = device


class _Clique:
    """The communicators one initAll made; their calls queue here until groupEnd."""

    def __init__(self, devices: list) -> None:
        self.devices = devices
        self.calls: List[list] = [[] for _ in devices]

    def launch(self) -> None:
        calls, self.calls = self.calls, [[] for _ in self.devices]
        if len({len(member) for member in calls}) != 1:
            raise NcclError(f"stand-in: in one group the devices {self.devices} made "
                            f"{[len(member) for member in calls]} calls; NCCL would hang")
        collectives = list(zip(*calls))
        for k, members in enumerate(collectives):
            if len({(m.kind, m.key) for m in members}) != 1:
                raise NcclError(f"stand-in: call {k} of the group differs between devices: "
                                f"{[(m.kind, m.key) for m in members]}")
        for members in collectives:
            self._enqueue(members)

    @staticmethod
    def _enqueue(members: tuple) -> None:
        streams = [_stream_on(m.stream, m.device) for m in members]
        planned: dict = {}
        positions = []
        for stream in streams:   # where each member's piece of work will sit in its stream
            planned[id(stream)] = planned.get(id(stream), stream.enqueued) + 1   # (not ptr:
            positions.append(planned[id(stream)])   # each device's null stream is handle 0)
        done = []

        def arrive():
            if done:
                return
            done.append(True)
            for stream, position in zip(streams, positions):   # (some not enqueued yet)
                stream.run_until(min(position - 1, stream.enqueued))
            if not NO_WORK:
                _LOCAL_COLLECTIVES[members[0].kind](members)
        for stream in streams:
            stream.enqueue(arrive, f"nccl {members[0].kind}")


def _stream_on(handle: int, device: int) -> Stream:
    """The stream ``handle`` means for a communicator of ``device``: NCCL launches each
    communicator's kernels with its device current, so handles 0 and 2 are that device's
    default streams [NCCL ``src/group.cc``, doLaunches: cudaSetDevice(comm->cudaDev) before
    each communicator's ncclLaunchPrepare]."""
    previous = Device.current_id()
    Device._local.id = device
    try:
        return Stream.from_ptr(handle)
    finally:
        Device._local.id = previous


def _local_broadcast(members: tuple) -> None:
    source = members[members[0].key[2]].send
    for member in members:
        if member.recv.ctypes.data != source.ctypes.data:
            member.recv[...] = source


_LOCAL_UFUNCS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, _AVG: np.add}


def _local_reduce(members: tuple) -> None:
    _, _, op, root = members[0].key
    total = members[0].send.copy()
    for member in members[1:]:
        _LOCAL_UFUNCS[op](total, member.send, out=total)
    if op == _AVG:
        np.true_divide(total, len(members), out=total)
    members[root].recv[...] = total


_LOCAL_COLLECTIVES = {"broadcast": _local_broadcast, "reduce": _local_reduce}
_open_cliques: list = []   # cliques with calls in the open group


def _end_local_group() -> None:
    cliques = list(_open_cliques)
    _open_cliques.clear()
    for clique in cliques:
        clique.launch()


class LocalNcclCommunicator:
    """A member of an initAll clique: the NcclCommunicator methods cupycomm.devices calls."""

    def __init__(self, clique: _Clique, rank: int) -> None:
        self._clique, self._rank, self._alive = clique, rank, True

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self._clique.devices)

    def device_id(self) -> int:
        return self._clique.devices[self._rank]

    def destroy(self) -> None:
        self._alive = False

    def _call(self, kind: str, key: tuple, stream: int, send: Any, recv: Any) -> None:
        if not self._alive:
            raise NcclError("stand-in: communicator destroyed", status=5)
        if _open_group() is None:
            raise NcclError(f"stand-in: {kind} on one of several communicators of this process "
                            f"outside groupStart()/groupEnd(): NCCL would deadlock", status=5)
        self._clique.calls[self._rank].append(_Call(kind, key, stream, send, recv,
                                                    self.device_id()))
        if self._clique not in _open_cliques:
            _open_cliques.append(self._clique)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        _converted("broadcast", sendbuff, recvbuff, count, datatype, root, stream)
        root_here = self._rank == root
        send = _view(sendbuff, count, datatype, "broadcast sendbuff") if root_here else None
        recv = _view(recvbuff, count, datatype, "broadcast recvbuff")
        self._call("broadcast", (count, datatype, root), stream, send, recv)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        _converted("reduce", sendbuf, recvbuf, count, datatype, op, root, stream)
        send = _view(sendbuf, count, datatype, "reduce sendbuff")
        recv = _view(recvbuf, count, datatype, "reduce recvbuff") if self._rank == root else None
        self._call("reduce", (count, datatype, op, root), stream, send, recv)


def _init_all(devices: Any) -> List[LocalNcclCommunicator]:
    """cupy.cuda.nccl.NcclCommunicator.initAll: one communicator per device, in this process."""
    global init_all_calls
    devices = list(range(devices)) if isinstance(devices, int) else list(devices)
    for device in devices:
        Device(device)
    if len(set(devices)) != len(devices):
        raise NcclError(f"stand-in: initAll of {devices}: a device is repeated", status=4)
    init_all_calls += 1
    clique = _Clique(devices)
    return [LocalNcclCommunicator(clique, rank) for rank in range(len(devices))]


NcclCommunicator.initAll = staticmethod(_init_all)
cuda.alloc_pinned_memory = alloc_pinned_memory
cuda.PinnedMemoryPointer = PinnedMemoryPointer
for _name in ("memcpyAsync", "memcpy2DAsync", "memcpyHostToHost", "memcpyHostToDevice",
              "memcpyDeviceToHost", "memcpyDeviceToDevice", "memcpyDefault", "deviceCanAccessPeer",
              "_deviceEnsurePeerAccess", "CUDARuntimeError", "streamCaptureModeGlobal",
              "streamCaptureModeThreadLocal", "streamCaptureModeRelaxed",
              "threadExchangeStreamCaptureMode"):
    setattr(runtime, _name, globals()[_name])


_thread_errors = threading.local()   # rule 14: each host thread's last error


def last_error() -> int:
    """The status cudaGetLastError would return on this thread now (0: none), left as it is."""
    return getattr(_thread_errors, "status", 0)


def _get_last_error() -> int:
    """cudaGetLastError: this thread's last error, which it resets to none."""
    status, _thread_errors.status = last_error(), 0
    return status


def _enable_peer_access(peerDevice: int) -> int:
    """cudaDeviceEnablePeerAccess: its status, a failure kept as this thread's last error."""
    if (Device.current_id(), peerDevice) in peer_access:
        _thread_errors.status = 704   # cudaErrorPeerAccessAlreadyEnabled
        return 704
    _deviceEnsurePeerAccess(peerDevice)
    return 0


def check_status(status: int) -> None:
    """CuPy's check_status: a failure resets the last error, then raises."""
    if status:
        _get_last_error()
        error = CUDARuntimeError(f"stand-in: CUDA runtime status {status}")
        error.status = status
        raise error


def deviceEnablePeerAccess(peerDevice: int) -> None:
    """CUDA refuses a second enabling: cudaErrorPeerAccessAlreadyEnabled (status 704)."""
    check_status(_enable_peer_access(peerDevice))


runtime.deviceEnablePeerAccess = deviceEnablePeerAccess
