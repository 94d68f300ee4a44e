"""The watchdog: no rank waits forever, and the one that gives up says why.

The call path writes a communicator's :class:`Tracker` (``seq``; ``busy`` while a blocking
call lasts) and one slot of its flight recorder's ring. One daemon thread per process looks
ten times a second: it publishes the tracker to the node board, ends the job (or aborts the
NCCL communicator) on a timeout, a dead or departed peer or NCCL's asynchronous error, and
arms a C-level backstop while a call is blocked. It reads only Python attributes, CUDA
events and shared memory, and makes no MPI call but ``MPI_Abort``. Anything with
``check(now) -> bool`` and ``timeout`` can be watched (the pytest plugin's hang guard is);
:func:`meet` watches ``init()``'s first collective. Each look's rules, and why:
docs/internals.md, "faults/watchdog.py".
"""
from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Iterator, Optional, Protocol, Tuple

from mpi4py import MPI

from .. import _env
from .._bootstrap import describe_rank, exiting
from .._collectives import BY_NAME, CALLS, POINT_TO_POINT
from . import board as _board, stacks
from .flight import Recorder
from .abort import abort_job, report_stream
from .board import BUSY, BUSY_SEQ, CLOSED, LEFT, LEFT_AT, PID, RANK, SEQ, NodeBoard
from .heartbeat import Heartbeats
from ..errors import SharedFileRefused
from ..run import exit_records
from ..survivors import policy
from ..survivors.lost import known_lost

if TYPE_CHECKING:   # the contract only: faults/ does not import the backends
    from ..backends import Health

__all__ = ["Watched", "Tracker", "watch", "unwatch", "meet", "GRACE", "INTERVAL",
           "HOLD_MARGIN", "BACKSTOP_MAX"]

INTERVAL = 0.1       # seconds between two looks
GRACE = 2.0          # seconds a collective may wait after a peer left before issuing it
HOLD_MARGIN = (10.0, 30.0)   # the GIL may be held this much (bounds) past a waiting timeout
BACKSTOP_MAX = 1e9   # seconds: the backstop's limit at most (no timeout, inf, arms this);
#                      faulthandler's C timer refuses past about 9.2e9 (OverflowError)


class Watched(Protocol):
    """What the watchdog thread looks at."""

    timeout: float   # seconds: what a waiting call may take (the GIL backstop adds a margin)

    def check(self, now: float) -> bool:
        """Judge the item at ``time.monotonic()`` ``now``; return whether a call waits."""


