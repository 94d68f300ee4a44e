"""cupycomm.devices: one process, several GPUs. Every function x every dtype against NumPy
references, on host places ("cpu"), on four stand-in devices (the NCCL and copy paths, their
streams and events) and on the GPUs of the machine when it has some; every bad input; the
one-process example. Per-process calls: under mpiexec each rank runs them on its own."""
import contextlib
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

import cupycomm
from cupycomm.comm.coalesce import runs_by_dtype
from cupycomm.testing import standin as sd
from arrays import GPU, GPU_SKIP_REASON, STANDIN, lib_params, rank_input, reduce_reference
from cupycomm import devices
from cupycomm.backends import local as local_nccl
from cupycomm.devices import comm as device_comm, copies as device_copies

DTYPES = list(cupycomm.DTYPES)
ROOT = Path(__file__).resolve().parents[2]


class Where:
    """Where a test body runs: host places, the stand-in's four devices, or the real GPUs."""

    def __init__(self, lib):
        self.lib = lib
        self.module = lib.device_module if lib.is_device else None
        self.count = devices.count(device_module=self.module) if lib.is_device else 0

    def places(self, n):
        """Up to ``n`` distinct places (fewer on a machine with fewer GPUs)."""
        return ["cpu"] * n if self.count == 0 else list(range(min(n, self.count)))

    def put(self, data, place):
        if place == "cpu":
            return np.array(data)
        with self.lib.module.cuda.Device(place):
            return self.lib.array(data)

    def check(self, a, expected, place):
        """``a`` holds ``expected`` (dtype and values) at ``place``."""
        if place == "cpu":
            assert type(a) is np.ndarray, type(a)
            got = a
        else:   # reading waits for the place's current stream only: it must be enough
            assert a.device.id == place, (a.device.id, place)
            with self.lib.module.cuda.Device(place):
                got = self.lib.numpy(a)
        assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
        np.testing.assert_array_equal(got, expected)

    def call(self, fn, *args, **kwargs):
        return fn(*args, device_module=self.module, **kwargs)


@pytest.fixture(params=lib_params())
def where(request, monkeypatch):
    if request.param is STANDIN:
        monkeypatch.setattr(sd, "DEVICE_COUNT", 4)
    return Where(request.param)


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 4)
    return Where(STANDIN)


def data(i, shape, dtype, salt=0):
    return rank_input(i, shape, dtype, salt)


# -- broadcast ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_from_a_target_from_elsewhere_and_from_the_host(where, dtype):
    x = data(0, (5, 3), dtype)
    targets = where.places(3)
    for source in dict.fromkeys([targets[-1], targets[0], "cpu"]):
        copies = where.call(devices.broadcast, where.put(x, source), targets)
        assert len(copies) == len(targets)
        for copy, place in zip(copies, targets):
            where.check(copy, x, place)
    if where.count >= 3:   # a source device that is not a target: uploaded to the first first
        for copy, place in zip(where.call(devices.broadcast, where.put(x, 2), [0, 1]), [0, 1]):
            where.check(copy, x, place)


def test_broadcast_into_out_and_of_a_strided_view(where):
    x = data(0, (4, 6), np.float32)
    targets = where.places(3)
    out = [where.put(np.zeros((4, 3), np.float32), p) for p in targets]
    result = where.call(devices.broadcast, where.put(x, targets[0])[:, ::2], out=out)
    assert all(r is o for r, o in zip(result, out))
    for r, place in zip(result, targets):
        where.check(r, x[:, ::2], place)


def test_broadcast_coalesced_every_dtype_in_small_buffers(where):
    arrays = [data(i, (3, i % 4 + 1), dtype) for i, dtype in enumerate(DTYPES)]
    arrays += [data(99, (), np.float64), data(98, (0, 2), np.int32), data(97, (50,), np.int8)]
    targets = where.places(3)
    for source in (targets[0], "cpu"):
        placed = [where.put(a, source) for a in arrays]
        result = where.call(devices.broadcast_coalesced, placed, targets, buffer_bytes=40)
        assert len(result) == len(targets)
        for row, place in zip(result, targets):
            assert len(row) == len(arrays)
            for got, expected in zip(row, arrays):
                where.check(got, expected, place)


