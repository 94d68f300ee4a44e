"""One process, many GPUs: broadcast, scatter, gather and sums across this process's devices,
and parallel_apply (the torch.cuda.comm family).

A place is a GPU id (an int, or a ``cupy.cuda.Device``) or ``"cpu"``; inputs are NumPy or
CuPy arrays, and results are put at the places asked for. broadcast and reduce_add (and
their coalesced forms) over several GPUs are NCCL collectives, everything else asynchronous
copies on the copy engines, ordered with each device's current stream by events. Every
argument is checked before anything is allocated or moved (TypeError, ValueError, naming
the function, the argument and the value). ``device_module`` is the CuPy-like module to
use: CuPy by default, imported only when a call involves a GPU (the test suite passes its
stand-in). The guide: docs/guide/devices-and-prefetch.md; the streams in full:
docs/internals.md, "devices/comm.py".
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union, cast

from .places import HOST, DeviceCall, Place, brief, describe, with_length
from ..backends.shapes import offsets, views_of
from ..comm.coalesce import runs_by_dtype
from .copies import (Copy, Order, broadcast_arrays, keep, move, sum_arrays, whole)

__all__ = ["broadcast", "broadcast_coalesced", "scatter", "gather", "reduce_add",
           "reduce_add_coalesced", "parallel_apply", "count", "HOST", "BUFFER_BYTES"]

BUFFER_BYTES = 10 * 2 ** 20
"""The default size limit of one coalesced buffer, in bytes (torch's ``buffer_size``)."""


# -- coalescing -----------------------------------------------------------------------------------
def _flatten(lib: DeviceCall, arrays: Sequence[Any], place: Place) -> Any:
    """One 1-d array at ``place`` holding ``arrays`` (of one dtype) one after another."""
    sizes = [a.size for a in arrays]
    flat = lib.empty(place, (sum(sizes),), arrays[0].dtype)
    move(lib, [whole(flat, place, lib.contiguous(a, place), place, start)
               for a, start in zip(arrays, offsets(sizes))])
    return flat


def _unflatten(flats: Sequence[Any], buckets: List[List[int]],
               like: Sequence[Any]) -> Tuple[Any, ...]:
    """Views of ``flats`` (one per bucket) shaped like ``like``, in ``like``'s order."""
    views: List[Any] = [None] * len(like)
    for flat, bucket in zip(flats, buckets):
        for j, view in zip(bucket, views_of(flat, [like[j] for j in bucket])):
            views[j] = view
    return tuple(views)


# -- the family -----------------------------------------------------------------------------------
def broadcast(x: Any, devices: Optional[Sequence[Any]] = None, *,
              out: Optional[Sequence[Any]] = None, device_module: Any = None) -> Tuple[Any, ...]:
    """Copy ``x`` to each place of ``devices``, or into each array of ``out``.

    Args:
        x: the array, on a GPU or the host.
        devices: the places of the copies: GPU ids, or ``"cpu"``.
        out: arrays shaped and typed like ``x`` to copy into (keyword-only); their places
            are the targets.

    .. note:: Exactly one of ``devices`` and ``out`` must be given.

    Returns:
        A tuple of copies of ``x``: new arrays on ``devices``, or the arrays of ``out``.

    Example (2 GPUs)::

        x = cupy.arange(3)                           # on device 0
        a, b = devices.broadcast(x, devices=[0, 1])  # a on device 0, b on device 1: [0, 1, 2]
    """
    lib = DeviceCall("broadcast", device_module)
    source = lib.place("x", x)
    lib.one_of("devices", devices, "out", out)
    if out is None:
        targets, outs = lib.targets("devices", devices), None
    else:
        targets, outs = lib.outs("out", out, "x", x), [[o] for o in out]
    copies = broadcast_arrays(lib, [lib.contiguous(x, source)], source, targets, outs)
    return tuple(row[0] for row in copies)


def broadcast_coalesced(arrays: Sequence[Any], devices: Sequence[Any], *,
                        buffer_bytes: int = BUFFER_BYTES,
                        device_module: Any = None) -> Tuple[Tuple[Any, ...], ...]:
    """Copy several arrays (all at one place) to each place of ``devices``, packed into
    buffers of at most ``buffer_bytes`` per dtype, so that many small arrays cost a few
    transfers. Returns ``result[t][k]``, the copy of ``arrays[k]`` at ``devices[t]`` (a view
    into a shared buffer).

    Example (2 GPUs)::

        w, b = cupy.ones((2, 2)), cupy.zeros(2)      # on device 0
        (w0, b0), (w1, b1) = devices.broadcast_coalesced([w, b], devices=[0, 1])
    """
    lib = DeviceCall("broadcast_coalesced", device_module)
    arrays = lib.sequence("arrays", arrays, empty=True)
    places = [lib.place(f"arrays[{i}]", a) for i, a in enumerate(arrays)]
    for i, p in enumerate(places):
        if p != places[0]:
            raise lib.fail(ValueError, f"arrays[{i}] is on {describe(p)}, but arrays[0] is on "
                                       f"{describe(places[0])}; the arrays come from one place")
    targets = lib.targets("devices", devices)
    limit = lib.integer("buffer_bytes", buffer_bytes, 1)
    if not arrays:
        return tuple(() for _ in targets)
    buckets = runs_by_dtype(arrays, limit)
    flats = [_flatten(lib, [arrays[j] for j in bucket], places[0]) for bucket in buckets]
    copies = broadcast_arrays(lib, flats, places[0], targets)
    return tuple(_unflatten(row, buckets, arrays) for row in copies)


def scatter(x: Any, devices: Optional[Sequence[Any]] = None,
            chunk_sizes: Optional[Sequence[int]] = None, axis: int = 0,
            streams: Optional[Sequence[Any]] = None, *, out: Optional[Sequence[Any]] = None,
            device_module: Any = None) -> Tuple[Any, ...]:
    """Split ``x`` along ``axis`` and put chunk ``i`` at ``devices[i]`` (or into ``out[i]``).

    Args:
        x: the array, on a GPU or the host.
        devices: the places of the chunks: GPU ids, or ``"cpu"``.
        chunk_sizes: the length of each chunk along ``axis``; they add up to
            ``x.shape[axis]``. Default: as equal as possible, the first ones longer by one
            (as ``numpy.array_split``).
        axis: the axis to split along.
        streams: per target, the stream for the copies to it, or None for its current
            stream; the current stream then waits for them.
        out: arrays to copy into (keyword-only), like ``x`` but along ``axis``; their
            places are the targets and their lengths the chunk sizes.

    .. note:: Exactly one of ``devices`` and ``out`` must be given; ``chunk_sizes`` only
        with ``devices``.

    Returns:
        The chunks as a tuple of new arrays, or the arrays of ``out``.

    Example (2 GPUs)::

        x = numpy.arange(10).reshape(5, 2)
        a, b = devices.scatter(x, devices=[0, 1])   # a: rows 0..2 on device 0, b: rows 3..4 on 1
    """
    lib = DeviceCall("scatter", device_module)
    source = lib.place("x", x)
    axis = lib.axis("x", x, axis)
    lib.one_of("devices", devices, "out", out)
    length = x.shape[axis]
    if out is None:
        targets = lib.targets("devices", devices)
        sizes = lib.chunk_sizes("chunk_sizes", chunk_sizes, len(targets), length, axis)
    else:
        lib.not_with_out("chunk_sizes", chunk_sizes, "out's lengths are the chunk sizes")
        targets = lib.outs("out", out, "x", x, axis)
        sizes = lib.chunk_sizes(f"out's lengths along axis {axis}", [o.shape[axis] for o in out],
                                len(targets), length, axis)
    given = lib.streams(streams, targets)
    x = lib.contiguous(x, source)
    parts = list(out) if out is not None else [
        lib.empty(t, with_length(x.shape, axis, size), x.dtype) for t, size in zip(targets, sizes)]
    move(lib, [Copy(part, t, 0, x, source, start, axis, size)
               for part, t, start, size in zip(parts, targets, offsets(sizes), sizes)], given)
    return tuple(parts)


def gather(arrays: Sequence[Any], axis: int = 0, destination: Any = None, *, out: Any = None,
           device_module: Any = None) -> Any:
    """Join ``arrays`` (from any places) along ``axis`` at ``destination`` (or into ``out``).

    Args:
        arrays: arrays of one dtype, alike but along ``axis``.
        axis: the axis to join along.
        destination: a GPU id or ``"cpu"``. Default: the host for host arrays, else the
            current device.
        out: the array to join into (keyword-only), on a GPU or the host.

    .. note:: ``destination`` must not be given with ``out``.

    Returns:
        The joined array (``out`` when given).

    Example (2 GPUs)::

        parts = [cupy.arange(2), cupy.arange(3)]    # say on devices 0 and 1
        devices.gather(parts, destination="cpu")     # array([0, 1, 0, 1, 2])
    """
    lib = DeviceCall("gather", device_module)
    arrays = lib.sequence("arrays", arrays)
    places = [lib.place(f"arrays[{i}]", a) for i, a in enumerate(arrays)]
    first = arrays[0]
    axis = lib.axis("arrays[0]", first, axis)
    for i, a in enumerate(arrays[1:], 1):
        lib.like(f"arrays[{i}]", a, "arrays[0]", first, axis)
    sizes = [a.shape[axis] for a in arrays]
    shape = with_length(first.shape, axis, sum(sizes))
    if out is None:
        target = lib.destination(destination, places)
    else:
        lib.not_with_out("destination", destination, "out's place is the destination")
        target = lib.place("out", out)
        if out.dtype != first.dtype:
            raise lib.fail(TypeError, f"out has dtype {out.dtype}, expected {first.dtype}")
        if out.shape != shape:
            raise lib.fail(ValueError, f"out has shape {out.shape}, expected {shape} (the "
                                       f"arrays joined along axis {axis})")
        lib.writable("out", out)
    parts = [lib.contiguous(a, p) for a, p in zip(arrays, places)]
    result = lib.empty(target, shape, first.dtype) if out is None else out
    move(lib, [Copy(result, target, start, part, p, 0, axis, size)
               for part, p, start, size in zip(parts, places, offsets(sizes), sizes)])
    return result


def reduce_add(inputs: Sequence[Any], destination: Any = None, *,
               device_module: Any = None) -> Any:
    """The elementwise sum of ``inputs`` (one per GPU, or host arrays), at ``destination``.

    Inputs have one shape and dtype (bool adds as *or*; integers wrap, as in NCCL).
    ``destination`` is a GPU id or ``"cpu"``; default: the host for host inputs, else the
    current device. Returns a new array.

    Example (2 GPUs)::

        xs = [cupy.full(2, 1.0), cupy.full(2, 2.0)]   # on devices 0 and 1
        devices.reduce_add(xs, destination=0)          # array([3., 3.]) on device 0
    """
    lib = DeviceCall("reduce_add", device_module)
    inputs = lib.sequence("inputs", inputs)
    places = tuple(lib.place(f"input {i}", a) for i, a in enumerate(inputs))
    for i, a in enumerate(inputs[1:], 1):
        lib.like(f"input {i}", a, "input 0", inputs[0])
    lib.distinct("the inputs' places", places)
    target = lib.destination(destination, places)
    job = [lib.contiguous(a, p) for a, p in zip(inputs, places)]
    return sum_arrays(lib, [job], places, target)[0]


def reduce_add_coalesced(inputs: Sequence[Sequence[Any]], destination: Any = None, *,
                         buffer_bytes: int = BUFFER_BYTES,
                         device_module: Any = None) -> Tuple[Any, ...]:
    """reduce_add of many arrays at once: ``inputs[i]`` lists the arrays of one place (one
    per GPU, or host lists), alike across places position by position. They are packed into
    buffers of at most ``buffer_bytes`` per dtype, so that many small arrays cost a few
    reductions. Returns the sums in order (views into shared buffers) at ``destination``.

    Example (2 GPUs)::

        grads = [[w0, b0], [w1, b1]]                   # w0, b0 on device 0; w1, b1 on device 1
        w, b = devices.reduce_add_coalesced(grads, destination=0)
    """
    lib = DeviceCall("reduce_add_coalesced", device_module)
    rows = [lib.sequence(f"inputs[{i}]", row, empty=True)
            for i, row in enumerate(lib.sequence("inputs", inputs))]
    first = rows[0]
    places = []
    for i, row in enumerate(rows):
        if len(row) != len(first):
            raise lib.fail(ValueError, f"inputs[{i}] has {len(row)} arrays, expected "
                                       f"{len(first)} like inputs[0]")
        here = [lib.place(f"inputs[{i}][{j}]", a) for j, a in enumerate(row)]
        for j, (a, p) in enumerate(zip(row, here)):
            if p != here[0]:
                raise lib.fail(ValueError, f"inputs[{i}][{j}] is on {describe(p)}, expected "
                                           f"{describe(here[0])} like inputs[{i}][0]; each inner "
                                           f"list holds the arrays of one place")
            lib.like(f"inputs[{i}][{j}]", a, f"inputs[0][{j}]", first[j])
        places.append(here[0] if here else HOST)
    lib.distinct("the inputs' places", places)
    limit = lib.integer("buffer_bytes", buffer_bytes, 1)
    target = lib.destination(destination, places)
    if not first:
        return ()
    buckets = runs_by_dtype(first, limit)
    jobs = [[_flatten(lib, [row[j] for j in bucket], p) for row, p in zip(rows, places)]
            for bucket in buckets]
    return _unflatten(sum_arrays(lib, jobs, tuple(places), target), buckets, first)


def parallel_apply(fn: Union[Callable[..., Any], Sequence[Callable[..., Any]]],
                   inputs: Sequence[Any],
                   devices: Optional[Sequence[Any]] = None, *,
                   device_module: Any = None) -> List[Any]:
    """Call ``fn`` once per input, on the input's device and that device's own stream.

    Args:
        fn: a callable, or one callable per input.
        inputs: one entry per device: a tuple is unpacked into positional arguments,
            anything else is the single argument. The arrays inside (nested tuples, lists
            and dicts too) must be on the entry's device.
        devices: the places to run on; default: where each input's first array is.

    ``fn`` runs for each device in turn, from this thread, with the device current and its
    stream (one per device, kept) current: the kernels it queues run on the devices at the
    same time (unless ``fn`` waits for them). Each stream first waits for the work queued
    on its device's current stream, and that stream waits for ``fn``'s work afterwards.
    On ``"cpu"`` places ``fn`` is simply called.

    Returns:
        The list of ``fn``'s results, in input order.

    Example (2 GPUs)::

        parts = devices.scatter(x, devices=[0, 1])
        outs = devices.parallel_apply(lambda a: a * 2, parts)
    """
    lib = DeviceCall("parallel_apply", device_module)
    inputs = lib.sequence("inputs", inputs)
    fns = [fn] * len(inputs) if callable(fn) else lib.sequence("fn", fn)
    if len(fns) != len(inputs) or not all(callable(f) for f in fns):
        raise lib.fail(TypeError, f"fn must be a callable or one callable per input "
                                  f"({len(inputs)}), got {brief(fn)}")
    found = [lib.leaves(f"inputs[{i}]", item) for i, item in enumerate(inputs)]
    if devices is None:
        for i, leaves in enumerate(found):
            if not leaves:
                raise lib.fail(ValueError, f"inputs[{i}] holds no array, so its device is "
                                           f"unknown; pass devices=")
        places = tuple(leaves[0][1] for leaves in found)
        lib.distinct("the inputs' devices", places)
    else:
        places = lib.targets("devices", devices)
        lib.count("devices", places, len(inputs), "inputs")
    for leaves, place in zip(found, places):
        for path, p in leaves:
            if p != place:
                raise lib.fail(ValueError, f"{path} is on {describe(p)}, but its input runs on "
                                           f"{describe(place)}")
    order = Order(lib) if places[0] != HOST else None
    outputs = []
    for f, item, place in zip(fns, inputs, places):
        args = item if isinstance(item, tuple) else (item,)
        if order is None:
            outputs.append(f(*args))
            continue
        gpu = cast(int, place)   # the places are all GPUs where there is an order
        stream = keep(("stream", lib.xp, gpu), lambda: _new_stream(lib, gpu))
        order.fork(gpu, stream, {gpu})
        with lib.on(gpu), stream:
            outputs.append(f(*args))
        order.join(gpu, stream, {gpu})
    return outputs


def _new_stream(lib: DeviceCall, device: int) -> Any:
    with lib.on(device):
        return lib.xp.cuda.Stream(non_blocking=True)


def count(*, device_module: Any = None) -> int:
    """How many GPUs this process sees: 0 without CuPy or a usable device.

    Example::

        places = list(range(devices.count())) or ["cpu"] * 2
    """
    return DeviceCall("count", device_module).gpu_count()
