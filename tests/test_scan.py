"""Prefix reductions (MPI_Scan, MPI_Exscan): every dtype x op x in-place/out-of-place x
sync/async on host arrays against a NumPy reference from every rank's known input; on device
arrays, refused by name (NCCL has no scan), before any communication."""
import numpy as np
import pytest

import cupycomm
from arrays import HOST, STANDIN, all_inputs, assert_equal, rank_input, reduce_reference
from test_collectives import complete

SHAPE = (5, 3)
OPS = ("sum", "prod", "min", "max")
REDUCTIONS = [pytest.param(dtype, op, id=f"{dtype}-{op}")
              for dtype, row in cupycomm.DTYPES.items() for op in OPS
              if cupycomm.ReduceOp(op) in row.ops]
MODES = ["inplace", "out", "inplace-async", "out-async"]   # (exscan: "inplace" is a new array)
SHARED_COMM = True
ON_HOST = pytest.mark.parametrize("lib", [HOST], ids=["host"])   # (the device refuses)


@ON_HOST
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,op", REDUCTIONS)
@pytest.mark.parametrize("call", ["scan", "exscan"])
def test_prefix_reductions(lib, comm, call, dtype, op, mode):
    x = lib.array(rank_input(comm.rank, SHAPE, dtype))
    out = None if mode.startswith("inplace") else lib.empty(SHAPE, dtype)
    result = complete(getattr(comm, call)(x, op=op, out=out, async_op=mode.endswith("async")),
                      mode)
    upto = comm.rank + 1 if call == "scan" else comm.rank
    if upto == 0:   # exscan on rank 0: nothing before it (None, as mpi4py's exscan)
        assert result is None
    else:
        if out is not None:
            assert result is out
        else:   # scan in place; exscan into a new array (MPI leaves rank 0's undefined)
            assert (result is x) == (call == "scan")
        inputs = all_inputs(comm.size, SHAPE, dtype)[:upto]
        assert_equal(lib, result, reduce_reference(inputs, op, upto), op)
    if out is not None or call == "exscan":
        assert_equal(lib, x, rank_input(comm.rank, SHAPE, dtype))


@ON_HOST
@pytest.mark.parametrize("call", ["scan", "exscan"])
def test_prefix_sums_of_ranks(lib, comm, call):
    """The docstring's example: ranks 0, 1, 2, 3 scan to 0, 1, 3, 6."""
    got = getattr(comm, call)(np.array([comm.rank]))
    if call == "exscan" and comm.rank == 0:
        assert got is None
    else:
        last = comm.rank if call == "scan" else comm.rank - 1
        np.testing.assert_array_equal(got, [last * (last + 1) // 2])


@ON_HOST
@pytest.mark.parametrize("call", ["scan", "exscan"])
def test_avg_is_refused_by_name(lib, comm, call):
    seq = comm.parts.tracker.seq
    with pytest.raises(ValueError, match=rf"{call}: op 'avg' .*sum, then divide"):
        getattr(comm, call)(np.ones(3), op="avg")
    assert comm.parts.tracker.seq == seq   # nothing was communicated
    usable = getattr(comm, call)(np.ones(2))   # the communicator still works
    if call == "exscan" and comm.rank == 0:
        assert usable is None
    else:
        np.testing.assert_array_equal(usable, np.full(2, comm.rank + (call == "scan")))


@pytest.mark.parametrize("lib", [STANDIN], ids=["standin"])
@pytest.mark.parametrize("call", ["scan", "exscan"])
def test_device_arrays_are_refused_by_name(lib, comm, call):
    seq = comm.parts.tracker.seq
    with pytest.raises(TypeError, match=rf"{call}: NCCL has no {call}"):
        getattr(comm, call)(lib.array(np.ones(3)))
    assert comm.parts.tracker.seq == seq
