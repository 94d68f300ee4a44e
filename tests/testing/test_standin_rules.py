"""Each rule of the stand-in (see the list in ``cupycomm.testing.standin``'s docstring), broken on purpose:
the stand-in must refuse what CUDA or NCCL would refuse, or the suite proves nothing."""
import contextlib
import ctypes
import gc
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from cupycomm.testing import standin as sd
from cupycomm.backends.nccl import NcclBackend, nccl_module
from cupycomm.faults import watchdog
from arrays import held_inside, in_new_thread


def Tracker():
    """A communicator's tracker, as cupycomm makes one."""
    return watchdog.Tracker("rules", 0, 1, 60.0)


# -- the nccl submodule exists once imported --------------------------------------------------------
def test_cuda_has_no_nccl_until_it_is_imported():
    sd.forget_nccl_import()
    with pytest.raises(AttributeError):
        sd.cuda.nccl
    backend = NcclBackend(MPI.COMM_SELF, 0, sd, Tracker())   # imports it, as it must
    assert sd.cuda.nccl is sd.nccl
    backend.close()


def test_nccl_that_cannot_load_is_named(monkeypatch):
    monkeypatch.setattr(sd.nccl, "available", False)
    with pytest.raises(RuntimeError, match="libnccl could not load"):
        nccl_module(sd)
    with pytest.raises(RuntimeError, match="libnccl could not load"):
        NcclBackend(MPI.COMM_SELF, 0, sd, Tracker())


# -- CUDA graph capture -----------------------------------------------------------------------------
def capturing(mode=None):
    """A stream that has begun a capture in ``mode`` (the stand-in's default: CuPy's relaxed)."""
    stream = sd.Stream(non_blocking=True)
    stream.begin_capture(mode)
    return stream


def test_an_event_recorded_in_a_capture_is_never_done():
    stream = capturing()
    event = sd.Event()
    event.record(stream)
    assert not event.done                           # the query invalidates the capture
    with pytest.raises(sd.CUDARuntimeError, match="Invalidated"):
        stream.end_capture()
    assert not event.done                           # cudaErrorCapturedEvent, for ever
    with pytest.raises(sd.CUDARuntimeError, match="cudaErrorCapturedEvent"):
        event.synchronize()
    event.record(sd.Stream())                        # recorded again outside: usable
    assert event.done


@pytest.mark.parametrize("mode", [sd.streamCaptureModeGlobal, sd.streamCaptureModeThreadLocal])
@pytest.mark.parametrize("call", ["query", "synchronize", "allocate"])
def test_unsafe_calls_invalidate_a_strict_capture(mode, call):
    """In global or thread-local mode, the capturing thread may not query, synchronize or
    allocate; in global mode, no other thread in global mode may either."""
    unrelated = sd.Event()
    unrelated.record(sd.Stream())
    calls = {"query": lambda: unrelated.done, "synchronize": unrelated.synchronize,
             "allocate": lambda: sd.empty(4)}
    stream = capturing(mode)
    other_thread = in_new_thread(calls[call])
    if mode == sd.streamCaptureModeGlobal:
        assert other_thread is False or isinstance(other_thread, sd.CUDARuntimeError)
    else:
        assert other_thread is True or not isinstance(other_thread, Exception)
        with pytest.raises(sd.CUDARuntimeError) if call != "query" else contextlib.nullcontext():
            assert calls[call]() is not True
    with pytest.raises(sd.CUDARuntimeError, match="Invalidated"):
        stream.end_capture()


def test_relaxed_captures_and_relaxed_threads_allow_unsafe_calls():
    unrelated = sd.Event()
    unrelated.record(sd.Stream())
    stream = capturing()                              # CuPy's default: relaxed
    assert unrelated.done and in_new_thread(lambda: unrelated.done) is True
    sd.empty(4)
    stream.end_capture()
    stream = capturing(sd.streamCaptureModeGlobal)

    def relaxed_query():
        sd.runtime.threadExchangeStreamCaptureMode(sd.streamCaptureModeRelaxed)
        return unrelated.done
    assert in_new_thread(relaxed_query) is True
    stream.end_capture()


