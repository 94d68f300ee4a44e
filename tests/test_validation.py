"""Every bad input: a clear exception naming the argument and the value, raised on every rank
before any communication (the communicator's sequence count does not move), and the
communicator still works afterwards."""
import numpy as np
import pytest

import cupycomm
from cupycomm.testing import standin
from arrays import HOST, STANDIN, all_inputs, assert_equal, rank_input

F8 = np.float64


def indivisible(comm):
    """A shape whose leading axis does not split into comm.size parts (0-d when size is 1)."""
    return () if comm.size == 1 else (2 * comm.size + 1,)


def cases():
    """(id, call(comm, lib), exception type, message pattern)."""
    a = lambda lib, shape=(4,), dtype=F8: lib.array(np.ones(shape, dtype))
    return [
        ("not-an-array", lambda c, lib: c.all_reduce([1.0, 2.0]), TypeError,
         r"all_reduce: x must be a NumPy or CuPy array \(or expose the buffer protocol, "
         r"__array_interface__, __cuda_array_interface__ or __dlpack__\), got builtins\.list "
         r"on rank \d"),
        ("none", lambda c, lib: c.broadcast(None), TypeError, "x must be a NumPy or CuPy array"),
        ("scalar", lambda c, lib: c.all_reduce(np.float64(1)), TypeError,
         "got numpy.float64"),
        ("string-dtype", lambda c, lib: c.all_gather(np.array(["a", "b"])), TypeError,
         r"x has dtype <U1, which is not supported"),
        ("object-dtype", lambda c, lib: c.broadcast(np.array([object()])), TypeError,
         "x has dtype object"),
        ("non-contiguous", lambda c, lib: c.all_reduce(a(lib, (8,))[::2]), ValueError,
         r"x must be C-contiguous, got shape \(4,\) with strides"),
        ("fortran-order", lambda c, lib: c.all_gather(a(lib, (3, 2)).T), ValueError,
         "C-contiguous"),
        ("out-dtype", lambda c, lib: c.all_reduce(a(lib), out=a(lib, dtype=np.float32)),
         TypeError, "out has dtype float32, expected float64"),
        ("out-shape", lambda c, lib: c.all_reduce(a(lib), out=a(lib, (5,))), ValueError,
         r"out has shape \(5,\), expected \(4,\)"),
        ("out-non-contiguous", lambda c, lib: c.all_reduce(a(lib), out=a(lib, (8,))[::2]),
         ValueError, "out must be C-contiguous"),
        ("out-kind", lambda c, lib: c.all_reduce(
            a(lib), out=np.ones(4) if lib.is_device else standin.empty(4)),
         TypeError, "one call takes host arrays or device arrays, not both"),
        ("all-gather-out-size", lambda c, lib: c.all_gather(a(lib), out=a(lib, (4 * c.size + 1,))),
         ValueError, r"out has shape \(\d+,\), expected \(\d+, 4\) or \(\d+,\)"),
        ("all-gather-list-length", lambda c, lib: c.all_gather(a(lib), out=[a(lib)] * (c.size + 1)),
         ValueError, r"out is a list of \d+ arrays, expected \d+ \(one per rank\)"),
        ("all-gather-list-item", lambda c, lib: c.all_gather(a(lib), out=[a(lib, (3,))] * c.size),
         ValueError, r"out\[0\] has shape \(3,\), expected \(4,\)"),
        ("root-too-large", lambda c, lib: c.broadcast(a(lib), c.size), ValueError,
         r"root=\d+ is not a rank of this communicator \(0\.\.\d+\)"),
        ("root-negative", lambda c, lib: c.reduce(a(lib), -1), ValueError, "root=-1 is not a rank"),
        ("root-float", lambda c, lib: c.gather(a(lib), 0.0), TypeError,
         "root must be an int rank, got 0.0"),
        ("root-bool", lambda c, lib: c.gather(a(lib), True), TypeError, "root must be an int"),
        ("peer-out-of-range", lambda c, lib: c.send(a(lib), c.size + 2), ValueError,
         r"dst=\d+ is not a rank"),
        ("send-to-self", lambda c, lib: c.send(a(lib), c.rank), ValueError,
         r"dst=\d+ is this rank; a message to oneself needs its receive posted"),
        ("recv-from-self", lambda c, lib: c.recv(a(lib), c.rank), ValueError,
         r"src=\d+ is this rank"),
        ("sendrecv-src", lambda c, lib: c.sendrecv(a(lib), 0, a(lib), -3), ValueError,
         "src=-3 is not a rank"),
        ("sendrecv-buf-dtype", lambda c, lib: c.sendrecv(a(lib), 0, a(lib, dtype=np.int64), 0),
         TypeError, "buf has dtype int64, expected float64"),
        ("leading-axis", lambda c, lib: c.all_to_all(a(lib, indivisible(c))), ValueError,
         r"x has shape \(\d*,?\): its leading axis must split into \d+ equal parts"),
        ("reduce-scatter-axis", lambda c, lib: c.reduce_scatter(a(lib, indivisible(c))),
         ValueError, "leading axis must split"),
        ("reduce-scatter-list-length", lambda c, lib: c.reduce_scatter([a(lib)] * (c.size + 1)),
         ValueError, r"x is a list of \d+ arrays, expected"),
        ("reduce-scatter-empty-list", lambda c, lib: c.reduce_scatter([]), ValueError,
         "x is an empty list"),
        ("reduce-scatter-out", lambda c, lib: c.reduce_scatter(a(lib, (c.size * 2,)),
                                                               out=a(lib, (3,))),
         ValueError, r"out has shape \(3,\), expected \(2,\)"),
        ("scatter-x-shape", lambda c, lib: c.scatter(a(lib, (c.size * 4 + 1,)), 0, out=a(lib)),
         ValueError, r"x has shape \(\d+,\), expected \(\d+, 4\) or \(\d+,\)"),
        ("scatter-out-missing", lambda c, lib: c.scatter(a(lib), 0), TypeError,
         "missing 1 required keyword-only argument: 'out'"),
        ("all-gather-out-holds-x", lambda c, lib: (lambda w: c.all_gather(w[0:4], out=w))(
            a(lib, (4 * c.size,))), ValueError,
         r"all_gather: out overlaps x \(they share memory\); give out memory of its own on "
         r"rank \d"),
        ("reduce-scatter-out-in-x", lambda c, lib: (lambda x: c.reduce_scatter(x, out=x[0:2]))(
            a(lib, (2 * c.size,))), ValueError, "reduce_scatter: out overlaps x"),
        ("all-reduce-out-overlaps-x", lambda c, lib: (lambda w: c.all_reduce(
            w[0:4], out=w[2:6]))(a(lib, (6,))), ValueError,
         r"all_reduce: out overlaps x \(they share memory\); give out memory of its own, or "
         r"pass x itself \(or out=None\) to reduce in place"),
        ("reduce-out-overlaps-x", lambda c, lib: (lambda w: c.reduce(w[1:5], 0, out=w[0:4]))(
            a(lib, (6,))), ValueError, "reduce: out overlaps x"),
        ("all-to-all-out-is-x", lambda c, lib: (lambda x: c.all_to_all(x, out=x))(
            a(lib, (2 * c.size,))), ValueError, "all_to_all: out overlaps x"),
        ("uneven-all-to-all-out-is-x", lambda c, lib: (lambda x: c.all_to_all(
            x, out=x, in_splits=[2] * c.size, out_splits=[2] * c.size))(
            a(lib, (2 * c.size,))), ValueError, "all_to_all: out overlaps x"),
        ("gather-out-holds-x", lambda c, lib: (lambda w: c.gather(w[0:4], 0, out=w))(
            a(lib, (4 * c.size,))), ValueError, "gather: out overlaps x"),
        ("scatter-x-holds-out", lambda c, lib: (lambda w: c.scatter(w, 0, out=w[0:4]))(
            a(lib, (4 * c.size,))), ValueError, "scatter: x overlaps out"),
        ("op-unknown", lambda c, lib: c.all_reduce(a(lib), op="mean"), ValueError,
         r"op must be one of 'sum', 'prod', 'min', 'max', 'avg' or a ReduceOp, got 'mean'"),
        ("op-unhashable", lambda c, lib: c.all_reduce(a(lib), op=["sum"]), ValueError,
         "op must be one of"),
        ("op-none", lambda c, lib: c.reduce_scatter(a(lib, (c.size,)), op=None), ValueError,
         "op must be one of .* got None"),
        ("op-integer-avg", lambda c, lib: c.all_reduce(a(lib, dtype=np.int32), op="avg"),
         ValueError, r"op='avg' is not defined for int32 \(an integer mean would truncate"),
        ("op-complex-max", lambda c, lib: c.reduce(a(lib, dtype=np.complex64), op="max"),
         ValueError, "op='max' is not defined for complex64"),
    ]


CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_before_communication(lib, comm, case):
    _, call, kind, pattern = case
    seq = comm.parts.tracker.seq
    with pytest.raises(kind, match=pattern):
        call(comm, lib)
    assert comm.parts.tracker.seq == seq, "communication started before the error"
    x = lib.array(rank_input(comm.rank, (3,), F8))
    assert_equal(lib, comm.all_reduce(x), all_inputs(comm.size, (3,), F8).sum(0))


def test_stream_on_host_is_refused():
    with cupycomm.init(cupycomm.comm.communicator.MPI.COMM_WORLD) as comm:
        with pytest.raises(TypeError, match="stream= applies to device arrays only"):
            comm.all_reduce(np.ones(2), stream=object())


def test_closed_communicator(lib):
    comm = lib.comm()
    comm.close()
    comm.close()   # twice is harmless
    assert comm.closed
    for call in (lambda: comm.all_reduce(lib.array(np.ones(2))), comm.barrier,
                 lambda: comm.sendrecv(lib.array(np.ones(2)), 0, lib.array(np.ones(2)), 0)):
        with pytest.raises(cupycomm.CommClosedError, match="the communicator is closed"):
            call()


def test_array_on_another_device(monkeypatch):
    monkeypatch.setattr(standin, "DEVICE_COUNT", 2)
    from mpi4py import MPI
    with cupycomm.init(MPI.COMM_WORLD, device=0, device_module=standin) as comm:
        with standin.Device(1):
            elsewhere = standin.asarray(np.ones(3))
        with pytest.raises(ValueError, match="x is on device 1 but the communicator uses device 0"):
            comm.all_reduce(elsewhere)
        here = standin.asarray(np.ones(3))
        assert_equal(STANDIN, comm.all_reduce(here), np.full(3, float(comm.size)))



