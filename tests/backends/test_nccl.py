"""The NCCL backend's own behaviour: stream and event ordering, Work lifetime, lazy creation,
close, NCCL errors and timeouts. Against the stand-in in CI; the ordering test also runs on a
real GPU, where a slow kernel writes the input just before the collective."""
import gc
import pathlib
import re
import threading
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import cupycomm
from cupycomm.run import launchers
from cupycomm.testing import SIMULATES_NODES, run_job
from cupycomm.testing import standin as sd
from cupycomm.backends.nccl import NcclBackend, nccl_module
from cupycomm.faults.watchdog import Tracker
from arrays import GPU, GPU_SKIP_REASON, STANDIN, assert_equal, held_inside, in_new_thread

ROOT = pathlib.Path(__file__).resolve().parents[2]



def test_sync_collective_runs_on_the_caller_stream_then_records_the_watchdogs_event(dcomm):
    """As torch's ProcessGroupNCCL for async_op=False (pytorch#150398): no comm stream, no
    event fork and join; only the event the watchdog queries."""
    caller = sd.Stream(non_blocking=True)
    x = sd.asarray(np.ones(4))
    before = len(dcomm.init_device().stream.log)
    with caller:
        dcomm.all_reduce(x)
    assert caller.log == ["nccl allReduce", f"record {dcomm.parts.router.device._finished.name}"]
    assert len(dcomm.parts.router.device.stream.log) == before
    caller.synchronize()   # (the host never waited: on a busy GPU x is not summed yet)
    assert_equal(STANDIN, x, np.full(4, float(dcomm.size)))


def test_the_watchdogs_one_event_covers_earlier_calls_on_other_streams(dcomm):
    """Every synchronous call records the same event on its own stream: the last one done
    means all done, because NCCL runs one communicator's kernels in issue order (stand-in
    rule 13)."""
    backend = dcomm.init_device()
    held, free = sd.Stream(non_blocking=True, deferred=True), sd.Stream(non_blocking=True)
    x, y = sd.asarray(np.ones(2)), sd.asarray(np.ones(3))
    with held:
        dcomm.all_reduce(x)
    assert backend.has_pending_work()
    with free:
        dcomm.all_reduce(y)
    free.synchronize()   # (on a busy GPU it is not done before)
    assert not backend.has_pending_work() and not held.pending
    assert_equal(STANDIN, x, np.full(2, float(dcomm.size)))
    assert_equal(STANDIN, y, np.full(3, float(dcomm.size)))


def test_kernel_before_the_collective_on_the_caller_stream_is_seen(dcomm):
    """The caller's stream still holds the kernel that writes x when the collective is issued:
    without the event wait, NCCL would reduce the stale ones."""
    caller = sd.Stream(non_blocking=True, deferred=True)
    x = sd.asarray(np.ones(4))
    with caller:
        sd.launch(caller, lambda: x.__setitem__(Ellipsis, dcomm.rank + 10), "write x")
        dcomm.all_reduce(x)
        assert caller.log[0] == "write x"
        caller.synchronize()
    expected = sum(r + 10 for r in range(dcomm.size))
    assert_equal(STANDIN, x, np.full(4, float(expected)))


def test_async_collective_leaves_the_caller_stream_alone_until_wait(dcomm):
    caller = sd.Stream(non_blocking=True)
    x = sd.asarray(np.ones(3))
    with caller:
        work = dcomm.all_reduce(x, async_op=True)
        assert caller.log == [f"record {dcomm.parts.router.device._ready.name}"]
        assert work.wait() is x
        assert caller.log[-1].startswith("wait event")
        caller.synchronize()   # wait() only orders the caller's stream: the GPU may be busy
    assert work.is_completed()
    assert_equal(STANDIN, x, np.full(3, float(dcomm.size)))


def test_stream_argument_launches_there_without_events_from_other_streams(dcomm):
    mine = sd.Stream(non_blocking=True)
    x = sd.asarray(np.ones(2))
    before = len(dcomm.parts.router.device.stream.log)
    assert dcomm.all_reduce(x, stream=mine) is x
    held_event, held = dcomm.parts.router.device._held[-1]   # the arrays kept until the stream reads them
    assert mine.log == ["nccl allReduce", f"record {dcomm.parts.router.device._finished.name}",
                        f"record {held_event.name}"] and held == (x, x)
    assert len(dcomm.parts.router.device.stream.log) == before
    work = dcomm.broadcast(x, 0, stream=mine, async_op=True)
    assert mine.log[-2:] == ["nccl bcast", mine.log[-1]] and mine.log[-1].startswith("record")
    work.synchronize()


def test_work_keeps_its_arrays_alive_until_completion(dcomm):
    held = sd.Stream(non_blocking=True, deferred=True)

    def start():
        x = sd.asarray(np.ones(1000))
        dcomm.all_reduce(x, stream=held, async_op=True)   # the Work is dropped at once
        return weakref.ref(x)
    ref = start()
    gc.collect()
    assert ref() is not None, "an in-flight collective's array was freed"
    held.synchronize()
    dcomm.all_reduce(sd.asarray(np.ones(1)), async_op=True).wait()   # prunes completed work
    gc.collect()
    assert ref() is None, "a completed collective still holds its array"