def test_a_capture_cannot_wait_on_outside_work():
    outside = sd.Event()
    outside.record(sd.Stream())
    stream = capturing()
    with pytest.raises(sd.CUDARuntimeError, match="cudaErrorStreamCaptureIsolation"):
        stream.wait_event(outside)
    with pytest.raises(sd.CUDARuntimeError, match="Invalidated"):
        stream.end_capture()


def test_forked_streams_must_join():
    stream, side = capturing(), sd.Stream(non_blocking=True)
    fork = sd.Event()
    fork.record(stream)
    side.wait_event(fork)                             # side joins the capture
    assert side.is_capturing()
    with pytest.raises(sd.CUDARuntimeError, match="cudaErrorStreamCaptureUnjoined"):
        stream.end_capture()
    stream = capturing()
    fork.record(stream)
    side.wait_event(fork)
    join = sd.Event()
    join.record(side)
    stream.wait_event(join)
    stream.end_capture()
    assert not side.is_capturing()


# -- devices, streams and events ---------------------------------------------------------------------
def test_a_new_thread_starts_on_device_0_and_each_device_has_its_own_null_stream(monkeypatch):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    with sd.Device(1):
        assert in_new_thread(lambda: sd.Device().id) == 0
        on_one = sd.Stream.null.queue()
        sd.launch(sd.Stream.null, lambda: None, "on device 1's null stream")
    assert sd.Stream.null.queue() is not on_one
    assert "on device 1's null stream" not in sd.Stream.null.log
    assert sd.get_current_stream(1) is sd.Stream.null   # no stream entered on device 1


def test_events_and_streams_of_different_devices_do_not_mix(monkeypatch):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    with sd.Device(1):
        event, stream = sd.Event(), sd.Stream()
    with pytest.raises(RuntimeError, match="recorded on a stream of device 0"):
        event.record(sd.Stream())
    with pytest.raises(RuntimeError, match="recorded on a stream of device 0"):
        event.record(sd.Stream.null)                 # handle 0: the current device's
    with pytest.raises(RuntimeError, match="the current device is 0"):
        with stream:
            pass
    event.record(stream)
    sd.Stream().wait_event(event)                    # waiting across devices is allowed


# -- NCCL ----------------------------------------------------------------------------------------------
def test_a_communicator_is_made_on_the_current_device(monkeypatch):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    with sd.Device(1):
        comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    assert comm.device_id() == 1
    comm.destroy()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting", [{}, {"NCCL_HOSTID": "rank"},
                                     {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}],
                         ids=["refused", "distinct-hostids", "multi-rank-switch"])
def test_two_ranks_on_one_gpu_are_refused_unless_told(monkeypatch, setting):
    monkeypatch.setattr(sd, "SHARED_GPUS", True)        # the ranks of one host share GPU 0
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    world = MPI.COMM_WORLD
    for name, value in setting.items():
        monkeypatch.setenv(name, f"host-{world.Get_rank()}" if value == "rank" else value)
    unique_id = world.bcast(sd.get_unique_id() if world.Get_rank() == 0 else None)
    if not setting:
        with pytest.raises(sd.NcclError, match="Duplicate GPU detected"):
            sd.NcclCommunicator(world.Get_size(), unique_id, world.Get_rank())
        return
    comm = sd.NcclCommunicator(world.Get_size(), unique_id, world.Get_rank())
    comm.destroy()


def test_a_destroyed_or_aborted_communicator_refuses_every_call():
    for end in ("destroy", "abort"):
        comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
        getattr(comm, end)()
        x = sd.zeros(2)
        for call in (comm.check_async_error,
                     lambda: comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, 0),
                     lambda: comm.commSplit(0, 0)):
            with pytest.raises(sd.NcclError, match="ncclInvalidArgument"):
                call()
        getattr(comm, end)()                           # CuPy: a no-op on a NULL handle


# -- a communicator that lost a member is aborted, never destroyed (rule 21) --------------------
def test_a_communicator_that_lost_a_member_is_aborted_never_destroyed():
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    comm.member_lost = "rank 1 was killed"
    with pytest.raises(sd.NcclError, match=r"ncclCommDestroy .*\(rank 1 was killed\).*"
                                           r"pytorch#194679.*abort it"):
        comm.destroy()
    assert comm.freed_by == ""                 # still alive: refused before anything was freed
    comm.abort()
    assert comm.freed_by == "ncclCommAbort"
    comm.destroy()                             # a no-op once aborted, as in CuPy


