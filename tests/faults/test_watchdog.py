"""What the call path tells the watchdog: ``Tracker.busy`` names the blocking call while it
lasts and is cleared when it ends, also when it raises (else the watchdog would take a rank
that caught an MPI error for one that hangs, and abort the job later). And how the watchdog
judges what it sees: peers on the node board, the GIL backstop, where its report goes."""
import inspect
import os
import subprocess
import sys
import tempfile
import traceback
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from cupycomm.faults.board import CLOSED, FIELDS, LEFT, LEFT_AT, PID, RANK, SEQ, NodeBoard
from cupycomm._collectives import BY_NAME
from cupycomm.faults import abort
from cupycomm.faults.abort import abort_job
from cupycomm.faults.heartbeat import Departure
from cupycomm.faults.watchdog import GRACE, HOLD_MARGIN, Tracker, _Watchdog, unwatch
from cupycomm.backends.mpi import MPIBackend
from cupycomm.work import poll_until

pytestmark = pytest.mark.mpi(max_size=1)


class _ScriptedMPI:
    """A stand-in MPI communicator whose blocking calls record what the tracker said."""

    def __init__(self, tracker: Tracker, fail: bool) -> None:
        self.tracker, self.fail, self.seen = tracker, fail, []

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def _blocking(self, *args):
        self.seen.append((self.tracker.seq, self.tracker.busy))
        if self.fail:
            raise MPI.Exception(MPI.ERR_TRUNCATE)

    Allreduce = Barrier = Recv = Alltoallv = _blocking

    @staticmethod
    def Waitall(requests):
        pass


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_busy_names_the_blocking_call_while_it_lasts(fail):
    tracker = Tracker("test", 0, 2, timeout=1.0)
    scripted = _ScriptedMPI(tracker, fail)
    backend = MPIBackend(scripted, tracker)
    x = np.arange(4, dtype=np.float32)
    spec = backend.reductions[x.dtype]["sum"]   # (MPI.FLOAT, MPI.SUM, no average, no view)
    calls = [lambda: backend.all_reduce(x, x, spec, False, None),
             lambda: backend.barrier(),
             lambda: backend.recv(x, None, 1, False, None),
             lambda: backend.all_to_all_v(x, x.copy(), None, [8, 8], [8, 8], False, None)]
    for call in calls:
        if fail:
            with pytest.raises(MPI.Exception):
                call()
        else:
            call()
        assert tracker.busy is None
    assert scripted.seen == [(1, "all_reduce"), (2, "barrier"), (3, "recv"), (4, "all_to_all")]
    tracker.check(now=100.0)       # nothing in progress: the watchdog waits for nothing
    assert tracker._waiting is None


class _AnyMPI:
    """A stand-in MPI communicator with every mpi4py call, each recording what the tracker
    said; the nonblocking ones (``I...``) return a request, which completes at once."""

    def __init__(self, tracker: Tracker, fail: bool) -> None:
        self.tracker, self.fail, self.seen = tracker, fail, []

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def __getattr__(self, method):
        def call(*args):
            self.seen.append((method, self.tracker.seq, self.tracker.busy))
            if self.fail:
                raise MPI.Exception(MPI.ERR_TRUNCATE)
            return MPI.REQUEST_NULL if method.startswith("I") else None
        return call


def prepared_arguments(name):
    """Arguments of collective ``name``'s prepared call on 4-element float32 arrays."""
    x, y = np.zeros(4, np.float32), np.zeros(4, np.float32)
    return {"all_reduce": (x, x), "reduce_scatter": (x, y), "all_gather": (x, y),
            "all_to_all": (x, y), "reduce": (x, x, 0), "gather": (x, y, 0),
            "scatter": (x, y, 0), "broadcast": (x, 0), "sendrecv": (x, 1, y, 1)}[name]


PREPARED = ("all_reduce", "reduce_scatter", "reduce", "gather", "scatter", "all_gather",
            "all_to_all", "broadcast", "sendrecv")