def test_lazy_creation_and_close():
    comm = STANDIN.comm()
    assert comm.parts.router.device is None
    comm.all_reduce(np.ones(2))          # host work never creates the NCCL communicator
    assert comm.parts.router.device is None
    with pytest.raises(RuntimeError, match=r"call comm.init_device\(\) on every rank"):
        comm.sendrecv(sd.asarray(np.ones(1)), 0, sd.empty(1), 0)
    assert comm.parts.router.device is None
    assert_equal(STANDIN, comm.all_reduce(sd.asarray(np.ones(2))), np.full(2, float(comm.size)))
    backend = comm.parts.router.device
    assert backend is not None and comm.device.id == 0
    raw = backend._comm
    comm.close()
    assert not raw._alive
    comm.close()
    with pytest.raises(cupycomm.CommClosedError):
        comm.all_reduce(sd.asarray(np.ones(2)))
    again = STANDIN.comm()   # a new communicator after close works
    assert_equal(STANDIN, again.all_reduce(sd.asarray(np.ones(2))), np.full(2, float(again.size)))
    again.close()


def test_close_waits_for_synchronous_collectives_on_the_callers_streams():
    """A synchronous collective is on the caller's stream, not the comm stream: close() must
    still let it finish before the NCCL communicator is destroyed."""
    comm = STANDIN.comm()
    comm.init_device()
    x = sd.asarray(np.ones(2))
    caller = sd.Stream(non_blocking=True, deferred=True)
    with caller:
        comm.all_reduce(x)
    assert caller.pending
    comm.close()
    assert not caller.pending
    assert_equal(STANDIN, x, np.full(2, float(comm.size)))


def test_device_choice_spreads_local_ranks_over_gpus(monkeypatch):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    with STANDIN.comm() as comm:
        assert comm.device.id == comm.local_rank % 2
    with STANDIN.comm(device=1) as comm:
        assert comm.device.id == 1


def test_every_entry_point_uses_the_communicators_device_while_another_is_current(
        monkeypatch):
    """The caller's stream is the current stream of the communicator's device (an event of
    one device cannot be recorded on another's stream; the null stream is each device's own)."""
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    with STANDIN.comm(device=1) as comm:
        comm.init_device()
        x, y, z = _on(1, np.ones(3)), _on(1, np.ones(2)), _on(1, np.ones(2, np.float32))
        n = float(comm.size)
        with sd.Device(0):
            assert_equal(STANDIN, comm.all_reduce(x), np.full(3, n))
            comm.all_reduce(x, async_op=True).wait()
            with comm.batch():
                comm.all_reduce(x)
            comm.all_reduce_coalesced([x, y, z])             # x and y packed on device 1
            comm.all_reduce_coalesced([x, y], async_op=True).wait()
            bucket = comm.bucket([x, y, z])
            bucket.all_reduce()
            out = comm.all_gather(x)
        sd.Device(1).synchronize()
        assert_equal(STANDIN, x, np.full(3, n ** 5))
        assert_equal(STANDIN, bucket.arrays[0], np.full(3, n ** 6))
        assert_equal(STANDIN, bucket.arrays[2], np.full(2, n ** 2, np.float32))
        assert out.device.id == 1 and bucket.flats[0].device.id == 1


def test_a_rank_on_gpu_1_makes_no_context_on_gpu_0(monkeypatch):
    """Fault 1 of issue 23: a new thread's current device is 0, CuPy's Device.__exit__ always
    sets the previous device back and cudaSetDevice makes a context (stand-in rule 14): the
    watchdog's look must leave this process with a context on GPU 1 alone (about 0.5 GiB of
    GPU 0 per rank otherwise)."""
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    monkeypatch.setattr(sd.Device._local, "id", sd.Device.current_id(), raising=False)
    with STANDIN.comm(device=1) as comm:
        x = comm.xp.asarray(np.ones(2))   # comm.xp makes the rank's device current
        sd.contexts.clear()
        backend = comm.init_device()
        assert_equal(STANDIN, comm.all_reduce(x), np.full(2, float(comm.size)))
        for _ in range(2):   # the watchdog's looks, in a thread of their own
            look = threading.Thread(target=backend._tracker.check, args=(time.monotonic(),))
            look.start()
            look.join()
        assert sd.context_devices() == {1}


