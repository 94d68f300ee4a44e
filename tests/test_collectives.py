"""Every collective x dtype x op x in-place/out-of-place x sync/async, against NumPy references.

Each rank's input is known to every rank (``rank_input``), so each rank checks its own result
against a reference computed from all inputs. Runs on host arrays (MPI), on the NCCL backend
over the stand-in, and on a GPU when there is one.
"""
import numpy as np
import pytest

import cupycomm
from cupycomm.backends.mpi import MPIBackend
from cupycomm.backends.nccl import NcclBackend
from arrays import all_inputs, assert_equal, rank_input, reduce_reference

DTYPES = list(cupycomm.DTYPES)
REDUCTIONS = [pytest.param(dtype, op.value, id=f"{dtype}-{op.value}")
              for dtype, row in cupycomm.DTYPES.items() for op in row.ops]
MODES = ["inplace", "out", "inplace-async", "out-async"]
MOVE_MODES = ["new", "out", "new-async", "out-async"]
SHAPE = (5, 3)   # 15 elements: no power of two anywhere
# One communicator per library for the whole module (tests/conftest.py): made and closed for
# each of its thousands of tests, it took a quarter of the module's time on 4 ranks; sharing it
# also checks that each call leaves the communicator usable for the next.
SHARED_COMM = True


def can_reduce(lib, dtype):
    """Whether ``lib``'s backend has a type to reduce ``dtype`` with (NCCL has no int16)."""
    backend = NcclBackend if lib.is_device else MPIBackend
    return np.dtype(dtype) in backend.reductions


def complete(result, mode):
    """The result of a call made in ``mode``: waits on the Work of an async call."""
    if mode.endswith("async"):
        assert isinstance(result, cupycomm.Work), result
        work = result
        result = work.wait()
        work.synchronize()
        assert work.is_completed()
    return result


def no_reduction(lib, comm, dtype, call):
    """Where the backend has no type for ``dtype``, the call must refuse it, before any traffic."""
    with pytest.raises(ValueError, match=f"has no {np.dtype(dtype)} type"):
        call()