def test_buckets_keep_dtypes_apart_and_respect_the_limit():
    a = [np.ones(4, np.float32), np.ones(2, np.int8), np.ones(4, np.float32),
         np.ones(100, np.float32), np.ones(2, np.int8)]
    assert runs_by_dtype(a, 32) == [[0, 2], [1, 4], [3]]
    assert runs_by_dtype(a, 16) == [[0], [1, 4], [2], [3]]
    assert runs_by_dtype([], 16) == []


# -- scatter and gather ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_then_gather_every_dtype(where, dtype):
    x = data(1, (7, 3), dtype)
    targets = where.places(3)
    parts = where.call(devices.scatter, where.put(x, targets[-1]), targets)
    expected = np.array_split(x, len(targets))
    for part, chunk, place in zip(parts, expected, targets):
        where.check(part, chunk, place)
    for destination in dict.fromkeys([targets[0], targets[-1], "cpu"]):
        where.check(where.call(devices.gather, parts, destination=destination), x, destination)


SPLITS = [(0, None), (1, None), (2, None), (-1, None), (0, [4, 0, 1]), (1, [1, 3, 1]),
          (2, [0, 6, 0]), (1, [5, 0, 0])]


@pytest.mark.parametrize("axis,sizes", SPLITS, ids=[f"axis{a}-{s}" for a, s in SPLITS])
def test_scatter_and_gather_along_any_axis_in_any_chunks(where, axis, sizes):
    x = data(2, (5, 5, 6), np.float64)
    targets = where.places(3)
    if sizes is not None and len(targets) < 3:
        sizes = [x.shape[axis]] + [0] * (len(targets) - 1)
    edges = np.cumsum([0] + (sizes or [len(c) for c in np.array_split(
        np.empty(x.shape[axis]), len(targets))]))
    expected = [np.take(x, range(a, b), axis=axis) for a, b in zip(edges, edges[1:])]
    for source in dict.fromkeys([targets[0], "cpu"]):
        parts = where.call(devices.scatter, where.put(x, source), targets, sizes, axis)
        for part, chunk, place in zip(parts, expected, targets):
            where.check(part, chunk, place)
        for destination in dict.fromkeys([targets[-1], "cpu"]):
            joined = where.call(devices.gather, parts, axis=axis, destination=destination)
            where.check(joined, x, destination)


def test_scatter_and_gather_with_out(where):
    x = data(3, (4, 6), np.int64)
    targets = where.places(2)
    sizes = [6] if len(targets) == 1 else [2, 4]
    out = [where.put(np.zeros((4, s), np.int64), p) for s, p in zip(sizes, targets)]
    parts = where.call(devices.scatter, where.put(x, "cpu"), axis=1, out=out)
    assert all(p is o for p, o in zip(parts, out))
    for part, chunk, place in zip(parts, np.split(x, np.cumsum(sizes)[:-1], axis=1), targets):
        where.check(part, chunk, place)
    into = where.put(np.zeros_like(x), targets[-1])
    assert where.call(devices.gather, parts, axis=1, out=into) is into
    where.check(into, x, targets[-1])


def test_gather_of_parts_of_different_lengths_and_default_destination(where):
    parts_np = [data(i, (i + 1, 2), np.float32) for i in range(3)]
    targets = where.places(3)
    parts = [where.put(p, targets[i % len(targets)]) for i, p in enumerate(parts_np)]
    result = where.call(devices.gather, parts)
    default = "cpu" if where.count == 0 else 0   # the current device
    where.check(result, np.concatenate(parts_np), default)


