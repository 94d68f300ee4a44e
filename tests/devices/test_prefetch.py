"""cupycomm.prefetch: items copied to a device ahead of use, on a side stream. On the host the
items pass through; on the stand-in, every dtype and nested items arrive, the consumer's
stream waits for the copies, a staging buffer is rewritten only after its copy has read it,
device memory is written only after the consumer's earlier work; errors come in order; on a
GPU, the overlap it is for. Per-process: under mpiexec each rank runs its own."""
import importlib.util
import os
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

import cupycomm
from cupycomm.testing import standin as sd
from arrays import GPU, GPU_SKIP_REASON, rank_input

DTYPES = list(cupycomm.DTYPES)
Pair = namedtuple("Pair", "x y")


@pytest.fixture(autouse=True)
def two_devices(monkeypatch):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)


def items(n=6, dtype=np.float64):
    """Known random items of varying sizes (growing, then shrinking: staging buffers are
    reused and regrown), nested, with values that are not arrays."""
    out = []
    for i in range(n):
        rows = [3, 5, 9, 2, 7, 1][i % 6]
        out.append(Pair(rank_input(i, (rows, 4), dtype),
                        {"labels": rank_input(i, (rows,), np.int32, salt=1), "epoch": i,
                         "extra": [rank_input(i, (), dtype, salt=2), "text"]}))
    return out


def on_host(tree):
    """``tree`` with stand-in device arrays read back (their values, on the host)."""
    if isinstance(tree, sd.ndarray):
        return sd.asnumpy(tree)
    if isinstance(tree, dict):
        return {k: on_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        values = [on_host(v) for v in tree]
        return type(tree)(*values) if hasattr(tree, "_fields") else type(tree)(values)
    return tree


def assert_same(got, expected, device=None):
    """Equal structure and values; arrays on ``device`` (None: NumPy arrays)."""
    if isinstance(expected, np.ndarray):
        if device is None:
            assert type(got) is np.ndarray
        else:
            assert isinstance(got, sd.ndarray) and got.device.id == device
            got = sd.asnumpy(got)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    elif isinstance(expected, dict):
        assert type(got) is dict and got.keys() == expected.keys()
        for key in expected:
            assert_same(got[key], expected[key], device)
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected):
            assert_same(g, e, device)
    else:
        assert got == expected


@pytest.mark.parametrize("device", [None, "cpu"])
def test_without_a_gpu_items_pass_through_unchanged(device):
    batches = items()
    got = list(cupycomm.prefetch(batches, device))
    assert len(got) == len(batches) and all(g is b for g, b in zip(got, batches))


