"""all_reduce_coalesced and Bucket: equal to separate all_reduce calls, any shapes and dtypes."""
import numpy as np
import pytest

import cupycomm
from arrays import all_inputs, assert_equal, rank_input, reduce_reference

SHAPES = [(3,), (2, 2), (), (0,), (17,), (1, 5), (0, 3), (9,)]
DTYPES = [np.float32, np.float64, np.float32, np.int32, np.float64, np.float16, np.int32,
          np.uint8]


def make_arrays(lib, rank, salt=0):
    return [lib.array(rank_input(rank, shape, dtype, salt=salt + i))
            for i, (shape, dtype) in enumerate(zip(SHAPES, DTYPES))]


def expected(comm, op, salt=0):
    return [reduce_reference(all_inputs(comm.size, shape, dtype, salt=salt + i), op, comm.size)
            for i, (shape, dtype) in enumerate(zip(SHAPES, DTYPES))]


@pytest.mark.parametrize("bucket_bytes", [None, 64, 1], ids=["default", "64B", "1B"])
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_coalesced_equals_separate_calls(lib, comm, op, bucket_bytes, mode):
    arrays = make_arrays(lib, comm.rank)
    result = comm.all_reduce_coalesced(arrays, op=op, bucket_bytes=bucket_bytes,
                                       async_op=mode == "async")
    if mode == "async":
        assert isinstance(result, cupycomm.Work)
        result = result.wait()
    assert all(r is a for r, a in zip(result, arrays))
    for array, want in zip(arrays, expected(comm, op)):
        assert_equal(lib, array, want, op)


def test_coalesced_average_of_float_gradients(lib, comm):
    kinds = [((4,), np.float64), ((2, 3), np.complex64), ((), np.float32)]
    grads = [lib.array(rank_input(comm.rank, s, d, salt=i)) for i, (s, d) in enumerate(kinds)]
    comm.all_reduce_coalesced(grads, op="avg")
    for i, (g, (s, d)) in enumerate(zip(grads, kinds)):
        assert_equal(lib, g, reduce_reference(all_inputs(comm.size, s, d, salt=i), "avg",
                                              comm.size), "avg")


def test_coalesced_calls_reuse_their_buffer_and_stay_correct(lib, comm):
    """A training loop: the same shapes every step pack into the same kept buffers, and each
    step's result is that step's (the kept views never leak an old result)."""
    kept = []
    for step in range(3):
        arrays = make_arrays(lib, comm.rank, salt=10 * step)
        comm.all_reduce_coalesced(arrays)
        for array, want in zip(arrays, expected(comm, "sum", salt=10 * step)):
            assert_equal(lib, array, want, "sum")
        kept.append({id(plan.flat) for plan in comm.parts.staging._free.values()})
    shared = [d for d in set(DTYPES) if DTYPES.count(d) > 1]   # the dtypes that get packed
    assert len(kept[0]) >= len(shared)
    assert kept[0] == kept[1] == kept[2]


def test_coalesced_keeps_a_bounded_number_of_buffers(lib, comm):
    keep = comm.parts.staging.KEEP
    for n in range(2, keep + 6):   # a new set of shapes each call
        comm.all_reduce_coalesced([lib.array(np.ones(n)), lib.array(np.ones(3))])
    assert len(comm.parts.staging._free) == keep


def test_coalesced_calls_on_two_streams_do_not_share_a_buffer_unordered(dcomm):
    """Finding 8 of issue 32: the kept buffer of a call on a stream still busy (its pack,
    all_reduce and unpack not run yet) is taken by the next call of the same shapes on
    another stream, which must not pack into it before the first call's unpack has read it
    (stand-in rules 6, 13 and 23: copies are kernels, streams unordered without events)."""
    from cupycomm.testing import standin as sd
    n = float(dcomm.size)
    busy, free = sd.Stream(non_blocking=True, deferred=True), sd.Stream(non_blocking=True)
    first = [sd.asarray(np.full(3, 1.0)), sd.asarray(np.full(2, 2.0))]
    second = [sd.asarray(np.full(3, 10.0)), sd.asarray(np.full(2, 20.0))]
    with busy:
        dcomm.all_reduce_coalesced(first)
    with free:
        dcomm.all_reduce_coalesced(second)
    busy.synchronize()
    free.synchronize()
    for got, want in zip(first + second, [1.0, 2.0, 10.0, 20.0]):
        np.testing.assert_array_equal(sd.asnumpy(got), np.full(got.shape, want * n))


def test_a_coalesced_call_captured_after_one_outside_takes_a_buffer_of_its_own(dcomm):
    """A capture cannot wait on outside work (stand-in rule 4): the kept buffer of a call
    on another stream is left to it, and the captured call packs into a new one, which
    the graph's replays use."""
    from cupycomm.testing import standin as sd
    n = float(dcomm.size)
    outside, inside = [sd.asarray(np.ones(3)), sd.asarray(np.ones(2))], \
        [sd.asarray(np.full(3, 2.0)), sd.asarray(np.full(2, 3.0))]
    dcomm.all_reduce_coalesced(outside)
    capturing = sd.Stream(non_blocking=True)
    capturing.begin_capture()
    with capturing:
        dcomm.all_reduce_coalesced(inside)
    graph = capturing.end_capture()
    dcomm.launch_graph(graph, capturing)
    capturing.synchronize()
    for got, want in zip(outside + inside, [n, n, 2.0 * n, 3.0 * n]):
        np.testing.assert_array_equal(sd.asnumpy(got), np.full(got.shape, want))