def test_a_communicator_whose_members_all_live_is_destroyed():
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    comm.destroy()
    assert comm.freed_by == "ncclCommDestroy"


# -- a dead member leaves kernels waiting until the abort, and NCCL reports it (rule 22) -------
class _DeadMember:
    """A communicator's MPI as ULFM leaves it once a member died: its collectives and
    transfers fail with ERR_PROC_FAILED."""

    def __init__(self, mpi_comm):
        self.mpi_comm = mpi_comm

    def Allgather(self, *args):
        raise MPI.Exception(MPI.ERR_PROC_FAILED)

    Bcast = Allgather

    def __getattr__(self, name):
        return getattr(self.mpi_comm, name)


def test_a_collective_whose_member_died_waits_until_the_communicator_is_aborted(monkeypatch):
    """No MPI error reaches the caller: the launch returns, its kernel (and the work queued
    behind it) waits, the host blocks only where it synchronizes; ncclCommGetAsyncError says
    ncclRemoteError, and so does every later launch (NCCL's ncclCommEnsureReady), enqueuing
    nothing; the abort ends the wait and leaves garbage in the output, not its old values."""
    monkeypatch.setattr(sd, "LOSSES", frozenset({MPI.ERR_PROC_FAILED}))   # ULFM's, modelled
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    comm._comm = _DeadMember(comm._comm)
    stream, after = sd.Stream(non_blocking=True), sd.Stream(non_blocking=True)
    x, y = sd.asarray(np.arange(4.0)), sd.asarray(np.full(4, 7.0))
    comm.allReduce(x.data.ptr, y.data.ptr, 4, 8, 0, stream.ptr)   # raises nothing
    with pytest.raises(sd.NcclError, match="ncclRemoteError") as error:
        comm.check_async_error()
    assert error.value.status == 6
    event = stream.record()
    after.wait_event(event)                       # the host does not block here
    ran = []
    sd.launch(after, lambda: ran.append(True))
    with pytest.raises(sd.NcclError, match="ncclRemoteError") as refused:
        comm.bcast(x.data.ptr, 4, 8, 0, after.ptr)   # nor here: the launch returns the error
    assert refused.value.status == 6 and "nccl bcast" not in after.log
    assert not stream.done and not event.done and not after.done and ran == []
    with pytest.raises(sd.NcclError, match="ncclCommDestroy .*a kernel waits for a dead"):
        comm.destroy()                            # rule 21: aborted, never destroyed
    aborter = threading.Timer(0.3, comm.abort)
    aborter.start()
    began = time.monotonic()
    after.synchronize()                           # blocks until the abort ends the kernels
    aborter.join()
    assert time.monotonic() - began >= 0.25 and ran == [True]
    assert stream.done and event.done and comm.freed_by == "ncclCommAbort"
    assert (sd.asnumpy(y) == 0).all(), sd.asnumpy(y)   # cut short: garbage (an H200's zeros)


def test_a_kernel_that_runs_after_the_abort_leaves_garbage_in_its_output():
    """A collective queued before the abort (a busy GPU) and run after it: its output is
    undefined (NCCL's user guide: the results of operations the abort ended cannot be
    assumed), here zeros, never the buffer's old values."""
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    held = sd.Stream(non_blocking=True, deferred=True)
    x, y = sd.asarray(np.arange(4.0)), sd.asarray(np.full(4, 7.0))
    comm.allReduce(x.data.ptr, y.data.ptr, 4, 8, 0, held.ptr)
    comm.abort()
    held.synchronize()
    assert (sd.asnumpy(y) == 0).all(), sd.asnumpy(y)


@pytest.mark.parametrize("bad, error", [(2.0, TypeError), (None, TypeError),
                                        (-1, OverflowError)], ids=["float", "None", "negative"])
