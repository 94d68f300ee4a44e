"""Host-to-device copies of batches on a background stream, ahead of the loop that uses them."""
from __future__ import annotations

import collections
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Deque, Iterable, Iterator, List, Optional, Tuple, cast

import numpy as np

from .._dtypes import DTYPES
from .places import HOST, DeviceCall, brief
from .nested import map_arrays, path_text

__all__ = ["prefetch", "Prefetcher"]

_ALIGN = 256                  # bytes: where each array of a batch starts in its staging buffer
_PARALLEL_BYTES = 4 * 2 ** 20  # an array this large is staged by several threads
_threads: Optional[ThreadPoolExecutor] = None


def prefetch(iterable: Iterable[Any], device: Any, depth: int = 2, *,
             device_module: Any = None) -> Iterator[Any]:
    """Iterate over ``iterable`` with the NumPy arrays of each item already on ``device``.

    What torch's DataParallel does with its background copy streams: each item's host arrays
    are copied into a pinned staging buffer and from there to new device arrays on a side
    stream, ``depth`` items ahead of the one the loop holds, so that the copies overlap the
    loop's kernels.

    - **Items** may be arrays or tuples, lists and dicts of them, nested; everything that is
      not a NumPy array (numbers, strings, arrays already on a device) is passed as it is.
    - **Ordering.** When an item is handed out, the then-current stream of ``device`` waits
      (by an event, not the host) for its copies: use the item on that stream.
    - **Memory.** Device arrays are new for every item, from the memory pool of the stream
      current when the item is requested; before the side stream writes into them it waits
      for the work queued on that stream so far (CuPy has no ``record_stream``, so a block
      freed by the loop's last step is only rewritten after that step). A staging buffer is
      rewritten only after the copy that read it has completed.
    - **Without a GPU** (``device`` None or ``"cpu"``) the items are passed through
      unchanged, so the same loop runs on the host.

    Args:
        iterable: the batches, e.g. a data loader.
        device: a GPU id or ``cupy.cuda.Device`` (``comm.device``), or None / ``"cpu"``.
        depth: how many items are copied ahead of the one in use (0: each item is copied
            when it is requested).

    Returns:
        An iterator; on a GPU a :class:`Prefetcher`, whose ``close()`` ends the copies early.

    Example::

        for x, y in cupycomm.prefetch(loader, device=comm.device, depth=2):
            loss = step(x, y)             # x and y are on the device
    """
    lib = DeviceCall("prefetch", device_module)
    depth = lib.integer("depth", depth, 0)
    try:
        source = iter(iterable)
    except TypeError:
        raise lib.fail(TypeError, f"iterable must be iterable, got {brief(iterable)}") from None
    place = HOST if device is None else lib.device("device", device)
    if place == HOST:
        return source
    return Prefetcher(source, cast(int, place), depth, lib)