def test_a_call_from_a_new_thread_makes_no_context_on_gpu_0(monkeypatch):
    """Finding 9 of issue 32: a new thread's current device is 0 and has no context there;
    a call from it (a launch, a new array, wait()) must not set device 0 back after making
    the rank's current (stand-in rule 14: that makes a context on GPU 0, hundreds of MiB
    per rank). A thread that had a context on device 0 gets device 0 back."""
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    monkeypatch.setattr(sd.Device._local, "id", sd.Device.current_id(), raising=False)
    with STANDIN.comm(device=1) as comm:
        x = comm.xp.asarray(np.ones(2))   # comm.xp makes the rank's device current
        comm.init_device()
        sd.contexts.clear()

        y = comm.xp.asarray(np.ones(3))

        def calls():
            comm.all_reduce(x)
            gathered = comm.all_gather(x)
            comm.all_reduce(x, async_op=True).wait()
            return gathered
        gathered = in_new_thread(calls)
        in_new_thread(lambda: comm.all_reduce_coalesced([x, y]))   # (its first call)
        assert sd.context_devices() == {1}
        n = float(comm.size)
        assert_equal(STANDIN, gathered, np.full((comm.size, 2), n))
        sd.Device(1).synchronize()
        assert_equal(STANDIN, x, np.full(2, n ** 3))
        assert_equal(STANDIN, y, np.full(3, n))

        def on_0():
            sd.runtime.setDevice(0)
            comm.all_reduce(x)
            return sd.runtime.getDevice()
        assert in_new_thread(on_0) == 0


@pytest.mark.parametrize("given", [False, True], ids=["current-stream", "stream="])
def test_reduce_scatter_of_a_list_copies_its_parts_where_the_collective_runs(monkeypatch, given):
    """Finding 10 of issue 32: the parts are copied into one array on the communicator's
    device, on the stream the collective runs on (its device's current stream, or
    ``stream=``), whatever device is current: kernels there that wrote the parts first are
    seen (stand-in rule 6: a copy is a kernel on the current stream)."""
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    monkeypatch.setattr(sd.Device._local, "id", sd.Device.current_id(), raising=False)
    with STANDIN.comm(device=1) as comm:
        comm.init_device()
        n, me = comm.size, comm.rank
        with sd.Device(1):
            parts = [sd.asarray(np.zeros(3)) for _ in range(n)]
            caller = sd.Stream(non_blocking=True, deferred=True)
            with caller:
                for j, part in enumerate(parts):
                    sd.launch(caller, lambda part=part, j=j: part.__setitem__(
                        Ellipsis, me + j + 1.0), "write a part")
                with sd.Device(0):   # another device current
                    out = comm.reduce_scatter(parts, stream=caller if given else None)
            caller.synchronize()
            assert_equal(STANDIN, out, np.full(3, n * (me + 1.0) + n * (n - 1) / 2))


def _on(device, data):
    with sd.Device(device):
        return sd.asarray(data)


def test_close_waits_for_the_watchdogs_use_of_the_communicator(dcomm, monkeypatch):
    """ncclCommGetAsyncError takes no lock and ncclCommDestroy frees what it reads: close()
    (and abort) wait until the watchdog's call returns, and it leaves a closing one alone."""
    backend = dcomm.init_device()
    inside, release = held_inside(monkeypatch, backend._comm, "check_async_error")
    answers, failures = [], []
    watchdog_like = threading.Thread(target=lambda: answers.append(backend.async_error()))
    watchdog_like.start()
    inside.wait(10)

    def close():
        try:
            backend.close()
        except Exception as error:   # the stand-in's rule, if close did not wait
            failures.append(error)
    closer = threading.Thread(target=close)
    closer.start()
    closer.join(0.5)                 # long enough for an unserialised close to destroy
    release.set()
    watchdog_like.join()
    closer.join()
    assert failures == [] and answers == [""]
    assert not backend._comm._alive and backend.async_error() == ""


def test_after_an_abort_every_call_says_aborted(dcomm):
    backend = dcomm.init_device()
    assert backend.abort("a test")
    with pytest.raises(cupycomm.NcclError, match="all_reduce: the NCCL communicator was "
                                                 "aborted"):
        backend.check_errors("all_reduce #3")
    assert backend.async_error() == "" and not backend.has_pending_work()
    with pytest.raises(sd.NcclError, match="aborted"):
        backend._comm.check_async_error()        # NCCL's comm is freed: invalid argument


def test_split_waits_for_the_collectives_in_flight_first(dcomm):
    """CuPy's commSplit docstring: collectives still in flight may deadlock it."""
    backend = dcomm.init_device()
    x = sd.asarray(np.ones(2))
    caller = sd.Stream(non_blocking=True, deferred=True)
    with sd.deferred(backend.stream):
        dcomm.all_reduce(x, async_op=True)
        with caller:
            dcomm.all_reduce(x)                      # synchronous: on the caller's stream
        assert backend.stream.pending and caller.pending
        backend.split(0, dcomm.rank).destroy()
        assert not backend.stream.pending and not caller.pending
    assert_equal(STANDIN, x, np.full(2, float(dcomm.size) ** 2))


def test_nccl_failure_is_a_named_error(dcomm, monkeypatch):
    def broken(*args):
        raise sd.NcclError("unhandled cuda error")
    monkeypatch.setattr(dcomm.parts.router.device._comm, "allReduce", broken)
    with pytest.raises(cupycomm.NcclError, match=r"all_reduce: NCCL failed on rank \d+: "
                                                 r"unhandled cuda error"):
        dcomm.all_reduce(sd.asarray(np.ones(2)))