def test_arguments_are_converted_as_cupys_compiled_signatures_do(bad, error):
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    x = sd.zeros(2)
    with pytest.raises(error):
        comm.allReduce(x.data.ptr, x.data.ptr, bad, 8, 0, 0)       # size_t count
    with pytest.raises(TypeError):
        comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0)            # arity
    with pytest.raises(error if bad is not None else TypeError):
        sd.runtime.memcpyAsync(x.data.ptr, x.data.ptr, 8, sd.runtime.memcpyDefault,
                               bad if bad != -1 else 2 ** 64)      # intptr_t stream
    with pytest.raises(TypeError):
        sd.NcclCommunicator(1, bytearray(sd.get_unique_id()), 0)   # bytes commId
    comm.allReduce(x.data.ptr, x.data.ptr, np.uint64(2), np.int32(8), 0, 0)   # __index__
    comm.destroy()


# -- NCCL's order ---------------------------------------------------------------------------------------
def test_one_communicators_calls_run_in_issue_order_whatever_their_streams():
    comm, other = (sd.NcclCommunicator(1, sd.get_unique_id(), 0) for _ in range(2))
    held, free = sd.Stream(non_blocking=True, deferred=True), sd.Stream(non_blocking=True)
    x = sd.asarray(np.ones(2))
    comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, held.ptr)
    other.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, free.ptr)   # another communicator's
    assert held.pending, "a call of another communicator waited for it"
    comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, free.ptr)
    assert not held.pending, "a later call of its communicator ran before it"
    y = sd.empty(2)
    sd.groupStart()
    other.send(x.data.ptr, 2, 8, 0, held.ptr)
    other.recv(y.data.ptr, 2, 8, 0, held.ptr)
    sd.groupEnd()
    assert held.pending
    other.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, free.ptr)    # groups are ordered too
    assert not held.pending
    comm.destroy()
    other.destroy()


# -- memory ----------------------------------------------------------------------------------------------
def raw_view(address, count):
    """The float64 values at ``address``, whoever owns that memory now."""
    return np.frombuffer((ctypes.c_char * (8 * count)).from_address(address), np.float64)


def test_freed_memory_is_poisoned_in_its_streams_order_and_reused_by_that_stream():
    stream, other = sd.Stream(non_blocking=True), sd.Stream(non_blocking=True)
    with stream:
        x = sd.asarray(np.ones(4))
        address = x.data.ptr
        with sd.deferred(stream):
            del x
            gc.collect()
            sd.empty(1)                                  # the pool looks at what was freed
            assert (raw_view(address, 4) == 1).all()     # the stream has not got there yet
            stream.synchronize()
        assert np.isnan(raw_view(address, 4)).all()      # poisoned: NaN
        with other:
            assert sd.empty(4).data.ptr != address       # not another stream's
        assert sd.empty(4).data.ptr == address           # this stream's, at once


# -- the stand-in's own kernels in stream order (rule 6) ----------------------------------------------
def test_the_standins_own_kernels_run_in_their_streams_order():
    """An assignment, a copy, a concatenate and arithmetic on device arrays are kernels of the
    current stream: they see what that stream's earlier work wrote, however late it runs."""
    stream = sd.Stream(non_blocking=True)
    x, y = sd.asarray(np.zeros(2)), sd.asarray(np.zeros(2))
    with stream, sd.deferred(stream):
        sd.launch(stream, lambda: x.view(np.ndarray).__setitem__(Ellipsis, 7.0), "write x")
        y[...] = x                                   # queued behind "write x"
        copied, joined = x.copy(), sd.concatenate([x, x])
        assert (y.view(np.ndarray) == 0).all()       # nothing ran yet
        doubled = x * 2                              # computed now: after "write x"
    stream.synchronize()
    assert (doubled.view(np.ndarray) == 14).all()
    for array in (y, copied, joined):
        assert (array.view(np.ndarray) == 7).all()


def test_a_host_copy_waits_for_the_arrays_devices_stream(monkeypatch):
    """CuPy's ndarray.get makes the array's device current for the copy: the null stream (the
    current stream of a thread that entered none) is that device's [cupy/_core/core.pyx]."""
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    with sd.Device(1):
        x = sd.asarray(np.zeros(2))
        with sd.deferred(sd.Stream.null.queue()):
            sd.launch(sd.Stream.null, lambda: x.view(np.ndarray).__setitem__(Ellipsis, 3.0))
    with sd.Device(0):
        assert (sd.asnumpy(x) == 3).all()


