"""The backends and the whole contract between them and the rest of cupycomm.

:mod:`.mpi` (host arrays through mpi4py's buffer calls), :mod:`.nccl` (device arrays through
one ``NcclCommunicator`` per communicator) and :mod:`.local` (one process driving several
GPUs, for ``cupycomm.devices``) make every NCCL call of the package (the benchmark's raw
baselines excepted). The contract is a few small protocols, which their callers' annotations
use: :class:`Collectives` (what the Communicator calls once every argument is checked:
backends trust their inputs), :class:`HostBackend` and :class:`DeviceBackend` (what each
kind has besides), :class:`Completion` (what a Work calls to complete), :class:`Health`
(what the watchdog thread asks of a device backend: never blocking, no MPI) and
:class:`Marks` (what the backends write per call for the watchdog and the flight recorder).
"""
from __future__ import annotations

from typing import Any, ContextManager, List, Mapping, Optional, Protocol, Sequence, Tuple

__all__ = ["Collectives", "HostBackend", "DeviceBackend", "Completion", "HostCompletion",
           "DeviceCompletion", "Health", "Marks", "Ring"]


class Collectives(Protocol):
    """What the Communicator calls once it has checked every argument: results allocated with
    ``empty``, the spec looked up (``reductions[dtype][op]``, ``movements[dtype]``); ``recv``
    is the receive buffer (``recv is x``: in place); each returns the result, or a Work when
    ``async_op``. The methods are :data:`cupycomm._collectives.BACKEND_METHODS` (which
    :class:`~cupycomm.comm.foreign.Foreign` wraps), ``empty``, the batch() hooks and
    ``close``."""

    # Read-only: a backend may hold them as class attributes of narrower types.
    @property
    def name(self) -> str: ...                    # "mpi" or "nccl"

    @property
    def array_type(self) -> type: ...             # numpy.ndarray, cupy.ndarray

    @property
    def device_id(self) -> Optional[int]: ...     # None for host memory

    @property
    def movements(self) -> Mapping[Any, Any]: ...   # dtype -> backend-specific spec

    @property
    def reductions(self) -> Mapping[Any, Mapping[Any, Any]]: ...   # dtype -> op -> spec

    def empty(self, shape: tuple, dtype: Any, stream: Any = None) -> Any: ...
    # Arrays, specs and streams are the backend's own types; results are arrays or a Work.
    def all_reduce(self, x: Any, recv: Any, spec: Any, async_op: bool, stream: Any) -> Any: ...

    def reduce(self, x: Any, recv: Any, spec: Any, root: int, async_op: bool,
               stream: Any) -> Any: ...

    def broadcast(self, x: Any, spec: Any, root: int, async_op: bool, stream: Any) -> Any: ...

    def all_gather(self, x: Any, recv: Any, spec: Any, async_op: bool, stream: Any,
                   unpack: Sequence[Any] = ()) -> Any: ...

    def reduce_scatter(self, x: Any, recv: Any, spec: Any, async_op: bool, stream: Any,
                       pack: Sequence[Any] = ()) -> Any: ...

    def all_to_all(self, x: Any, recv: Any, spec: Any, async_op: bool, stream: Any) -> Any: ...

    def all_to_all_v(self, x: Any, recv: Any, spec: Any, send_bytes: Sequence[int],
                     recv_bytes: Sequence[int], async_op: bool, stream: Any) -> Any: ...

    def scatter(self, x: Any, recv: Any, spec: Any, root: int, async_op: bool,
                stream: Any) -> Any: ...

    def gather(self, x: Any, recv: Any, spec: Any, root: int, async_op: bool,
               stream: Any) -> Any: ...

    def send(self, x: Any, spec: Any, peer: int, async_op: bool, stream: Any) -> Any: ...

    def recv(self, x: Any, spec: Any, peer: int, async_op: bool, stream: Any) -> Any: ...

    def sendrecv(self, x: Any, spec: Any, dst: int, buf: Any, src: int, async_op: bool,
                 stream: Any) -> Any: ...

    def begin_group(self, group: Any) -> None: ...

    def end_group(self, group: Any, cancel: bool) -> None: ...

    def close(self) -> None: ...