def read_only(data):
    array = np.array(data)
    array.flags.writeable = False
    return array


READ_ONLY_CASES = [
    ("all_reduce", "x", lambda c: c.all_reduce(read_only(np.ones(4)))),
    ("all_reduce", "out", lambda c: c.all_reduce(np.ones(4), out=read_only(np.ones(4)))),
    ("reduce", "x", lambda c: c.reduce(read_only(np.ones(4)), root=0)),
    ("broadcast", "x", lambda c: c.broadcast(read_only(np.ones(4)), root=0)),
    ("all_gather", "out", lambda c: c.all_gather(np.ones(2), out=read_only(np.ones(2 * c.size)))),
    ("all_gather", r"out\[0\]", lambda c: c.all_gather(
        np.ones(2), out=[read_only(np.ones(2))] + [np.ones(2)] * (c.size - 1))),
    ("reduce_scatter", "out", lambda c: c.reduce_scatter(np.ones(c.size),
                                                         out=read_only(np.ones(1)))),
    ("all_to_all", "out", lambda c: c.all_to_all(np.ones(c.size), out=read_only(np.ones(c.size)))),
    ("all_to_all", "out", lambda c: c.all_to_all(np.ones(c.size), in_splits=[1] * c.size,
                                                  out=read_only(np.ones(c.size)))),
    ("scatter", "out", lambda c: c.scatter(np.ones(c.size), 0, out=read_only(np.ones(1)))),
    ("gather", "out", lambda c: c.gather(np.ones(1), 0, out=read_only(np.ones(c.size)))),
    ("recv", "buf", lambda c: c.recv(read_only(np.ones(2)), (c.rank + 1) % c.size)),
    ("sendrecv", "buf", lambda c: c.sendrecv(np.ones(2), 0, read_only(np.ones(2)), 0)),
    ("all_reduce_coalesced", r"arrays\[1\]", lambda c: c.all_reduce_coalesced(
        [np.ones(2), read_only(np.ones(2))])),
]


