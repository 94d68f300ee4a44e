"""Debug mode: ranks compare a fingerprint of each collective first, so that valid calls run
as before and a disagreement raises CollectiveMismatch on every rank, naming who differs."""
import numpy as np
import pytest

import cupycomm
from arrays import all_inputs, assert_equal, rank_input

F4 = np.float32


@pytest.fixture
def debug_comm(lib, request):
    from cupycomm.testing import release
    communicator = lib.comm(debug=True)
    if lib.is_device:
        communicator.init_device()
    yield communicator
    release(request, communicator, communicator.close)


def test_valid_rooted_calls_pass_the_check(lib, debug_comm):
    """Arguments only the root reads (scatter's x, gather's and reduce's out) and outputs
    given on some ranks only are a rank's own affair: they must not count as disagreement."""
    comm, last = debug_comm, debug_comm.size - 1
    mine = rank_input(comm.rank, (3,), F4)
    stacked = all_inputs(comm.size, (3,), F4)
    reduced = comm.reduce(lib.array(mine), root=last,
                          out=lib.empty((3,), F4) if comm.rank == last else None)
    gathered = comm.gather(lib.array(mine), root=last)
    part = comm.scatter(lib.array(stacked) if comm.rank == last else None, root=last,
                        out=lib.empty((3,), F4))
    summed = comm.all_reduce(lib.array(mine), out=lib.empty((3,), F4) if comm.rank else None)
    if comm.rank == last:
        assert_equal(lib, reduced, stacked.sum(0))
        assert_equal(lib, gathered, stacked)
    else:
        assert reduced is None and gathered is None
    assert_equal(lib, part, stacked[comm.rank])
    assert_equal(lib, summed, stacked.sum(0))


@pytest.mark.parametrize("kind", ["count", "dtype", "op", "root"])
def test_a_disagreement_raises_on_every_rank_and_names_the_rank(lib, debug_comm, kind):
    comm = debug_comm
    odd = comm.rank == comm.size - 1 and comm.size > 1
    x = lib.array(np.ones(5 if odd and kind == "count" else 4,
                          np.float64 if odd and kind == "dtype" else F4))
    call = {"count": lambda: comm.all_reduce(x), "dtype": lambda: comm.all_reduce(x),
            "op": lambda: comm.all_reduce(x, op="max" if odd else "sum"),
            "root": lambda: comm.broadcast(x, root=1 if odd else 0)}[kind]
    if comm.size == 1:
        call()   # nobody to disagree with
        return
    seq = comm.parts.tracker.seq
    with pytest.raises(cupycomm.CollectiveMismatch,
                       match=rf"ranks disagree: (.*; )?rank {comm.size - 1} called "):
        call()
    assert comm.parts.tracker.seq == seq, "the collective started despite the disagreement"
    y = lib.array(rank_input(comm.rank, (2,), F4))
    assert_equal(lib, comm.all_reduce(y), all_inputs(comm.size, (2,), F4).sum(0))


def test_new_group_with_different_ranks_is_a_disagreement(debug_comm):
    comm = debug_comm
    members = [0] if comm.rank == 0 or comm.size == 1 else [0, comm.size - 1]
    if comm.size == 1:
        assert comm.new_group(range(1)).size == 1
        return
    with pytest.raises(cupycomm.CollectiveMismatch, match=r"new_group #\d+: ranks disagree: "
                                                          r"rank 0 called new_group with "
                                                          r"ranks: \[0\]"):
        comm.new_group(members)
    group = comm.new_group(range(comm.size))   # a range and a list of the same ranks agree
    assert group.size == comm.size
    group.close()


def test_a_closed_communicator_says_so_in_debug_mode(lib):
    comm = lib.comm(debug=True)
    comm.close()
    with pytest.raises(cupycomm.CommClosedError, match="all_reduce: the communicator is closed"):
        comm.all_reduce(lib.array(np.ones(2)))