# -- reduce_add -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_add_every_dtype_onto_every_kind_of_destination(where, dtype):
    places = where.places(3)
    stacked = np.stack([data(i, (4, 5), dtype, salt=7) for i in range(len(places))])
    expected = reduce_reference(stacked, "sum", len(places))
    inputs = [where.put(a, p) for a, p in zip(stacked, places)]
    destinations = dict.fromkeys([places[0], places[-1], "cpu"] + [3] * (where.count == 4))
    for destination in destinations:
        where.check(where.call(devices.reduce_add, inputs, destination=destination), expected,
                    destination)
    for i, p in enumerate(places):   # the inputs are untouched
        where.check(inputs[i], stacked[i], p)


def test_reduce_add_of_strided_inputs_and_default_destination(where):
    places = where.places(2)
    full = [data(i, (4, 8), np.float64) for i in range(len(places))]
    inputs = [where.put(a, p)[:, 1::2] for a, p in zip(full, places)]
    result = where.call(devices.reduce_add, inputs)
    where.check(result, sum(a[:, 1::2] for a in full), "cpu" if where.count == 0 else 0)


def test_reduce_add_coalesced_every_dtype_in_small_buffers(where):
    places = where.places(3)
    shapes = [(i % 3 + 1, 2) for i in range(len(DTYPES))] + [(), (0,)]
    dtypes = DTYPES + [np.dtype(np.float32), np.dtype(np.int8)]
    per_place = [[data(i, s, d, salt=j) for j, (s, d) in enumerate(zip(shapes, dtypes))]
                 for i in range(len(places))]
    inputs = [[where.put(a, p) for a in row] for row, p in zip(per_place, places)]
    for destination in dict.fromkeys([places[-1], "cpu"]):
        sums = where.call(devices.reduce_add_coalesced, inputs, destination, buffer_bytes=24)
        assert len(sums) == len(shapes)
        for j, got in enumerate(sums):
            stacked = np.stack([row[j] for row in per_place])
            where.check(got, reduce_reference(stacked, "sum", len(places)), destination)


# -- parallel_apply -------------------------------------------------------------------------------
Pair = namedtuple("Pair", "a b")


def test_parallel_apply_runs_each_input_where_it_is(where):
    places = where.places(3)
    xs = [data(i, (3, 2), np.float64) for i in range(len(places))]
    inputs = [where.put(x, p) for x, p in zip(xs, places)]
    outs = where.call(devices.parallel_apply, lambda a: a * 2 + 1, inputs)
    for out, x, p in zip(outs, xs, places):
        where.check(out, x * 2 + 1, p)
    # tuples are unpacked, nested containers are searched for arrays, one fn per input
    packed = [(Pair(a, {"k": [a]}), 3) for a in inputs]
    fns = [lambda pair, k, i=i: pair.b["k"][0] * k + i for i in range(len(places))]
    outs = where.call(devices.parallel_apply, fns, packed, places)
    for i, (out, x, p) in enumerate(zip(outs, xs, places)):
        where.check(out, x * 3 + i, p)


def test_parallel_apply_on_the_host_just_calls(where):
    calls = []
    outs = devices.parallel_apply(lambda v: calls.append(v) or v + 1, [1, 2], ["cpu", "cpu"])
    assert outs == [2, 3] and calls == [1, 2]


# -- streams, events and NCCL on the stand-in -----------------------------------------------------
@pytest.fixture
def held(standin):
    """A deferred current stream on each stand-in device (a GPU still busy with earlier
    work): nothing queued there runs until something waits for it."""
    streams = []
    for device in range(4):
        with sd.Device(device):
            streams.append(sd.Stream(non_blocking=True, deferred=True).use())
    yield streams
    for device in range(4):
        with sd.Device(device):
            sd.Stream.null.use()


def idle(streams):
    return all(s.executed == 0 for s in streams)


