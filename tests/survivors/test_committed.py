"""cupycomm.State (what cupycomm.resilient keeps: commit, restore in place, sync from a root)
and resilient's checks of its arguments, under any MPI and on every size: neither needs a
lost rank (tests/survivors/test_resilient.py loses some under Open MPI's ULFM)."""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

import cupycomm
from cupycomm.survivors import policy
from cupycomm.testing import release
from cupycomm.testing import standin as sd
from arrays import HOST, lib_params

# NumPy and CuPy arrays (and the stand-in's); a torch tensor would be a value to pickle
ARRAYS = [p for p in lib_params() if p.id != "torch"]


@pytest.fixture(params=ARRAYS)
def lib(request):
    return request.param


@pytest.fixture
def host_comm(request):
    communicator = HOST.comm()
    yield communicator
    release(request, communicator, communicator.close)


def test_restore_puts_the_committed_values_back_in_place(lib):
    w, b = lib.array(np.arange(3.0)), lib.array(np.zeros(()))
    state = cupycomm.State(params=[w, b], single=lib.array(np.ones(2)), epoch=0,
                           notes={"lr": 0.5})
    state.params[0] += 10
    state.single *= 3
    state.epoch, state.notes["lr"], state.completed = 4, 0.1, 9
    state.restore()
    assert state.params[0] is w and state.params[1] is b   # the same arrays, changed back
    np.testing.assert_array_equal(lib.numpy(w), np.arange(3.0))
    np.testing.assert_array_equal(lib.numpy(state.single), np.ones(2))
    assert (state.epoch, state.notes, state.completed) == (0, {"lr": 0.5}, 0)


def test_a_commit_is_a_copy_and_the_new_starting_point(lib):
    state = cupycomm.State(w=lib.array(np.zeros(2)), step_sizes=[0.5])
    state.w += 1
    state.step_sizes.append(0.25)
    state.completed = 1
    state.commit()
    state.w += 1                  # changes after the commit only...
    state.step_sizes.append(0.125)
    state.restore()               # ...are undone
    np.testing.assert_array_equal(lib.numpy(state.w), np.ones(2))
    assert state.step_sizes == [0.5, 0.25] and state.completed == 1


def test_a_value_rebound_to_another_shape_gets_a_copy_back(lib):
    state = cupycomm.State(w=lib.array(np.zeros(2)))
    state.w = lib.array(np.ones(5))
    state.restore()
    np.testing.assert_array_equal(lib.numpy(state.w), np.zeros(2))
    assert list(state) == ["w"]


@pytest.mark.parametrize("name", ["commit", "restore", "sync", "completed", "_names"])
def test_names_of_state_itself_are_refused(name):
    with pytest.raises(ValueError, match=f"State: '{name}' cannot name a value"):
        cupycomm.State(**{name: 1})


def test_sync_makes_every_rank_roots_and_commits_it(comm, lib):
    last = comm.size - 1
    state = cupycomm.State(params=[lib.array(np.full(3, comm.rank, dtype=np.float32)),
                                   lib.array(np.arange(2) + comm.rank)],
                           epoch=comm.rank, tag=f"rank {comm.rank}")
    state.completed = 10 * comm.rank
    state.sync(comm, root=last)
    lib.synchronize()
    np.testing.assert_array_equal(lib.numpy(state.params[0]), np.full(3, last, np.float32))
    np.testing.assert_array_equal(lib.numpy(state.params[1]), np.arange(2) + last)
    assert (state.epoch, state.tag, state.completed) == (last, f"rank {last}", 10 * last)
    state.params[0] += 1
    state.restore()               # back to the synced values: sync committed them
    np.testing.assert_array_equal(lib.numpy(state.params[0]), np.full(3, last, np.float32))


def test_sync_refuses_arrays_that_differ_from_roots_on_every_rank(comm, lib):
    if comm.size == 1:
        pytest.skip("a mismatch needs a second rank")
    rows = 3 if comm.rank == 1 else 2
    state = cupycomm.State(w=lib.array(np.zeros(rows)))
    with pytest.raises(ValueError, match="State.sync: the arrays of"):
        state.sync(comm)
    comm.barrier()                # every rank raised, none was left in a broadcast


def step(comm, state, i):
    raise AssertionError("a refused call runs no step")


@pytest.mark.parametrize("change, kind, text", [
    ({"step": None}, TypeError, "step must be callable"),
    ({"state": {"w": 1}}, TypeError, "state must be a cupycomm.State, got builtins.dict"),
    ({"comm": None}, TypeError, "comm must be a cupycomm.Communicator"),
    ({"steps": 2.5}, TypeError, "steps must be an int, got 2.5"),
    ({"steps": -1}, ValueError, "steps must be >= 0, got -1"),
    ({"min_size": 0}, ValueError, "min_size must be >= 1, got 0"),
    ({"min_size": 5}, ValueError, "min_size=5 is more than the communicator's"),
    ({"max_failures": -1}, ValueError, "max_failures must be >= 0, got -1"),
    ({"max_failures": True}, TypeError, "max_failures must be an int, got True"),
    ({"commit_every": 0}, ValueError, "commit_every must be >= 1, got 0"),
    ({"on_shrink": "print"}, TypeError, "on_shrink must be callable or None"),
])
def test_resilient_refuses_bad_arguments_before_any_communication(host_comm, change, kind,
                                                                  text):
    comm = host_comm
    args = {"step": step, "state": cupycomm.State(w=np.zeros(1)), "comm": comm, "steps": 3}
    args.update(change)
    with pytest.raises(kind, match=f"^resilient: {text}"):
        cupycomm.resilient(args.pop("step"), args.pop("state"), args.pop("comm"), **args)
    comm.barrier()                # still usable: nothing was sent


