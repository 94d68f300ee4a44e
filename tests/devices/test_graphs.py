"""CUDA graph capture: a collective issued while the current stream is capturing is captured
(a synchronous one in the capturing stream itself; an async one on the comm stream, which
forks from and joins back into the capture by events), with no host synchronisation and no
allocation, so replaying the graph replays the collective."""
import threading
import time

import numpy as np
import pytest

import cupycomm
from cupycomm.testing import standin as sd
from arrays import GPU, GPU_SKIP_REASON, STANDIN, assert_equal



def test_captured_all_reduce_replays(dcomm):
    x = sd.asarray(np.ones(4))
    out = sd.empty(4)
    stream = sd.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dcomm.all_reduce(x, out=out)             # captured, not run
        dcomm.all_reduce(out)                    # in place on the result
        graph = stream.end_capture()
    assert_equal(STANDIN, x, np.ones(4))         # nothing ran during the capture
    n = dcomm.size
    for replay in range(2):
        x[...] = replay + 1
        graph.launch(stream)
        stream.synchronize()
        assert_equal(STANDIN, out, np.full(4, float((replay + 1) * n * n)))


def test_capture_of_every_preallocated_collective(dcomm):
    n, r = dcomm.size, dcomm.rank
    x = sd.asarray(np.full(2 * n, r + 1.0))
    gathered, part, exchanged = sd.empty(2 * n * n), sd.empty(2), sd.empty(2 * n)
    stream = sd.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dcomm.all_gather(x, out=gathered)
        dcomm.reduce_scatter(x, out=part)
        dcomm.all_to_all(x, out=exchanged)
        dcomm.broadcast(x, 0)
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    everyone = np.repeat(np.arange(1.0, n + 1), 2 * n)
    assert_equal(STANDIN, gathered, everyone)
    assert_equal(STANDIN, part, np.full(2, n * (n + 1) / 2))
    assert_equal(STANDIN, exchanged, np.repeat(np.arange(1.0, n + 1), 2))
    assert_equal(STANDIN, x, np.full(2 * n, 1.0))


def test_async_collective_in_a_capture_must_be_waited_in_it(dcomm):
    stream = sd.Stream(non_blocking=True)
    x = sd.asarray(np.ones(3))
    with stream:
        stream.begin_capture()
        dcomm.all_reduce(x, async_op=True).wait()     # joins the comm stream back
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    assert_equal(STANDIN, x, np.full(3, float(dcomm.size)))
    with stream:
        stream.begin_capture()
        dcomm.all_reduce(x, async_op=True)            # never joined: CUDA refuses the capture
        with pytest.raises(sd.CUDARuntimeError, match="not joined back"):
            stream.end_capture()


def test_captured_collectives_leave_nothing_for_the_watchdog(dcomm):
    """The events of captured collectives are graph nodes: never queried (CUDA answers
    cudaErrorCapturedEvent for ever, and a query during the capture invalidates it), so the
    watchdog must not see them as pending work, and captured Works are not kept in flight."""
    backend = dcomm.init_device()
    x = sd.asarray(np.ones(3))
    stream = sd.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dcomm.all_reduce(x)
        work = dcomm.all_reduce(x, async_op=True)
        assert not work.is_completed()               # not queried: the capture stays valid
        work.wait()
        assert work.is_completed()
        with dcomm.batch():
            batched = dcomm.all_reduce(x, async_op=True)
        batched.wait()
        graph = stream.end_capture()
    assert not backend.has_pending_work() and not backend._inflight
    graph.launch(stream)
    stream.synchronize()
    assert not backend.has_pending_work()
    assert_equal(STANDIN, x, np.full(3, float(dcomm.size ** 3)))


def test_wait_across_a_capture_boundary_is_refused_clearly(dcomm):
    x = sd.asarray(np.ones(3))
    stream = sd.Stream(non_blocking=True)
    before = dcomm.all_reduce(x, async_op=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(RuntimeError, match="launched before it began"):
            before.wait()                            # CUDA: cudaErrorStreamCaptureIsolation
        captured = dcomm.all_reduce(x, async_op=True)
        with pytest.raises(RuntimeError, match="captured in a CUDA graph runs when"):
            captured.synchronize()
        captured.wait()
        stream.end_capture()
    before.wait()
    stream.synchronize()


@pytest.mark.parametrize("mode", [None, 0, 1], ids=["cupy-relaxed", "torch-global",
                                                    "thread-local"])
def test_watchdog_queries_never_invalidate_a_capture(dcomm, mode):
    """The watchdog thread queries events while the main thread captures: in relaxed mode,
    which any capture mode allows (pytorch#104555: torch's default is global)."""
    backend = dcomm.init_device()
    x = sd.asarray(np.ones(3))
    dcomm.all_reduce(x)                              # the watchdog's event: recorded outside
    STANDIN.synchronize()                            # and done (were every stream deferred)
    stream = sd.Stream(non_blocking=True)
    with stream:
        stream.begin_capture(mode)
        dcomm.all_reduce(x)
        answers = []
        watchdog_like = threading.Thread(target=lambda: answers.append(
            (backend.has_pending_work(), backend.async_error())))
        watchdog_like.start()
        watchdog_like.join()
        graph = stream.end_capture()                 # raises if the capture was invalidated
    assert answers == [(False, "")]
    graph.launch(stream)
    stream.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason=GPU_SKIP_REASON)
def test_gpu_graph_replays_the_collective():
    cupy = GPU.module
    with GPU.comm() as comm:
        comm.device.use()
        comm.init_device()
        x = cupy.ones(1024, cupy.float32)
        out = cupy.empty_like(x)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            # Warm up first, as torch's graph docs advise: NCCL sets up its connections on a
            # communicator's first collective, which must not be what is captured.
            comm.all_reduce(x, out=out)
            stream.synchronize()
            stream.begin_capture()
            comm.all_reduce(x, out=out)
            graph = stream.end_capture()
            for replay in range(3):
                x.fill(replay + 1)
                graph.launch(stream)
            stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), np.full(1024, 3.0 * comm.size))