@pytest.mark.parametrize("name,arg,call", READ_ONLY_CASES,
                         ids=[f"{n}-{a}-{i}" for i, (n, a, _) in enumerate(READ_ONLY_CASES)])
def test_read_only_results_are_refused_on_every_rank(name, arg, call):
    """Where a call writes (in place, out, buf), a read-only NumPy array is refused on every
    rank alike; MPI would write into it on some ranks (not a broadcast's root) and fail on
    others."""
    if name in ("recv",) and cupycomm.comm.communicator.MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("recv needs 2 ranks (a rank cannot receive from itself); ran with 1")
    with HOST.comm() as comm:
        seq = comm.parts.tracker.seq
        with pytest.raises(ValueError, match=f"{name}: {arg} is read-only, but {name} writes"):
            call(comm)
        assert comm.parts.tracker.seq == seq, "communication started before the error"
        assert_equal(HOST, comm.all_reduce(np.ones(2)), np.full(2, float(comm.size)))


def test_read_only_inputs_are_accepted(lib, comm):
    x = read_only(rank_input(comm.rank, (2,), F8))
    out = lib.empty((2,), F8)
    if lib.is_device:
        x = lib.array(x)
    assert_equal(lib, comm.all_reduce(x, out=out), all_inputs(comm.size, (2,), F8).sum(0))
    assert_equal(lib, comm.all_gather(x), all_inputs(comm.size, (2,), F8))


def test_stream_must_be_a_stream(dcomm):
    x = standin.asarray(np.ones(2))
    for bad in ("abc", 7, object()):
        with pytest.raises(TypeError, match=r"all_reduce: stream must be a CUDA stream "
                                            r"\(cupy.cuda.Stream or ExternalStream\), got"):
            dcomm.all_reduce(x, stream=bad)
    assert_equal(STANDIN, dcomm.all_reduce(x, stream=standin.Stream()),
                 np.full(2, float(dcomm.size)))


def test_uneven_all_to_all_refuses_a_wrong_out_on_every_rank(lib, comm):
    """Only in_splits given: each rank learns what it receives from the others, so a wrong
    out on one rank is seen by all of them before any data moves."""
    last = comm.size - 1
    rows = comm.size   # every rank sends one row to each rank: each receives comm.size rows
    out = lib.empty((rows + (comm.rank == last),), F8)
    with pytest.raises(ValueError, match=rf"all_to_all: out of rank {last} has {rows + 1} rows, "
                                         rf"but the ranks' in_splits send it {rows}"):
        comm.all_to_all(lib.array(np.ones(comm.size)), in_splits=[1] * comm.size, out=out)
    x = lib.array(np.full(comm.size, float(comm.rank)))
    got = comm.all_to_all(x, in_splits=[1] * comm.size, out=lib.empty((rows,), F8))
    assert_equal(lib, got, np.arange(comm.size, dtype=F8))


@pytest.mark.parametrize("call", ["all_reduce", "reduce"])
def test_out_the_same_view_as_x_reduces_in_place(lib, comm, call):
    """out=x[:] (another view of x's very memory) is the in-place form, as out=x is (MPICH
    refused such a pair as aliased buffers)."""
    x = lib.array(rank_input(comm.rank, (3,), F8))
    got = (comm.all_reduce(x, out=x[:]) if call == "all_reduce"
           else comm.reduce(x, 0, out=x[:]))
    if call == "all_reduce" or comm.rank == 0:
        assert_equal(lib, got, all_inputs(comm.size, (3,), F8).sum(0))
        assert_equal(lib, x, all_inputs(comm.size, (3,), F8).sum(0))


def test_an_uneven_all_to_all_refuses_out_overlapping_x_before_its_exchange(lib, comm):
    x = lib.array(np.ones(2 * comm.size))
    seq = comm.parts.tracker.seq
    with pytest.raises(ValueError, match="all_to_all: out overlaps x"):
        comm.all_to_all(x, out=x, in_splits=[2] * comm.size)
    assert comm.parts.tracker.seq == seq
