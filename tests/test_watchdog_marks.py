"""What the call path tells the watchdog: ``Tracker.busy`` names the blocking call while it
lasts and is cleared when it ends, also when it raises (else the watchdog would take a rank
that caught an MPI error for one that hangs, and abort the job later)."""
import numpy as np
import pytest
from mpi4py import MPI

from cupycomm._watchdog import Tracker
from cupycomm.backends.mpi import MPIBackend

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

    Allreduce = Barrier = Recv = _blocking

    @staticmethod
    def Waitall(requests):
        pass


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_busy_names_the_blocking_call_while_it_lasts(fail):
    tracker = Tracker("test", 0, 2, timeout=1.0)
    scripted = _ScriptedMPI(tracker, fail)
    backend = MPIBackend(scripted, tracker)
    x = np.arange(4, dtype=np.float32)
    calls = [lambda: backend.all_reduce(x, x, (MPI.FLOAT, MPI.SUM, False, None), False, None),
             lambda: backend.barrier(),
             lambda: backend.recv(x, None, 1, False, None)]
    for call in calls:
        if fail:
            with pytest.raises(MPI.Exception):
                call()
        else:
            call()
        assert tracker.busy is None
    assert scripted.seen == [(1, "all_reduce"), (2, "barrier"), (3, "recv")]
    tracker.check(now=100.0)       # nothing in progress: the watchdog waits for nothing
    assert tracker._waiting is None


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
    monkeypatch.setattr("cupycomm._watchdog.abort_job", aborted.append)
    tracker.seq, tracker.busy = 5, "all_reduce"
    tracker.check(now=10.0)
    tracker.check(now=10.5)
    assert aborted == []
    tracker.check(now=11.5)
    assert len(aborted) == 1 and "all_reduce #5" in aborted[0] and "waited 2 s" in aborted[0]