class Completion(Protocol):
    def check_errors(self, label: str) -> None:
        """Raise if the backend has failed meanwhile (NCCL's asynchronous errors) while the
        Work ``label`` ("all_reduce #12") waits."""

    def expired(self, label: str, timeout: float) -> None:
        """``wait(timeout=)`` of the call ``label`` ran out: never returns."""


class HostCompletion(Completion, Protocol):
    def test_all(self, requests: list) -> bool: ...
    def wait_all(self, requests: list, label: str) -> None: ...


class DeviceCompletion(Completion, Protocol):
    def stream_wait(self, event: Any, captured: bool = False, label: str = "wait") -> None:
        """The caller's current stream (of the backend's device) waits for ``event``
        (recorded in a CUDA graph capture if ``captured``)."""


class Health(Protocol):
    def has_pending_work(self) -> bool: ...
    def async_error(self) -> str: ...
    def abort(self, reason: str, lost: Optional[Tuple[int, ...]] = None,
              late: Optional[Tuple[int, ...]] = None) -> bool:
        """End the device communicator for ``reason``: because world ranks ``lost`` died
        (later calls raise PeerLost), or because a call timed out while the ranks ``late``
        of this node had not issued it (the Works it cut short raise CollectiveTimeout)."""
    def pending(self, seq: int) -> str: ...


class Ring(Protocol):
    """The flight recorder's ring (:class:`~cupycomm.faults.flight.Recorder`): call ``seq``
    writes its name in ``calls[seq % size]``."""

    calls: List[Any]
    size: int


class Marks(Protocol):
    """What a backend writes per call, on the main thread, for the watchdog thread to read.

    Example (each of the host backend's calls; the device backend writes ``(label, "nccl")``
    in the ring, and ``busy`` only while the launch itself lasts, which may block the host)::

        marks.seq = seq = marks.seq + 1        # the call's number on this communicator
        marks.flight.calls[seq % marks.flight.size] = "all_reduce"
        marks.busy = "all_reduce"              # while it blocks (hangs are judged by it)
        try:
            comm.Allreduce(...)
        finally:
            marks.busy = None
    """

    seq: int              # the calls issued on this communicator
    busy: Optional[str]   # the blocking call or wait in progress ("all_reduce #12"), or None

    @property
    def flight(self) -> Ring: ...

    def expired(self, label: str, timeout: float) -> None:
        """``Work.wait(timeout=)`` of the host call ``label`` ran out: ends the job."""


class HostBackend(Collectives, HostCompletion, Protocol):
    def barrier(self, async_op: bool = False) -> Any: ...

    # The calls made so far (by the general path), blocking and started: what the
    # Communicator's common case looks up.
    calls: Tuple[Any, Any]

    def gather_ints(self, values: Sequence[int], label: str) -> Any:
        """Every rank's ``values`` (a row each), blocking: control traffic that sizes or
        checks a call (uneven all_to_all counts, debug mode's fingerprints)."""


class DeviceBackend(Collectives, DeviceCompletion, Health, Protocol):
    @property
    def stream(self) -> Any: ...   # the comm stream (async calls, batch() blocks)

    # its device current inside (a new thread's device 0 is not set back: no context there)
    def on_device(self) -> ContextManager[None]: ...

    def split(self, color: Optional[int], key: int) -> Any: ...

    def settle(self, label: str) -> None:
        """Block until every collective launched outside captures has completed, then raise
        what cut any short (``label`` names the caller in the error)."""

    def drop(self) -> None:
        """Its communicator was collected unclosed (in any thread): free nothing now, and
        close at a safe point (:func:`cupycomm._bootstrap.at_safe_point`)."""