def test_scatter_waits_for_its_source_and_the_source_for_the_copies(standin, held):
    with sd.Device(0):
        x = sd.zeros((6, 2))
    sd.launch(held[0], lambda: x.__setitem__(Ellipsis, np.arange(12.).reshape(6, 2)), "fill")
    parts = devices.scatter(x, [1, 2, 3], device_module=sd)
    assert idle(held), "the host waited for a stream"
    assert held[0].log[:2] == ["fill", held[0].log[1]] and held[0].log[1].startswith("record")
    for target in held[1:]:
        assert target.log[0] == f"wait {held[0].log[1].split()[1]}"
        assert target.log[1].startswith("memcpy device->device")
    assert [entry.split()[0] for entry in held[0].log[2:]] == ["wait"] * 3
    for part, chunk, place in zip(parts, np.split(np.arange(12.).reshape(6, 2), 3), [1, 2, 3]):
        standin.check(part, chunk, place)
    assert {(1, 0), (2, 0), (3, 0)} <= sd.peer_access


def test_scatter_on_given_streams_then_the_current_streams_wait(standin):
    x = np.arange(8.0)
    side = []
    for device in (0, 1):
        with sd.Device(device):
            side.append(sd.Stream(non_blocking=True, deferred=True))
    parts = devices.scatter(x, [0, 1], streams=side, device_module=sd)
    for stream, device in zip(side, (0, 1)):
        with sd.Device(device):   # the new part's memory may be in use on the current stream
            assert f"record {stream.log[0].split()[1]}" in sd.get_current_stream().log
        assert any(entry.startswith("memcpy host") or entry.startswith("memcpy pageable")
                   for entry in stream.log), stream.log
        with sd.Device(device):
            assert f"wait {stream.log[-1].split()[-1]}" in sd.get_current_stream().log
    for part, chunk, place in zip(parts, np.split(x, 2), (0, 1)):
        standin.check(part, chunk, place)


def test_gather_waits_for_each_parts_stream(standin, held):
    parts = []
    for device in (1, 2):
        with sd.Device(device):
            part = sd.zeros(3)
        sd.launch(held[device], lambda p=part, d=device: p.__setitem__(Ellipsis, d), "fill")
        parts.append(part)
    result = devices.gather(parts, destination=0, device_module=sd)
    assert idle(held), "the host waited for a stream"
    standin.check(result, np.array([1.0] * 3 + [2.0] * 3), 0)
    reduced = devices.reduce_add(parts, destination=3, device_module=sd)
    standin.check(reduced, np.full(3, 3.0), 3)


def test_nccl_paths_run_in_groups_on_each_devices_current_stream(standin, monkeypatch):
    monkeypatch.setattr(local_nccl, "_communicators", {})   # none from earlier tests
    before = sd.init_all_calls
    x = sd.asarray(np.arange(4.0))
    producer = sd.Stream(non_blocking=True, deferred=True)
    with producer:
        sd.launch(producer, lambda: x.__setitem__(Ellipsis, x * 10), "scale")
        copies = devices.broadcast(x, [0, 1, 2], device_module=sd)
        assert "nccl broadcast" in producer.log
    producer.synchronize()   # (device 0's copy is on it: the null stream is not ordered with it)
    for copy, place in zip(copies, [0, 1, 2]):
        standin.check(copy, np.arange(4.0) * 10, place)
    total = devices.reduce_add(copies, destination=1, device_module=sd)
    standin.check(total, np.arange(4.0) * 30, 1)
    devices.broadcast(x, [0, 1, 2], device_module=sd)
    assert sd.init_all_calls == before + 1, "the communicators of a device tuple are kept"
    devices.broadcast(x, [2, 1], device_module=sd)
    assert sd.init_all_calls == before + 2


def test_reduce_add_without_an_nccl_type_adds_on_the_destination(standin):
    xs = [standin.put(data(i, (5,), np.int16), i) for i in range(3)]
    calls = sd.init_all_calls
    total = devices.reduce_add(xs, destination=2, device_module=sd)
    assert sd.init_all_calls == calls
    standin.check(total, sum(data(i, (5,), np.int16) for i in range(3)).astype(np.int16), 2)