def _stage(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, by several threads for a large array: one thread copies host memory
    more slowly than the copy engine moves it to the device, and would set the pace."""
    global _threads
    workers = min(8, os.cpu_count() or 1)
    parts = min(workers, src.nbytes // _PARALLEL_BYTES, len(src) if src.ndim else 0)
    if parts < 2:
        np.copyto(dst, src)
        return
    if _threads is None:
        _threads = ThreadPoolExecutor(workers, thread_name_prefix="cupycomm-prefetch")
    edges = [len(src) * i // parts for i in range(parts + 1)]
    list(_threads.map(lambda a, b: np.copyto(dst[a:b], src[a:b]), edges[:-1], edges[1:]))


class _Slot:
    """A pinned staging buffer, and the event of the last copy that read it."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda
        self.memory: Any = None
        self.host = np.empty(0, np.uint8)
        self.copied = cuda.Event(disable_timing=True)

    def reserve(self, nbytes: int) -> np.ndarray:
        """The staging buffer as bytes, at least ``nbytes`` long (call after ``copied``)."""
        if self.host.size < nbytes:
            self.memory = self._cuda.alloc_pinned_memory(nbytes)
            self.host = np.ndarray((nbytes,), np.uint8, buffer=self.memory)
        return self.host


class Prefetcher(Iterator[Any]):
    """The iterator :func:`prefetch` returns for a GPU.

    ``stream`` is its side stream; ``close()`` (also on leaving a ``with`` block, and at the
    end of the items) waits for the copies in flight and frees the staging buffers.
    """

    def __init__(self, source: Iterator[Any], device: int, depth: int, lib: DeviceCall) -> None:
        self._source = source
        self._depth = depth
        self._lib = lib
        self._cuda = lib.xp.cuda
        self.device = device
        with self._cuda.Device(device):
            self.stream = self._cuda.Stream(non_blocking=True)
            self._requested = self._cuda.Event(disable_timing=True)
            self._slots: Optional[List[_Slot]] = [_Slot(self._cuda) for _ in range(depth + 1)]
        self._queue: Deque[Tuple[Any, _Slot]] = collections.deque()   # (item on device, slot)
        self._taken = 0   # items taken from the source
        self._error: Optional[Exception] = None
        self._exhausted = False

    def __next__(self) -> Any:
        if self._slots is None:
            raise StopIteration
        with self._cuda.Device(self.device):
            consumer = self._cuda.get_current_stream()
            while len(self._queue) <= self._depth and not self._exhausted:
                self._fetch(consumer)
            if not self._queue:
                error, self._error = self._error, None
                self.close()
                if error is not None:
                    raise error
                raise StopIteration
            item, slot = self._queue.popleft()
            consumer.wait_event(slot.copied)
            return item

    def _fetch(self, consumer: Any) -> None:
        """Take the next item and start its copies; an error from the source (or in the item)
        is kept until the items before it have been handed out, as a plain loop would see it."""
        try:
            item = next(self._source)
            self._taken += 1
            assert self._slots is not None   # __next__ fetches only while open
            slot = self._slots[self._taken % len(self._slots)]
            self._queue.append((self._upload(item, slot, consumer), slot))
        except StopIteration:
            self._exhausted = True
        except Exception as error:
            self._exhausted, self._error = True, error

    def _is_host(self, a: Any) -> bool:
        return self._lib.where(a) == HOST

    def _upload(self, item: Any, slot: _Slot, consumer: Any) -> Any:
        arrays: List[Any] = []

        def collect(a: Any, path: Tuple[Any, ...]) -> None:
            if a.dtype not in DTYPES:   # the error names the array; the text only then
                self._lib.place(path_text(f"item {self._taken - 1}", path), a)
            arrays.append(a)
        map_arrays(item, collect, self._is_host)
        starts, total = [], 0
        for a in arrays:
            starts.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        slot.copied.synchronize()
        staging = slot.reserve(total)
        placed = []
        for a, start in zip(arrays, starts):
            _stage(staging[start:start + a.nbytes].view(a.dtype).reshape(a.shape), a)
            placed.append(self._lib.xp.empty(a.shape, a.dtype))   # the consumer stream's pool
        self._requested.record(consumer)
        self.stream.wait_event(self._requested)
        runtime = self._cuda.runtime
        for target, start in zip(placed, starts):
            if target.nbytes:
                runtime.memcpyAsync(target.data.ptr, slot.memory.ptr + start, target.nbytes,
                                    runtime.memcpyHostToDevice, self.stream.ptr)
        slot.copied.record(self.stream)
        on_device = iter(placed)
        return map_arrays(item, lambda a, path: next(on_device), self._is_host)

    def close(self) -> None:
        """Wait for the copies in flight and free the staging buffers; the iterator ends.

        The host waits because CuPy's pinned memory pool would hand a freed staging buffer
        to the next allocation at once, while a copy may still be reading it.
        """
        if self._slots is None:
            return
        self.stream.synchronize()
        self._queue.clear()
        self._slots = None

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_slots", None) is not None and not sys.is_finalizing():
            self.close()   # at interpreter exit CUDA may already be gone
