"""The Communicator's argument checks beyond the array alone: ``out`` and list parts, leading
axes and splits, ranks and peers, streams, the open/closed state, and the texts of the errors.

Every check runs on the calling rank before any communication. A bad argument raises
TypeError (the wrong kind of object) or ValueError (a wrong value or shape) whose message
names the collective, the argument, the value and the rank, e.g.
``all_gather: out has shape (6,), expected (4, 3) or (12,) on rank 3``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from ._dtypes import DTYPES, op_error
from .errors import CommClosedError

__all__ = ["Validation", "kind_name", "arg_name"]


def kind_name(x: Any) -> str:
    """``numpy.ndarray``, ``torch.Tensor``: an object's library and type, for messages."""
    return f"{type(x).__module__}.{type(x).__name__}"


def arg_name(arg: Any) -> str:
    """An argument's name for a message: ``"x"``, or ``("arrays", 3)`` for ``arrays[3]``
    (a loop over many arrays passes tuples: the text is only made for an error)."""
    return arg if isinstance(arg, str) else f"{arg[0]}[{arg[1]}]"


class Validation:
    """Checks mixed into :class:`cupycomm.Communicator`; they read the state its docstring
    lists (rank, size, backends, the open batch, closed) and call its dispatch
    (:class:`cupycomm._dispatch.Dispatch`) for arrays given alongside the data argument."""

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
                                              f"{kind_name(stream)}")
        device = getattr(stream, "device_id", -1)   # (-1: the current device's, as handle 0)
        if device not in (-1, b.device_id):
            raise self._fail(ValueError, name, f"stream= is a stream of device {device}, but "
                                               f"the communicator uses device {b.device_id}; "
                                               f"pass a stream made on device {b.device_id} "
                                               f"(with comm.device: cupy.cuda.Stream())")

    def _check_open(self, name: str) -> None:
        if self._closed:
            raise CommClosedError(f"{name}: the communicator is closed (rank {self.rank}); "
                                  f"create a new one with cupycomm.init()")

    # -- errors -----------------------------------------------------------------------------------
    def _fail(self, kind: type, name: str, text: str) -> Exception:
        return kind(f"{name}: {text} on rank {self.rank}")

    def _dtype_error(self, name: str, arg: Any, x: Any) -> Exception:
        supported = ", ".join(str(d) for d in DTYPES)
        return self._fail(TypeError, name, f"{arg_name(arg)} has dtype {x.dtype}, which is not "
                                           f"supported (supported: {supported})")

    def _reduction_error(self, name: str, arg: str, b: Any, x: Any, op: Any) -> Exception:
        row = DTYPES.get(x.dtype)
        if row is None:
            return self._dtype_error(name, arg, x)
        if isinstance(op, str) and op in {o.value for o in row.ops}:
            return self._fail(ValueError, name, f"{b.name.upper()} has no {x.dtype} type to "
                                                f"reduce; convert to a wider type")
        return self._fail(ValueError, name, op_error(row, op))
