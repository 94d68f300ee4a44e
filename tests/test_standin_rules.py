"""Each rule of the stand-in (see the list in ``nccl_standin``'s docstring), broken on purpose:
the stand-in must refuse what CUDA or NCCL would refuse, or the suite proves nothing."""
import contextlib
import threading

import pytest
from mpi4py import MPI

import nccl_standin as sd
from cupycomm.backends.nccl import NcclBackend, nccl_module


class Tracker:
    seq = 0


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


def in_new_thread(call):
    """What ``call()`` returns or raises in a new thread (whose capture mode is CUDA's default,
    global)."""
    outcome = []

    def run():
        try:
            outcome.append(call())
        except Exception as error:
            outcome.append(error)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return outcome[0]


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