# -- CUDA contexts ----------------------------------------------------------------------------------------
def test_set_device_makes_a_context_and_device_exit_always_sets_the_device_back(monkeypatch):
    """cudaSetDevice creates its device's primary context (CUDA 12); CuPy's Device.__exit__
    calls setDevice(previous) even where the thread never set one (a new thread's is 0)."""
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)

    def mine():
        me = threading.get_ident()
        return {device for thread, device in list(sd.contexts) if thread == me}

    def forget_mine():   # (a thread id is reused once its thread has ended)
        for device in mine():
            sd.contexts.discard((threading.get_ident(), device))

    def entered_once():
        forget_mine()
        with sd.Device(1):
            pass
        return mine(), sd.runtime.getDevice()

    def set_once():
        forget_mine()
        sd.runtime.setDevice(1)
        sd.Event().record(sd.Stream.null)
        return mine(), sd.runtime.getDevice()
    assert in_new_thread(entered_once) == ({0, 1}, 0)     # a context on GPU 0 as well
    assert in_new_thread(set_once) == ({1}, 1)
    assert in_new_thread(lambda: (forget_mine(), sd.runtime.getDevice(), mine())) == (
        None, 0, set())

    def bound():   # a new thread has no current context until a runtime call binds one
        before = (sd.runtime.getDevice(), sd.cuda.driver.ctxGetCurrent())
        sd.runtime.setDevice(1)
        return before, sd.cuda.driver.ctxGetCurrent() != 0
    assert in_new_thread(bound) == ((0, 0), True)
    assert 1 in sd.context_devices()


# -- copies are kernels -----------------------------------------------------------------------------------
def test_a_copy_between_device_arrays_is_a_kernel_on_the_current_stream():
    """A copy runs when its stream gets there: on a stream still busy, not yet."""
    held = sd.Stream(non_blocking=True, deferred=True)
    x, y, flat = sd.asarray(np.zeros(2)), sd.asarray(np.ones(2)), sd.asarray(np.zeros(4))
    sd.launch(held, lambda: None, "earlier work")   # the stream is busy with it
    with held:
        x[...] = y
        sd.concatenate([y, y], axis=None, out=flat)
    assert held.log == ["earlier work", "copy", "concatenate"]
    assert not x.get().any() and not flat.get().any()   # the stream has not got there
    held.synchronize()
    assert x.get().all() and flat.get().all()
    sd.launch(held, lambda: x.__setitem__(Ellipsis, y * 2), "a kernel's own copy")
    held.synchronize()
    assert (x.get() == 2).all() and held.log[-1] == "a kernel's own copy"


# -- one communicator, one thread at a time ---------------------------------------------------------------
def test_one_communicator_is_not_used_from_two_threads_at_once(monkeypatch):
    """NCCL forbids concurrent host calls on one communicator (a thread inside a call, a
    thread's open group holding one), nothing else; its group state is per thread."""
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    x = sd.asarray(np.ones(2))
    held = sd.Stream(non_blocking=True, deferred=True)

    def all_reduce(stream):
        return lambda: comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, stream.ptr)
    all_reduce(held)()                                    # in flight
    assert in_new_thread(all_reduce(sd.Stream.null)) is None   # handed over all the same
    real = comm._enqueue
    inside, release = held_inside(monkeypatch, comm, "_enqueue")
    launcher = threading.Thread(target=all_reduce(sd.Stream.null))
    launcher.start()
    inside.wait(10)
    monkeypatch.setattr(comm, "_enqueue", real)
    refused = in_new_thread(all_reduce(sd.Stream.null))   # while that one is inside
    assert isinstance(refused, sd.NcclError) and "second thread" in str(refused)
    assert in_new_thread(comm.check_async_error) is None  # made to be asked meanwhile
    release.set()
    launcher.join()
    sd.groupStart()
    all_reduce(held)()                                    # in this thread's open group
    assert in_new_thread(sd._open_group) is None          # not another thread's
    refused = in_new_thread(all_reduce(sd.Stream.null))
    assert isinstance(refused, sd.NcclError) and "second thread" in str(refused)
    sd.groupEnd()
    held.synchronize()
    comm.destroy()