# -- reductions -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,op", REDUCTIONS)
def test_all_reduce(lib, comm, dtype, op, mode):
    x = lib.array(rank_input(comm.rank, SHAPE, dtype))
    out = None if mode.startswith("inplace") else lib.empty(SHAPE, dtype)
    call = lambda: comm.all_reduce(x, op=op, out=out, async_op=mode.endswith("async"))
    if not can_reduce(lib, dtype):
        return no_reduction(lib, comm, dtype, call)
    result = complete(call(), mode)
    assert result is (x if out is None else out)
    assert_equal(lib, result, reduce_reference(all_inputs(comm.size, SHAPE, dtype), op,
                                               comm.size), op)
    if out is not None:
        assert_equal(lib, x, rank_input(comm.rank, SHAPE, dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,op", REDUCTIONS)
def test_reduce(lib, comm, dtype, op, mode):
    root = comm.size - 1
    x = lib.array(rank_input(comm.rank, SHAPE, dtype))
    out = None if mode.startswith("inplace") else lib.empty(SHAPE, dtype)
    call = lambda: comm.reduce(x, root, op=op, out=out, async_op=mode.endswith("async"))
    if not can_reduce(lib, dtype):
        return no_reduction(lib, comm, dtype, call)
    result = complete(call(), mode)
    if comm.rank == root:
        assert result is (x if out is None else out)
        assert_equal(lib, result, reduce_reference(all_inputs(comm.size, SHAPE, dtype), op,
                                                   comm.size), op)
    else:
        assert result is None
        assert_equal(lib, x, rank_input(comm.rank, SHAPE, dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,op", REDUCTIONS)
def test_reduce_scatter(lib, comm, dtype, op, mode):
    whole = (2 * comm.size, 3)
    x = lib.array(rank_input(comm.rank, whole, dtype))
    out = None if mode.startswith("inplace") else lib.empty((2, 3), dtype)
    call = lambda: comm.reduce_scatter(x, op=op, out=out, async_op=mode.endswith("async"))
    if not can_reduce(lib, dtype):
        return no_reduction(lib, comm, dtype, call)
    result = complete(call(), mode)
    if out is not None:
        assert result is out
    reduced = reduce_reference(all_inputs(comm.size, whole, dtype), op, comm.size)
    assert_equal(lib, result, reduced[2 * comm.rank:2 * comm.rank + 2], op)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,op", REDUCTIONS)
def test_reduce_scatter_list(lib, comm, dtype, op, mode):
    parts = [lib.array(rank_input(comm.rank, (4,), dtype, salt=j)) for j in range(comm.size)]
    out = None if mode.startswith("inplace") else lib.empty((4,), dtype)
    call = lambda: comm.reduce_scatter(parts, op=op, out=out, async_op=mode.endswith("async"))
    if not can_reduce(lib, dtype):
        return no_reduction(lib, comm, dtype, call)
    result = complete(call(), mode)
    if out is not None:
        assert result is out
    mine = all_inputs(comm.size, (4,), dtype, salt=comm.rank)
    assert_equal(lib, result, reduce_reference(mine, op, comm.size), op)


@pytest.mark.parametrize("dtype,op", [pytest.param(d, o.value, id=f"{d}-{o.value}")
                                      for d, row in cupycomm.DTYPES.items()
                                      for o in cupycomm.ReduceOp if o not in row.ops])
def test_op_not_defined_for_dtype(lib, comm, dtype, op):
    x = lib.array(rank_input(comm.rank, SHAPE, dtype))
    for call in (lambda: comm.all_reduce(x, op=op), lambda: comm.reduce(x, op=op),
                 lambda: comm.reduce_scatter([x] * comm.size, op=op)):
        with pytest.raises(ValueError, match=f"op='{op}' is not defined for {np.dtype(dtype)}"):
            call()
    if can_reduce(lib, dtype):   # the communicator is still usable: sum is always defined
        assert_equal(lib, comm.all_reduce(x), reduce_reference(
            all_inputs(comm.size, SHAPE, dtype), "sum", comm.size))


def test_all_reduce_and_broadcast_on_every_kind_of_communicator(lib, any_comm):
    """The world, a copy of it and a split half each reduce and broadcast over their own
    members, numbered from 0 in each."""
    x = lib.array(rank_input(any_comm.rank, SHAPE, np.float64))
    assert_equal(lib, any_comm.all_reduce(x), reduce_reference(
        all_inputs(any_comm.size, SHAPE, np.float64), "sum", any_comm.size))
    root = any_comm.size - 1
    y = lib.array(rank_input(any_comm.rank, SHAPE, np.float64))
    assert_equal(lib, any_comm.broadcast(y, root), rank_input(root, SHAPE, np.float64))


@pytest.mark.parametrize("op", list(cupycomm.ReduceOp))
def test_reduce_op_enum_and_string_agree(lib, comm, op):
    x = lib.array(rank_input(comm.rank, SHAPE, np.float64))
    by_enum = comm.all_reduce(x, op=op, out=lib.empty(SHAPE, np.float64))
    by_name = comm.all_reduce(x, op=op.value, out=lib.empty(SHAPE, np.float64))
    np.testing.assert_array_equal(lib.numpy(by_enum), lib.numpy(by_name))


@pytest.mark.parametrize("holder", ["first", "last"])
def test_the_dtypes_guides_way_with_nan_gives_every_rank_the_same_answer(lib, comm, holder):
    """docs/guide/dtypes-and-ops.md: max/min with a NaN keep or drop it by the rank that
    holds it (MPICH); agree on NaN first with a sum (NaN on every rank), then reduce with
    NaN replaced (-inf for max): the same, right answer on every rank."""
    nan_rank = 0 if holder == "first" else comm.size - 1
    x = np.array([comm.rank + 1.0, np.nan if comm.rank == nan_rank else 2.0])
    assert np.isnan(lib.numpy(comm.all_reduce(lib.array(x), op="sum"))[1])
    replaced = comm.all_reduce(lib.array(np.where(np.isnan(x), -np.inf, x)), op="max")
    lib.synchronize()
    np.testing.assert_array_equal(lib.numpy(replaced),
                                  [comm.size, 2.0 if comm.size > 1 else -np.inf])


@pytest.mark.parametrize("root_choice", ["first", "middle", "last"])
def test_every_root(lib, comm, root_choice):
    root = {"first": 0, "middle": comm.size // 2, "last": comm.size - 1}[root_choice]
    x = lib.array(rank_input(comm.rank, SHAPE, np.int32))
    everyone = all_inputs(comm.size, SHAPE, np.int32)
    reduced = comm.reduce(x, root, out=lib.empty(SHAPE, np.int32))
    gathered = comm.gather(x, root)
    y = lib.array(rank_input(comm.rank, SHAPE, np.int32))
    comm.broadcast(y, root)
    parts = lib.array(everyone) if comm.rank == root else None
    scattered = comm.scatter(parts, root, out=lib.empty(SHAPE, np.int32))
    assert_equal(lib, y, everyone[root])
    assert_equal(lib, scattered, everyone[comm.rank])
    if comm.rank == root:
        assert_equal(lib, reduced, everyone.sum(axis=0, dtype=np.int32))
        assert_equal(lib, gathered, everyone)
    else:
        assert reduced is None and gathered is None


# -- data movement --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast(lib, comm, dtype, mode):
    root = comm.size - 1
    x = lib.array(rank_input(comm.rank, SHAPE, dtype))
    result = complete(comm.broadcast(x, root, async_op=mode == "async"), mode)
    assert result is x
    assert_equal(lib, x, rank_input(root, SHAPE, dtype))


@pytest.mark.parametrize("mode", MOVE_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather(lib, comm, dtype, mode):
    x = lib.array(rank_input(comm.rank, SHAPE, dtype))
    out = lib.empty((comm.size,) + SHAPE, dtype) if mode.startswith("out") else None
    result = complete(comm.all_gather(x, out=out, async_op=mode.endswith("async")), mode)
    if out is not None:
        assert result is out
    assert_equal(lib, result, all_inputs(comm.size, SHAPE, dtype))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("layout", ["concatenated", "list"])
@pytest.mark.parametrize("dtype", [np.bool_, np.int16, np.float16, np.complex128], ids=str)
def test_all_gather_layouts(lib, comm, dtype, layout, mode):
    x = lib.array(rank_input(comm.rank, SHAPE, dtype))
    everyone = all_inputs(comm.size, SHAPE, dtype)
    if layout == "list":
        out = [lib.empty(SHAPE, dtype) for _ in range(comm.size)]
        result = complete(comm.all_gather(x, out=out, async_op=mode == "async"), mode)
        assert len(result) == comm.size and all(r is o for r, o in zip(result, out))
        for j, part in enumerate(out):
            assert_equal(lib, part, everyone[j])
    else:
        out = lib.empty((comm.size * SHAPE[0],) + SHAPE[1:], dtype)
        result = complete(comm.all_gather(x, out=out, async_op=mode == "async"), mode)
        assert result is out
        assert_equal(lib, out, everyone.reshape(out.shape))


@pytest.mark.parametrize("mode", MOVE_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_to_all(lib, comm, dtype, mode):
    whole = (2 * comm.size, 3)
    x = lib.array(rank_input(comm.rank, whole, dtype))
    out = lib.empty(whole, dtype) if mode.startswith("out") else None
    result = complete(comm.all_to_all(x, out=out, async_op=mode.endswith("async")), mode)
    if out is not None:
        assert result is out
    everyone = all_inputs(comm.size, whole, dtype)
    expected = np.concatenate([everyone[j, 2 * comm.rank:2 * comm.rank + 2]
                               for j in range(comm.size)])
    assert_equal(lib, result, expected)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter(lib, comm, dtype, mode):
    root = comm.size - 1
    everyone = all_inputs(comm.size, SHAPE, dtype, salt=7)
    x = lib.array(everyone) if comm.rank == root else None
    out = lib.empty(SHAPE, dtype)
    result = complete(comm.scatter(x, root, out=out, async_op=mode == "async"), mode)
    assert result is out
    assert_equal(lib, out, everyone[comm.rank])


@pytest.mark.parametrize("mode", MOVE_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather(lib, comm, dtype, mode):
    root = comm.size - 1
    x = lib.array(rank_input(comm.rank, SHAPE, dtype))
    out = lib.empty((comm.size * SHAPE[0], SHAPE[1]), dtype) if mode.startswith("out") else None
    result = complete(comm.gather(x, root, out=out, async_op=mode.endswith("async")), mode)
    if comm.rank != root:
        assert result is None
        return
    everyone = all_inputs(comm.size, SHAPE, dtype)
    if out is not None:
        assert result is out
        everyone = everyone.reshape(out.shape)
    assert_equal(lib, result, everyone)


# -- zero-size and 0-d arrays ---------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0,), (0, 3), ()], ids=["empty", "empty-2d", "0d"])
def test_zero_size_and_0d(lib, comm, shape):
    x = lib.array(rank_input(comm.rank, shape, np.float32))
    everyone = all_inputs(comm.size, shape, np.float32)
    assert_equal(lib, comm.all_reduce(x, out=lib.empty(shape, np.float32)), everyone.sum(0))
    assert_equal(lib, comm.all_gather(x), everyone)
    assert_equal(lib, comm.broadcast(lib.array(rank_input(comm.rank, shape, np.float32)), 0),
                 everyone[0])
    gathered = comm.gather(x, 0)
    if comm.rank == 0:
        assert_equal(lib, gathered, everyone)
    parts = [lib.empty(shape, np.float32) for _ in range(comm.size)]
    assert comm.all_gather(x, out=parts) == parts
    for j, part in enumerate(parts):
        assert_equal(lib, part, everyone[j])
    pieces = [lib.array(rank_input(comm.rank, shape, np.float32, salt=j)) for j in range(comm.size)]
    assert_equal(lib, comm.reduce_scatter(pieces),
                 all_inputs(comm.size, shape, np.float32, salt=comm.rank).sum(0))
    z = lib.array(rank_input(comm.rank, shape, np.complex64))
    assert_equal(lib, comm.all_reduce(z, op="avg"),
                 reduce_reference(all_inputs(comm.size, shape, np.complex64), "avg", comm.size),
                 "avg")
    if shape == ():
        with pytest.raises(ValueError, match="leading axis"):
            comm.all_to_all(x)
        with pytest.raises(ValueError, match="leading axis"):
            comm.reduce_scatter(x)
    else:
        assert_equal(lib, comm.all_to_all(lib.array(np.zeros((0, 3), np.float32))),
                     np.zeros((0, 3), np.float32))
        assert_equal(lib, comm.reduce_scatter(lib.array(np.zeros((0, 3), np.float32))),
                     np.zeros((0, 3), np.float32))


# -- uneven all_to_all ----------------------------------------------------------------------------
def uneven_rows(sender, receiver):
    """Rows ``sender`` sends ``receiver``: 0, 1 or 2, zeros included."""
    return (sender + 2 * receiver) % 3


@pytest.mark.parametrize("mode", ["given", "exchanged", "out", "exchanged-out", "async",
                                  "batch"])
@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.complex128, np.bool_], ids=str)
def test_all_to_all_uneven(lib, comm, dtype, mode):
    in_splits = [uneven_rows(comm.rank, j) for j in range(comm.size)]
    out_splits = [uneven_rows(i, comm.rank) for i in range(comm.size)]
    inputs = [rank_input(r, (sum(uneven_rows(r, j) for j in range(comm.size)), 2), dtype)
              for r in range(comm.size)]
    x = lib.array(inputs[comm.rank])
    starts = lambda r: np.cumsum([0] + [uneven_rows(r, j) for j in range(comm.size)])
    expected = np.concatenate([inputs[i][starts(i)[comm.rank]:starts(i)[comm.rank + 1]]
                               for i in range(comm.size)]).reshape(-1, 2)
    out = lib.empty(expected.shape, dtype) if mode.endswith("out") else None
    call = lambda: comm.all_to_all(x, in_splits=in_splits, out=out, async_op=mode == "async",
                                   out_splits=out_splits if mode in ("given", "out", "async")
                                   else None)
    if mode == "batch":   # the splits are exchanged at once; the data moves with the block
        with comm.batch():
            work = call()
        result = work.wait()
    else:
        result = call()
    if mode == "async":
        result = result.wait()
    if out is not None:
        assert result is out
    assert_equal(lib, result, expected)


@pytest.mark.parametrize("splits,pattern", [
    ("short", r"in_splits must be \d+ row counts >= 0 \(one per rank\), got \[1\]"),
    ("negative", r"in_splits must be \d+ row counts >= 0"),
    ("too-many-rows", r"in_splits=\[.*\] adds up to \d+ rows, but x has 2"),
])
def test_all_to_all_uneven_rejects_bad_splits(lib, comm, splits, pattern):
    x = lib.array(np.ones((2, 3)))
    bad = {"short": [1] if comm.size > 1 else [1, 1], "negative": [-1] + [3] * (comm.size - 1),
           "too-many-rows": [3] * comm.size}[splits]
    if splits == "short" and comm.size == 1:
        pattern = r"in_splits must be 1 row counts >= 0 \(one per rank\), got \[1, 1\]"
    with pytest.raises(ValueError, match=pattern):
        comm.all_to_all(x, in_splits=bad, out_splits=[0] * comm.size)


def test_debug_mode_cross_checks_uneven_splits(lib):
    with lib.comm(debug=True) as comm:
        if lib.is_device:
            comm.init_device()
        in_splits = [uneven_rows(comm.rank, j) for j in range(comm.size)]
        out_splits = [uneven_rows(i, comm.rank) for i in range(comm.size)]
        x = lib.array(np.ones((sum(in_splits), 2)))
        comm.all_to_all(x, in_splits=in_splits, out_splits=out_splits)   # consistent: runs
        wrong = [n + (comm.rank == 0 and j == 0) for j, n in enumerate(out_splits)]
        with pytest.raises(cupycomm.CollectiveMismatch,
                           match=r"rank 0 sends \d+ rows to rank 0 \(in_splits\), which expects "
                                 r"\d+ from it \(out_splits\)"):
            comm.all_to_all(x, in_splits=in_splits, out_splits=wrong)