class Tracker:
    """One communicator's progress, and what the watchdog needs to judge it: the backends
    write its marks (:class:`cupycomm.backends.Marks`: ``seq``, ``busy``, ``flight``'s ring)
    on each call.

    Example (what the host backend does per call)::

        tracker.seq = seq = tracker.seq + 1
        tracker.flight.calls[seq % tracker.flight.size] = "all_reduce"
        tracker.busy = "all_reduce"   # while the blocking call lasts, then None
    """

    __slots__ = ("seq", "busy", "name", "rank", "size", "timeout", "board", "beats", "device",
                 "flight", "world_ranks", "_waiting", "_error_since", "__weakref__")

    def __init__(self, name: str, rank: int, size: int, timeout: float,
                 board: Optional[NodeBoard] = None, beats: Optional[Heartbeats] = None,
                 world_ranks: Optional[Tuple[int, ...]] = None) -> None:
        self.seq = 0
        self.busy: Optional[str] = None   # the blocking call in progress, set by the call path
        self.name = name
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.board = board
        self.beats = beats   # the cross-node view, when the communicator spans nodes
        self.device: Optional[Health] = None   # the NCCL backend, once there is one
        self.flight = Recorder(name, rank, board, self._progress)   # a slot per call
        # each rank's in the world: a lost peer is named so (by default the world's own)
        self.world_ranks = tuple(range(size)) if world_ranks is None else world_ranks
        self._waiting: Optional[tuple] = None   # ((seq, busy) or "device", since when)
        self._error_since: Optional[float] = None   # NCCL's async error, unexplained since

    # -- called by the backends on the main thread ------------------------------------------------
    @contextlib.contextmanager
    def inside(self, label: str) -> Iterator[None]:
        """Mark a blocking call outside the backends' call path (object collectives, the
        debug check). The backends write ``busy`` themselves: a with-block costs too much
        there."""
        self.busy = label
        try:
            yield
        finally:
            self.busy = None

    def leave(self) -> None:
        """The communicator is closing (call after :func:`unwatch`): its final progress goes
        on the board, which then says how many collectives this rank issued before it left;
        a node leader's heartbeats say goodbye to the other nodes; the flight recorder
        writes its file a last time."""
        self.flight.close()
        if self.board is not None:
            self.board.publish(self.seq, 0, 0)
            self.board.leave()
        if self.beats is not None:
            self.beats.close()

    def expired(self, label: str, timeout: float) -> None:
        """``Work.wait(timeout=)`` ran out on the host: MPI cannot cancel, so end the job."""
        name, at, _, arrivals = self.arrivals(label)
        abort_job(f"{name} #{at} on communicator {self.name} did not complete within "
                  f"the {timeout:g} s given to wait() on {describe_rank()}; "
                  f"{arrivals}; MPI cannot cancel a collective")

    def arrivals(self, label: str) -> tuple:
        """(collective, its number, the ranks on this node that have not issued it, a text
        saying how far each rank has got) for ``label``, a call or a Work's label."""
        name, at = _call(label, self.seq)
        late, text = self._arrivals(at, name)
        return name, at, late, text

    def _progress(self) -> tuple:
        """(calls issued, the blocking call, its number) now, for the flight recorder."""
        seq, busy = self.seq, self.busy
        return seq, busy, _call(busy, seq)[1] if busy is not None else seq

    # -- called by the watchdog thread ------------------------------------------------------------
    def check(self, now: float) -> bool:
        """Judge this communicator at time ``now``: publish its progress, end a wait that has
        gone on too long or whose peer is gone, abort device work that stopped progressing.
        Returns whether a call is blocked or device work is pending."""
        seq, busy, device = self.seq, self.busy, self.device
        name, at = _call(busy, seq) if busy is not None else ("", seq)
        self.flight.look(seq, busy, at)
        if self.board is not None:
            self.board.publish(seq, BY_NAME[name].code if busy is not None else 0,
                               at if busy is not None else 0)
        if self.beats is not None:
            self.beats.poll(now)
        waiting = True
        if busy is not None:
            waited = self._waited((at, busy), now)
            if waited > self.timeout:
                abort_job(f"{name} #{at} on communicator {self.name} has waited "
                          f"{waited:.0f} s (timeout {self.timeout:g} s) on {describe_rank()}; "
                          f"{self._arrivals(at, name)[1]}; MPI cannot cancel a collective")
            elif self.board is not None:
                gone, _ = self._gone_peer(name, at, now)
                if gone:
                    abort_job(f"{gone} while {describe_rank()} waits in {name} #{at}")
        elif device is not None and device.has_pending_work():
            waited = self._waited(("device", seq), now)
            if waited > self.timeout:
                late, arrivals = self._arrivals(seq, "")
                self._abort_device(device, f"{device.pending(seq)} not finished after "
                                   f"{waited:.0f} s on communicator {self.name} "
                                   f"(timeout {self.timeout:g} s); {arrivals}",
                                   late=tuple(late))
            elif self.board is not None:
                # A peer that left cleanly closed its communicator, which waits for its
                # device work: only a death can leave this rank's NCCL kernels waiting.
                dead, ranks = self._gone_peer("", seq, now, left_counts=False)
                if dead:
                    self._abort_device(device, f"{dead} while device collectives up to "
                                       f"#{seq} wait",
                                       tuple(sorted(self.world_ranks[r] for r in ranks)))
        else:
            self._waiting = None
            waiting = False
        if device is not None:
            error = device.async_error()
            if error:
                self._device_error(device, error, seq, now)
        return waiting

    def _device_error(self, device: Health, error: str, seq: int, now: float) -> None:
        """NCCL reported ``error`` asynchronously: abort the device communicator; in "raise"
        mode, for the peer the board or the heartbeats say is gone (PeerLost), waiting up to
        :meth:`_loss_bound` for them to say it (docs/internals.md, "faults/watchdog.py")."""
        reason = f"NCCL reported an asynchronous error: {error}"
        if policy.raising():
            dead, ranks = self._gone_peer("", seq, now, left_counts=False)
            if dead:
                self._abort_device(device, f"{dead}; {reason}",
                                   tuple(sorted(self.world_ranks[r] for r in ranks)))
                return
            if self._error_since is None:
                self._error_since = now
            if now - self._error_since <= self._loss_bound():
                return
        self._abort_device(device, reason)

    def lost_ranks(self, seq: int) -> Tuple[int, ...]:
        """The world ranks whose loss explains NCCL's asynchronous error met by device
        collective ``seq``: in "raise" mode those that the node board, the heartbeats or
        MPI's ULFM name within :meth:`_loss_bound`; else, or where none is named, ()."""
        if not policy.raising():
            return ()
        deadline = time.monotonic() + self._loss_bound()
        while True:
            now = time.monotonic()
            _, ranks = self._gone_peer("", seq, now, left_counts=False)
            lost = tuple(sorted(self.world_ranks[r] for r in ranks)) or known_lost(self)
            if lost or now >= deadline:
                return lost
            time.sleep(INTERVAL / 2)

    def _loss_bound(self) -> float:
        """Seconds within which a lost peer is named here: the heartbeats' bound (a silent
        node), with a beat to relay it; the grace on one node (the board sees a death at
        once)."""
        beats = self.beats
        return GRACE if beats is None else beats.bound + beats.interval + GRACE

    def _gone_peer(self, name: str, at: int, now: float,
                   left_counts: bool = True) -> Tuple[str, Tuple[int, ...]]:
        """(a text naming a peer, on this node or (as its heartbeats relay) on another one,
        that this rank may be waiting for in call ``at`` and that is gone, or ''; its ranks
        in the communicator's numbering: a silent node's are all of its own) (when a peer that left
        counts: docs/internals.md, "faults/watchdog.py")."""
        left_counts = left_counts and name not in POINT_TO_POINT
        surviving, host_wait = policy.raising(), bool(name)
        for row in self.board.peers() if self.board is not None else ():
            if row[LEFT]:
                state = _left(int(row[LEFT]), int(row[SEQ]), row[LEFT_AT] / 1e9, at, now,
                              left_counts)
            elif not _board.alive(int(row[PID])):
                if surviving and host_wait:
                    continue   # MPI's ULFM tells the survivors: PeerLost (cupycomm.survivors)
                state = "has died (its process ended: os._exit, a signal or a crash)"
            else:
                continue
            if state:
                return (f"rank {row[RANK]} of communicator {self.name} (pid {row[PID]}) "
                        f"{state}", (int(row[RANK]),))
        remote = self.beats.departure() if self.beats is not None else None
        if remote is not None:
            state = (_left(remote.left, remote.seq, remote.since, at, now, left_counts)
                     if remote.left else "" if surviving and host_wait else remote.how)
            if state:
                return f"{remote.who} {state}", remote.ranks
        return "", ()

    def _waited(self, key: tuple, now: float) -> float:
        if self._waiting is None or self._waiting[0] != key:
            self._waiting = (key, now)
        return now - self._waiting[1]

    def _abort_device(self, device: Health, reason: str,
                      lost: Optional[Tuple[int, ...]] = None,
                      late: Optional[Tuple[int, ...]] = None) -> None:
        """Abort the device communicator for ``reason``; ``lost``: the world ranks whose
        death it is (later device calls raise PeerLost naming them); ``late``: the ranks of
        this node a timeout found behind (the Works it cuts short raise CollectiveTimeout)."""
        self._error_since = None
        if device.abort(reason, lost, late):
            cut = "" if late is None else ", its cut-short Works CollectiveTimeout"
            sys.stderr.write(f"cupycomm watchdog: {reason} on {describe_rank()}; the NCCL "
                             f"communicator was aborted: later device calls raise "
                             f"{'NcclError' if lost is None else 'PeerLost'}{cut}\n")
            sys.stderr.flush()
        self._waiting = None

    def _arrivals(self, at: int, name: str) -> tuple:
        """(ranks on this node that have not issued collective ``at`` yet, a text naming them
        and those blocked in another collective of that number: ranks that called different
        ones)."""
        if self.board is None:
            return [], "no other rank's progress is known"
        late, behind, elsewhere = [], [], []
        for row in self.board.peers():
            doing = CALLS[row[BUSY] - 1].name if row[BUSY] else ""
            if row[SEQ] < at:
                late.append(int(row[RANK]))
                behind.append(f"rank {row[RANK]} is at #{row[SEQ]}, " + (
                    f"blocked in {doing} #{row[BUSY_SEQ]}" if doing else "not in a collective"))
            elif (doing and row[BUSY_SEQ] == at and doing != name
                  and not {doing, name} & POINT_TO_POINT):
                elsewhere.append(f"rank {row[RANK]} is blocked in {doing} #{at}")
        parts = []
        if late:
            parts.append(f"ranks not arrived: {late} ({'; '.join(behind)})")
        if elsewhere:
            parts.append(f"the ranks called different collectives: {'; '.join(elsewhere)}")
        text = "; ".join(parts) or "every rank on this node has arrived"
        here = {int(row[RANK]) for row in self.board.rows}
        remote = [rank for rank in range(self.size) if rank not in here]
        if remote:   # the heartbeats carry departures, not how far each rank got
            text += f"; ranks on other nodes, not known here: {remote}"
        return late, text