def test_resilient_refuses_where_a_lost_rank_ends_the_job(host_comm):
    if policy.raising():
        pytest.skip("this process was started with on_peer_loss='raise'")
    with pytest.raises(RuntimeError, match=r"resilient: losing a peer ends this job .*"
                                           r"on_peer_loss='raise'.*--with-ft ulfm"):
        cupycomm.resilient(step, cupycomm.State(w=np.zeros(1)), host_comm, steps=3)


def test_resilient_refuses_a_closed_communicator():
    closed = HOST.comm()
    closed.close()
    with pytest.raises(cupycomm.CommClosedError, match="resilient: .* is closed"):
        cupycomm.resilient(step, cupycomm.State(w=np.zeros(1)), closed, steps=3)


class _LossNotRaised:
    """A communicator whose MPI knows of a lost rank that no call has raised yet (a device
    collective a dying peer cut short): what resilient's agreement must count as a failure."""

    def __init__(self, failed):
        self.failed, self.voted = failed, []
        self.parts = SimpleNamespace(router=SimpleNamespace(device=None))   # host arrays only

    def failed_ranks(self):
        return list(self.failed)

    def agree(self, flag):
        self.voted.append(flag)
        return flag


@pytest.mark.parametrize("failed, counts", [((), True), ((2,), False)])
def test_a_step_counts_only_where_no_loss_is_known(failed, counts):
    from cupycomm.survivors.resilient import _together
    comm = _LossNotRaised(failed)
    assert _together(comm, lambda: None) is counts
    assert comm.voted == [counts]


def _busy():
    """A stream of a busy GPU: its work held back, getting on a step each time it is asked."""
    stream = sd.Stream(non_blocking=True, deferred=True)
    stream.busy = True
    return stream


def _voting(comm, monkeypatch, held):
    """``comm``'s agree, recording each flag and whether ``held`` still held work then."""
    votes, agree = [], comm.agree
    monkeypatch.setattr(comm, "agree", lambda flag: votes.append(
        (flag, bool(held.pending))) or agree(flag))
    return votes


def test_a_step_is_voted_on_once_its_device_collectives_completed(dcomm, monkeypatch):
    """A device call returns at launch: the vote comes only after this rank's device work on
    the communicator has completed (a busy GPU, here a stream holding its work back, which
    gets on as it is asked), so that a step counts only with results that are there."""
    from cupycomm.survivors.resilient import _together
    held = _busy()
    x = sd.asarray(np.ones(2))
    votes = _voting(dcomm, monkeypatch, held)

    def step():
        with held:
            dcomm.all_reduce(x)
    assert _together(dcomm, step) is True
    assert votes == [(True, False)]
    np.testing.assert_array_equal(sd.asnumpy(x), np.full(2, float(dcomm.size)))


def test_a_step_whose_device_collective_an_abort_cut_short_never_counts(dcomm, monkeypatch):
    """The step's device all_reduce waits for a peer that died; the watchdog aborts the NCCL
    communicator for that loss after the step returned (its output is now undefined): the
    step is voted down on every rank, never counted (the H200's zeros were committed so)."""
    from cupycomm.survivors.resilient import _together
    held = sd.Stream(non_blocking=True, deferred=True)
    x = sd.asarray(np.ones(2))
    votes = _voting(dcomm, monkeypatch, held)
    backend = dcomm.init_device()

    def step():
        with held:
            dcomm.all_reduce(x)
        threading.Timer(0.3, backend.abort, ("rank 9 has died (a test)", (9,))).start()
    assert _together(dcomm, step) is False
    assert votes == [(False, True)]
    held.pending.clear()   # the collective never ran anywhere: drop it on every rank


def test_sync_commits_only_once_its_device_broadcasts_completed(dcomm, monkeypatch):
    """State.sync (resilient's first sync, its restore after a loss) commits what the
    broadcasts wrote: once they completed, and not at all where an abort cut them short, so
    the last good commit stays for the next restore."""
    state = cupycomm.State(w=sd.asarray(np.full(2, float(dcomm.rank + 1))))
    with _busy():
        state.sync(dcomm)
    np.testing.assert_array_equal(sd.asnumpy(state._committed["w"]), np.ones(2))
    state.w[...] = 5.0
    state.commit()
    backend, held = dcomm.init_device(), sd.Stream(non_blocking=True, deferred=True)
    threading.Timer(0.3, backend.abort, ("rank 9 has died (a test)", (9,))).start()
    with held, pytest.raises(cupycomm.PeerLost):
        state.sync(dcomm)
    held.pending.clear()
    np.testing.assert_array_equal(sd.asnumpy(state._committed["w"]), np.full(2, 5.0))