def prepared_call(backend, name, async_op):
    """The call the Communicator's common case would take (the general path makes it)."""
    dtype = np.dtype(np.float32)
    reduces = name in ("all_reduce", "reduce", "reduce_scatter")
    return backend._call(name, async_op, dtype, backend.reductions[dtype]["sum"] if reduces
                         else None)


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "started"])
@pytest.mark.parametrize("name", PREPARED)
def test_every_prepared_call_writes_the_marks(name, async_op, fail):
    """seq counts the call, the flight recorder's ring names it in slot seq, busy names it
    while the MPI call runs and is None after, also when it raised."""
    tracker = Tracker("test", 0, 2, timeout=1.0)
    tracker.seq = 6
    scripted = _AnyMPI(tracker, fail)
    run = prepared_call(MPIBackend(scripted, tracker), name, async_op)
    if fail:
        with pytest.raises(MPI.Exception):
            run(*prepared_arguments(name))
    else:
        run(*prepared_arguments(name))
    assert [seq_busy for _, *seq_busy in scripted.seen] == [[7, name]]
    assert scripted.seen[0][0].startswith("I") == async_op
    assert tracker.seq == 7 and tracker.busy is None
    assert tracker.flight.calls[7 % tracker.flight.size] == name


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "started"])
@pytest.mark.parametrize("name", PREPARED)
def test_a_traceback_through_a_prepared_call_shows_its_source_line(name, async_op):
    """The prepared call is plain Python in backends/mpi.py (no generated source): an error
    of MPI's shows the file and the line that made the call."""
    tracker = Tracker("test", 0, 2, timeout=1.0)
    run = prepared_call(MPIBackend(_AnyMPI(tracker, fail=True), tracker), name, async_op)
    with pytest.raises(MPI.Exception) as raised:
        run(*prepared_arguments(name))
    frames = traceback.extract_tb(raised.value.__traceback__)
    ours = [f for f in frames if f.filename == inspect.getsourcefile(MPIBackend)]
    assert len(ours) == 1, frames   # one frame of cupycomm's between the caller and MPI
    assert ours[0].name == "run" and ours[0].line.startswith("request = call("), ours[0]


def test_inside_marks_and_clears_even_on_error():
    tracker = Tracker("test", 0, 2, timeout=1.0)
    with pytest.raises(KeyError):
        with tracker.inside("broadcast_object"):
            assert tracker.busy == "broadcast_object"
            raise KeyError("lost")
    assert tracker.busy is None


def test_a_blocking_call_that_waits_past_the_timeout_is_judged_a_hang(monkeypatch):
    tracker = Tracker("test", 0, 2, timeout=1.0)
    aborted = []
    monkeypatch.setattr("cupycomm.faults.watchdog.abort_job", aborted.append)
    tracker.seq, tracker.busy = 5, "all_reduce"
    tracker.check(now=10.0)
    tracker.check(now=10.5)
    assert aborted == []
    tracker.check(now=11.5)
    assert len(aborted) == 1 and "all_reduce #5" in aborted[0] and "waited 2 s" in aborted[0]


# -- peers on the node board ----------------------------------------------------------------------
def _board(rows: np.ndarray, index: int) -> NodeBoard:
    """Row ``index`` of ``rows`` seen as its rank's NodeBoard (no shared memory, no MPI)."""
    board = NodeBoard.__new__(NodeBoard)
    board.rows, board.mine, board.index = rows, rows[index], index
    lock = tempfile.TemporaryFile()   # the lock of locked(), a file of its own
    board._fd = lock.fileno()
    weakref.finalize(board, lock.close)
    return board


@pytest.fixture
def node(monkeypatch):
    """This rank (0, waiting) and a peer (1, a live process) on a board; the aborts made."""
    rows = np.zeros((2, FIELDS), np.int64)
    rows[0, [RANK, PID]] = 0, os.getpid()
    rows[1, [RANK, PID]] = 1, os.getppid()
    aborted = []
    monkeypatch.setattr("cupycomm.faults.watchdog.abort_job", aborted.append)
    tracker = Tracker("test", 0, 2, timeout=1000.0, board=_board(rows, 0))
    yield tracker, _board(rows, 1), aborted
    tracker.flight.close()   # a later abort reports every live recorder: not this one


def _leave(peer: NodeBoard, seq: int, at: float, monkeypatch, exiting: bool = True) -> None:
    """The peer issued ``seq`` collectives, then left at time ``at``: exiting, or closing."""
    monkeypatch.setattr("cupycomm._bootstrap._exiting", exiting)
    peer.publish(seq, 0, 0)
    peer.leave()
    peer.mine[LEFT_AT] = int(at * 1e9)