def _left(why: int, seq: int, since: float, at: int, now: float, counts: bool) -> str:
    """How a peer that left (``why``: CLOSED or EXITING) after its collective ``seq``, at
    ``since``, ends a wait in collective ``at``: a text, or '' when it does not (yet)."""
    if not counts or seq >= at or now - since < GRACE:
        return ""
    how = ("closed the communicator" if why == CLOSED else
           "has exited (its program ended or called sys.exit)")
    return f"{how} after its collective #{seq}"


def _call(busy: str, seq: int) -> tuple:
    """(collective, its number) of a busy label: "barrier" is the latest one issued (``seq``);
    a Work's wait names its own ("all_reduce #12")."""
    name, _, number = busy.partition(" #")
    return name, int(number) if number.isdigit() else seq


class _Watchdog(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="cupycomm-watchdog", daemon=True)
        self.watched: "weakref.WeakSet[Watched]" = weakref.WeakSet()
        self.armed = False

    def run(self) -> None:
        failed = ""   # the last failure reported: one that repeats is said once
        while True:
            try:
                with _lock:   # unwatch() waits: no look at an item once it is unwatched
                    now = time.monotonic()
                    waiting = [item for item in list(self.watched) if item.check(now)]
                self.arm_backstop(waiting)
            except Exception:   # the process's one watcher never dies: say it, look again
                if exiting():   # what it watched is closed, MPI finalizing: nothing to say
                    return
                text = traceback.format_exc()
                if text != failed:
                    failed = text
                    sys.stderr.write(f"cupycomm watchdog: a look failed on {describe_rank()} "
                                     f"(the watchdog goes on looking):\n{text}")
                    sys.stderr.flush()
            time.sleep(INTERVAL)

    def arm_backstop(self, waiting: list) -> None:
        """Arm the GIL backstop while ``waiting`` (the items with a blocked call or pending
        device work) is not empty; else disarm it."""
        stream = stacks.with_descriptor(report_stream()) if waiting else None
        if stream is not None:
            longest = max(item.timeout for item in waiting)
            low, high = HOLD_MARGIN
            limit = min(longest + max(low, min(longest, high)), BACKSTOP_MAX)
            faulthandler.dump_traceback_later(limit, exit=True, file=stream)
            self.armed = True
        elif self.armed:
            faulthandler.cancel_dump_traceback_later()
            self.armed = False