def test_asynchronous_nccl_error_surfaces_while_waiting(dcomm):
    held = sd.Stream(non_blocking=True, deferred=True)
    work = dcomm.all_reduce(sd.asarray(np.ones(2)), stream=held, async_op=True)
    dcomm.parts.router.device._comm.async_error = "remote process exited"
    with pytest.raises(cupycomm.NcclError, match="remote process exited"):
        work.synchronize(timeout=5)
    held.pending.clear()   # the collective never ran anywhere: drop it on every rank


def test_after_an_abort_for_a_loss_every_call_raises_peer_lost_naming_it(dcomm):
    """As the host path's PeerLost: the lost world ranks (sorted), the call, its number (a
    Work's own; for a refused launch, the one it would have had)."""
    backend = dcomm.init_device()
    dcomm.all_reduce(sd.asarray(np.ones(2)))
    seq = dcomm.parts.tracker.seq
    assert backend.abort("a test of a loss", (4, 1))
    with pytest.raises(cupycomm.PeerLost, match=rf"all_reduce #{seq + 1}: the NCCL "
                                                rf"communicator was aborted \(a test of a "
                                                rf"loss\) .*lost world rank\(s\) \[1, 4\]") as raised:
        dcomm.all_reduce(sd.asarray(np.ones(2)))
    assert (raised.value.ranks, raised.value.call, raised.value.seq) == ((1, 4), "all_reduce",
                                                                        seq + 1)
    assert dcomm.parts.tracker.seq == seq   # a refused call is not counted
    with pytest.raises(cupycomm.PeerLost) as raised:
        backend.check_errors("recv #7")
    assert (raised.value.ranks, raised.value.call, raised.value.seq) == ((1, 4), "recv", 7)


class _Relaying:
    """Heartbeats whose leader relays, ``after`` s from now, that world rank ``lost`` (a rank
    of another node, appended to the communicator's numbering) died."""

    bound, interval = 5.0, 0.5

    def __init__(self, tracker, after: float, lost: int) -> None:
        from cupycomm.faults.heartbeat import Departure
        self.at, rank = time.monotonic() + after, tracker.size
        tracker.world_ranks = tracker.world_ranks + (lost,)
        self.gone = Departure(f"rank {rank} (node b)", 0, 0, 0.0, "has died", (rank,))

    def poll(self, now: float) -> None:
        pass

    def departure(self):
        return self.gone if time.monotonic() >= self.at else None


@pytest.mark.parametrize("meets", ["launch", "synchronize"])
def test_in_raise_mode_nccls_async_error_raises_peer_lost_once_the_loss_is_named(
        dcomm, monkeypatch, meets):
    """NCCL hands its asynchronous error (a peer's connection closed) to every launch after
    it (stand-in rule 22) and to the poll of a Work: in "raise" mode that is PeerLost naming
    the lost world rank, as soon as the heartbeats name it (within their bound), never a
    bare NcclError that ``except PeerLost`` misses; the NCCL communicator is aborted."""
    monkeypatch.setattr("cupycomm.survivors.policy._raising", True)
    backend, tracker = dcomm.init_device(), dcomm.parts.tracker
    held = sd.Stream(non_blocking=True, deferred=True)
    work = dcomm.all_reduce(sd.asarray(np.ones(2)), stream=held, async_op=True)
    monkeypatch.setattr(tracker, "world_ranks", tracker.world_ranks)
    monkeypatch.setattr(tracker, "beats", _Relaying(tracker, 0.3, 9))
    backend._comm.async_error = "ncclRemoteError: a remote process exited"
    began = time.monotonic()
    with pytest.raises(cupycomm.PeerLost, match=r"lost world rank\(s\) \[9\]") as raised:
        if meets == "launch":
            dcomm.all_reduce(sd.asarray(np.ones(2)))
        else:
            work.synchronize(timeout=30)
    assert raised.value.ranks == (9,) and raised.value.call == "all_reduce"
    assert 0.25 <= time.monotonic() - began < 5.0
    assert not backend._comm._alive and backend._comm.freed_by == "ncclCommAbort"
    with pytest.raises(cupycomm.PeerLost):
        dcomm.all_reduce(sd.asarray(np.ones(2)))
    held.pending.clear()   # the collective never ran anywhere: drop it on every rank


