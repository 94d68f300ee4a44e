"""batch() blocks, isend and irecv: exchanges that cannot deadlock whatever their order."""
import numpy as np
import pytest

import cupycomm
from cupycomm.testing import standin
from arrays import all_inputs, assert_equal, rank_input


def grid(size):
    """A 2-D process grid (rows, cols) with rows * cols == size."""
    rows = max(r for r in range(1, int(size ** 0.5) + 1) if size % r == 0)
    return rows, size // rows


@pytest.mark.parametrize("receives_first", [True, False], ids=["recv-first", "send-first"])
@pytest.mark.parametrize("dtype", [np.float64, np.int8, np.complex64], ids=str)
def test_ring_in_one_block(lib, comm, dtype, receives_first):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    mine = lib.array(rank_input(comm.rank, (6,), dtype))
    from_left = lib.empty((6,), dtype)
    with comm.batch():
        calls = [lambda: comm.irecv(from_left, left), lambda: comm.isend(mine, right)]
        works = [call() for call in (calls if receives_first else calls[::-1])]
    assert all(isinstance(w, cupycomm.Work) for w in works)
    received = works[0] if receives_first else works[1]
    assert received.wait() is from_left
    assert_equal(lib, from_left, rank_input(left, (6,), dtype))


def test_2d_halo_exchange_in_one_block(lib, comm):
    rows, cols = grid(comm.size)
    row, col = divmod(comm.rank, cols)
    neighbours = {"up": ((row - 1) % rows) * cols + col, "down": ((row + 1) % rows) * cols + col,
                  "left": row * cols + (col - 1) % cols, "right": row * cols + (col + 1) % cols}
    opposite = {"up": "down", "down": "up", "left": "right", "right": "left"}
    edge = lambda rank, side: np.full(3, 10 * rank + "udlr".index(side[0]), np.float32)
    halos = {side: lib.empty(3, np.float32) for side in neighbours}
    # Messages between one pair match in the order they are posted (there are no tags), so
    # sends go up, down, left, right and receives come from the opposite sides in that order;
    # how sends and receives interleave is free: even ranks receive first, odd ranks send first.
    sends = [lambda side=side: comm.isend(lib.array(edge(comm.rank, side)), neighbours[side])
             for side in ("up", "down", "left", "right")]
    receives = [lambda side=side: comm.irecv(halos[side], neighbours[side])
                for side in ("down", "up", "right", "left")]
    with comm.batch():
        for call in (receives + sends if comm.rank % 2 == 0 else sends + receives):
            call()
    for side, peer in neighbours.items():
        assert_equal(lib, halos[side], edge(peer, opposite[side]))


def test_every_call_in_a_block_returns_a_work_completed_by_the_block(lib, comm):
    x = lib.array(np.full(4, comm.rank + 1.0))
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    buf = lib.empty(4, np.float64)
    with comm.batch():
        work = comm.sendrecv(x, right, buf, left)
        assert isinstance(work, cupycomm.Work)
    assert work.wait() is buf
    work.synchronize()
    assert work.is_completed()
    assert_equal(lib, buf, np.full(4, left + 1.0))


def test_collectives_join_a_block(comm, lib):
    """Host: nonblocking MPI collectives waited together; device: collectives in the NCCL group."""
    x = lib.array(rank_input(comm.rank, (3,), np.float64))
    mine = rank_input(comm.rank, (2,), np.int32, salt=1)
    parts = [lib.empty((2,), np.int32) for _ in range(comm.size)]
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    buf = lib.empty((2,), np.int32)
    with comm.batch():
        reduced = comm.all_reduce(x)
        gathered = comm.all_gather(lib.array(mine), out=parts)
        comm.irecv(buf, left)
        comm.isend(lib.array(mine), right)
    assert reduced.wait() is x
    assert gathered.wait() == parts
    assert_equal(lib, x, all_inputs(comm.size, (3,), np.float64).sum(axis=0))
    for peer, part in enumerate(parts):
        assert_equal(lib, part, rank_input(peer, (2,), np.int32, salt=1))
    assert_equal(lib, buf, rank_input(left, (2,), np.int32, salt=1))


def test_blocks_do_not_nest(comm):
    with comm.batch():
        with pytest.raises(RuntimeError, match="batch: batch\\(\\) blocks do not nest"):
            with comm.batch():
                pass


def test_host_and_device_calls_cannot_share_a_block():
    from arrays import STANDIN
    with STANDIN.comm() as comm:
        comm.init_device()
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        host_buf = np.full(2, -1.0)
        with pytest.raises(TypeError, match="batch: send on device arrays cannot join a block "
                                            "of host calls"):
            with comm.batch():
                comm.sendrecv(np.full(2, float(comm.rank)), right, host_buf, left)
                comm.isend(standin.asarray(np.ones(2)), right)
        np.testing.assert_array_equal(host_buf, np.full(2, -1.0))   # a block that raised: nothing ran
        with comm.batch():   # and the communicator is as usable as before
            comm.sendrecv(np.full(2, float(comm.rank)), right, host_buf, left)
        np.testing.assert_array_equal(host_buf, np.full(2, float(left)))


def test_a_block_that_raises_issues_nothing(lib, comm):
    """Every rank raises at the same bad call: nothing of the block was issued, so no rank
    waits for a peer's half of it, and the next call works."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    buf = lib.array(np.full(3, -1.0))
    with pytest.raises(ValueError, match=f"send: dst={comm.size} is not a rank"):
        with comm.batch():
            comm.irecv(buf, left)
            comm.isend(lib.array(np.ones(3)), comm.size)
    assert_equal(lib, buf, np.full(3, -1.0))
    with comm.batch():
        comm.irecv(buf, left)
        comm.isend(lib.array(np.full(3, float(comm.rank))), right)
    assert_equal(lib, buf, np.full(3, float(left)))


def test_device_block_refuses_stream_and_early_wait():
    from arrays import STANDIN
    with STANDIN.comm() as comm:
        comm.init_device()
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        buf = standin.empty(2)
        with comm.batch():
            work = comm.irecv(buf, left)
            with pytest.raises(RuntimeError, match="wait\\(\\) inside its batch\\(\\) block"):
                work.wait()
            with pytest.raises(TypeError, match="stream= cannot be used inside a batch"):
                comm.isend(standin.asarray(np.ones(2)), right,
                           stream=standin.Stream())
            comm.isend(standin.asarray(np.full(2, float(comm.rank))), right)
        assert_equal(STANDIN, work.wait(), np.full(2, float(left)))