@pytest.mark.parametrize("depth", [0, 1, 2, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_items_arrive_on_the_device_with_every_dtype(dtype, depth):
    batches = items(dtype=dtype)
    got = list(cupycomm.prefetch(batches, sd.Device(1), depth, device_module=sd))
    assert len(got) == len(batches)
    for g, b in zip(got, batches):
        assert_same(g, b, device=1)


def test_device_arrays_and_empty_arrays_in_an_item():
    with sd.Device(1):
        already = sd.asarray(np.ones(3))
    batch = [(already, np.empty((0, 3)), np.arange(12.0).reshape(3, 4)[:, ::2])]
    ((same, empty, strided),) = list(cupycomm.prefetch(batch, 1, device_module=sd))
    assert same is already
    assert_same(empty, np.empty((0, 3)), device=1)
    assert_same(strided, np.arange(12.0).reshape(3, 4)[:, ::2], device=1)


def test_large_arrays_are_staged_by_several_threads():
    big = [rank_input(i, (3 * 2 ** 19 + 5, 4), np.float64)[::-1] for i in range(2)]   # 12 MiB
    for got, expected in zip(cupycomm.prefetch(big, 0, device_module=sd), big):
        assert_same(got, expected, device=0)
    if (os.cpu_count() or 1) > 1:
        assert sys.modules["cupycomm.devices.prefetch"]._threads is not None


def test_the_consumer_stream_waits_for_the_copy():
    batches = items(3)
    it = cupycomm.prefetch(batches, 0, depth=1, device_module=sd)
    consumer = sd.Stream(non_blocking=True, deferred=True)
    with sd.deferred(it.stream), consumer:
        first = next(it)
        assert it.stream.executed < it.stream.enqueued, "the copies ran at once"
        copied = it.stream.log[it.stream.log.index("record " + consumer.log[-1].split()[1])]
        assert consumer.log[-1] == "wait " + copied.split()[1]
        assert_same(on_host(first), batches[0])   # asnumpy syncs the consumer: its wait runs
    it.close()


def held_back_loop(batches, depth):
    """Iterate with the side stream and the consumer's stream both held back (a busy GPU):
    only the host's own waits make copies run before the loop ends."""
    it = cupycomm.prefetch(batches, 0, depth=depth, device_module=sd)
    consumer = sd.Stream(non_blocking=True, deferred=True)
    with sd.deferred(it.stream), consumer:
        got = list(it)
    consumer.synchronize()
    return got


def test_a_staging_buffer_is_rewritten_only_after_its_copy_read_it():
    """Every copy is still pending when the host wants its staging buffer again, depth + 1
    items later: the host must wait for that copy first."""
    for depth in (0, 1, 3):
        batches = items(8)
        for g, b in zip(held_back_loop(batches, depth), batches):
            assert_same(g, b, device=0)


def test_without_the_hosts_wait_the_stand_in_would_see_overwritten_staging(monkeypatch):
    """The check above has teeth: skip the host's wait and items arrive with later data."""
    monkeypatch.setattr(sd.Event, "synchronize", lambda self: None)
    got = held_back_loop([np.full(4, float(i)) for i in range(6)], depth=1)
    assert [float(sd.asnumpy(g)[0]) for g in got] != [float(i) for i in range(6)]


def test_new_device_memory_is_written_after_the_consumers_earlier_work():
    """CuPy's pool gives a new item the memory of arrays freed on the consumer's stream, whose
    last kernels may still be queued: each copy waits for an event recorded on the consumer's
    stream when its item was requested (with depth 1: after the step two items back)."""
    it = cupycomm.prefetch([np.full(2, float(i)) for i in range(4)], 0, depth=1,
                           device_module=sd)
    consumer = sd.Stream(non_blocking=True, deferred=True)
    with consumer:
        for i, _ in enumerate(it):
            sd.launch(consumer, lambda: None, f"step {i}")
    side, log = it.stream.log, consumer.log
    requested = side[0].split()[1]
    assert all(side[i - 1] == f"wait {requested}"
               for i, entry in enumerate(side) if entry.startswith("memcpy"))
    records = [i for i, entry in enumerate(log) if entry == f"record {requested}"]
    assert [sum(e.startswith("step") for e in log[:r]) for r in records] == [0, 0, 1, 2]
    consumer.synchronize()


def test_a_source_error_comes_after_the_items_before_it():
    def source():
        yield np.ones(2)
        yield np.full(2, 2.0)
        raise ValueError("loader broke")
    it = cupycomm.prefetch(source(), 0, depth=5, device_module=sd)
    assert_same(next(it), np.ones(2), device=0)
    assert_same(next(it), np.full(2, 2.0), device=0)
    with pytest.raises(ValueError, match="loader broke"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_an_item_of_an_unsupported_dtype_is_refused_in_its_turn():
    batches = [np.ones(2), (np.ones(1), {"bad": np.array([object()])})]
    it = cupycomm.prefetch(batches, 0, depth=3, device_module=sd)
    assert_same(next(it), np.ones(2), device=0)
    with pytest.raises(TypeError, match=r"prefetch: item 1\[1\]\['bad'\] has dtype object, "
                                        r"which is not supported"):
        next(it)


@pytest.mark.parametrize("kwargs,kind,pattern", [
    ({"depth": -1}, ValueError, r"prefetch: depth must be >= 0, got -1"),
    ({"depth": 1.5}, TypeError, r"prefetch: depth must be an int, got 1\.5"),
    ({"depth": True}, TypeError, r"depth must be an int, got True"),
    ({"device": 2}, ValueError, r"prefetch: device is 2, but this process sees 2 GPUs \(0\.\.1\)"),
    ({"device": "cuda"}, TypeError, r"prefetch: device must be a GPU id \(an int or a Device\) "
                                    r"or 'cpu', got 'cuda'"),
    ({"iterable": 5}, TypeError, r"prefetch: iterable must be iterable, got 5"),
])
def test_bad_arguments_are_refused_at_the_call(kwargs, kind, pattern):
    arguments = {"iterable": items(2), "device": 0, "device_module": sd, **kwargs}
    with pytest.raises(kind, match=pattern):
        cupycomm.prefetch(**arguments)


def test_close_waits_for_the_copies_and_ends_the_iteration():
    it = cupycomm.prefetch(items(6), 0, depth=3, device_module=sd)
    with sd.deferred(it.stream):
        next(it)
    assert not it.stream.done
    it.close()
    assert it.stream.done
    with pytest.raises(StopIteration):
        next(it)
    with cupycomm.prefetch(items(6), 0, depth=3, device_module=sd) as it:
        next(it)
    assert it.stream.done and list(it) == []


def test_the_end_of_the_items_frees_the_staging_buffers():
    it = cupycomm.prefetch(items(3), 0, depth=2, device_module=sd)
    list(it)
    assert it.stream.done and it._slots is None


# -- real GPU -------------------------------------------------------------------------------------
def _prefetch_overlap():
    """benchmarks/prefetch_overlap.py, whose timing and step the GPU test shares."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prefetch_overlap.py"
    spec = importlib.util.spec_from_file_location("prefetch_overlap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.mpi(max_size=1)   # a timing: not with every rank of a shared GPU at once
@pytest.mark.skipif(GPU is None, reason=GPU_SKIP_REASON)
def test_gpu_items_arrive_and_the_loop_overlaps_copies_with_compute():
    """Issue 7, as an H100 measured it (benchmarks/prefetch_overlap.py): with a step as long as
    the copy, the prefetching loop hides most of the copies behind the steps (0.92 of the copy
    hidden), and beats the plain loop (0.72 of its time). The plain loop is no serial
    copy-then-compute: cudaMemcpyAsync from pageable memory stages on the host at once, while
    the GPU runs the steps queued before it (CUDA Runtime API, "API synchronization behavior")."""
    cupy = GPU.module
    rng = np.random.default_rng(0)
    batches = [rng.random(2 ** 24, dtype=np.float32) for _ in range(12)]   # 64 MiB each
    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for got, expected in zip(cupycomm.prefetch(batches[:3], 0), batches[:3]):
                np.testing.assert_array_equal(cupy.asnumpy(got), expected)

            bench = _prefetch_overlap()
            step = bench.step

            def per_batch(loop):
                return bench.per_batch(stream, loop, len(batches))
            copy = per_batch(lambda: [cupy.asarray(b) for b in batches])
            x = cupy.asarray(batches[0])
            reps = max(1, round(10 * copy / (per_batch(lambda: step(x, 10)) * len(batches))))
            compute = per_batch(lambda: [step(x, reps) for _ in batches])
            plain = per_batch(lambda: [step(cupy.asarray(b), reps) for b in batches])
            ahead = per_batch(lambda: [step(b, reps)
                                       for b in cupycomm.prefetch(batches, 0, depth=2)])
    hidden = 1 - (ahead - compute) / copy
    print(f"per batch: copy {copy * 1e3:.2f} ms, step {compute * 1e3:.2f} ms ({reps} reps), "
          f"plain loop {plain * 1e3:.2f} ms, prefetching loop {ahead * 1e3:.2f} ms; "
          f"{hidden:.2f} of the copy hidden, {ahead / plain:.2f} of the plain loop")
    assert hidden >= 0.5 and ahead <= 0.85 * plain