@pytest.mark.parametrize("waits", ["wait", "synchronize", "wait(timeout)"])
def test_a_work_the_watchdogs_abort_cut_short_raises_and_never_returns_its_buffer(
        dcomm, waits):
    """An async all_reduce whose peer never came, aborted by the watchdog for it (its kernel
    then ends, its event completes, its output is garbage): wait() and synchronize() raise
    the cause, and the flight recorder says the call was aborted, not done."""
    backend, tracker = dcomm.init_device(), dcomm.parts.tracker
    held = sd.Stream(non_blocking=True, deferred=True)
    x = sd.asarray(np.full(2, 5.0))
    work = dcomm.all_reduce(x, stream=held, async_op=True)
    seq = tracker.seq
    reason = f"device collectives up to #{seq} have not finished after 1 s (a test)"
    tracker._abort_device(backend, reason)   # what the watchdog does past the timeout
    held.synchronize()                       # the abort ended the kernel: its event is done
    with pytest.raises(cupycomm.NcclError, match=re.escape(
            f"all_reduce: the NCCL communicator was aborted ({reason}) on rank")):
        {"wait": work.wait, "synchronize": work.synchronize,
         "wait(timeout)": lambda: work.wait(timeout=5)}[waits]()
    assert not work.is_completed()
    calls = {c["seq"]: c for c in tracker.flight.state()["calls"]}
    assert calls[seq]["aborted"] and not calls[seq]["completed"], calls[seq]
    assert "aborted" in tracker.flight.history()


@pytest.mark.parametrize("waits", ["wait", "synchronize", "wait(timeout)"])
def test_a_work_a_timeout_cut_short_raises_the_timeout_naming_the_late_ranks(dcomm, waits):
    """Issue 32 finding 2: a Work cut short by the watchdog's abort for a timeout raises the
    timeout (CollectiveTimeout naming the ranks of this node that had not issued the call),
    not a bare NcclError; later launches still raise NcclError."""
    backend, tracker = dcomm.init_device(), dcomm.parts.tracker
    held = sd.Stream(non_blocking=True, deferred=True)
    work = dcomm.all_reduce(sd.asarray(np.full(2, 5.0)), stream=held, async_op=True)
    seq = tracker.seq
    tracker._abort_device(backend, f"device collectives up to #{seq} have not finished after "
                          f"1 s (a test)", late=(1,))
    held.synchronize()
    with pytest.raises(cupycomm.CollectiveTimeout, match=r"ranks of this node that had not "
                       r"issued it: \[1\]") as raised:
        {"wait": work.wait, "synchronize": work.synchronize,
         "wait(timeout)": lambda: work.wait(timeout=5)}[waits]()
    assert (raised.value.collective, raised.value.seq, raised.value.missing) == (
        "all_reduce", seq, (1,))
    with pytest.raises(cupycomm.NcclError, match="aborted"):
        dcomm.all_reduce(sd.asarray(np.ones(2)))


def test_device_timeout_aborts_the_nccl_communicator(dcomm):
    held = sd.Stream(non_blocking=True, deferred=True)
    work = dcomm.all_reduce(sd.asarray(np.ones(2)), stream=held, async_op=True)
    seq = dcomm.parts.tracker.seq
    with pytest.raises(cupycomm.CollectiveTimeout,
                       match=rf"all_reduce #{seq}: not completed after 0.2 s on rank \d+; .*"
                             rf"the NCCL communicator was aborted") as raised:
        work.wait(timeout=0.2)
    assert (raised.value.collective, raised.value.seq) == ("all_reduce", seq)
    held.pending.clear()
    assert not dcomm.parts.router.device._comm._alive
    with pytest.raises(cupycomm.NcclError, match="aborted"):
        dcomm.all_reduce(sd.asarray(np.ones(2)))
    dcomm.all_reduce(np.ones(2))   # the host backend is untouched


def test_device_timeout_names_the_ranks_that_never_issued_the_call():
    """The ranks of this node that have not issued the call (the node's board shows how far
    each got), and the ranks on other nodes as not known here."""
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("needs ranks that do not arrive; ran with 1")
    with STANDIN.comm() as comm:
        # connected, so the next launch never blocks; run here (a busy GPU's would run on
        # its own, the stand-in's only when the host waits: rank 0 aborts before it would)
        comm.all_reduce(sd.asarray(np.ones(2))).get()
        node = comm.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        here = sorted(node.allgather(comm.rank))
        node.Free()
        if comm.rank == 0:   # the others never issue it
            held = sd.Stream(non_blocking=True, deferred=True)
            work = comm.all_reduce(sd.asarray(np.ones(2)), stream=held, async_op=True)
            time.sleep(0.3)   # the watchdog publishes every rank's progress every 0.1 s
            with pytest.raises(cupycomm.CollectiveTimeout,
                               match=r"all_reduce #\d+: .*ranks not arrived: \[1") as raised:
                work.wait(timeout=0.2)
            assert raised.value.missing == tuple(here[1:])
            elsewhere = [r for r in range(comm.size) if r not in here]
            if elsewhere:
                assert f"ranks on other nodes, not known here: {elsewhere}" in str(raised.value)
            held.pending.clear()
            for peer in range(1, comm.size):
                comm.mpi_comm.send("done", dest=peer)
        else:   # in no collective of the communicator (a raw MPI receive is not one)
            assert comm.mpi_comm.recv(source=0) == "done"
        comm.barrier()


