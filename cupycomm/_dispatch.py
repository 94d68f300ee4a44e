"""Which backend takes an array: the call path's first step, foreign arrays as NumPy/CuPy views,
and the NCCL communicator made on the first device array.

The fast path of :meth:`Dispatch._take` is a dictionary lookup by the array's type, a read
of its flags and the spec lookup by dtype (and op); everything that explains an error, adopts
a new array type or converts a foreign array runs only when the fast path fails.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _bootstrap, _foreign
from ._dtypes import DTYPES
from ._validate import arg_name, kind_name

__all__ = ["Dispatch"]


class Dispatch:
    """Dispatch mixed into :class:`cupycomm.Communicator`; it reads and writes the state its
    docstring lists (``_backends`` by array type, ``_cupy``, ``_nccl`` via ``init_device``)."""

    def _take(self, name: str, arg: str, x: Any, op: Any = None, collective: bool = True,
              writes: bool = False) -> Tuple[Any, Any, Any]:
        """(backend, array, spec) for argument ``arg``, after every check of the array alone
        (that it is writable too if the call ``writes`` into it), and of ``op`` for its dtype
        when ``op`` is given. The spec is the backend's ``reductions[dtype][op]``, or
        ``movements[dtype]`` without ``op``. For a foreign array, the array is a NumPy/CuPy
        view of it and the backend a :class:`~cupycomm._foreign.Foreign` that maps results
        back."""
        b = self._backends.get(type(x))
        if b is None:
            b, x = self._take_slowly(name, arg, x, collective, writes)
        elif b.device_id is None:
            flags = x.flags
            if not flags.c_contiguous or (writes and not flags.writeable):
                b, x = self._take_slowly(name, arg, x, collective, writes)
        elif not x.flags.c_contiguous or x.device.id != b.device_id:
            b, x = self._take_slowly(name, arg, x, collective, writes)
        try:
            if op is None:
                return b, x, b.movements[x.dtype]
            return b, x, b.reductions[x.dtype][op]
        except (KeyError, TypeError):
            if op is None:
                raise self._dtype_error(name, arg, x) from None
            raise self._reduction_error(name, arg, b, x, op) from None

    def _take_slowly(self, name: str, arg: Any, x: Any, collective: bool,
                     writes: bool) -> Tuple[Any, Any]:
        self._check_open(name)
        arg = arg_name(arg)
        b = self._backends.get(type(x))
        if b is None:
            kind = self._classify(x)
            if kind is None:
                try:
                    native = _foreign.to_native(x, self._device_module)
                except _foreign.Unsupported as why:
                    raise self._fail(TypeError, name, f"{arg} {why}") from None
                if native is None:
                    raise self._fail(TypeError, name, f"{arg} must be a NumPy or CuPy array "
                                                      f"(or expose the buffer protocol, "
                                                      f"__array_interface__, "
                                                      f"__cuda_array_interface__ or "
                                                      f"__dlpack__), got {kind_name(x)}")
                why = writes and _foreign.read_only_through_dlpack(x, native)
                if why:
                    raise self._fail(ValueError, name, f"{arg} {why}, so {name} cannot write "
                                                       f"its result there; pass a NumPy array "
                                                       f"or a buffer, or use NumPy 2.1 or newer")
                inner, native = self._take_slowly(name, arg, native, collective, writes)
                return _foreign.Foreign(inner, native, x), native
            b = self._adopt(name, kind, x, collective)
        if x.dtype not in DTYPES:
            raise self._dtype_error(name, arg, x)
        if not x.flags.c_contiguous:
            raise self._fail(ValueError, name, f"{arg} must be C-contiguous, got shape "
                                               f"{x.shape} with strides {x.strides}; pass a "
                                               f"contiguous copy (ascontiguousarray)")
        if b.device_id is not None and x.device.id != b.device_id:
            raise self._fail(ValueError, name,
                             f"{arg} is on device {x.device.id} but the communicator uses "
                             f"device {b.device_id}; make that device current "
                             f"(comm.device.use()) before creating arrays, or pass "
                             f"init(device=...)")
        if writes and b.device_id is None and not x.flags.writeable:   # CuPy has no read-only
            raise self._fail(ValueError, name, f"{arg} is read-only, but {name} writes its "
                                               f"result there; pass a writable array")
        return b, x

    def _device_module(self) -> Any:
        if self._cupy is None:
            self._cupy = _bootstrap.import_cupy()
        if self._cupy is None:
            raise TypeError("a device array was given but CuPy cannot be imported")
        return self._cupy

    def _classify(self, x: Any) -> Optional[str]:
        """'device', 'host', or None for an object that is neither; no backend is created."""
        cupy = self._cupy
        if cupy is None and type(x).__module__.split(".")[0] == "cupy":
            cupy = self._cupy = _bootstrap.import_cupy()
        if cupy is not None and isinstance(x, cupy.ndarray):
            return "device"
        return "host" if isinstance(x, np.ndarray) else None

    def _adopt(self, name: str, kind: str, x: Any, collective: bool) -> Any:
        """The backend for an array type seen for the first time."""
        if kind == "host":   # a NumPy subclass
            backend = self._host
        elif self._nccl is None and not collective:
            raise self._fail(RuntimeError, name,
                             "the NCCL communicator does not exist yet; it is created by "
                             "every rank together: call comm.init_device() on every rank "
                             "(or run any collective on device arrays) before device "
                             "point-to-point calls")
        elif self._batch is not None and self._nccl is None:
            raise self._fail(RuntimeError, name, "the NCCL communicator cannot be created "
                                                 "inside a batch() block: call "
                                                 "comm.init_device() before it")
        else:
            backend = self.init_device()
        self._backends[type(x)] = backend
        return backend

    def _array_module(self, b: Any) -> Any:
        """NumPy for the host backend, the device module (CuPy) for the device backend."""
        return np if getattr(b, "inner", b) is self._host else self._cupy

    def _check_kind(self, name: str, arg: str, b: Any, other: Any, like: Any,
                    writes: bool = True) -> Any:
        """``other`` as an array that passes every check (writable if ``writes``) and matches
        ``like``'s backend and dtype (a NumPy/CuPy view if it is foreign)."""
        if other is None:
            raise self._fail(TypeError, name, f"{arg} must be an array, got None")
        known, native = self._backends.get(type(other)), other
        if known is None and self._classify(other) is None:
            known, native, _ = self._take(name, arg, other, collective=False, writes=writes)
        own = getattr(b, "inner", b)
        mixed = (getattr(known, "inner", known) is not own if known is not None
                 else (self._classify(native) == "host") != (own is self._host))
        if mixed:
            raise self._fail(TypeError, name, f"{arg} is {kind_name(other)} but the input is "
                                              f"{kind_name(like)}; one call takes host arrays "
                                              f"or device arrays, not both")
        self._take(name, arg, native, writes=writes)
        if native.dtype != like.dtype:
            raise self._fail(TypeError, name, f"{arg} has dtype {native.dtype}, expected "
                                              f"{like.dtype} (the input's)")
        if native is not other and isinstance(b, _foreign.Foreign):
            b.remember(native, other)
        return native
