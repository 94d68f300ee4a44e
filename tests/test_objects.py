"""Object collectives: pickled Python objects, small and larger than 64 MiB."""
import threading

import numpy as np
import pytest

import cupycomm


def payload(rank):
    return {"rank": rank, "name": f"r{rank}", "values": list(range(rank + 1))}


@pytest.fixture
def hcomm():
    with cupycomm.init(cupycomm.comm.communicator.MPI.COMM_WORLD) as comm:
        yield comm


def test_broadcast_object(hcomm):
    root = hcomm.size - 1
    got = hcomm.broadcast_object(payload(hcomm.rank) if hcomm.rank == root else None, root)
    assert got == payload(root)


def test_all_gather_object(hcomm):
    assert hcomm.all_gather_object(payload(hcomm.rank)) == [payload(r) for r in range(hcomm.size)]


def test_gather_object(hcomm):
    got = hcomm.gather_object(payload(hcomm.rank), root=0)
    assert got == ([payload(r) for r in range(hcomm.size)] if hcomm.rank == 0 else None)


def test_scatter_object(hcomm):
    root = hcomm.size - 1
    objs = [payload(100 + r) for r in range(hcomm.size)] if hcomm.rank == root else None
    assert hcomm.scatter_object(objs, root) == payload(100 + hcomm.rank)


def test_large_object_over_64_mib(hcomm):
    big = np.arange(9 * 2 ** 20, dtype=np.float64) if hcomm.rank == 0 else None   # 72 MiB
    got = hcomm.broadcast_object(big, 0)
    assert got.nbytes > 64 * 2 ** 20
    np.testing.assert_array_equal(got[-3:], np.arange(9 * 2 ** 20 - 3, 9 * 2 ** 20))


def test_object_calls_validate_before_communication(hcomm):
    seq = hcomm.parts.tracker.seq
    with pytest.raises(ValueError, match=r"broadcast_object: root=-1 is not a rank"):
        hcomm.broadcast_object(1, -1)
    with pytest.raises(ValueError, match=r"scatter_object: objs must be a list of \d+ objects "
                                         r"\(one per rank\), got a list of length 0"):
        hcomm.scatter_object([], 0)
    with pytest.raises(ValueError, match=r"objs must be a list of \d+ objects .* got 'dict'"):
        hcomm.scatter_object({}, 0)
    assert hcomm.parts.tracker.seq == seq
    assert hcomm.all_gather_object(hcomm.rank) == list(range(hcomm.size))


def test_debug_mode_checks_object_collectives_by_name_and_root():
    with cupycomm.init(cupycomm.comm.communicator.MPI.COMM_WORLD, debug=True) as comm:
        assert comm.broadcast_object("x" if comm.rank == 0 else None) == "x"
        if comm.size > 1:
            with pytest.raises(cupycomm.CollectiveMismatch, match="ranks disagree"):
                comm.gather_object(comm.rank, root=comm.rank % 2)


@pytest.mark.parametrize("call", ["broadcast_object", "all_gather_object", "gather_object",
                                  "scatter_object"])
def test_a_pickling_error_raises_before_the_call_and_the_peers_go_on(call):
    # Rank 0's object cannot be pickled; it catches the error and calls again, which must be
    # the call its peers wait in: nothing was counted, sent or matched (the lock's own
    # TypeError named the object only; the tag of pkl5's call was taken; scatter had sent
    # rank 0's part). On today's code the peers hung until the timeout.
    with cupycomm.init(cupycomm.comm.communicator.MPI.COMM_WORLD, timeout=30) as comm:
        def run(obj):
            if call == "scatter_object":
                return comm.scatter_object([obj] * comm.size if comm.rank == 0 else None)
            if call == "broadcast_object":
                return comm.broadcast_object(obj if comm.rank == 0 else None)
            return getattr(comm, call)(obj)

        if comm.rank == 0:
            seq = comm.parts.tracker.seq
            objs = ([comm.rank] * (comm.size - 1) + [threading.Lock()]
                    if call == "scatter_object" else threading.Lock())
            with pytest.raises(TypeError, match=rf"{call}: (obj|objs\[{comm.size - 1}\]) "
                                                rf"cannot be pickled \(TypeError: cannot pickle "
                                                rf"'_thread.lock' object\) on rank 0"):
                if call == "scatter_object":
                    comm.scatter_object(objs)
                else:
                    getattr(comm, call)(objs)
            assert comm.parts.tracker.seq == seq
        got = run(7)
        assert got == {"broadcast_object": 7, "scatter_object": 7,
                       "all_gather_object": [7] * comm.size,
                       "gather_object": [7] * comm.size if comm.rank == 0 else None}[call]
