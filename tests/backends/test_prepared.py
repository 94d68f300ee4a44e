"""The host's calls as the common case takes them (the fast path of a call on NumPy arrays,
blocking and with async_op, from the calls the general path made): every collective takes
them on its common case and gives the general path's result, and every bad input of the
bad-input suite is still refused, before any communication, while they are ready for every
(collective, dtype, op)."""
import inspect

import numpy as np
import pytest

import cupycomm
from cupycomm.comm.general import GeneralPath
from arrays import HOST, all_inputs, rank_input
from test_validation import CASES, READ_ONLY_CASES

F8 = np.float64
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter")
PREPARED = REDUCTIONS + ("gather", "scatter", "all_gather", "all_to_all", "broadcast", "sendrecv")


def _refuse(*args):
    raise AssertionError("the general path ran where the prepared call should have")


@pytest.fixture
def host(request):
    with HOST.comm() as comm:
        yield comm


class AsyncCalls:
    """The communicator, with ``async_op=True`` added to every call that takes it."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        found = getattr(self._comm, name)
        if callable(found) and "async_op" in inspect.signature(found).parameters:
            return lambda *args, **kwargs: found(*args, async_op=True, **kwargs)
        return found


def ring(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


# name -> (the call on rank-known float64 inputs of 2 * size elements, its NumPy reference)
def common_calls(comm):
    n, r, size = 2 * comm.size, comm.rank, comm.size
    mine = lambda: rank_input(r, (n,), F8)
    every = all_inputs(size, (n,), F8)
    right, left = ring(comm)
    part = n // size
    return {
        "all_reduce": (lambda: comm.all_reduce(mine()), every.sum(0)),
        "all_reduce out": (lambda: comm.all_reduce(mine(), out=np.empty(n)), every.sum(0)),
        "reduce": (lambda: comm.reduce(mine(), root=0, op="max"),
                   every.max(0) if r == 0 else None),
        "broadcast": (lambda: comm.broadcast(mine(), root=size - 1), every[size - 1]),
        "all_gather": (lambda: comm.all_gather(mine()), every),
        "all_gather out": (lambda: comm.all_gather(mine(), out=np.empty(n * size)),
                           every.reshape(-1)),
        "reduce_scatter": (lambda: comm.reduce_scatter(mine()),
                           every.sum(0)[r * part:(r + 1) * part]),
        "all_to_all": (lambda: comm.all_to_all(mine(), out=np.empty(n)),
                       np.concatenate([every[j, r * part:(r + 1) * part] for j in range(size)])),
        "gather": (lambda: comm.gather(mine(), root=0), every if r == 0 else None),
        "scatter": (lambda: comm.scatter(every[0] if r == 0 else None, 0,
                                         out=np.empty(part)), every[0, r * part:(r + 1) * part]),
        "sendrecv": (lambda: comm.sendrecv(mine(), right, np.empty(n), left), every[left]),
    }


NAMES = ["all_reduce", "all_reduce out", "reduce", "broadcast", "all_gather", "all_gather out",
         "reduce_scatter", "all_to_all", "gather", "scatter", "sendrecv"]


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("name", NAMES)
def test_the_common_case_takes_the_prepared_call(host, name, async_op, monkeypatch):
    """Once the general path made the call, with the backend's general methods made to fail,
    the common case still works: it ran that call, and gave the NumPy reference (async: a
    Work whose wait() gives it)."""
    call, expected = common_calls(AsyncCalls(host) if async_op else host)[name]
    first = call()
    if async_op:
        first.wait()
    monkeypatch.setattr(host.parts.router.host, name.split()[0], _refuse)
    got = call()
    if async_op:
        assert isinstance(got, cupycomm.Work)
        got = got.wait()
    if expected is None:
        assert got is None
    else:
        np.testing.assert_array_equal(got, expected)


def test_a_reduce_op_member_takes_the_same_prepared_call_as_its_string(host, monkeypatch):
    x = rank_input(host.rank, (3,), F8)
    host.all_reduce(x.copy(), op="max")   # made by the general path
    calls = host.parts.router.host.calls[0].all_reduce[x.dtype]
    made, ran = calls["max"], []
    calls["max"] = lambda *args: ran.append(args) or made(*args)
    monkeypatch.setattr(host.parts.router.host, "_call", _refuse)   # the lookup must not miss
    got = host.all_reduce(x.copy(), op=cupycomm.ReduceOp.MAX)
    assert len(ran) == 1
    np.testing.assert_array_equal(got, all_inputs(host.size, (3,), F8).max(0))


def test_nothing_is_made_that_was_not_asked_for(host):
    """The first call of a dtype makes its own call only, in its own mode: an "avg" makes
    the sum's MPI call, and the common case's entry for "avg", which divides after it."""
    backend = host.parts.router.host
    host.all_reduce(np.ones(2, np.float32), op="avg")
    blocking, started = backend.calls
    assert list(blocking.all_reduce) == [np.dtype(np.float32)]
    assert set(blocking.all_reduce[np.dtype(np.float32)]) == {"sum", "avg"}
    assert all(not getattr(started, name) for name in PREPARED)
    assert all(not getattr(blocking, name) for name in PREPARED if name != "all_reduce")


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("dtype,op", [(F8, "avg"), ("bfloat16", "sum"), ("bfloat16", "avg")])
def test_a_call_that_divides_or_views_takes_the_common_case_once_made(host, monkeypatch,
                                                                      dtype, op, async_op):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    comm = AsyncCalls(host) if async_op else host
    x = rank_input(host.rank, (2 * host.size,), dtype)
    expected = all_inputs(host.size, x.shape, dtype).astype(F8).sum(0) / (
        host.size if op == "avg" else 1)
    results = [comm.all_reduce(x.copy(), op=op), comm.broadcast(x.copy(), root=0)]
    monkeypatch.setattr(GeneralPath, "all_reduce", _refuse)
    monkeypatch.setattr(GeneralPath, "broadcast", _refuse)
    results += [comm.all_reduce(x.copy(), op=op), comm.broadcast(x.copy(), root=0)]
    if async_op:
        results = [work.wait() for work in results]
    for reduced, broadcast in zip(results[0::2], results[1::2]):
        np.testing.assert_allclose(reduced.astype(F8), expected, rtol=1e-2)
        np.testing.assert_array_equal(broadcast, rank_input(0, x.shape, dtype))


class Elementwise:
    """An op whose == answers with an array, as a NumPy array's does: it must reach the
    general path's error, not fail in the fast path's test of the op."""

    def __eq__(self, other):
        return np.array([True, False])

    __hash__ = None


@pytest.mark.parametrize("op", [["sum"], Elementwise(), "mean", "SUM", 1, None],
                         ids=["list", "elementwise-eq", "unknown", "name-not-value", "int",
                              "none"])
@pytest.mark.parametrize("name", REDUCTIONS)
def test_a_bad_op_gets_the_general_paths_error_on_every_reduction(host, name, op):
    arm_tripwires(host)
    x = rank_input(host.rank, (2 * host.size,), F8)
    with pytest.raises(ValueError, match=f"{name}: op must be one of 'sum', 'prod'"):
        getattr(host, name)(x, op=op)


def test_the_completed_started_calls_are_let_go(host):
    """A started call's Work is kept in the backend's in-flight queue (MPI may write into its
    arrays until it completes), and let go at the next start once it has completed."""
    works = [host.all_reduce(np.ones(2), async_op=True) for _ in range(3)]
    assert works[-1] in host.parts.router.host._inflight
    for work in works:
        work.wait()
    last = host.broadcast(np.ones(2), async_op=True)
    assert list(host.parts.router.host._inflight) == [last]
    last.wait()


def test_batch_and_close_take_the_general_path(host, monkeypatch):
    """Inside a batch() block every call is queued by the general path; after it the common
    case takes the calls made before; after close, the general path says the communicator is
    closed."""
    host.all_reduce(np.ones(2))   # the float64 calls made before the block
    with host.batch():
        work = host.all_reduce(np.ones(2))
        assert isinstance(work, cupycomm.Work)
    np.testing.assert_array_equal(work.wait(), np.full(2, float(host.size)))
    with monkeypatch.context() as patched:
        patched.setattr(host.parts.router.host, "all_reduce", _refuse)
        np.testing.assert_array_equal(host.all_reduce(np.ones(2)), np.full(2, float(host.size)))
    host.close()
    with pytest.raises(cupycomm.CommClosedError):
        host.all_reduce(np.ones(2))


def arm_tripwires(comm):
    """Every call the general path could make for the common case to find (blocking and
    started, each collective, dtype and op) made ready, as a call that fails the test if it
    runs."""
    backend = comm.parts.router.host
    for calls in backend.calls:
        for name in PREPARED:
            by_dtype = getattr(calls, name)
            if name in REDUCTIONS:
                for dtype, specs in backend.reductions.items():
                    by_dtype[dtype] = {spec.key: _refuse for spec in specs.values()}
            else:
                by_dtype.update((dtype, _refuse) for dtype in backend.movements)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_bad_input_suite_is_refused_while_prepared_calls_are_ready(host, case, async_op):
    """Every bad input of tests/test_validation.py (host arrays), blocking and with async_op:
    the same error, before any communication, and no prepared call runs for it."""
    _, call, kind, pattern = case
    arm_tripwires(host)
    seq = host.parts.tracker.seq
    with pytest.raises(kind, match=pattern):
        call(AsyncCalls(host) if async_op else host, HOST)
    assert host.parts.tracker.seq == seq, "communication started before the error"


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("name,arg,call", READ_ONLY_CASES,
                         ids=[f"{n}-{a}-{i}" for i, (n, a, _) in enumerate(READ_ONLY_CASES)])
def test_read_only_results_are_refused_while_prepared_calls_are_ready(host, name, arg, call,
                                                                       async_op):
    if name == "recv" and host.size < 2:
        pytest.skip("recv needs 2 ranks (a rank cannot receive from itself); ran with 1")
    arm_tripwires(host)
    with pytest.raises(ValueError, match=f"{name}: {arg} is read-only, but {name} writes"):
        call(AsyncCalls(host) if async_op else host)
