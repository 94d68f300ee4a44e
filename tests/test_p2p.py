"""Point-to-point: send, recv and sendrecv, blocking and asynchronous, on every dtype."""
import gc
import weakref

import numpy as np
import pytest

import cupycomm
from arrays import assert_equal, rank_input

DTYPES = list(cupycomm.DTYPES)


def neighbours(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sendrecv_ring(lib, comm, dtype, mode):
    right, left = neighbours(comm)
    x = lib.array(rank_input(comm.rank, (7,), dtype))
    buf = lib.empty((7,), dtype)
    result = comm.sendrecv(x, right, buf, left, async_op=mode == "async")
    if mode == "async":
        result = result.wait()
    assert result is buf
    assert_equal(lib, buf, rank_input(left, (7,), dtype))
    assert_equal(lib, x, rank_input(comm.rank, (7,), dtype))


def test_sendrecv_of_different_sizes(lib, comm):
    right, left = neighbours(comm)
    sent = lib.array(rank_input(comm.rank, (3 + comm.rank,), np.float32))
    buf = lib.empty((3 + left,), np.float32)
    comm.sendrecv(sent, right, buf, left)
    assert_equal(lib, buf, rank_input(left, (3 + left,), np.float32))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.float16, np.complex128], ids=str)
def test_send_recv_ring(lib, comm, dtype, mode):
    if comm.size < 2:
        pytest.skip("send/recv needs 2 ranks (a rank cannot send to itself); ran with 1")
    right, left = neighbours(comm)
    x = lib.array(rank_input(comm.rank, (2, 3), dtype))
    buf = lib.empty((2, 3), dtype)
    calls = [lambda: comm.send(x, right, async_op=mode == "async"),
             lambda: comm.recv(buf, left, async_op=mode == "async")]
    if comm.rank % 2:   # even ranks send first, odd ranks receive first (NCCL needs an order
        calls.reverse()  # outside a group: its stream runs one transfer after the other)
    sent, received = calls[0](), calls[1]()
    if comm.rank % 2:
        sent, received = received, sent
    if mode == "async":
        assert sent.wait() is None
        received = received.wait()
    assert sent is None or isinstance(sent, cupycomm.Work)
    assert received is buf
    assert_equal(lib, buf, rank_input(left, (2, 3), dtype))


def test_messages_between_two_ranks_keep_their_order(lib, comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks; ran with 1")
    if comm.rank == 0:
        works = [comm.send(lib.array(np.full(4, i, np.int64)), 1, async_op=True) for i in range(5)]
        for work in works:
            work.wait()
        lib.synchronize()   # (before the barrier: the stand-in's busy streams send only then)
    elif comm.rank == 1:
        for i in range(5):
            assert_equal(lib, comm.recv(lib.empty(4, np.int64), 0), np.full(4, i, np.int64))
    comm.barrier()


def test_host_work_keeps_its_arrays_alive_until_completion():
    """A dropped Work of a host call in flight: MPI still writes into its array, so the
    backend keeps it alive until the call completes (or the communicator closes)."""
    from arrays import HOST
    with HOST.comm() as comm:
        if comm.size < 2:
            pytest.skip("needs a peer to send later; ran with 1 rank")

        def start():
            buf = np.zeros(1000)
            if comm.rank == 0:
                comm.irecv(buf, 1)   # the Work is dropped at once; rank 1 has sent nothing yet
            return weakref.ref(buf)
        ref = start()
        gc.collect()
        if comm.rank == 0:
            assert ref() is not None, "an in-flight receive's array was freed"
        comm.barrier()
        if comm.rank == 1:
            comm.send(np.ones(1000), 0)
    gc.collect()
    assert ref() is None, "close() did not let go of the completed call's array"
