"""Arrays of other libraries (torch, numba, JAX, Python buffers) without a copy.

An object that exposes ``__cuda_array_interface__`` or a CUDA ``__dlpack__`` becomes a CuPy
view of its memory; one that exposes a CPU ``__dlpack__``, ``__array_interface__`` or the
buffer protocol becomes a NumPy view. The collective runs on the view, so in-place results
land in the caller's own object. :class:`Foreign` wraps the backend for that call and maps
the results back: the caller's own objects where the result is one of them, else a new
object of the caller's library made by its ``from_dlpack`` (torch, for instance), else the
NumPy or CuPy array.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from .backends import Backend
from .work import Work

__all__ = ["to_native", "Foreign"]

_DLPACK_CPU, _DLPACK_CUDA = 1, 2
_METHODS = frozenset(name for name in vars(Backend) if not name.startswith("_")
                     and callable(getattr(Backend, name)))


def to_native(x: Any, cupy: Callable[[], Any]) -> Optional[Any]:
    """A NumPy or CuPy view of ``x``'s memory, or None if ``x`` exposes none. ``cupy()``
    returns the device module (it is only loaded for device objects). NumPy scalars are not
    arrays: they have no memory a result could land in."""
    if isinstance(x, np.generic):
        return None
    if hasattr(x, "__cuda_array_interface__"):
        return cupy().asarray(x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = x.__dlpack_device__()[0]
        if device_type == _DLPACK_CUDA:
            return cupy().from_dlpack(x)
        if device_type == _DLPACK_CPU:
            return np.from_dlpack(x)
    if hasattr(x, "__array_interface__"):
        return np.asarray(x)
    try:
        memoryview(x)
    except TypeError:
        return None
    return np.asarray(x)


class Foreign:
    """A backend for one call whose arguments were foreign objects: delegates to ``inner``
    and maps every result (arrays, lists of arrays, a Work's result) back to the caller's."""

    def __init__(self, inner: Any, native: Any, original: Any) -> None:
        self.inner = inner
        self.like = original
        self._originals: Dict[int, Tuple[Any, Any]] = {}
        self.remember(native, original)

    def remember(self, native: Any, original: Any) -> None:
        """``native`` stands for ``original`` in this call's results."""
        self._originals[id(native)] = (native, original)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name not in _METHODS:
            return attribute
        return lambda *args, **kwargs: self._back(attribute(*args, **kwargs))

    def _back(self, result: Any) -> Any:
        if isinstance(result, Work):
            result._result = self._back(result._result)
            return result
        if isinstance(result, list):
            return [self._back(item) for item in result]
        if result is None:
            return None
        native, original = self._originals.get(id(result), (None, None))
        return original if native is result else self._new(result)

    def _new(self, array: Any) -> Any:
        """A new result in the caller's library, where it has ``from_dlpack``."""
        library = sys.modules.get(type(self.like).__module__.split(".")[0])
        from_dlpack = getattr(library, "from_dlpack", None)
        if callable(from_dlpack) and library is not np:
            try:
                return from_dlpack(array)
            except (TypeError, ValueError, RuntimeError, BufferError):
                pass   # that library cannot take it: the NumPy/CuPy array it is
        return array
