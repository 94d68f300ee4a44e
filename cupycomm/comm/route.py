"""Which backend takes an array: the general call path's first step, the arrays given alongside
the data array, foreign arrays as NumPy/CuPy views, and the NCCL backend made on the first
device array.

:meth:`Router.route` is a dictionary lookup by the array's type, a read of its flags and the
lookup of the backend's wire type by dtype (and op); everything that explains an error, adopts
a new array type or converts a foreign array runs only when that fails
(:meth:`Router._route_unusual`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, cast

import numpy as np
from mpi4py import MPI

from .. import _bootstrap
from . import foreign
from .._dtypes import DTYPES
from .checks import Checks, arg_name, kind_name
from ..backends import Collectives, DeviceBackend
from ..backends.mpi import MPIBackend
from ..faults.watchdog import Tracker

__all__ = ["MOVES", "Route", "Router"]

Route = Tuple[Collectives, Any, Any]
"""(backend, array, spec): the backend that takes the array, the array as NumPy/CuPy (a view
of a foreign one; the backend is then a :class:`~cupycomm.comm.foreign.Foreign` that maps
results back), and the backend's spec for its dtype (and op), which its methods take:
``reductions[dtype][op]``, or ``movements[dtype]`` without an op."""

#: :meth:`Router.route`'s ``op`` for a call that moves data (not None, which a user may pass
#: as a reduction's op, to be refused by name as any other unknown op).
MOVES: Any = object()

_may_share_memory = np.may_share_memory   # exact for C-contiguous arrays: their bounds


class Router:
    """The backends of one communicator and which one takes each array.

    It owns the host backend (``host``), the device backend once made (``device``, by
    :meth:`init_device` or the first collective on a device array) and the device module
    (``cupy``, loaded on first need); ``backends`` maps each array type seen to its backend.

    Example::

        router = Router(mpi_comm, tracker, Checks(rank, size), device=None, device_rank=0,
                        device_module=None)
        backend, x, spec = router.route("all_reduce", "x", numpy.ones(2), "sum")
        backend is router.host   # True
    """

    def __init__(self, mpi_comm: MPI.Comm, tracker: Tracker, checks: Checks,
                 device: Optional[int], device_rank: int, device_module: Any) -> None:
        self.host = MPIBackend(mpi_comm, tracker)
        self.device: Optional[DeviceBackend] = None
        self.backends: Dict[type, Collectives] = {np.ndarray: self.host}   # and those seen
        self.cupy = device_module
        self.device_choice = device        # init(device=), else None: by device_rank
        self.device_rank = device_rank     # the local rank the device is chosen by
        self.device_id: Optional[int] = None
        self._mpi = mpi_comm
        self._tracker = tracker
        self._checks = checks

    # -- the array's backend ----------------------------------------------------------------------
    def route(self, name: str, arg: Any, x: Any, op: Any = MOVES,
              collective: bool = True, writes: bool = False, stream: Any = None) -> Route:
        """The :data:`Route` of argument ``arg`` of call ``name``, after every check of the
        array alone (that it is writable too if the call ``writes`` into it), of ``op`` for
        its dtype unless ``op`` is :data:`MOVES` (a call that moves data), and of ``stream``
        for the backend when given."""
        b = self.backends.get(type(x))
        if b is None:
            b, x = self._route_unusual(name, arg, x, collective, writes)
        elif b.device_id is None:
            flags = x.flags
            if not flags.c_contiguous or (writes and not flags.writeable):
                b, x = self._route_unusual(name, arg, x, collective, writes)
        elif not x.flags.c_contiguous or x.device.id != b.device_id:
            b, x = self._route_unusual(name, arg, x, collective, writes)
        try:
            spec = b.movements[x.dtype] if op is MOVES else b.reductions[x.dtype][op]
        except (KeyError, TypeError):
            if op is MOVES:
                raise self._checks.dtype_error(name, arg, x) from None
            raise self._checks.reduction_error(name, arg, b, x, op) from None
        if stream is not None:
            self._checks.check_stream(name, b, stream)
        return b, x, spec

    def _route_unusual(self, name: str, arg: Any, x: Any, collective: bool,
                       writes: bool) -> Tuple[Collectives, Any]:
        """(backend, array) for an array the fast lookup did not take: a closed communicator,
        a type seen for the first time, a foreign array, or a check that fails (raised)."""
        checks = self._checks
        checks.check_open(name)
        arg = arg_name(arg)
        b = self.backends.get(type(x))
        if b is None:
            kind = self.classify(x)
            if kind is None:
                return self._route_foreign(name, arg, x, collective, writes)
            b = self._adopt(name, kind, x, collective)
        if x.dtype not in DTYPES:
            raise checks.dtype_error(name, arg, x)
        if not x.flags.c_contiguous:
            raise checks.fail(ValueError, name, f"{arg} must be C-contiguous, got shape "
                                                f"{x.shape} with strides {x.strides}; pass a "
                                                f"contiguous copy (ascontiguousarray)")
        if b.device_id is not None and x.device.id != b.device_id:
            raise checks.fail(ValueError, name,
                              f"{arg} is on device {x.device.id} but the communicator uses "
                              f"device {b.device_id}; make that device current "
                              f"(comm.device.use()) before creating arrays, or pass "
                              f"init(device=...)")
        if writes and b.device_id is None and not x.flags.writeable:   # CuPy has no read-only
            raise checks.fail(ValueError, name, f"{arg} is read-only, but {name} writes its "
                                                f"result there; pass a writable array")
        return b, x

    def _route_foreign(self, name: str, arg: str, x: Any, collective: bool,
                       writes: bool) -> Tuple[Collectives, Any]:
        """(a :class:`~cupycomm.comm.foreign.Foreign` backend, the NumPy/CuPy view) of a torch,
        numba, JAX or buffer object."""
        checks = self._checks
        try:
            native = foreign.to_native(x, self.device_module)
        except foreign.Unsupported as why:
            raise checks.fail(TypeError, name, f"{arg} {why}") from None
        if native is None:
            raise checks.fail(TypeError, name, f"{arg} must be a NumPy or CuPy array (or "
                                               f"expose the buffer protocol, "
                                               f"__array_interface__, "
                                               f"__cuda_array_interface__ or __dlpack__), "
                                               f"got {kind_name(x)}")
        read_only = writes and foreign.read_only_through_dlpack(x, native)
        if read_only:
            raise checks.fail(ValueError, name, f"{arg} {read_only}, so {name} cannot write its "
                                                f"result there; pass a NumPy array or a "
                                                f"buffer, or use NumPy 2.1 or newer")
        inner, native = self._route_unusual(name, arg, native, collective, writes)
        return cast(Collectives, foreign.Foreign(inner, native, x)), native

    def device_module(self) -> Any:
        """The device module (CuPy), loaded now if need be; TypeError where it cannot be."""
        if self.cupy is None:
            self.cupy = _bootstrap.import_cupy()
        if self.cupy is None:
            raise TypeError("a device array was given but CuPy cannot be imported")
        return self.cupy

    def classify(self, x: Any) -> Optional[str]:
        """'device', 'host', or None for an object that is neither; no backend is created."""
        cupy = self.cupy
        if cupy is None and type(x).__module__.split(".")[0] == "cupy":
            cupy = self.cupy = _bootstrap.import_cupy()
        if cupy is not None and isinstance(x, cupy.ndarray):
            return "device"
        return "host" if isinstance(x, np.ndarray) else None

    def _adopt(self, name: str, kind: str, x: Any, collective: bool) -> Collectives:
        """The backend for an array type seen for the first time."""
        backend: Collectives
        if kind == "host":   # a NumPy subclass
            backend = self.host
        elif self.device is None and not collective:
            raise self._checks.fail(RuntimeError, name,
                                    "the NCCL communicator does not exist yet; it is created "
                                    "by every rank together: call comm.init_device() on every "
                                    "rank (or run any collective on device arrays) before "
                                    "device point-to-point calls")
        elif self._checks.batch is not None and self.device is None:
            raise self._checks.fail(RuntimeError, name, "the NCCL communicator cannot be "
                                                        "created inside a batch() block: call "
                                                        "comm.init_device() before it")
        else:
            backend = self.init_device()
        self.backends[type(x)] = backend
        return backend

    def array_module(self, b: Any) -> Any:
        """NumPy for the host backend, the device module (CuPy) for the device backend."""
        return np if getattr(b, "inner", b) is self.host else self.cupy

    # -- the device -------------------------------------------------------------------------------
    def device_number(self) -> Optional[int]:
        """This rank's CUDA device number (loading CuPy), or None where there is no GPU."""
        if self.device_id is None:
            if self.cupy is None:
                self.cupy = _bootstrap.import_cupy()
            if self.cupy is not None:
                self.device_id = (self.device_choice if self.device_choice is not None
                                  else _bootstrap.choose_device(self.device_rank, self.cupy))
        return self.device_id

    def init_device(self, nccl_comm: Any = None) -> DeviceBackend:
        """The device backend, made now if need be (collective, unless ``nccl_comm``, an
        NCCL communicator already made for these ranks, is given)."""
        device = self.device
        if device is None:
            device_id = self.device_number()
            if device_id is None:
                raise RuntimeError(f"init_device: no GPU is usable on rank "
                                   f"{self._checks.rank} (CuPy "
                                   f"{'is missing' if self.cupy is None else 'sees none'})")
            from ..backends.nccl import NcclBackend
            device = NcclBackend(self._mpi, device_id, self.cupy, self._tracker, nccl_comm)
            self.backends[device.array_type] = device
            self._tracker.device = self.device = device
        return device

    def drop(self) -> None:
        """The communicator was collected unclosed, in whichever thread the garbage collector
        ran: the device backend is closed at a safe point instead (see
        :meth:`DeviceBackend.drop`)."""
        if self.device is not None:
            self.device.drop()

    def close(self) -> None:
        """Close the backends (waiting for their calls in flight); no array is taken after."""
        self.backends = {}
        if not MPI.Is_finalized():
            self.host.close()
        if self.device is not None:
            self.device.close()

    # -- arrays given alongside the data array ----------------------------------------------------
    def check_kind(self, name: str, arg: str, b: Any, other: Any, like: Any,
                   writes: bool = True) -> Any:
        """``other`` as an array that passes every check (writable if ``writes``) and matches
        ``like``'s backend and dtype (a NumPy/CuPy view if it is foreign)."""
        fail = self._checks.fail
        if other is None:
            raise fail(TypeError, name, f"{arg} must be an array, got None")
        known: Any = self.backends.get(type(other))
        native = other
        if known is None and self.classify(other) is None:
            known, native, _ = self.route(name, arg, other, collective=False, writes=writes)
        own = getattr(b, "inner", b)
        mixed = (getattr(known, "inner", known) is not own if known is not None
                 else (self.classify(native) == "host") != (own is self.host))
        if mixed:
            raise fail(TypeError, name, f"{arg} is {kind_name(other)} but the input is "
                                        f"{kind_name(like)}; one call takes host arrays or "
                                        f"device arrays, not both")
        self.route(name, arg, native, writes=writes)
        if native.dtype != like.dtype:
            raise fail(TypeError, name, f"{arg} has dtype {native.dtype}, expected "
                                        f"{like.dtype} (the input's)")
        if native is not other and isinstance(b, foreign.Foreign):
            b.remember(native, other)
        return native

    def check_out(self, name: str, arg: str, b: Any, out: Any, like: Any,
                  shapes: Sequence[tuple], expected: str = "", writes: bool = True) -> Any:
        """``out`` as an array of ``like``'s kind and dtype with one of ``shapes`` (and
        writable, unless the call only reads it: ``writes=False``)."""
        if (type(out) is type(like) and out.dtype is like.dtype and out.shape in shapes
                and out.flags.c_contiguous
                and (out.device.id == b.device_id if b.device_id is not None
                     else not writes or out.flags.writeable)):
            return out
        out = self.check_kind(name, arg, b, out, like, writes)
        if out.shape not in shapes:
            want = " or ".join(str(s) for s in shapes)
            raise self._checks.fail(ValueError, name, f"{arg} has shape {out.shape}, expected "
                                                      f"{want}{expected}")
        return out

    def check_apart(self, name: str, arg: str, b: Any, out: Any, x: Any,
                    in_place: bool = False) -> Any:
        """``out``, where it shares no memory with ``x`` (two checked C-contiguous arrays of
        backend ``b``; ``arg`` names ``out``, "x" for scatter's, whose ``x`` is its out);
        ``x`` itself where ``in_place`` (a reduction, which has an in-place form) and ``out``
        is another view of ``x``'s very memory: MPI refuses such a pair as aliased, NCCL
        takes equal pointers as in place. Any other overlap: ValueError, before any
        communication (MPI names no argument or aborts, NCCL mixes the data silently)."""
        if out is x:
            if in_place:
                return out
        elif b.device_id is None:
            if not _may_share_memory(out, x):
                return out
            if (in_place and out.__array_interface__["data"][0]
                    == x.__array_interface__["data"][0] and out.nbytes == x.nbytes):
                return x
        else:
            start, begin = out.data.ptr, x.data.ptr
            if start + out.nbytes <= begin or begin + x.nbytes <= start:
                return out
            if in_place and start == begin and out.nbytes == x.nbytes:
                return x
        other = "out" if arg == "x" else "x"
        also = ", or pass x itself (or out=None) to reduce in place" if in_place else ""
        raise self._checks.fail(ValueError, name, f"{arg} overlaps {other} (they share "
                                                  f"memory); give out memory of its own{also}")

    def check_parts(self, name: str, arg: str, b: Any, parts: Sequence, like: Any,
                    writes: bool = True) -> list:
        """``parts`` as a list of ``size`` arrays shaped like ``like`` (written, unless
        ``writes=False``)."""
        size = self._checks.size
        if len(parts) != size:
            raise self._checks.fail(ValueError, name, f"{arg} is a list of {len(parts)} "
                                                      f"arrays, expected {size} (one per rank)")
        return [self.check_out(name, f"{arg}[{j}]", b, part, like, (like.shape,),
                               writes=writes) for j, part in enumerate(parts)]
