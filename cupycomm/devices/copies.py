"""Moving arrays between places for cupycomm.devices: copies on the copy engines, and NCCL
groups (:mod:`cupycomm.backends.local`), ordered with the current streams by events (the
semantics: docs/internals.md, "devices/comm.py").

A :class:`Copy` is a block of equally spaced rows: a chunk along any axis of a C-contiguous
array, or a whole array. ``move`` runs copies; ``broadcast_arrays`` and ``sum_arrays`` are the
bodies of broadcast and reduce_add, plain and coalesced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast


from ..backends import local
from .places import HOST, DeviceCall, Place

__all__ = ["keep", "Order", "Copy", "whole", "move", "broadcast_arrays", "sum_arrays"]

_kept: Dict[tuple, Any] = {}   # per device module: peer access enabled, parallel_apply's streams


def keep(key: tuple, make: Callable[[], Any]) -> Any:
    if key not in _kept:
        _kept[key] = make()
    return _kept[key]


class Order:
    """The events of one call, between its devices' current streams and the streams it uses."""

    def __init__(self, lib: DeviceCall) -> None:
        self._cuda = lib.xp.cuda
        self._current: Dict[int, Any] = {}
        self._ready: Dict[int, Any] = {}

    def current(self, device: int) -> Any:
        if device not in self._current:
            with self._cuda.Device(device):
                self._current[device] = self._cuda.get_current_stream()
        return self._current[device]

    def _is_current(self, device: int, stream: Any, user: int) -> bool:
        return user == device and self.current(user).ptr == stream.ptr

    def _record(self, device: int, stream: Any) -> Any:
        with self._cuda.Device(device):   # an event is recorded on a stream of its own device
            event = self._cuda.Event(disable_timing=True)
            event.record(stream)
        return event

    def fork(self, device: int, stream: Any, sources: Set[int]) -> None:
        """``stream`` (of ``device``) waits for the work queued so far on the current streams
        of ``sources``, as it was when this call first looked."""
        for source in sources:
            if not self._is_current(device, stream, source):
                if source not in self._ready:
                    self._ready[source] = self._record(source, self.current(source))
                with self._cuda.Device(device):
                    stream.wait_event(self._ready[source])

    def join(self, device: int, stream: Any, users: Set[int], host: bool = False) -> None:
        """The current streams of ``users`` (and the host, if ``host``) wait for ``stream``."""
        waiting = [user for user in users if not self._is_current(device, stream, user)]
        if not waiting and not host:
            return
        done = self._record(device, stream)
        for user in waiting:
            with self._cuda.Device(user):
                self.current(user).wait_event(done)
        if host:
            done.synchronize()


@dataclass(frozen=True)
class Copy:
    """``count`` entries along ``axis`` of ``src`` from ``src_start`` into ``dst`` from
    ``dst_start``; both arrays C-contiguous and alike but along ``axis``."""

    dst: Any
    dst_place: Place
    dst_start: int
    src: Any
    src_place: Place
    src_start: int
    axis: int
    count: int


def whole(dst: Any, dst_place: Place, src: Any, src_place: Place, offset: int = 0) -> Copy:
    """All of ``src`` into flat position ``offset`` of ``dst``."""
    return Copy(dst.reshape(-1), dst_place, offset, src.reshape(-1), src_place, 0, 0, src.size)


def _rows(a: Any, place: Place, axis: int, start: int, count: int) -> Tuple[int, int, int, int]:
    """(address, pitch, width, height) in bytes of ``a[..., start:start + count, ...]``."""
    inner = a.itemsize * math.prod(a.shape[axis + 1:])
    base = a.ctypes.data if place == HOST else a.data.ptr
    return base + start * inner, inner * a.shape[axis], inner * count, math.prod(a.shape[:axis])


def _memcpy(runtime: Any, c: Copy, stream: Any) -> None:
    dst, dpitch, width, height = _rows(c.dst, c.dst_place, c.axis, c.dst_start, c.count)
    src, spitch, _, _ = _rows(c.src, c.src_place, c.axis, c.src_start, c.count)
    if width * height == 0:
        return
    if c.src_place == HOST:
        kind = runtime.memcpyHostToDevice
    elif c.dst_place == HOST:
        kind = runtime.memcpyDeviceToHost
    else:   # between two GPUs CUDA finds the devices from the addresses, as CuPy's copies do
        kind = runtime.memcpyDeviceToDevice if c.src_place == c.dst_place else \
            runtime.memcpyDefault
    if height == 1 or dpitch == spitch == width:
        runtime.memcpyAsync(dst, src, width * height, kind, stream.ptr)
    else:
        runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream.ptr)


PEER_ACCESS_ALREADY_ENABLED = 704   # cudaErrorPeerAccessAlreadyEnabled (CUDA's driver_types.h)