def test_parallel_apply_runs_on_a_side_stream_between_events(standin):
    x = sd.zeros(4)
    producer = sd.Stream(non_blocking=True, deferred=True)
    seen = []
    with producer:
        sd.launch(producer, lambda: x.__setitem__(Ellipsis, 5.0), "fill")

        def fn(a):
            seen.append(sd.get_current_stream())
            out = sd.empty(4)
            sd.launch(sd.get_current_stream(), lambda: out.__setitem__(Ellipsis, a + 1), "k")
            return out
        (out,) = devices.parallel_apply(fn, [x], device_module=sd)
        worker = seen[0]
        assert worker is not producer and worker.device_id == 0
        assert worker.log[0].startswith("wait") and producer.log[-1].startswith("wait")
        standin.check(out, np.full(4, 6.0), 0)   # on producer, which waits for fn's work


def test_nccl_failure_is_a_named_error(standin, monkeypatch):
    def broken(*args):
        raise sd.NcclError("unhandled cuda error")
    monkeypatch.setattr(sd.LocalNcclCommunicator, "reduce", broken)
    xs = [standin.put(np.ones(2), d) for d in (0, 1)]
    with pytest.raises(cupycomm.NcclError, match=r"reduce_add: NCCL failed on devices \[0, 1\]: "
                                                 r"unhandled cuda error"):
        devices.reduce_add(xs, device_module=sd)