_watchdog: Optional[_Watchdog] = None
_lock = threading.Lock()


def watch(item: Watched) -> None:
    """Have the watchdog look at ``item`` every INTERVAL s (starting the thread the first
    time); it is held weakly."""
    global _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = _Watchdog()
            _watchdog.start()
        _watchdog.watched.add(item)


def unwatch(item: Watched) -> None:
    """Stop looking at ``item``; once this returns, the thread does not touch it again."""
    with _lock:
        if _watchdog is not None:
            _watchdog.watched.discard(item)


def meet(comm: MPI.Comm, timeout: float) -> None:
    """``init()``'s first collective, watched: a barrier over ``comm`` that every rank must
    reach within ``timeout`` s, else this rank ends the job, naming init (and, under
    ``cupycomm.run`` on the world, the ranks that have not called it). Before it no
    communicator exists to watch: a rank that failed or exited after MPI started (MPICH
    keeps it in ``MPI_Finalize``) would leave its peers waiting forever."""
    arrived = comm.Ibarrier()
    deadline, pause = time.monotonic() + timeout, 5e-5
    while not arrived.Test():
        if time.monotonic() > deadline:
            abort_job(f"the {comm.Get_size()} ranks did not all reach cupycomm.init() "
                      f"within {timeout:g} s (timeout), as {describe_rank()} waited for "
                      f"them{_not_started(comm)}: a rank that failed or exited before init?")
        time.sleep(pause)
        pause = min(2 * pause, 5e-3)


def _not_started(comm: MPI.Comm) -> str:
    """'; ranks [1] never called it (cupycomm.run's records)', where those say so."""
    directory = _env.read("CUPYCOMM_RUN_DIR")
    if not directory or comm.Get_size() != _env.read("CUPYCOMM_RUN_SIZE"):
        return ""
    try:
        job = exit_records.JobDirectory(directory)
    except (OSError, SharedFileRefused):   # gone, or not this user's: nothing to say
        return ""
    try:
        records = job.read(comm.Get_size())
    finally:
        job.close()
    missing = [rank for rank, record in enumerate(records) if record is None]
    return f"; ranks {missing} never called it (cupycomm.run's records)" if missing else ""