def test_a_peer_that_left_after_issuing_the_collective_is_not_waited_for(node, monkeypatch):
    """A rank that ran the last collective and exited while a slower peer is still inside it
    (or whose process has even ended since): a correct program, never aborted."""
    tracker, peer, aborted = node
    tracker.seq, tracker.busy = 5, "barrier"
    _leave(peer, 5, at=0.0, monkeypatch=monkeypatch)
    peer.mine[PID] = _ended_pid()
    for now in (0.0, 10.0, 100.0):
        tracker.check(now)
    assert aborted == []


@pytest.mark.parametrize("exiting, how", [(True, "has exited (its program ended or called "
                                                 "sys.exit)"),
                                          (False, "closed the communicator")])
def test_a_peer_that_left_before_the_collective_ends_the_job_after_the_grace(
        node, monkeypatch, exiting, how):
    """The grace is counted from when the peer left, not from when the wait began."""
    tracker, peer, aborted = node
    tracker.seq, tracker.busy = 5, "all_reduce"
    tracker.check(0.0)                          # the wait begins
    _leave(peer, 4, at=100.0, monkeypatch=monkeypatch, exiting=exiting)
    tracker.check(100.0 + GRACE / 2)
    assert aborted == []
    tracker.check(100.0 + GRACE * 1.5)
    assert len(aborted) == 1
    assert f"rank 1 of communicator test (pid {os.getppid()}) {how} after its collective #4 " \
           f"while rank 0 of" in aborted[0]
    assert "waits in all_reduce #5" in aborted[0]


def test_a_point_to_point_wait_is_not_ended_by_a_peer_that_left(node, monkeypatch):
    """Nothing says the peer that left was the partner: the timeout bounds such a wait."""
    tracker, peer, aborted = node
    tracker.seq, tracker.busy = 5, "recv"
    tracker.check(0.0)
    _leave(peer, 2, at=0.0, monkeypatch=monkeypatch)
    tracker.check(100.0)
    assert aborted == []


def test_a_peer_that_died_without_leaving_ends_the_job_at_once(node):
    tracker, peer, aborted = node
    peer.mine[PID] = _ended_pid()
    tracker.seq, tracker.busy = 3, "recv"
    tracker.check(0.0)
    assert len(aborted) == 1 and "rank 1 of communicator test" in aborted[0]
    assert "has died" in aborted[0] and "waits in recv #3" in aborted[0]


class _Device:
    """A device backend with collectives pending for ever; the aborts it was told of."""

    def __init__(self) -> None:
        self.aborts: list = []

    def has_pending_work(self) -> bool:
        return True

    def async_error(self) -> str:
        return ""

    def pending(self, seq: int) -> str:
        return f"device collectives up to #{seq} have"

    def abort(self, reason: str, lost=None, late=None) -> bool:
        self.aborts.append((reason, lost))
        self.late = late
        return len(self.aborts) == 1


def test_a_dead_peer_aborts_device_work_naming_its_world_rank(node):
    """The board's rank is the communicator's: the abort (hence PeerLost) names the world's."""
    tracker, peer, aborted = node
    tracker.world_ranks = (5, 3)
    tracker.device = device = _Device()
    tracker.seq = 4
    tracker.check(0.0)
    assert device.aborts == []                  # the peer lives: only the timeout would abort
    peer.mine[PID] = _ended_pid()
    tracker.check(0.1)
    assert aborted == [] and len(device.aborts) == 1
    reason, lost = device.aborts[0]
    assert lost == (3,) and "rank 1 of communicator test" in reason and "has died" in reason
    assert "device collectives up to #4 wait" in reason