# -- bad input ------------------------------------------------------------------------------------
def bad_cases():
    """(id, call(put), exception, message) on the stand-in's four devices; ``put(a, d)``
    places NumPy data on device d."""
    f8 = lambda shape=(4, 4): np.ones(shape)
    D = dict(device_module=sd)

    def other_device_stream():
        with sd.Device(1):
            return sd.Stream()
    return [
        ("x-not-an-array", lambda put: devices.broadcast([1.0], [0], **D), TypeError,
         r"broadcast: x must be a NumPy or CuPy array, got builtins\.list"),
        ("x-dtype", lambda put: devices.scatter(np.array(["a", "b"]), [0], **D), TypeError,
         r"scatter: x has dtype <U1, which is not supported \(supported: bool, int8"),
        ("unknown-device", lambda put: devices.broadcast(f8(), [0, 99], **D), ValueError,
         r"broadcast: devices\[1\] is 99, but this process sees 4 GPUs \(0\.\.3\)"),
        ("negative-device", lambda put: devices.scatter(f8(), [-1], **D), ValueError,
         r"devices\[0\] is -1"),
        ("device-kind", lambda put: devices.scatter(f8(), [0, 1.0], **D), TypeError,
         r"scatter: devices\[1\] must be a GPU id \(an int or a Device\) or 'cpu', got 1\.0"),
        ("device-string", lambda put: devices.scatter(f8(), ["cuda:0"], **D), TypeError,
         r"got 'cuda:0'"),
        ("repeated-device", lambda put: devices.scatter(f8(), [0, 1, 0], **D), ValueError,
         r"scatter: device 0 appears twice in devices \[0, 1, 0\]"),
        ("mixed-places", lambda put: devices.broadcast(f8(), [0, "cpu"], **D), ValueError,
         r"broadcast: devices \[0, 'cpu'\] mix GPUs and 'cpu'"),
        ("devices-not-a-list", lambda put: devices.broadcast(f8(), "cpu", **D), TypeError,
         r"broadcast: devices must be a list or tuple, got 'cpu'"),
        ("devices-empty", lambda put: devices.scatter(f8(), [], **D), ValueError,
         r"scatter: devices is empty"),
        ("neither-devices-nor-out", lambda put: devices.broadcast(f8(), **D), TypeError,
         r"broadcast: exactly one of devices and out must be given, got devices=None and "
         r"out=None"),
        ("both-devices-and-out", lambda put: devices.scatter(f8(), [0], out=[put(f8(), 0)], **D),
         TypeError, r"devices=\[0\] and out=\[<cupycomm\.testing\.standin\.ndarray of shape \(4, 4\)>\]"),
        ("chunks-sum", lambda put: devices.scatter(f8((5, 2)), [0, 1], [2, 2], **D), ValueError,
         r"scatter: chunk_sizes \(2, 2\) add up to 4, but x has 5 along axis 0"),
        ("chunks-count", lambda put: devices.scatter(f8(), [0, 1], [4], **D), ValueError,
         r"chunk_sizes has 1 entries, but there are 2 targets"),
        ("chunks-negative", lambda put: devices.scatter(f8(), [0, 1], [5, -1], **D), ValueError,
         r"chunk_sizes\[1\] must be >= 0, got -1"),
        ("chunks-kind", lambda put: devices.scatter(f8(), [0, 1], [2.0, 2], **D), TypeError,
         r"chunk_sizes\[0\] must be an int, got 2\.0"),
        ("chunks-with-out", lambda put: devices.scatter(f8(), None, [4], out=[put(f8(), 0)], **D),
         TypeError, r"chunk_sizes must not be given with out"),
        ("out-lengths", lambda put: devices.scatter(f8(), out=[put(f8((3, 4)), 0)], **D),
         ValueError, r"out's lengths along axis 0 \(3,\) add up to 3, but x has 4"),
        ("out-shape", lambda put: devices.scatter(f8(), out=[put(f8((4, 3)), 0)], **D),
         ValueError, r"scatter: out\[0\] has shape \(4, 3\), expected \(\*, 4\) like x"),
        ("out-dtype", lambda put: devices.broadcast(f8(), out=[put(np.ones((4, 4), "f4"), 0)],
                                                    **D),
         TypeError, r"broadcast: out\[0\] has dtype float32, expected float64 like x"),
        ("out-strided", lambda put: devices.broadcast(f8(), out=[put(f8((4, 8)), 0)[:, ::2]], **D),
         ValueError, r"out\[0\] must be C-contiguous"),
        ("out-repeated-device", lambda put: devices.broadcast(
            f8(), out=[put(f8(), 1), put(f8(), 1)], **D), ValueError,
         r"device 1 appears twice in out \[1, 1\]"),
        ("axis-range", lambda put: devices.scatter(f8(), [0], axis=2, **D), ValueError,
         r"scatter: axis 2 is out of range for x of shape \(4, 4\)"),
        ("axis-kind", lambda put: devices.gather([f8()], axis=0.0, **D), TypeError,
         r"gather: axis must be an int, got 0\.0"),
        ("scalar-x", lambda put: devices.scatter(np.array(1.0), [0], **D), ValueError,
         r"scatter: x is 0-d: it has no axis to split or join along"),
        ("streams-count", lambda put: devices.scatter(f8(), [0, 1], streams=[None], **D),
         ValueError, r"streams has 1 entries, but there are 2 targets"),
        ("stream-of-other-device", lambda put: devices.scatter(
            f8(), [0], streams=[other_device_stream()], **D), ValueError,
         r"streams\[0\] belongs to device 1, but its target is device 0"),
        ("stream-for-the-host", lambda put: devices.scatter(f8(), ["cpu"], streams=[sd.Stream()],
                                                            **D),
         TypeError, r"streams\[0\] is given for 'cpu'"),
        ("stream-kind", lambda put: devices.scatter(f8(), [0], streams=["s"], **D), TypeError,
         r"streams\[0\] must be a CUDA stream or None, got 's'"),
        ("gather-shape", lambda put: devices.gather([put(f8((2, 4)), 0), put(f8((2, 3)), 1)],
                                                    **D),
         ValueError,
         r"gather: arrays\[1\] has shape \(2, 3\), expected \(\*, 4\) like arrays\[0\]"),
        ("gather-dtype", lambda put: devices.gather([f8((2,)), np.ones(2, np.int32)], **D),
         TypeError, r"gather: arrays\[1\] has dtype int32, expected float64 like arrays\[0\]"),
        ("gather-empty", lambda put: devices.gather([], **D), ValueError,
         r"gather: arrays is empty"),
        ("gather-destination-and-out", lambda put: devices.gather([f8()], destination=0,
                                                                  out=f8(), **D),
         TypeError, r"destination must not be given with out"),
        ("gather-out-shape", lambda put: devices.gather([f8(), f8()], out=f8(), **D), ValueError,
         r"gather: out has shape \(4, 4\), expected \(8, 4\) \(the arrays joined along axis 0\)"),
        ("gather-destination", lambda put: devices.gather([f8()], destination=4, **D), ValueError,
         r"gather: destination is 4, but this process sees 4 GPUs"),
        ("reduce-shape", lambda put: devices.reduce_add(
            [put(f8(), 0), put(f8(), 1), put(f8((4, 3)), 2)], **D), ValueError,
         r"reduce_add: input 2 has shape \(4, 3\), expected \(4, 4\) like input 0"),
        ("reduce-dtype", lambda put: devices.reduce_add(
            [put(f8(), 0), put(np.ones((4, 4), np.float32), 1)], **D), TypeError,
         r"reduce_add: input 1 has dtype float32, expected float64 like input 0"),
        ("reduce-same-device", lambda put: devices.reduce_add([put(f8(), 1), put(f8(), 1)], **D),
         ValueError, r"reduce_add: device 1 appears twice in the inputs' places \[1, 1\]"),
        ("reduce-mixed", lambda put: devices.reduce_add([put(f8(), 0), f8()], **D), ValueError,
         r"reduce_add: the inputs' places \[0, 'cpu'\] mix GPUs and 'cpu'"),
        ("reduce-not-arrays", lambda put: devices.reduce_add([f8(), 3], **D), TypeError,
         r"reduce_add: input 1 must be a NumPy or CuPy array, got builtins\.int"),
        ("coalesced-rows", lambda put: devices.reduce_add_coalesced([[f8()], [f8(), f8()]], **D),
         ValueError, r"inputs\[1\] has 2 arrays, expected 1 like inputs\[0\]"),
        ("coalesced-row-places", lambda put: devices.reduce_add_coalesced(
            [[put(f8(), 0), put(f8(), 1)], [put(f8(), 1), put(f8(), 1)]], **D), ValueError,
         r"inputs\[0\]\[1\] is on device 1, expected device 0 like inputs\[0\]\[0\]"),
        ("coalesced-shapes", lambda put: devices.reduce_add_coalesced([[f8()], [f8((2,))]], **D),
         ValueError, r"inputs\[1\]\[0\] has shape \(2,\), expected \(4, 4\) like inputs\[0\]\[0\]"),
        ("buffer-bytes", lambda put: devices.broadcast_coalesced([f8()], [0], buffer_bytes=0, **D),
         ValueError, r"buffer_bytes must be >= 1, got 0"),
        ("buffer-bytes-kind", lambda put: devices.reduce_add_coalesced([[f8()]],
                                                                       buffer_bytes="1", **D),
         TypeError, r"buffer_bytes must be an int, got '1'"),
        ("coalesced-sources", lambda put: devices.broadcast_coalesced(
            [put(f8(), 0), put(f8(), 1)], [2], **D), ValueError,
         r"arrays\[1\] is on device 1, but arrays\[0\] is on device 0; the arrays come from one"),
        ("apply-wrong-device", lambda put: devices.parallel_apply(
            abs, [(put(f8(), 0),), {"x": put(f8(), 0)}], [0, 1], **D), ValueError,
         r"parallel_apply: inputs\[1\]\['x'\] is on device 0, but its input runs on device 1"),
        ("apply-no-array", lambda put: devices.parallel_apply(abs, [1], **D), ValueError,
         r"inputs\[0\] holds no array, so its device is unknown; pass devices="),
        ("apply-fns", lambda put: devices.parallel_apply([abs], [f8(), f8()], ["cpu", "cpu"], **D),
         TypeError, r"fn must be a callable or one callable per input \(2\)"),
        ("apply-devices", lambda put: devices.parallel_apply(abs, [f8()], ["cpu", "cpu"], **D),
         ValueError, r"devices has 2 entries, but there are 1 inputs"),
    ]


