"""The Communicator's argument checks that need no backend: leading axes and splits, ranks and
peers, a subgroup's color, key and ranks, streams, the open/closed state, and the texts of the
errors (the arrays given alongside the data array are checked by :mod:`cupycomm.comm.route`).

Every check runs on the calling rank before any communication. A bad argument raises
TypeError (the wrong kind of object) or ValueError (a wrong value or shape) whose message
names the collective, the argument, the value and the rank, e.g.
``all_gather: out has shape (6,), expected (4, 3) or (12,) on rank 3``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Type

import numpy as np

from .._dtypes import DTYPES, op_error
from .batch import Batch
from ..errors import CommClosedError, CommShrunkError

__all__ = ["Checks", "kind_name", "arg_name"]


def kind_name(x: Any) -> str:
    """``numpy.ndarray``, ``torch.Tensor``: an object's library and type, for messages."""
    return f"{type(x).__module__}.{type(x).__name__}"


def arg_name(arg: Any) -> str:
    """An argument's name for a message: ``"x"``, or ``("arrays", 3)`` for ``arrays[3]``
    (a loop over many arrays passes tuples: the text is only made for an error)."""
    return arg if isinstance(arg, str) else f"{arg[0]}[{arg[1]}]"


class Checks:
    """The checks of one communicator's ``rank`` of ``size``, as a part of it; they read the
    facts of its state that they judge: ``closed`` (set by ``close()``; ``shrunk`` too, the
    name of the call, where ``shrink()`` or ``grow()`` replaced it) and ``batch`` (the open
    ``batch()`` block, set by ``batch()``).

    Example::

        checks = Checks(rank=0, size=2)
        checks.check_rank("reduce", "root", 2)
        # ValueError: reduce: root=2 is not a rank of this communicator (0..1) on rank 0
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.closed = False
        self.shrunk = ""   # "shrink" or "grow": the call that replaced it
        self.batch: Optional[Batch] = None

    # -- shapes -----------------------------------------------------------------------------------
    def check_leading_axis(self, name: str, arg: str, x: Any) -> None:
        if x.ndim == 0 or x.shape[0] % self.size:
            raise self.fail(ValueError, name, f"{arg} has shape {x.shape}: its leading axis "
                                              f"must split into {self.size} equal parts "
                                              f"(one per rank)")

    def check_splits(self, arg: str, splits: Any, rows: Optional[int]) -> List[int]:
        """``splits`` as a list of ``size`` row counts >= 0 (adding up to ``rows`` if given)."""
        try:
            counts = [int(n) for n in splits]
            valid = (len(counts) == self.size and all(n >= 0 for n in counts)
                     and all(float(n) == c for n, c in zip(splits, counts)))
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise self.fail(ValueError, "all_to_all", f"{arg} must be {self.size} row counts "
                                                      f">= 0 (one per rank), got {splits!r}")
        if rows is not None and sum(counts) != rows:
            raise self.fail(ValueError, "all_to_all", f"{arg}={counts} adds up to "
                                                      f"{sum(counts)} rows, but x has {rows}")
        return counts

    # -- ranks, subgroups, streams, state ---------------------------------------------------------
    def check_rank(self, name: str, arg: str, value: Any) -> None:
        if type(value) is int and 0 <= value < self.size:
            return
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self.fail(TypeError, name, f"{arg} must be an int rank, got {value!r}")
        if not 0 <= value < self.size:
            raise self.fail(ValueError, name, f"{arg}={value!r} is not a rank of this "
                                              f"communicator (0..{self.size - 1})")

    def check_peer(self, name: str, arg: str, peer: Any) -> None:
        self.check_rank(name, arg, peer)
        if peer == self.rank and self.batch is None:
            raise self.fail(ValueError, name, f"{arg}={peer} is this rank; a message to "
                                              f"oneself needs its receive posted with it: "
                                              f"use sendrecv or a batch() block")

    def check_split(self, color: Any, key: Any) -> None:
        """``split(color, key)``'s arguments: an int color >= 0 or None, an int key or None."""
        if color is not None and (isinstance(color, bool)
                                  or not isinstance(color, (int, np.integer)) or color < 0):
            raise self.fail(ValueError, "split", f"color must be an int >= 0 or None, got "
                                                 f"{color!r}")
        if key is not None and (isinstance(key, bool) or not isinstance(key, (int, np.integer))):
            raise self.fail(TypeError, "split", f"key must be an int or None, got {key!r}")

    def check_members(self, ranks: Any) -> List[int]:
        """``new_group(ranks)``'s ranks, sorted: a non-empty list of distinct ranks."""
        members = list(ranks) if isinstance(ranks, (list, tuple, range)) else None
        if not members:
            raise self.fail(ValueError, "new_group", f"ranks must be a non-empty list of "
                                                     f"ranks, got {ranks!r}")
        for member in members:
            self.check_rank("new_group", "ranks", member)
        if len(set(members)) != len(members):
            repeated = sorted({r for r in members if members.count(r) > 1})
            raise self.fail(ValueError, "new_group", f"ranks repeats {repeated}: each rank "
                                                     f"may appear once")
        return sorted(members)

    def check_stream(self, name: str, b: Any, stream: Any) -> None:
        if b.device_id is None:
            raise self.fail(TypeError, name, "stream= applies to device arrays only; host "
                                             "collectives run on MPI")
        if not isinstance(getattr(stream, "ptr", None), int):
            raise self.fail(TypeError, name, f"stream must be a CUDA stream "
                                             f"(cupy.cuda.Stream or ExternalStream), got "
                                             f"{kind_name(stream)}")
        device = getattr(stream, "device_id", -1)   # (-1: the current device's, as handle 0)
        if device not in (-1, b.device_id):
            raise self.fail(ValueError, name, f"stream= is a stream of device {device}, but "
                                              f"the communicator uses device {b.device_id}; "
                                              f"pass a stream made on device {b.device_id} "
                                              f"(with comm.device: cupy.cuda.Stream())")

    def check_open(self, name: str) -> None:
        if self.closed:
            if self.shrunk:
                why = ("shrunk after a peer was lost" if self.shrunk == "shrink"
                       else "grown by new processes")
                raise CommShrunkError(f"{name}: the communicator was {why} (rank "
                                      f"{self.rank}); use the communicator {self.shrunk}() "
                                      f"returned")
            raise CommClosedError(f"{name}: the communicator is closed (rank {self.rank}); "
                                  f"create a new one with cupycomm.init()")

    # -- errors -----------------------------------------------------------------------------------
    def fail(self, kind: Type[Exception], name: str, text: str) -> Exception:
        """The error ``kind`` of call ``name`` saying ``text`` and the rank (to raise)."""
        return kind(f"{name}: {text} on rank {self.rank}")

    def dtype_error(self, name: str, arg: Any, x: Any) -> Exception:
        supported = ", ".join(str(d) for d in DTYPES)
        return self.fail(TypeError, name, f"{arg_name(arg)} has dtype {x.dtype}, which is not "
                                          f"supported (supported: {supported})")

    def reduction_error(self, name: str, arg: Any, b: Any, x: Any, op: Any) -> Exception:
        row = DTYPES.get(x.dtype)
        if row is None:
            return self.dtype_error(name, arg, x)
        if isinstance(op, str) and op in {o.value for o in row.ops}:
            return self.fail(ValueError, name, f"{b.name.upper()} has no {x.dtype} type to "
                                               f"reduce; convert to a wider type")
        return self.fail(ValueError, name, op_error(row, op))