def captured_all_reduce(comm, x):
    """(a graph of ``comm.all_reduce(x)``, the stream that captured it)."""
    comm.init_device()   # (outside the capture: NCCL's communicator is not made in one)
    stream = sd.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        comm.all_reduce(x)
        return stream.end_capture(), stream


def test_a_graph_replayed_after_close_still_has_its_nccl_communicator():
    """Fault 3 of issue 23: ncclCommDestroy at close() would leave the graph's kernels using
    freed memory (stand-in rule 19): a communicator whose collectives were captured keeps
    its NCCL communicator, and launch_graph after close is refused."""
    comm = STANDIN.comm()
    x = sd.asarray(np.ones(3))
    graph, stream = captured_all_reduce(comm, x)
    comm.close()
    graph.launch(stream)
    stream.synchronize()
    assert_equal(STANDIN, x, np.full(3, float(comm.size)))
    with pytest.raises(cupycomm.CommClosedError, match="launch_graph"):
        comm.launch_graph(graph, stream)


def test_a_replay_that_never_completes_is_aborted_and_named():
    """Fault 7 of issue 23: a replay launched by comm.launch_graph is watched as an
    uncaptured collective is: past the timeout the NCCL communicator is aborted, naming it."""
    with STANDIN.comm(timeout=0.2) as comm:
        backend = comm.init_device()
        x = sd.asarray(np.ones(3))
        graph, stream = captured_all_reduce(comm, x)
        comm.launch_graph(graph, stream)               # watched, and completes
        stream.synchronize()
        assert not backend.has_pending_work()
        assert_equal(STANDIN, x, np.full(3, float(comm.size)))
        stuck = sd.Stream(non_blocking=True, deferred=True)   # a peer that never joins
        comm.launch_graph(graph, stuck)
        assert backend.has_pending_work()
        deadline = time.monotonic() + 10
        while not backend._aborted and time.monotonic() < deadline:
            backend._tracker.check(time.monotonic())   # (the watchdog thread's look)
            time.sleep(0.05)
        assert "CUDA graph replay #2 (launch_graph)" in backend._aborted
        stuck.pending.clear()                          # it never ran on any rank
        with pytest.raises(cupycomm.NcclError, match="launch_graph: the NCCL communicator was "
                                                     "aborted"):
            comm.launch_graph(graph, stuck)


def stuck_replay(comm, x):
    """(the graph, the stream) of a replay of ``comm.all_reduce(x)`` launched by
    ``comm.launch_graph`` that never runs: a peer that never launches its graph."""
    graph, _ = captured_all_reduce(comm, x)
    stuck = sd.Stream(non_blocking=True, deferred=True)
    comm.launch_graph(graph, stuck)
    return graph, stuck


def aborted_by_the_watchdog(backend):
    """Wait (at most 10 s) for the watchdog thread to end ``backend``'s NCCL communicator."""
    deadline = time.monotonic() + 10
    while not backend._aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    return backend._aborted


@pytest.mark.mpi(min_size=2)   # (the watchdog watches no communicator of 1)
def test_a_timeout_never_waits_on_a_graph_the_user_holds():
    """Issue 32 finding 4: ncclCommAbort waits until every graph that captured the
    communicator is destroyed (stand-in rule 19), so the watchdog aborting one whose replay
    never completes, the graph still held, hung holding the lifetime lock. It is kept
    instead, never freed, the watchdog goes on, and every later call raises, naming why."""
    from cupycomm.backends import nccl
    from cupycomm.faults import watchdog
    with STANDIN.comm(timeout=0.3) as comm:
        backend = comm.init_device()
        x = sd.asarray(np.ones(3))
        graph, stuck = stuck_replay(comm, x)
        assert "CUDA graph replay #1 (launch_graph)" in aborted_by_the_watchdog(backend)
        assert "kept, not aborted: CUDA graphs captured its calls (drop them)" in backend._aborted
        raw = backend._comm
        assert raw.freed_by == "" and any(kept is raw for kept in nccl._KEPT_FOR_GRAPHS)
        assert watchdog._watchdog.is_alive()
        with pytest.raises(cupycomm.NcclError, match="launch_graph: .* not finished .* kept"):
            comm.launch_graph(graph, stuck)
        with pytest.raises(cupycomm.NcclError, match="all_reduce: .* not finished"):
            comm.all_reduce(x)
        stuck.pending.clear()                          # it never ran on any rank


@pytest.mark.mpi(min_size=2)   # (the watchdog watches no communicator of 1)
def test_a_timeout_revokes_a_communicator_graphs_hold_where_nccl4py_can(monkeypatch):
    """With nccl4py's ncclCommRevoke (NCCL >= 2.28.9) the stuck replay's kernel ends at once,
    and the communicator is still kept (the graph still lives)."""
    from cupycomm.backends import nccl
    monkeypatch.setattr(nccl, "_revoker", lambda module: sd.comm_revoke)
    with STANDIN.comm(timeout=0.3) as comm:
        backend = comm.init_device()
        x = sd.asarray(np.ones(3))
        graph, stuck = stuck_replay(comm, x)
        assert aborted_by_the_watchdog(backend)
        raw = backend._comm
        stuck.synchronize()                            # revoked: ends without its peers
        assert raw._revoked and raw.freed_by == "" and "kept" not in backend._aborted
        with pytest.raises(cupycomm.NcclError, match="launch_graph: .* not finished"):
            comm.launch_graph(graph, stuck)