def test_abort_while_another_thread_is_inside_a_launch_is_refused(monkeypatch):
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    x = sd.asarray(np.ones(2))
    inside, release = held_inside(monkeypatch, comm, "_enqueue")
    launcher = threading.Thread(target=comm.allReduce, args=(x.data.ptr, x.data.ptr, 2, 8, 0, 0))
    launcher.start()
    inside.wait(10)
    with pytest.raises(sd.NcclError, match="inside ncclAllReduce"):
        comm.abort()
    release.set()
    launcher.join()
    comm.abort()


# -- graphs of NCCL calls ---------------------------------------------------------------------------------
def captured_all_reduce(comm, x):
    stream = sd.Stream(non_blocking=True)
    stream.begin_capture()
    comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, stream.ptr)
    return stream.end_capture()


def test_graph_launches_take_their_place_in_the_communicators_order():
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    x = sd.asarray(np.ones(2))
    graph = captured_all_reduce(comm, x)
    held = sd.Stream(non_blocking=True, deferred=True)
    comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, held.ptr)
    graph.launch(sd.Stream(non_blocking=True))
    assert not held.pending, "a replay ran before the communicator's earlier call"
    del graph                                       # (rule 19: before the communicator)
    comm.destroy()


@pytest.mark.parametrize("end", ["destroy", "abort"])
def test_a_communicator_is_not_freed_while_a_graph_that_captured_it_lives(end):
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    x = sd.asarray(np.ones(2))
    graph = captured_all_reduce(comm, x)
    with pytest.raises(sd.NcclError, match=f"{'ncclComm' + end.title()} waits until every "
                                           f"CUDA graph .* is destroyed .*commDestroySync"):
        getattr(comm, end)()
    assert comm.freed_by == "" and comm.comm != 0
    graph.launch(sd.Stream(non_blocking=True))     # its graph still replays
    del graph
    gc.collect()
    getattr(comm, end)()
    assert comm.freed_by == f"ncclComm{end.title()}" and comm.comm == 0


def test_revoke_ends_the_kernels_in_flight_and_frees_nothing(monkeypatch):
    monkeypatch.setattr(sd, "LOSSES", frozenset({MPI.ERR_PROC_FAILED}))   # ULFM's, modelled
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    x = sd.asarray(np.ones(2))
    graph = captured_all_reduce(comm, x)
    comm._comm = _DeadMember(comm._comm)
    stream = sd.Stream(non_blocking=True)
    graph.launch(stream)                           # its kernel waits for the dead member
    assert not stream.done
    with pytest.raises(sd.NcclError, match="ncclInvalidArgument"):
        sd.comm_revoke(comm.comm, 1)
    sd.comm_revoke(comm.comm, 0)
    stream.synchronize()                           # ended, not waited for
    assert comm.freed_by == ""
    with pytest.raises(sd.NcclError, match="revoked"):
        comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, stream.ptr)
    with pytest.raises(sd.NcclError, match="waits until every CUDA graph"):
        comm.abort()                               # (the graph still lives)
    del graph
    gc.collect()
    comm.abort()


# -- CuPy's destructor destroys a communicator collected unfreed (rule 23) -------------------------
def test_a_collected_communicator_is_destroyed_in_the_collecting_thread():
    comm = sd.NcclCommunicator(1, sd.get_unique_id(), 0)
    mpi_comm = comm._comm
    comm.cycle = comm                              # collected by the cycle collector only
    del comm
    in_new_thread(gc.collect)
    assert mpi_comm == MPI.COMM_NULL               # ncclCommDestroy freed it


# -- the legacy null stream and the per-thread default stream ----------------------------------------------
def test_the_legacy_null_stream_orders_blocking_streams_and_not_non_blocking_ones():
    blocking = sd.Stream(deferred=True)
    non_blocking = sd.Stream(non_blocking=True, deferred=True)
    sd.launch(blocking, lambda: None, "on a blocking stream")
    sd.launch(non_blocking, lambda: None, "on a non-blocking stream")
    sd.launch(sd.Stream.null, lambda: None, "then on the null stream")
    assert not blocking.pending, "the null stream's work ran before a blocking stream's"
    assert non_blocking.pending
    with sd.deferred(sd.Stream.null.queue()):
        sd.launch(sd.Stream.null, lambda: None, "held on the null stream")
        sd.launch(sd.Stream(), lambda: None, "then on a blocking stream")
        assert not sd.Stream.null.pending, "a blocking stream's work ran before the null's"
        sd.launch(sd.Stream.null, lambda: None, "held on the null stream")
        sd.launch(sd.Stream(non_blocking=True), lambda: None, "then on a non-blocking one")
        assert sd.Stream.null.pending
    sd.Stream.null.synchronize()
    non_blocking.synchronize()


