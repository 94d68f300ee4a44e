"""Argument checks of the Communicator: fast checks on the call path, explanations off it.

Every check runs on the calling rank before any communication. The fast path of ``take``
is a few dictionary lookups and attribute reads; everything that explains an error, adopts a
new array type or converts a foreign array runs only when the fast path fails.

Messages name the collective, the argument, the value and the rank, e.g.
``all_gather: out has shape (6,), expected (4, 3) or (12,) on rank 3``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import _bootstrap, _foreign
from ._dtypes import DTYPES, op_error
from .errors import CommClosedError

__all__ = ["Checks"]


def _kind(x: Any) -> str:
    return f"{type(x).__module__.split('.')[0]}.{type(x).__name__}"


def _arg(arg: Any) -> str:
    """An argument's name for a message: ``"x"``, or ``("arrays", 3)`` for ``arrays[3]``
    (a loop over many arrays passes tuples: the text is only made for an error)."""
    return arg if isinstance(arg, str) else f"{arg[0]}[{arg[1]}]"


class Checks:
    """The checks, mixed into :class:`cupycomm.Communicator` (they read its ranks, its
    backends by array type and its open/closed state)."""

    # -- arrays -----------------------------------------------------------------------------------
    def _take(self, name: str, arg: str, x: Any, op: Any = None, collective: bool = True,
              writes: bool = False) -> Tuple[Any, Any, Any]:
        """(backend, array, spec) for argument ``arg``, after every check of the array alone
        (that it is writable too if the call ``writes`` into it), and of ``op`` for its dtype
        when ``op`` is given. The spec is the backend's ``reductions[dtype][op]``, or
        ``movements[dtype]`` without ``op``. For a foreign array, the array is a NumPy/CuPy
        view of it and the backend maps results back."""
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
        arg = _arg(arg)
        b = self._backends.get(type(x))
        if b is None:
            kind = self._classify(x)
            if kind is None:
                native = _foreign.to_native(x, self._device_module)
                if native is None:
                    raise self._fail(TypeError, name, f"{arg} must be a NumPy or CuPy array "
                                                      f"(or expose the buffer protocol, "
                                                      f"__array_interface__, "
                                                      f"__cuda_array_interface__ or "
                                                      f"__dlpack__), got {_kind(x)}")
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

    # -- arguments that must match the input ------------------------------------------------------
    def _check_out(self, name: str, arg: str, b: Any, out: Any, like: Any,
                   shapes: Sequence[tuple], expected: str = "", writes: bool = True) -> Any:
        """``out`` as an array of ``like``'s kind and dtype with one of ``shapes`` (and
        writable, unless the call only reads it: ``writes=False``)."""
        if (type(out) is type(like) and out.dtype is like.dtype and out.shape in shapes
                and out.flags.c_contiguous
                and (out.device.id == b.device_id if b.device_id is not None
                     else not writes or out.flags.writeable)):
            return out
        out = self._check_kind(name, arg, b, out, like, writes)
        if out.shape not in shapes:
            want = " or ".join(str(s) for s in shapes)
            raise self._fail(ValueError, name, f"{arg} has shape {out.shape}, expected "
                                               f"{want}{expected}")
        return out

    def _check_kind(self, name: str, arg: str, b: Any, other: Any, like: Any,
                    writes: bool = True) -> Any:
        """``other`` as an array that passes every check (writable if ``writes``) and matches
        ``like``'s backend and dtype (a NumPy/CuPy view if it is foreign)."""
        if other is None:
            raise self._fail(TypeError, name, f"{arg} must be an array, got None")
        known, native = self._backends.get(type(other)), other
        if known is None and self._classify(other) is None:
            known, native, _ = self._take(name, arg, other, collective=False)
        own = getattr(b, "inner", b)
        mixed = (getattr(known, "inner", known) is not own if known is not None
                 else (self._classify(native) == "host") != (own is self._host))
        if mixed:
            raise self._fail(TypeError, name, f"{arg} is {_kind(other)} but the input is "
                                              f"{_kind(like)}; one call takes host arrays or "
                                              f"device arrays, not both")
        self._take(name, arg, native, writes=writes)
        if native.dtype != like.dtype:
            raise self._fail(TypeError, name, f"{arg} has dtype {native.dtype}, expected "
                                              f"{like.dtype} (the input's)")
        if native is not other and isinstance(b, _foreign.Foreign):
            b.remember(native, other)
        return native

    def _check_parts(self, name: str, arg: str, b: Any, parts: Sequence, like: Any,
                     writes: bool = True) -> List:
        """``parts`` as a list of ``size`` arrays shaped like ``like`` (written, unless
        ``writes=False``)."""
        if len(parts) != self.size:
            raise self._fail(ValueError, name, f"{arg} is a list of {len(parts)} arrays, "
                                               f"expected {self.size} (one per rank)")
        return [self._check_out(name, f"{arg}[{j}]", b, part, like, (like.shape,),
                                writes=writes) for j, part in enumerate(parts)]

    def _check_leading_axis(self, name: str, arg: str, x: Any) -> None:
        if x.ndim == 0 or x.shape[0] % self.size:
            raise self._fail(ValueError, name, f"{arg} has shape {x.shape}: its leading axis "
                                               f"must split into {self.size} equal parts "
                                               f"(one per rank)")

    def _check_splits(self, arg: str, splits: Any, rows: Optional[int]) -> List[int]:
        """``splits`` as a list of ``size`` row counts >= 0 (adding up to ``rows`` if given)."""
        try:
            counts = [int(n) for n in splits]
            valid = (len(counts) == self.size and all(n >= 0 for n in counts)
                     and all(float(n) == c for n, c in zip(splits, counts)))
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise self._fail(ValueError, "all_to_all", f"{arg} must be {self.size} row counts "
                                                       f">= 0 (one per rank), got {splits!r}")
        if rows is not None and sum(counts) != rows:
            raise self._fail(ValueError, "all_to_all", f"{arg}={counts} adds up to "
                                                       f"{sum(counts)} rows, but x has {rows}")
        return counts

    # -- ranks, streams, state --------------------------------------------------------------------
    def _check_rank(self, name: str, arg: str, value: Any) -> None:
        if type(value) is int and 0 <= value < self.size:
            return
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self._fail(TypeError, name, f"{arg} must be an int rank, got {value!r}")
        if not 0 <= value < self.size:
            raise self._fail(ValueError, name, f"{arg}={value!r} is not a rank of this "
                                               f"communicator (0..{self.size - 1})")

    def _check_peer(self, name: str, arg: str, peer: Any) -> None:
        self._check_rank(name, arg, peer)
        if peer == self.rank and self._batch is None:
            raise self._fail(ValueError, name, f"{arg}={peer} is this rank; a message to "
                                               f"oneself needs its receive posted with it: "
                                               f"use sendrecv or a batch() block")

    def _check_stream(self, name: str, b: Any, stream: Any) -> None:
        if b.device_id is None:
            raise self._fail(TypeError, name, "stream= applies to device arrays only; host "
                                              "collectives run on MPI")
        if not isinstance(getattr(stream, "ptr", None), int):
            raise self._fail(TypeError, name, f"stream must be a CUDA stream "
                                              f"(cupy.cuda.Stream or ExternalStream), got "
                                              f"{_kind(stream)}")

    def _check_open(self, name: str) -> None:
        if self._closed:
            raise CommClosedError(f"{name}: the communicator is closed (rank {self.rank}); "
                                  f"create a new one with cupycomm.init()")

    # -- errors -----------------------------------------------------------------------------------
    def _fail(self, kind: type, name: str, text: str) -> Exception:
        return kind(f"{name}: {text} on rank {self.rank}")

    def _dtype_error(self, name: str, arg: Any, x: Any) -> Exception:
        supported = ", ".join(str(d) for d in DTYPES)
        return self._fail(TypeError, name, f"{_arg(arg)} has dtype {x.dtype}, which is not "
                                           f"supported (supported: {supported})")

    def _reduction_error(self, name: str, arg: str, b: Any, x: Any, op: Any) -> Exception:
        row = DTYPES.get(x.dtype)
        if row is None:
            return self._dtype_error(name, arg, x)
        if isinstance(op, str) and op in {o.value for o in row.ops}:
            return self._fail(ValueError, name, f"{b.name.upper()} has no {x.dtype} type to "
                                                f"reduce; convert to a wider type")
        return self._fail(ValueError, name, op_error(row, op))