@pytest.mark.mpi(max_size=1)   # starts a job of its own
def test_device_timeout_passes_on_simulated_nodes_as_the_faults_guide_runs_it():
    """docs/guide/faults-and-timeouts.md: ``cupycomm-run -n 4 -launcher fork -hosts
    nodeA:3,nodeB:1 -m pytest tests`` (here the device timeout's test alone)."""
    if launchers.find().kind not in SIMULATES_NODES:
        pytest.skip(f"{launchers.find().executable} cannot simulate nodes")
    guide = (ROOT / "docs" / "guide" / "faults-and-timeouts.md").read_text()
    assert "cupycomm-run -n 4 -launcher fork -hosts nodeA:3,nodeB:1 -m pytest tests" in guide
    job = run_job(4, "-m", "pytest", "-p", "no:cacheprovider", "-q", __file__, "-k",
                  "device_timeout_names", timeout=120, cwd=str(ROOT),
                  options=["-launcher", "fork", "-hosts", "nodeA:3,nodeB:1"])
    assert job.returncode == 0, job.output
    assert "1 passed" in job.stdout, job.output


@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason=GPU_SKIP_REASON)
def test_gpu_kernel_before_the_collective_is_seen():
    cupy = GPU.module
    with GPU.comm() as comm:
        comm.device.use()
        stream = cupy.cuda.Stream(non_blocking=True)
        n = 1 << 22
        with stream:
            x = cupy.zeros(n, cupy.float32)
            for _ in range(20):   # a long chain of kernels on the caller's stream
                x = x * 0.5 + (comm.rank + 1)
            comm.all_reduce(x)
            got = cupy.asnumpy(x)
        expected = sum(_series(r + 1) for r in range(comm.size))
        np.testing.assert_allclose(got, np.full(n, expected, np.float32), rtol=1e-5)


def _series(c, steps=20):
    value = 0.0
    for _ in range(steps):
        value = value * 0.5 + c
    return np.float32(value)


def test_watchdog_aborts_a_stuck_device_communicator(capfd):
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("the watchdog looks after communicators of 2 or more ranks; ran with 1")
    with STANDIN.comm(timeout=0.5) as comm:
        comm.init_device()
        caller = sd.Stream(non_blocking=True, deferred=True)
        comm.parts.router.device.stream.deferred = True           # a GPU that never gets to the collective
        with caller:
            comm.all_reduce(sd.asarray(np.ones(2)))
        # The watchdog thread marks the communicator aborted, then prints why: wait for both.
        printed, deadline = "", time.monotonic() + 10
        while "communicator was aborted" not in printed and time.monotonic() < deadline:
            time.sleep(0.05)
            printed += capfd.readouterr().err
        assert "have not finished after" in comm.parts.router.device._aborted
        assert "the NCCL communicator was aborted" in printed
        comm.parts.router.device.stream.pending.clear()            # the collective never ran on any rank
        caller.pending.clear()
        comm.parts.router.device.stream.deferred = False
        with pytest.raises(cupycomm.NcclError, match="was aborted"):
            comm.all_reduce(sd.asarray(np.ones(2)))


def test_the_watchdogs_query_leaves_the_callers_current_device_alone(monkeypatch):
    """CuPy's Device keeps the device to restore on the object: had the watchdog thread entered
    the Device the main thread was inside, the main thread would leave it on the watchdog's
    device (0), and rank 1's next arrays would be on the wrong GPU (the field-test report
    found it, at random, as "x is on device 0 but the communicator uses device 1")."""
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    # comm.device.use() below: this thread's device is restored after the test (device 1 no
    # longer exists for the next one)
    monkeypatch.setattr(sd.Device._local, "id", sd.Device.current_id(), raising=False)
    with STANDIN.comm(device=1) as comm:
        backend = comm.init_device()
        with sd.Device(1):   # (the test leaves this thread's current device as it found it)
            watchdog = threading.Thread(target=backend.has_pending_work)
            watchdog.start()
            watchdog.join()
            assert sd.Device.current_id() == 1
            x = comm.xp.asarray(np.ones(2))
            assert_equal(STANDIN, comm.all_reduce(x), np.full(2, float(comm.size)))


def test_async_works_take_their_events_from_those_of_completed_works(dcomm, monkeypatch):
    """An async call records the event of a Work that has completed instead of making one
    (CUDA events cost a driver call to create); a batch() block's shared event is not reused."""
    made = []
    new_event = dcomm.parts.router.device._new_event
    monkeypatch.setattr(dcomm.parts.router.device, "_new_event", lambda **kw: made.append(1) or new_event(**kw))
    x = sd.asarray(np.ones(2))
    first = dcomm.all_reduce(x, async_op=True)
    first.synchronize()
    event = first._event
    second = dcomm.all_reduce(x, async_op=True)
    assert second._event is event and first.is_completed() and first.wait() is x
    second.synchronize()
    with dcomm.batch():
        grouped = [dcomm.all_reduce(x, async_op=True), dcomm.all_reduce(x, async_op=True)]
    for work in grouped:
        work.synchronize()
    third = dcomm.all_reduce(x, async_op=True)
    assert third._event is event and grouped[0]._event is grouped[1]._event is not event
    third.wait()
    dcomm.parts.router.device.stream.synchronize()
    assert len(made) == 2   # the first Work's, and the block's
    assert_equal(STANDIN, x, np.full(2, float(dcomm.size) ** 5))


