"""Debug mode (``init(debug=True)`` or CUPYCOMM_DEBUG=1): before each collective, the ranks
compare a fingerprint of the call, so that a disagreement raises on every rank at once
instead of hanging or returning garbage.

The fingerprint holds what every rank passes alike (the collective, its sequence number,
``x``'s kind, dtype, size and contiguity, op, root, a new group's ranks); what may differ by
rank is left out, and point-to-point calls are not checked. Cost: one allgather of an 8-byte
checksum per collective (docs/guide/debug-mode.md; what is compared: docs/internals.md).

Example of the error, raised on every rank::

    CollectiveMismatch: all_reduce #4: ranks disagree: rank 2 called all_reduce with x: 12
    float32 (numpy), op: sum; ranks [0, 1, 3] called all_reduce with x: 10 float32 (numpy),
    op: sum (seen on rank 0)
"""
from __future__ import annotations

import functools
import inspect
import math
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


from .._collectives import CHECKED
from ..errors import CollectiveMismatch

__all__ = ["install", "fingerprint", "check_list"]

_ARRAYS = ("x", "out")   # array arguments: only the data argument counts
_IGNORED = ("self", "async_op", "stream", "obj", "objs")   # objects may differ by rank
_SPLITS = ("in_splits", "out_splits")   # rank-specific by nature: cross-checked instead
_DATA: Dict[str, Optional[str]] = {call.name: call.data for call in CHECKED}


def _array_print(value: Any, with_size: bool = True) -> Any:
    """What identifies an array argument across ranks: (library, dtype, size, contiguous),
    as plain values (text is made only for a message)."""
    if isinstance(value, (list, tuple)):
        return tuple(_array_print(v, with_size) for v in value)
    dtype = getattr(value, "dtype", None)
    if value is None:
        return "None"
    if dtype is None:
        return type(value).__name__
    flags = getattr(value, "flags", None)
    size = math.prod(value.shape) if with_size else None   # torch's size is a method
    return (type(value).__module__.split(".")[0], str(dtype), size,
            flags is None or flags.c_contiguous)


def _array_text(print_: Any) -> str:
    if isinstance(print_, str):
        return print_
    if not print_ or isinstance(print_[0], tuple):
        return "[" + ", ".join(_array_text(p) for p in print_) + "]"
    library, dtype, size, contiguous = print_
    count = "" if size is None else f"{size} "
    layout = "" if contiguous else " non-contiguous"
    return f"{count}{dtype}{layout} ({library})"


def fingerprint(name: str, arguments: Dict[str, Any]) -> Tuple:
    """(name, ((argument, value), ...)): what must agree across ranks. With uneven splits,
    array sizes differ by rank: the splits are cross-checked instead."""
    data = _DATA[name]
    uneven = any(arguments.get(key) is not None for key in _SPLITS)
    parts = []
    for key, value in arguments.items():
        if key in _IGNORED or key in _SPLITS or (key in _ARRAYS and key != data):
            continue
        if key == data:
            parts.append((key, _array_print(value, with_size=not uneven)))
        elif isinstance(value, (list, tuple, range)):
            parts.append((key, str(list(value))))
        else:
            parts.append((key, str(value)))
    return name, tuple(parts)


def _text(print_: Tuple) -> str:
    name, parts = print_
    described = ", ".join(f"{k}: {_array_text(v)}" for k, v in parts)   # others are text
    return f"{name} with {described}" if parts else name


def _mismatch(seq: int, prints: List[Tuple]) -> str:
    groups: Dict[Tuple, List[int]] = {}
    for rank, print_ in enumerate(prints):
        groups.setdefault(print_, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: len(item[1]))
    described = [f"{'rank ' + str(ranks[0]) if len(ranks) == 1 else 'ranks ' + str(ranks)} "
                 f"called {_text(print_)}" for print_, ranks in ordered]
    return f"#{seq}: ranks disagree: " + "; ".join(described)


def _splits_mismatch(splits: List[Tuple]) -> str:
    """Where rank i's in_splits[j] differs from rank j's out_splits[i], as text ('' if none)."""
    for i, (sent, _) in enumerate(splits):
        for j, (_, received) in enumerate(splits):
            if sent is not None and received is not None and list(sent)[j] != list(received)[i]:
                return (f"rank {i} sends {list(sent)[j]} rows to rank {j} (in_splits), which "
                        f"expects {list(received)[i]} from it (out_splits)")
    return ""


def _checked(parts: Any, name: str, method: Callable) -> Callable:
    parameters = list(inspect.signature(method).parameters.values())
    names = [p.name for p in parameters]
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(names) or not set(kwargs) <= set(names):
            return method(*args, **kwargs)   # the call's own TypeError, on every rank alike
        parts.checks.check_open(name)
        given = dict(zip(names, args), **kwargs)
        arguments = {n: given[n] if n in given else defaults[n] for n in names
                     if n in given or n in defaults}
        _compare(parts, name, fingerprint(name, arguments),
                 tuple(arguments.get(key) for key in _SPLITS))
        return method(*args, **kwargs)
    return call


def check_list(parts: Any, name: str, arrays: Sequence[Any], **arguments: Any) -> None:
    """Debug mode's check of call ``name`` on a list of ``arrays`` (and ``arguments``, such
    as the op): each array's library, dtype, size and contiguity, in order, must agree across
    ranks; else CollectiveMismatch on every rank, naming who differs. Collective.

    Example::

        check_list(comm.parts, "all_reduce_coalesced", grads, op="sum")
    """
    parts.checks.check_open(name)
    _compare(parts, name, (name, (("arrays", _array_print(list(arrays))),)
                          + tuple((key, str(value)) for key, value in arguments.items())))


def _compare(parts: Any, name: str, print_: Tuple, splits: Tuple = (None, None)) -> None:
    """Raise CollectiveMismatch on every rank unless every rank's ``print_`` (and
    ``splits``) agree. Ranks compare a checksum in one small allgather; only on a difference
    (or when uneven splits are given, which only the whole exchange can cross-check) do they
    exchange the whole fingerprints, to say who differs and how."""
    checksum = zlib.crc32(repr(print_).encode())
    checksums = parts.router.host.gather_ints([checksum], "debug check")
    if (checksums != checksum).any() or splits != (None, None):
        gathered = parts.router.host.gather_objects((print_, splits), "debug check")
        _raise_on_disagreement(parts.checks.rank, parts.tracker.seq + 1, name, print_, gathered)


def _raise_on_disagreement(rank: int, seq: int, name: str, mine: Tuple,
                           gathered: List[Tuple]) -> None:
    prints = [p for p, _ in gathered]
    if any(p != mine for p in prints):
        raise CollectiveMismatch(f"{name} {_mismatch(seq, prints)} (seen on rank {rank})")
    disagreement = _splits_mismatch([s for _, s in gathered])
    if disagreement:
        raise CollectiveMismatch(f"{name} #{seq}: {disagreement} (seen on rank {rank})")


def install(comm: Any, parts: Any) -> None:
    """Route the collectives of ``comm`` (whose ``parts`` they use) through the fingerprint
    check (instance attributes, so the class's call path, used without debug mode, stays as
    it is)."""
    for call in CHECKED:
        setattr(comm, call.name, _checked(parts, call.name, getattr(comm, call.name)))