def test_a_peer_dead_on_another_node_aborts_device_work_naming_its_world_ranks(node):
    """The heartbeats' departure (a silent node: all its ranks) in the world's numbering."""
    tracker, peer, aborted = node

    class Beats:
        def poll(self, now: float) -> None:
            pass

        def departure(self) -> Departure:
            return Departure("node b (ranks [3, 2]) of communicator test", 0, 0, 0.0,
                             "has sent no heartbeat", (3, 2))

    tracker.world_ranks, tracker.beats = (0, 7, 6, 5), Beats()
    tracker.device = device = _Device()
    tracker.check(0.0)
    assert aborted == [] and len(device.aborts) == 1
    reason, lost = device.aborts[0]
    assert lost == (5, 6) and reason.startswith("node b (ranks [3, 2]) of communicator test "
                                                "has sent no heartbeat while device")


class _Beats:
    """Heartbeats whose leader relays ``gone`` (a Departure, or None: nothing yet)."""

    bound, interval = 5.0, 0.5

    def __init__(self) -> None:
        self.gone = None

    def poll(self, now: float) -> None:
        pass

    def departure(self):
        return self.gone


class _FailingDevice(_Device):
    """Device work that a lost peer ended: nothing pending (NCCL's kernel returned, its output
    undefined), or pending for ever; NCCL's proxy reported the closed connection."""

    def __init__(self, pending: bool) -> None:
        super().__init__()
        self.pending_work = pending

    def has_pending_work(self) -> bool:
        return self.pending_work

    def async_error(self) -> str:
        return "" if self.aborts else "ncclRemoteError: a remote process exited"


@pytest.mark.parametrize("pending", [False, True], ids=["returned", "waiting"])
def test_in_raise_mode_a_loss_on_another_node_aborts_the_device_for_peer_lost(
        node, monkeypatch, pending):
    """NCCL reports a remote error as soon as a peer on another node dies; the heartbeats
    relay that death later (a beat, or their bound for a silent node). In "raise" mode the
    outcome is a local death's: the abort names the lost world ranks (later calls raise
    PeerLost), not a bare asynchronous error (NcclError)."""
    tracker, peer, aborted = node
    monkeypatch.setattr("cupycomm.survivors.policy._raising", True)
    tracker.world_ranks, tracker.beats = (0, 7, 6, 5), _Beats()
    tracker.device = device = _FailingDevice(pending)
    for now in (0.0, 1.0, 2.0, tracker.beats.bound):   # within the heartbeats' bound
        tracker.check(now)
    assert device.aborts == []
    tracker.beats.gone = Departure("rank 2 of communicator test (node b)", 0, 0, 0.0,
                                   "has died (its process ended: os._exit, a signal or a "
                                   "crash), as its node's heartbeat says", (2,))
    tracker.check(tracker.beats.bound + 0.1)
    assert aborted == [] and len(device.aborts) == 1
    reason, lost = device.aborts[0]
    assert lost == (6,), device.aborts
    assert reason.startswith("rank 2 of communicator test (node b) has died"), reason


def test_in_raise_mode_an_async_error_no_loss_explains_is_nccls_after_the_bound(node,
                                                                               monkeypatch):
    tracker, peer, aborted = node
    monkeypatch.setattr("cupycomm.survivors.policy._raising", True)
    tracker.beats = beats = _Beats()
    tracker.device = device = _FailingDevice(False)
    bound = beats.bound + beats.interval + GRACE
    tracker.check(10.0)
    tracker.check(10.0 + bound)
    assert device.aborts == []
    tracker.check(10.1 + bound)
    assert device.aborts == [("NCCL reported an asynchronous error: ncclRemoteError: a "
                              "remote process exited", None)]


def test_in_abort_mode_an_async_error_aborts_the_device_at_once(node):
    tracker, peer, aborted = node
    tracker.device = device = _FailingDevice(False)
    tracker.check(0.0)
    assert len(device.aborts) == 1 and device.aborts[0][1] is None


def test_a_peer_blocked_in_another_collective_of_the_same_number_is_named(node):
    """A rank that raised, caught it and went on to barrier #5 while its peer waits in
    all_reduce #5: every rank has arrived at #5, but not at the same collective."""
    tracker, peer, aborted = node
    peer.publish(5, BY_NAME["barrier"].code, 5)
    tracker.seq, tracker.busy, tracker.timeout = 5, "all_reduce", 1.0
    tracker.check(0.0)
    tracker.check(2.0)
    assert len(aborted) == 1
    assert "the ranks called different collectives: rank 1 is blocked in barrier #5" in \
        aborted[0]
    assert "every rank on this node has arrived" not in aborted[0]


