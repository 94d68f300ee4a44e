"""Places (GPU ids and "cpu") and the argument checks of cupycomm.devices and cupycomm.prefetch.

A :class:`DeviceCall` is made per call: it names the call in messages, holds the device module
(CuPy unless given; imported only when an argument needs it), and checks arguments before
anything is allocated or moved: TypeError for the wrong kind of object, ValueError for a
wrong value, each naming the call, the argument and the value.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np

from .. import _bootstrap
from .._dtypes import DTYPES
from .nested import map_arrays, path_text
from ..comm.checks import kind_name

__all__ = ["HOST", "Place", "DeviceCall", "describe", "brief", "with_length"]

HOST = "cpu"
"""The place that means host memory: where a GPU id can be given, ``"cpu"`` puts the part in
a NumPy array."""
Place = Union[int, str]


def describe(place: Place) -> str:
    return "the host" if place == HOST else f"device {place}"


def brief(value: Any) -> str:
    """A short repr for messages: arrays by kind and shape."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(brief(v) for v in value) + "]"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"<{kind_name(value)} of shape {value.shape}>"
    return repr(value)


def with_length(shape: tuple, axis: int, length: int) -> tuple:
    return shape[:axis] + (length,) + shape[axis + 1:]


class DeviceCall:
    """One call's checks and array modules; the device module (CuPy unless given) is loaded
    only when an argument needs it."""

    def __init__(self, name: str, module: Any) -> None:
        self.name = name
        self._module = module
        self._loaded = module is not None

    @property
    def xp(self) -> Any:
        if not self._loaded:
            self._module, self._loaded = _bootstrap.import_cupy(), True
        return self._module

    def fail(self, kind: type, text: str) -> Exception:
        return kind(f"{self.name}: {text}")

    def gpu_count(self) -> int:
        xp = self.xp
        if xp is None:
            return 0
        try:
            return xp.cuda.runtime.getDeviceCount()
        except Exception:  # no driver, no device
            return 0

    # places
    def device(self, arg: str, value: Any) -> Place:
        if isinstance(value, str) and value == HOST:
            return HOST
        ordinal = getattr(value, "id", value)   # a cupy.cuda.Device
        if isinstance(ordinal, bool) or not isinstance(ordinal, (int, np.integer)):
            raise self.fail(TypeError, f"{arg} must be a GPU id (an int or a Device) or 'cpu', "
                                       f"got {value!r}")
        count = self.gpu_count()
        if not 0 <= ordinal < count:
            sees = f"{count} GPU{'s' * (count > 1)} (0..{count - 1})" if count else "no GPU"
            raise self.fail(ValueError, f"{arg} is {value!r}, but this process sees {sees}; "
                                        f"use 'cpu' for the host")
        return int(ordinal)

    def targets(self, arg: str, devices: Any) -> Tuple[Place, ...]:
        places = tuple(self.device(f"{arg}[{i}]", d)
                       for i, d in enumerate(self.sequence(arg, devices)))
        self.distinct(arg, places)
        return places

    def distinct(self, what: str, places: Sequence[Place]) -> None:
        """The GPUs of one argument differ, and do not come with the host."""
        gpus = [p for p in places if p != HOST]
        if gpus and len(gpus) < len(places):
            raise self.fail(ValueError, f"{what} {list(places)} mix GPUs and 'cpu'; give GPU "
                                        f"ids, or only 'cpu' places on a machine without GPUs")
        for i, p in enumerate(gpus):
            if p in gpus[:i]:
                raise self.fail(ValueError, f"device {p} appears twice in {what} {list(places)}")

    def destination(self, value: Any, places: Sequence[Place]) -> Place:
        """``value`` checked; None means the host for host inputs, else the current device."""
        if value is not None:
            return self.device("destination", value)
        if all(p == HOST for p in places):
            return HOST
        return self.xp.cuda.Device().id

    def streams(self, streams: Any, targets: Sequence[Place]) -> Dict[Place, Any]:
        """Scatter's streams by target device (None entries: the target's current stream)."""
        if streams is None:
            return {}
        streams = self.sequence("streams", streams)
        self.count("streams", streams, len(targets), "targets")
        given = {}
        for i, (stream, target) in enumerate(zip(streams, targets)):
            if stream is None:
                continue
            if not hasattr(stream, "ptr"):
                raise self.fail(TypeError, f"streams[{i}] must be a CUDA stream or None, got "
                                           f"{stream!r}")
            if target == HOST:
                raise self.fail(TypeError, f"streams[{i}] is given for 'cpu'; streams order "
                                           f"GPU work")
            owner = getattr(stream, "device_id", -1)
            if owner not in (-1, target):
                raise self.fail(ValueError, f"streams[{i}] belongs to device {owner}, but its "
                                            f"target is device {target}")
            given[target] = stream
        return given

    # arrays
    def where(self, a: Any) -> Optional[Place]:
        """The place of array ``a``; None when ``a`` is not an array."""
        if self._loaded or (not isinstance(a, np.ndarray)
                            and type(a).__module__.split(".")[0] == "cupy"):
            xp = self.xp
            if xp is not None and isinstance(a, xp.ndarray):
                return a.device.id
        return HOST if isinstance(a, np.ndarray) else None

    def place(self, arg: str, a: Any) -> Place:
        """The place of ``a``, which must be an array of a supported dtype."""
        where = self.where(a)
        if where is None:
            raise self.fail(TypeError, f"{arg} must be a NumPy or CuPy array, got {kind_name(a)}")
        if a.dtype not in DTYPES:
            supported = ", ".join(str(d) for d in DTYPES)
            raise self.fail(TypeError, f"{arg} has dtype {a.dtype}, which is not supported "
                                       f"(supported: {supported})")
        return where

    def like(self, arg: str, a: Any, first_arg: str, first: Any,
             axis: Optional[int] = None) -> None:
        """``a`` has ``first``'s dtype and shape (its length along ``axis`` aside, if given)."""
        if a.dtype != first.dtype:
            raise self.fail(TypeError, f"{arg} has dtype {a.dtype}, expected {first.dtype} "
                                       f"like {first_arg}")
        same = a.shape if axis is None or a.ndim != first.ndim else \
            with_length(a.shape, axis, first.shape[axis])
        if same != first.shape:
            shown = first.shape if axis is None else "(" + ", ".join(
                "*" if i == axis else str(n) for i, n in enumerate(first.shape)) + ")"
            raise self.fail(ValueError, f"{arg} has shape {a.shape}, expected {shown} like "
                                        f"{first_arg}")

    def outs(self, arg: str, out: Any, like_arg: str, like: Any,
             axis: Optional[int] = None) -> Tuple[Place, ...]:
        """The places of the ``out`` arrays, each checked against ``like``."""
        out = self.sequence(arg, out)
        places = tuple(self.place(f"{arg}[{i}]", o) for i, o in enumerate(out))
        for i, o in enumerate(out):
            self.like(f"{arg}[{i}]", o, like_arg, like, axis)
            self.writable(f"{arg}[{i}]", o)
        self.distinct(arg, places)
        return places

    def writable(self, arg: str, out: Any) -> None:
        if not out.flags.c_contiguous:
            raise self.fail(ValueError, f"{arg} must be C-contiguous, got shape {out.shape} "
                                        f"with strides {out.strides}")

    def integer(self, arg: str, value: Any, at_least: Optional[int] = None) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self.fail(TypeError, f"{arg} must be an int, got {value!r}")
        if at_least is not None and value < at_least:
            raise self.fail(ValueError, f"{arg} must be >= {at_least}, got {value}")
        return int(value)

    def count(self, arg: str, items: Sequence, expected: int, of: str) -> None:
        if len(items) != expected:
            raise self.fail(ValueError, f"{arg} has {len(items)} entries, but there are "
                                        f"{expected} {of}")

    def not_with_out(self, arg: str, value: Any, why: str) -> None:
        if value is not None:
            raise self.fail(TypeError, f"{arg} must not be given with out ({why}), got "
                                       f"{arg}={value!r}")

    def axis(self, arg: str, a: Any, axis: Any) -> int:
        axis = self.integer("axis", axis)
        if a.ndim == 0:
            raise self.fail(ValueError, f"{arg} is 0-d: it has no axis to split or join along")
        if not -a.ndim <= axis < a.ndim:
            raise self.fail(ValueError, f"axis {axis} is out of range for {arg} of shape "
                                        f"{a.shape}")
        return axis % a.ndim

    def chunk_sizes(self, what: str, sizes: Any, parts: int, length: int, axis: int) -> List[int]:
        if sizes is None:   # as numpy.array_split: the first length % parts chunks one longer
            return [length // parts + (i < length % parts) for i in range(parts)]
        sizes = [self.integer(f"{what}[{i}]", size, 0)
                 for i, size in enumerate(self.sequence(what, sizes))]
        self.count(what, sizes, parts, "targets")
        if sum(sizes) != length:
            raise self.fail(ValueError, f"{what} {tuple(sizes)} add up to {sum(sizes)}, but x "
                                        f"has {length} along axis {axis}")
        return sizes

    def sequence(self, arg: str, value: Any, empty: bool = False) -> list:
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable) \
                or self.where(value) is not None:
            raise self.fail(TypeError, f"{arg} must be a list or tuple, got {brief(value)}")
        items = list(value)
        if not items and not empty:
            raise self.fail(ValueError, f"{arg} is empty")
        return items

    def one_of(self, first: str, a: Any, second: str, b: Any) -> None:
        if (a is None) == (b is None):
            raise self.fail(TypeError, f"exactly one of {first} and {second} must be given, got "
                                       f"{first}={brief(a)} and {second}={brief(b)}")

    def leaves(self, arg: str, tree: Any) -> List[Tuple[str, Place]]:
        """(path, place) of every array inside ``tree`` (nested tuples, lists, dicts)."""
        found: List[Tuple[str, Place]] = []

        map_arrays(tree,   # an array's place is never None: the second function says so
                   lambda a, path: found.append((path_text(arg, path), cast(Place, self.where(a)))),
                   lambda a: self.where(a) is not None)
        return found

    # memory
    def on(self, place: Place) -> Any:
        """A context in which ``place`` is the current device (nothing for the host)."""
        return contextlib.nullcontext() if place == HOST else self.xp.cuda.Device(place)

    def empty(self, place: Place, shape: tuple, dtype: Any) -> Any:
        if place == HOST:
            return np.empty(shape, dtype)
        with self.on(place):
            return self.xp.empty(shape, dtype)

    def contiguous(self, a: Any, place: Place) -> Any:
        if a.flags.c_contiguous:
            return a
        with self.on(place):
            return a.copy()