def test_handle_2_is_the_threads_own_blocking_stream_of_the_current_device(monkeypatch):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    mine = sd.Stream.from_ptr(2)
    assert sd.Stream.ptds.ptr == 2 and sd.Stream.ptds.queue() is mine
    assert in_new_thread(lambda: sd.Stream.from_ptr(2)) is not mine
    with sd.Device(1):
        assert sd.Stream.from_ptr(2) is not mine
    with sd.deferred(mine):
        sd.launch(sd.Stream.ptds, lambda: None, "on this thread's stream")
        sd.launch(sd.Stream.null, lambda: None, "then on the null stream")
        assert not mine.pending, "the per-thread stream is not ordered with the null stream"
    sd.Stream.ptds.begin_capture()                      # unlike handle 0, it can capture
    assert sd.Stream.ptds.is_capturing()
    sd.Stream.ptds.end_capture()


# -- the host thread's last error -------------------------------------------------------------------
def test_a_refused_peer_access_leaves_no_last_error_as_cupy_resets_it(monkeypatch):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    monkeypatch.setattr(sd, "peer_access", {(0, 1)})
    monkeypatch.setattr(sd._thread_errors, "status", 0, raising=False)
    with sd.Device(0), pytest.raises(sd.CUDARuntimeError) as refused:
        sd.cuda.runtime.deviceEnablePeerAccess(1)
    assert refused.value.status == 704 and sd.last_error() == 0
    with pytest.raises(AttributeError):   # CuPy's Python runtime has none to call
        sd.cuda.runtime.getLastError()
    # without CuPy's reset the status stays, on this thread only
    monkeypatch.setattr(sd, "_get_last_error", lambda: None)
    with sd.Device(0), pytest.raises(sd.CUDARuntimeError):
        sd.cuda.runtime.deviceEnablePeerAccess(1)
    assert sd.last_error() == 704
    assert in_new_thread(sd.last_error) == 0


# -- the first call that needs a peer connects to it, waiting for it (rule 24) -------------------
def world_communicator():
    world = MPI.COMM_WORLD
    unique_id = world.bcast(sd.get_unique_id() if world.rank == 0 else None)
    return sd.NcclCommunicator(world.size, unique_id, world.rank)


@pytest.mark.mpi(min_size=2)
def test_the_first_call_that_needs_a_peer_waits_in_the_host_for_it():
    comm = world_communicator()
    x = sd.asarray(np.ones(2))
    held = sd.Stream(non_blocking=True, deferred=True)   # its kernels never run: launches only
    if comm.rank_id() == 1:
        time.sleep(0.5)
    began = time.monotonic()
    comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, held.ptr)
    if comm.rank_id() == 0:
        assert time.monotonic() - began >= 0.4     # the host waited for rank 1's first call
    began = time.monotonic()
    comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, held.ptr)
    assert time.monotonic() - began < 0.3          # connected: a launch returns at once
    held.pending.clear()
    comm.destroy()


@pytest.mark.mpi(min_size=2)
def test_a_revoke_ends_the_wait_for_a_peer_that_never_connects():
    comm = world_communicator()
    x = sd.asarray(np.ones(2))
    held = sd.Stream(non_blocking=True, deferred=True)
    if comm.rank_id() == 0:
        revoke = threading.Timer(0.3, sd.comm_revoke, (comm.comm, 0))
        revoke.start()
        with pytest.raises(sd.NcclError, match="revoked while connecting"):
            comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, held.ptr)
        revoke.join()
    else:
        time.sleep(1.0)   # rank 0 gave up meanwhile; this rank's side of the connection is met
        comm.allReduce(x.data.ptr, x.data.ptr, 2, 8, 0, held.ptr)
    MPI.COMM_WORLD.Barrier()
    held.pending.clear()
    comm.destroy()