def test_coalesced_empty_list_does_nothing(lib, comm):
    assert comm.all_reduce_coalesced([]) == []


@pytest.mark.parametrize("case,kind,pattern", [
    ("bucket-zero", ValueError, "bucket_bytes must be a positive int, got 0"),
    ("not-a-list", TypeError, "arrays must be a list of arrays, got ndarray"),
    ("int-avg", ValueError, r"op='avg' is not defined for int32"),
    ("mixed", TypeError, r"arrays\[1\] is (numpy|cupycomm\.testing\.standin)\.ndarray but arrays\[0\] is "
                         r"((numpy|cupy|cupycomm\.testing\.standin)\.ndarray|torch\.Tensor); one call takes "
                         r"host arrays or device"),
])
def test_coalesced_rejects_bad_input_before_communication(lib, comm, case, kind, pattern):
    from cupycomm.testing import standin
    other = np.ones(2) if lib.is_device else standin.asarray(np.ones(2))
    calls = {"bucket-zero": lambda: comm.all_reduce_coalesced([lib.array(np.ones(2))],
                                                              bucket_bytes=0),
             "not-a-list": lambda: comm.all_reduce_coalesced(np.ones(2)),
             "int-avg": lambda: comm.all_reduce_coalesced([lib.array(np.ones(2, np.int32))],
                                                          op="avg"),
             "mixed": lambda: comm.all_reduce_coalesced([lib.array(np.ones(2)), other])}
    seq = comm.parts.tracker.seq
    with pytest.raises(kind, match=pattern):
        calls[case]()
    assert comm.parts.tracker.seq == seq


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bucket_arrays_are_views_reduced_in_one_call_per_dtype(lib, comm, mode):
    bucket = comm.bucket(make_arrays(lib, comm.rank))
    assert len(bucket.flats) == len(set(DTYPES))
    before = comm.parts.tracker.seq
    result = bucket.all_reduce(op="sum", async_op=mode == "async")
    if mode == "async":
        result = result.wait()
    assert comm.parts.tracker.seq - before == len(set(DTYPES))
    assert result is bucket.arrays
    for array, want in zip(bucket.arrays, expected(comm, "sum")):
        assert_equal(lib, array, want)
    bucket.arrays[0][...] = comm.rank            # writing a view writes the buffer
    bucket.broadcast(root=comm.size - 1)
    assert_equal(lib, bucket.arrays[0], np.full(3, comm.size - 1, np.float32))


def test_bucket_average(lib, comm):
    bucket = comm.bucket([lib.array(np.full(3, comm.rank + 1.0)), lib.array(np.ones((2, 2)))])
    bucket.all_reduce(op="avg")
    assert_equal(lib, bucket.arrays[0], np.full(3, (comm.size + 1) / 2), "avg")
    assert_equal(lib, bucket.arrays[1], np.ones((2, 2)), "avg")


def test_bucket_checks_the_op_against_every_dtype_before_any_call(lib, comm):
    bucket = comm.bucket([lib.array(np.full(2, comm.rank + 1.0)), lib.array(np.ones(2, np.int32))])
    seq = comm.parts.tracker.seq
    with pytest.raises(ValueError, match=r"bucket.all_reduce: op='avg' is not defined for int32"):
        bucket.all_reduce(op="avg")
    assert comm.parts.tracker.seq == seq, "communication started before the error"
    assert_equal(lib, bucket.arrays[0], np.full(2, comm.rank + 1.0))   # not averaged
    bucket.all_reduce(op="max")
    assert_equal(lib, bucket.arrays[0], np.full(2, float(comm.size)))


@pytest.mark.parametrize("call", ["all_reduce_coalesced", "bucket.all_reduce",
                                  "bucket.broadcast"])
def test_debug_mode_checks_each_array_of_the_list_across_ranks(lib, call):
    # Rank 1 (and every odd rank) lists 3 then 2 elements where the others list 2 then 3:
    # the packed buffers agree (5 float64), so only the list's own check can see it; before
    # it, debug mode passed and the arrays came back with their elements mixed.
    comm = lib.comm(debug=True)
    try:
        sizes = [3, 2] if comm.rank % 2 else [2, 3]
        arrays = [lib.array(np.full(n, 10.0 ** i)) for i, n in enumerate(sizes)]
        run = {"all_reduce_coalesced": lambda: comm.all_reduce_coalesced(arrays),
               "bucket.all_reduce": lambda: comm.bucket(arrays).all_reduce(),
               "bucket.broadcast": lambda: comm.bucket(arrays).broadcast(0)}[call]
        if comm.size == 1:
            run()   # nobody to disagree with
            return
        seq = comm.parts.tracker.seq
        with pytest.raises(cupycomm.CollectiveMismatch,
                           match=rf"{call} #\d+: ranks disagree: (.*; )?(rank 1|ranks \[1(, \d+)*\]) "
                                 rf"called {call} "
                                 rf"with arrays: \[3 float64 \(\w+\), 2 float64 \(\w+\)\]"):
            run()
        assert comm.parts.tracker.seq == seq, "the collective started despite the disagreement"
        same = [lib.array(np.full(n, 1.0)) for n in (2, 3)]
        assert_equal(lib, comm.all_reduce_coalesced(same)[1], np.full(3, float(comm.size)))
    finally:
        comm.close()