def _peer_access(lib: DeviceCall, device: int, peer: int) -> bool:
    """Let ``device`` reach ``peer``'s memory directly where the hardware can (otherwise CUDA
    stages peer copies through the host), tolerating access that something else enabled
    first. (Not with CuPy's private ``runtime._deviceEnsurePeerAccess``: once any module runs
    ``import cupy.cuda.runtime``, ``cupy.cuda.runtime`` is a Python module of public names.
    The refusal leaves no last error on the thread for a later check to find: CuPy's
    ``check_status`` resets it with cudaGetLastError before raising, as that helper does.)"""
    runtime = lib.xp.cuda.runtime
    if runtime.deviceCanAccessPeer(device, peer):
        with lib.xp.cuda.Device(device):
            try:
                runtime.deviceEnablePeerAccess(peer)
            except runtime.CUDARuntimeError as error:
                if error.status != PEER_ACCESS_ALREADY_ENABLED:
                    raise
    return True


def move(lib: DeviceCall, copies: Sequence[Copy],
         streams: Optional[Dict[Place, Any]] = None) -> None:
    """Run ``copies``: host ones at once, the others each on the stream of its GPU end (the
    destination's, else the source's), ordered by events (docs/internals.md, "devices/comm.py")."""
    batches: Dict[int, List[Copy]] = {}
    for c in copies:
        if c.dst_place == HOST and c.src_place == HOST:
            index = (slice(None),) * c.axis
            c.dst[index + (slice(c.dst_start, c.dst_start + c.count),)] = \
                c.src[index + (slice(c.src_start, c.src_start + c.count),)]
        else:
            gpu = cast(int, c.src_place if c.dst_place == HOST else c.dst_place)
            batches.setdefault(gpu, []).append(c)
    if not batches:
        return
    order = Order(lib)
    for device, batch in batches.items():
        stream = (streams or {}).get(device) or order.current(device)
        sources = cast(Set[int], {c.src_place for c in batch} - {HOST})
        for peer in sources - {device}:
            keep(("peer", lib.xp, device, peer), lambda: _peer_access(lib, device, peer))
        order.fork(device, stream, sources | {device})   # new memory: freed on the current stream
        with lib.on(device):
            for c in batch:
                _memcpy(lib.xp.cuda.runtime, c, stream)
        order.join(device, stream, sources | {device},
                   host=any(c.dst_place == HOST for c in batch))


# -- the shared bodies ----------------------------------------------------------------------------
def broadcast_arrays(lib: DeviceCall, sources: List[Any], source: Place, targets: Tuple[Place, ...],
                     outs: Optional[List[List[Any]]] = None) -> List[List[Any]]:
    """``result[t][k]``: a copy of ``sources[k]`` (C-contiguous, at ``source``) at
    ``targets[t]``, in ``outs[t][k]`` when given."""
    if outs is None:
        outs = [[lib.empty(t, a.shape, a.dtype) for a in sources] for t in targets]
    if targets[0] == HOST or len(targets) == 1:
        move(lib, [whole(out, t, a, source)
                   for t, row in zip(targets, outs) for out, a in zip(row, sources)])
        return outs
    if source in targets:
        root, sends = targets.index(source), sources
    else:   # NCCL broadcasts from a member: upload to the first one
        move(lib, [whole(out, targets[0], a, source) for out, a in zip(outs[0], sources)])
        root, sends = 0, outs[0]
    order, gpus = Order(lib), cast(Tuple[int, ...], targets)   # HOST is not among them here
    local.broadcast(lib.name, lib.xp, gpus, [order.current(t) for t in gpus], root, sends, outs)
    return outs


def sum_arrays(lib: DeviceCall, jobs: List[List[Any]], places: Tuple[Place, ...],
               destination: Place) -> List[Any]:
    """The elementwise sum of each job's arrays (``job[i]`` at ``places[i]``, C-contiguous,
    alike), at ``destination``."""
    home = destination if destination in places else places[0]
    root = places.index(home)
    results = [lib.empty(home, job[0].shape, job[0].dtype) for job in jobs]
    by_nccl = [j for j, job in enumerate(jobs)
               if home != HOST and len(places) > 1 and local.can_sum(job[0].dtype)]
    if by_nccl:
        order, gpus = Order(lib), cast(Tuple[int, ...], places)   # NCCL sums on GPUs only
        local.reduce_sum(lib.name, lib.xp, gpus, [order.current(p) for p in gpus], root,
                         [jobs[j] for j in by_nccl], [results[j] for j in by_nccl])
    by_adding = [j for j in range(len(jobs)) if j not in by_nccl]
    if by_adding:
        parts = {}   # (job, input) -> the input where it is at home, else a copy to make there
        for j in by_adding:
            for i, (a, p) in enumerate(zip(jobs[j], places)):
                if i != root:
                    parts[j, i] = a if p == home else lib.empty(home, a.shape, a.dtype)
        move(lib, [whole(results[j], home, jobs[j][root], home) for j in by_adding]
             + [whole(part, home, jobs[j][i], places[i])
                for (j, i), part in parts.items() if part is not jobs[j][i]])
        with lib.on(home):
            for (j, _), part in parts.items():
                results[j] += part
    if destination == home:
        return results
    moved = [lib.empty(destination, r.shape, r.dtype) for r in results]
    move(lib, [whole(m, destination, r, home) for m, r in zip(moved, results)])
    return moved