def test_an_abort_waits_for_a_launch_in_progress(dcomm, monkeypatch):
    """Fault 2 of issue 23: the watchdog's ncclCommAbort never runs while the caller's thread
    is inside an NCCL launch of the communicator (stand-in rule 11)."""
    backend = dcomm.init_device()
    inside, release = held_inside(monkeypatch, backend._comm, "_enqueue")
    failures = []

    def abort():
        try:
            backend.abort("a test")
        except Exception as error:   # the stand-in's rule, had the abort not waited
            failures.append(error)
    aborter = threading.Thread(target=abort)

    def watchdog_like():
        inside.wait(10)
        aborter.start()
        aborter.join(0.5)            # long enough for an unserialised abort to run
        release.set()
    watcher = threading.Thread(target=watchdog_like)
    watcher.start()
    x = sd.asarray(np.ones(2))
    dcomm.all_reduce(x)
    watcher.join()
    aborter.join()
    assert failures == [] and backend._aborted == "a test"
    # the whole launch ran before the abort (the kernel's result is undefined after it: on a
    # busy GPU it had not run)
    assert sd.Stream.null.log[-2:] == ["nccl allReduce", f"record {backend._finished.name}"]
    with pytest.raises(cupycomm.NcclError, match="was aborted"):
        dcomm.all_reduce(x)


def test_a_communicator_is_handed_to_another_thread_while_its_work_is_in_flight(dcomm):
    """Finding 6 of issue 32: NCCL forbids only concurrent host calls on one communicator,
    so a call from a second thread after the first one's returned runs, on every rank alike,
    whether or not the first one's kernels have completed (on a GPU they nearly never have:
    refusing then was a decision by timing, and a rank that refused left its peer hanging)."""
    backend = dcomm.init_device()
    n = float(dcomm.size)
    x, y = sd.asarray(np.ones(2)), sd.asarray(np.ones(3))
    held = sd.Stream(non_blocking=True, deferred=True)
    with held:
        dcomm.all_reduce(x)                                   # in flight
    assert backend.has_pending_work()
    assert_equal(STANDIN, in_new_thread(lambda: dcomm.all_reduce(y)), np.full(3, n))
    with held:
        dcomm.all_reduce(x)                                   # back, in flight again
    with_block = in_new_thread(lambda: _reduced_in_a_batch(dcomm, y))
    assert_equal(STANDIN, with_block, np.full(3, n * n))     # its own batch() block
    held.synchronize()
    assert_equal(STANDIN, x, np.full(2, n * n))


def _reduced_in_a_batch(comm, y):
    with comm.batch():
        comm.all_reduce(y)
    sd.Device().synchronize()
    return y


def test_a_second_thread_is_refused_while_the_first_is_inside_a_call(dcomm, monkeypatch):
    """Fault 4 of issue 23, finding 6 of issue 32: a call from a thread while another
    thread is inside a launch on the communicator, or its batch() block is open, would use
    NCCL's communicator from two threads at once (stand-in rule 15): refused before
    anything runs, naming the call and the fix; the communicator is usable after."""
    backend = dcomm.init_device()
    n = float(dcomm.size)
    x, y = sd.asarray(np.ones(2)), sd.asarray(np.ones(3))
    real = backend._comm.allReduce
    inside, release = held_inside(monkeypatch, backend._comm, "allReduce")
    launcher = threading.Thread(target=dcomm.all_reduce, args=(x,))
    launcher.start()
    inside.wait(10)
    seq = backend._tracker.seq
    outcome = []
    second = threading.Thread(target=lambda: outcome.append(in_new_thread(
        lambda: dcomm.broadcast(y))))
    second.start()
    second.join(2)                           # (a call that waited for the first would be here)
    release.set()
    launcher.join()
    second.join()
    refused = outcome[0]
    assert isinstance(refused, RuntimeError), refused
    assert "broadcast" in str(refused) and "another thread" in str(refused)
    assert "inside a call" in str(refused) and "one communicator per thread" in str(refused)
    assert backend._tracker.seq == seq
    monkeypatch.setattr(backend._comm, "allReduce", real)
    with dcomm.batch():
        dcomm.all_reduce(y)
        refused = in_new_thread(lambda: dcomm.all_reduce(x))
    assert isinstance(refused, RuntimeError) and "batch() block" in str(refused), refused
    sd.Device().synchronize()
    assert_equal(STANDIN, x, np.full(2, n))
    assert_equal(STANDIN, dcomm.all_reduce(y), np.full(3, n * n))


