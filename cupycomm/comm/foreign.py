"""Arrays of other libraries (torch, numba, JAX, Python buffers) without a copy.

An object that exposes ``__cuda_array_interface__`` or a CUDA ``__dlpack__`` becomes a CuPy
view of its memory; one that exposes a CPU ``__dlpack__``, ``__array_interface__`` or the
buffer protocol becomes a NumPy view. bfloat16 tensors (torch), which NumPy's and CuPy's
DLPack import do not know, travel as their 16-bit words viewed as ml_dtypes' bfloat16.

The collective runs on the view, so in-place results land in the caller's own object.
:class:`Foreign` wraps the backend for that call and maps the results of its collectives
back: the caller's own objects where the result is one of them, else a new object of the
caller's library made by its ``from_dlpack`` (torch, for instance), else the NumPy or CuPy
array. Buffers cupycomm allocates for itself (``empty``) stay NumPy or CuPy arrays.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from .._collectives import BACKEND_METHODS
from .._dtypes import DTYPES
from ..work import Work

__all__ = ["to_native", "Foreign", "Unsupported"]

_DLPACK_CPU, _DLPACK_CUDA = 1, 2
# NumPy before 2.1 imports every DLPack object read-only (the protocol had no flag to say
# otherwise), so results cannot be written into a host object that only exposes __dlpack__.
_NUMPY_DLPACK_READ_ONLY = tuple(int(part) for part in np.__version__.split(".")[:2]) < (2, 1)
_BFLOAT16 = next((dtype for dtype in DTYPES if dtype.name == "bfloat16"), None)


class Unsupported(TypeError):
    """An array of another library that cupycomm cannot view; the text completes
    "x ..." in the caller's message."""


def to_native(x: Any, cupy: Callable[[], Any]) -> Optional[Any]:
    """A NumPy or CuPy view of ``x``'s memory, or None if ``x`` exposes none. ``cupy()``
    returns the device module (it is only loaded for device objects). NumPy scalars are not
    arrays: they have no memory a result could land in.

    Raises :class:`Unsupported` for a bfloat16 array that cannot be viewed here.
    """
    if isinstance(x, np.generic):
        return None
    words = _bfloat16_words(x)
    if words is not None:
        return _as_bfloat16(to_native(words, cupy), x)
    if _exposes(x, "__cuda_array_interface__"):
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


def read_only_through_dlpack(x: Any, native: Any) -> Optional[str]:
    """Why ``native``, :func:`to_native`'s view of ``x``, is read-only when ``x`` may not be
    (NumPy before 2.1 imports host ``__dlpack__`` objects read-only), else None; the text
    completes "x ..." in the caller's message."""
    if (_NUMPY_DLPACK_READ_ONLY and isinstance(native, np.ndarray)
            and not native.flags.writeable and hasattr(x, "__dlpack__")
            and not _exposes(x, "__cuda_array_interface__")):
        return (f"exposes its memory through __dlpack__, which NumPy {np.__version__} (before "
                f"2.1) imports read-only")
    return None


def _exposes(x: Any, name: str) -> bool:
    """hasattr, for properties that raise more than AttributeError (torch's CUDA array
    interface raises TypeError for a dtype it cannot describe)."""
    try:
        getattr(x, name)
    except (AttributeError, TypeError):
        return False
    return True


def _library(x: Any) -> Any:
    return sys.modules.get(type(x).__module__.split(".")[0])


def _bfloat16_words(x: Any) -> Optional[Any]:
    """``x`` viewed as 16-bit integers when it is a bfloat16 array of a library with its own
    dtypes (torch: ``x.view(torch.int16)``), else None."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype) or not str(dtype).endswith("bfloat16"):
        return None
    int16 = getattr(_library(x), "int16", None)
    if int16 is None or not hasattr(x, "view"):
        return None
    return x.view(int16)


def _as_bfloat16(words: Any, original: Any) -> Any:
    if words is None:
        return None
    if _BFLOAT16 is None:
        raise Unsupported(f"has dtype {original.dtype}, which needs ml_dtypes' bfloat16 here: "
                          f"pip install 'cupycomm[bfloat16]'")
    try:
        return words.view(_BFLOAT16)
    except (TypeError, ValueError) as error:   # CuPy has no bfloat16 arrays
        raise Unsupported(f"has dtype {original.dtype}, which {type(words).__module__} "
                          f"arrays cannot hold ({error})") from None


class Foreign:
    """A backend for one call whose arguments were foreign objects: delegates to ``inner``
    and maps the results of its collectives (arrays, lists of arrays, a Work's result) back
    to the caller's objects. Only the collective methods are wrapped
    (:data:`cupycomm._collectives.BACKEND_METHODS`); everything else is ``inner``'s own."""

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
        if name not in BACKEND_METHODS:
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
        library = _library(self.like)
        from_dlpack = getattr(library, "from_dlpack", None)
        if not callable(from_dlpack) or library is np:
            return array
        try:
            if (_BFLOAT16 is not None and array.dtype == _BFLOAT16
                    and _bfloat16_words(self.like) is not None):
                return from_dlpack(array.view(np.int16)).view(self.like.dtype)
            return from_dlpack(array)
        except (TypeError, ValueError, RuntimeError, BufferError):
            return array   # that library cannot take it: the NumPy/CuPy array it is