def test_a_works_wait_is_named_by_its_own_number(node):
    """Work.wait() on all_reduce #2 after more calls were issued: #2, not the latest."""
    tracker, peer, aborted = node
    tracker.seq, tracker.busy, tracker.timeout = 7, "all_reduce #2", 1.0
    tracker.check(0.0)
    tracker.check(2.0)
    assert len(aborted) == 1 and aborted[0].startswith("all_reduce #2 on communicator test")
    assert "ranks not arrived: [1] (rank 1 is at #0, not in a collective)" in aborted[0]


def test_leaving_publishes_the_final_count_and_the_reason(monkeypatch):
    """leave() (called by close() after unwatch()) writes the last count, which the
    watchdog thread may not have published yet."""
    rows = np.zeros((1, FIELDS), np.int64)
    tracker = Tracker("test", 0, 2, timeout=1.0, board=_board(rows, 0))
    tracker.seq = 9
    unwatch(tracker)
    tracker.leave()
    tracker.flight.close()
    assert rows[0, SEQ] == 9 and rows[0, LEFT] == CLOSED and rows[0, LEFT_AT] > 0


def _ended_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    return int(child.stdout)


# -- the GIL backstop and where the report goes ---------------------------------------------------
def test_the_backstop_is_armed_only_while_a_call_waits(monkeypatch):
    armed = []
    monkeypatch.setattr("faulthandler.dump_traceback_later",
                        lambda limit, exit, file: armed.append(limit))
    monkeypatch.setattr("faulthandler.cancel_dump_traceback_later", lambda: armed.append(None))
    dog = _Watchdog()
    idle = Tracker("idle", 0, 2, timeout=100.0)
    busy = Tracker("busy", 0, 2, timeout=2.0)
    busy.busy = "barrier"
    waiting = [t for t in (idle, busy) if t.check(0.0)]
    assert waiting == [busy]
    dog.arm_backstop(waiting)
    assert armed == [2.0 + HOLD_MARGIN[0]] and dog.armed   # from the waiting one's timeout
    busy.busy = None
    dog.arm_backstop([t for t in (idle, busy) if t.check(1.0)])
    assert armed[-1] is None and not dog.armed


@pytest.mark.parametrize("timeout", [float("inf"), 1e10], ids=["inf", "1e10"])
def test_no_timeout_arms_a_backstop_faulthandler_takes(timeout):
    """inf (no timeout) or a very large one: the backstop is clamped to a limit that
    faulthandler takes (past its C timer's bound it raises OverflowError)."""
    dog = _Watchdog()
    waiting = Tracker("forever", 0, 2, timeout=timeout)
    waiting.busy = "barrier"
    try:
        dog.arm_backstop([waiting])
        assert dog.armed
    finally:
        dog.arm_backstop([])
    assert not dog.armed


def test_the_watchdog_thread_outlives_an_exception_in_a_look(capfd):
    """A look that raises is reported, and the thread looks again."""
    looks = []

    class Fails:
        timeout = 1.0

        def check(self, now):
            looks.append(now)
            if len(looks) == 1:
                raise RuntimeError("a deliberate failure in a look")
            return False

    item, dog = Fails(), _Watchdog()
    dog.watched.add(item)
    dog.start()
    assert poll_until(lambda: len(looks) >= 3, timeout=10), looks
    assert dog.is_alive()
    dog.watched.discard(item)
    err = capfd.readouterr().err
    assert "cupycomm watchdog: a look failed" in err and "a deliberate failure" in err, err


def test_abort_job_reports_where_it_is_told(tmp_path, monkeypatch):
    """Under the plugin the report goes to the terminal's descriptor, not to sys.stderr
    (pytest's capture, lost when the job aborts)."""
    monkeypatch.setattr("cupycomm.faults.abort.abort_world", lambda: None)
    with open(tmp_path / "terminal", "w") as terminal:
        abort.report_to(terminal)
        try:
            abort_job("a test message")
        finally:
            abort.report_to(None)
    text = (tmp_path / "terminal").read_text()
    assert "cupycomm watchdog: a test message: aborting the job" in text
    assert "in test_abort_job_reports_where_it_is_told" in text   # this thread's stack
