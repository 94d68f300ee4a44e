"""Every bad input: a clear exception naming the argument and the value, raised on every rank
before any communication (the communicator's sequence count does not move), and the
communicator still works afterwards."""
import numpy as np
import pytest

import cupycomm
import nccl_standin
from arrays import STANDIN, all_inputs, assert_equal, rank_input

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
            a(lib), out=np.ones(4) if lib.is_device else nccl_standin.empty(4)),
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
        ("op-unknown", lambda c, lib: c.all_reduce(a(lib), op="mean"), ValueError,
         r"op must be one of 'sum', 'prod', 'min', 'max', 'avg' or a ReduceOp, got 'mean'"),
        ("op-unhashable", lambda c, lib: c.all_reduce(a(lib), op=["sum"]), ValueError,
         "op must be one of"),
        ("op-integer-avg", lambda c, lib: c.all_reduce(a(lib, dtype=np.int32), op="avg"),
         ValueError, r"op='avg' is not defined for int32 \(an integer mean would truncate"),
        ("op-complex-max", lambda c, lib: c.reduce(a(lib, dtype=np.complex64), op="max"),
         ValueError, "op='max' is not defined for complex64"),
    ]


CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_before_communication(lib, comm, case):
    _, call, kind, pattern = case
    seq = comm._tracker.seq
    with pytest.raises(kind, match=pattern):
        call(comm, lib)
    assert comm._tracker.seq == seq, "communication started before the error"
    x = lib.array(rank_input(comm.rank, (3,), F8))
    assert_equal(lib, comm.all_reduce(x), all_inputs(comm.size, (3,), F8).sum(0))


def test_stream_on_host_is_refused():
    with cupycomm.init(cupycomm.communicator.MPI.COMM_WORLD) as comm:
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
    monkeypatch.setattr(nccl_standin, "DEVICE_COUNT", 2)
    from mpi4py import MPI
    with cupycomm.init(MPI.COMM_WORLD, device=0, device_module=nccl_standin) as comm:
        with nccl_standin.Device(1):
            elsewhere = nccl_standin.asarray(np.ones(3))
        with pytest.raises(ValueError, match="x is on device 1 but the communicator uses device 0"):
            comm.all_reduce(elsewhere)
        here = nccl_standin.asarray(np.ones(3))
        assert_equal(STANDIN, comm.all_reduce(here), np.full(3, float(comm.size)))