@pytest.mark.parametrize("call,kind,pattern",
                         [pytest.param(*case[1:], id=case[0]) for case in bad_cases()])
def test_bad_input_is_refused_before_anything_moves(standin, monkeypatch, call, kind, pattern):
    def put(a, device):
        with sd.Device(device):
            return sd.asarray(a)
    moved = []
    monkeypatch.setattr(device_copies, "move", lambda *a, **k: moved.append(a))
    monkeypatch.setattr(local_nccl, "_group", lambda *a, **k: moved.append(a))
    monkeypatch.setattr(device_comm, "move", lambda *a, **k: moved.append(a))
    with pytest.raises(kind, match=pattern):
        call(put)
    assert not moved


def test_host_places_need_no_gpu_and_say_so_for_gpu_ids():
    if devices.count() > 0:
        pytest.skip("this machine has a GPU; the message is for machines without one")
    with pytest.raises(ValueError, match=r"devices\[0\] is 0, but this process sees no GPU; "
                                         r"use 'cpu' for the host"):
        devices.scatter(np.ones(4), [0])


# -- the example, and host-only programs ----------------------------------------------------------
def run_alone(args):
    """Run python ``args`` as a process of its own (not a rank of this mpiexec job)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI", "PMIX", "HYDRA", "HYDI", "MPIR", "OMPI"))}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_one_process_example_checks_itself():
    done = run_alone(["examples/multi_gpu_one_process.py"])
    assert done.returncode == 0, done.stderr
    assert "scattered 12 rows to" in done.stdout and "gathered them back: ok" in done.stdout


def test_host_places_never_import_cupy():
    done = run_alone(["-c", "import sys, numpy as np; from cupycomm import devices; "
                            "p = devices.scatter(np.ones((4, 2)), ['cpu'] * 2); "
                            "devices.gather(p); devices.reduce_add(p); "
                            "assert 'cupy' not in sys.modules, 'CuPy was imported'"])
    assert done.returncode == 0, done.stderr


# -- real GPUs ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason=GPU_SKIP_REASON)
def test_gpu_a_slow_kernel_before_the_call_is_seen():
    cupy = GPU.module
    targets = list(range(min(4, cupy.cuda.runtime.getDeviceCount())))
    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            x = cupy.zeros((len(targets) * 1024, 1024), cupy.float32)
            for _ in range(50):   # a long chain of kernels still running when the copies start
                x = x * 0.5 + 1
            parts = devices.scatter(x, targets)
            copies = devices.broadcast(x, targets)
            total = devices.reduce_add(copies, destination=0)
            back = devices.gather(parts, destination="cpu")
            got = cupy.asnumpy(total)
    value = np.float32(0)
    for _ in range(50):
        value = value * np.float32(0.5) + np.float32(1)
    np.testing.assert_array_equal(back, np.full(back.shape, value, np.float32))
    np.testing.assert_allclose(got, np.full(got.shape, value * len(targets)), rtol=1e-6)


def test_a_sum_after_a_broadcast_sees_it_on_every_devices_null_stream(standin):
    """Each device's null stream is handle 0, with work of its own queued: a group's member
    takes its place in its own device's stream (the stand-in kept one count for handle 0)."""
    x = np.arange(4.0)
    with contextlib.ExitStack() as held:
        for device in (0, 1):
            with sd.Device(device):
                null = held.enter_context(sd.deferred(sd.Stream.null.queue()))
                for _ in range(3 * (1 - device)):   # device 0's stream is further on
                    sd.launch(null, lambda: None, "earlier work")
        copies = devices.broadcast(x, [0, 1], device_module=sd)
        total = devices.reduce_add(copies, "cpu", device_module=sd)
    standin.check(total, x * 2, "cpu")