def test_a_stream_of_another_device_is_refused_before_anything_runs(monkeypatch):
    """Fault 5 of issue 23: refused naming the call, the argument and both devices, on every
    rank alike, the communicator usable after it."""
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)
    monkeypatch.setattr(sd.Device._local, "id", sd.Device.current_id(), raising=False)
    with STANDIN.comm(device=1) as comm:
        x = comm.xp.asarray(np.ones(2))
        backend = comm.init_device()
        with sd.Device(0):
            other = sd.Stream(non_blocking=True)
        seq = backend._tracker.seq
        for async_op in (False, True):
            with pytest.raises(ValueError, match=r"all_reduce: stream= is a stream of device 0, "
                                                 r"but the communicator uses device 1"):
                comm.all_reduce(x, stream=other, async_op=async_op)
        assert backend._tracker.seq == seq
        assert_equal(STANDIN, comm.all_reduce(x), np.full(2, float(comm.size)))


def test_a_synchronous_collective_on_a_side_stream_keeps_its_input_alive(dcomm):
    """Fault 6 of issue 23: the input was allocated on the caller's stream A, the collective
    runs on B; the caller drops the input, and A's pool would hand its memory to the next
    allocation on A before B's kernel has read it (stand-in rule 7)."""
    a = sd.Stream(non_blocking=True)
    b = sd.Stream(non_blocking=True, deferred=True)
    n, r = dcomm.size, dcomm.rank
    with a:
        out = dcomm.all_gather(sd.asarray(np.full(3, r + 1.0)), stream=b)
        gc.collect()
        reuse = sd.asarray(np.full(3, 1000.0))   # on A: the dropped input's block if free
    b.synchronize()
    assert_equal(STANDIN, out, np.repeat(np.arange(1.0, n + 1), 3).reshape(n, 3))
    assert_equal(STANDIN, reuse, np.full(3, 1000.0))


def test_device_launches_and_the_first_device_call_are_marked_busy(monkeypatch):
    """Issue 32 finding 5: the unique-id exchange, ncclCommInitRank and a launch can block
    the host for a peer (stand-in rule 24): each is marked busy while it lasts, so that the
    watchdog names it at its timeout; cleared after, also when it raises."""
    tracker = Tracker("busy", 0, 1, 60.0)
    seen = []

    class Recording(sd.NcclCommunicator):
        def __init__(self, *args):
            seen.append(("ncclCommInitRank", tracker.busy))
            super().__init__(*args)

        def allReduce(self, *args):
            seen.append(("ncclAllReduce", tracker.busy))
            super().allReduce(*args)

    nccl = nccl_module(sd)
    monkeypatch.setattr(nccl, "NcclCommunicator", Recording)
    backend = NcclBackend(MPI.COMM_SELF, 0, sd, tracker)
    x = sd.asarray(np.ones(2))
    spec = backend.reductions[x.dtype]["sum"]
    backend.all_reduce(x, x, spec, False, None)
    backend.all_reduce(x, x, spec, True, None).wait()
    assert seen == [("ncclCommInitRank", "init_device #1"), ("ncclAllReduce", "all_reduce"),
                    ("ncclAllReduce", "all_reduce")]
    assert tracker.busy is None
    monkeypatch.setattr(backend._comm, "allReduce", lambda *args: sd.zeros(-1))   # raises
    with pytest.raises(ValueError):
        backend.all_reduce(x, x, spec, False, None)
    assert tracker.busy is None
    backend.close()


def test_an_abort_never_waits_on_a_launch_blocked_inside_nccl(monkeypatch):
    """Issue 32 finding 5: an abort (the watchdog's, shrink()'s) waited on the lifetime lock
    while another thread's launch was blocked inside NCCL (a peer never connecting), until
    the faulthandler backstop ended the process. It waits a moment, then keeps the NCCL
    communicator (ncclCommAbort may not run beside the launch) and says why; later calls
    raise."""
    from cupycomm.backends import nccl
    monkeypatch.setattr(nccl, "_LAUNCH_GRACE", 0.2, raising=False)
    backend = NcclBackend(MPI.COMM_SELF, 0, sd, Tracker("blocked", 0, 1, 60.0))
    raw = backend._comm
    x = sd.asarray(np.ones(2))
    spec = backend.reductions[x.dtype]["sum"]
    inside, leave = threading.Event(), threading.Event()
    monkeypatch.setattr(raw, "allReduce", lambda *args: (inside.set(), leave.wait(5)))
    launch = threading.Thread(target=backend.all_reduce, args=(x, x, spec, False, None))
    launch.start()
    assert inside.wait(5)
    began = time.monotonic()
    assert backend.abort("all_reduce #1 timed out")
    assert time.monotonic() - began < 2.0, "the abort waited for the blocked launch"
    assert "kept, not aborted: a launch is blocked inside NCCL" in backend._aborted
    assert raw.freed_by == "" and any(kept is raw for kept in nccl._KEPT_FOR_GRAPHS)
    leave.set()
    launch.join()
    with pytest.raises(cupycomm.NcclError, match="all_reduce: .* timed out; kept"):
        backend.all_reduce(x, x, spec, False, None)
    assert not backend.abort("again")

