"""Subgroups: split and new_group give full communicators, on host and device arrays."""
import gc
import weakref

import numpy as np
import pytest

from cupycomm.testing import standin
from arrays import assert_equal, rank_input


def members_of(comm, color_of):
    """The parent ranks with this rank's color, in order."""
    mine = color_of(comm.rank)
    return [r for r in range(comm.size) if color_of(r) == mine]


def test_split_by_parity_runs_every_collective(lib, comm):
    half = comm.split(comm.rank % 2)
    members = members_of(comm, lambda r: r % 2)
    assert (half.rank, half.size) == (members.index(comm.rank), len(members))
    everyone = np.stack([rank_input(r, (2 * half.size,), np.int64) for r in members])
    x = lib.array(rank_input(comm.rank, (2 * half.size,), np.int64))
    assert_equal(lib, half.all_reduce(lib.array(everyone[half.rank])), everyone.sum(0))
    assert_equal(lib, half.all_gather(x), everyone)
    assert_equal(lib, half.reduce_scatter(x), everyone.sum(0)[2 * half.rank:2 * half.rank + 2])
    assert_equal(lib, half.broadcast(lib.array(everyone[half.rank]), half.size - 1),
                 everyone[-1])
    exchanged = half.all_to_all(x)
    assert_equal(lib, exchanged, everyone[:, 2 * half.rank:2 * half.rank + 2].reshape(-1))
    gathered = half.gather(x, 0)
    if half.rank == 0:
        assert_equal(lib, gathered, everyone)
    right, left = (half.rank + 1) % half.size, (half.rank - 1) % half.size
    assert_equal(lib, half.sendrecv(x, right, lib.empty(x.shape, x.dtype), left), everyone[left])
    half.close()
    assert_equal(lib, comm.all_reduce(lib.array(np.ones(2))), np.full(2, float(comm.size)))


def test_split_orders_by_key_and_none_is_not_a_member(lib, comm):
    sub = comm.split(None if comm.rank == 0 else 1, key=-comm.rank)
    if comm.rank == 0:
        assert sub is None
        return
    assert sub.size == comm.size - 1
    assert sub.rank == comm.size - 1 - comm.rank     # reversed by the key
    assert_equal(lib, sub.all_reduce(lib.array(np.array([comm.rank]))),
                 np.array([sum(range(1, comm.size))]))
    sub.close()


def test_nested_split(lib, comm):
    outer = comm.split(comm.rank % 2)
    inner = outer.split(outer.rank // 2)
    total = inner.all_reduce(lib.array(np.array([comm.rank], np.int32)))
    outer_members = members_of(comm, lambda r: r % 2)
    inner_members = [r for i, r in enumerate(outer_members) if i // 2 == outer.rank // 2]
    assert_equal(lib, total, np.array([sum(inner_members)], np.int32))
    assert inner.name.endswith(f"split({outer.rank // 2})")
    inner.close()
    outer.close()


def test_new_group_with_a_non_member(lib, comm):
    chosen = sorted({0, comm.size - 1})
    group = comm.new_group(list(reversed(chosen)))
    if comm.rank not in chosen:
        assert group is None
        return
    assert (group.rank, group.size) == (chosen.index(comm.rank), len(chosen))
    assert_equal(lib, group.all_reduce(lib.array(np.array([comm.rank + 1.0]))),
                 np.array([float(sum(r + 1 for r in chosen))]))
    group.close()


@pytest.mark.parametrize("ranks,kind,pattern", [
    ([], ValueError, r"new_group: ranks must be a non-empty list of ranks, got \[\]"),
    ("01", ValueError, "ranks must be a non-empty list"),
    ([0, 99], ValueError, r"ranks=99 is not a rank of this communicator"),
    ([0, 0], ValueError, r"ranks repeats \[0\]: each rank may appear once"),
    ([0, 1.0], TypeError, "ranks must be an int rank, got 1.0"),
])
def test_new_group_rejects_bad_ranks(comm, ranks, kind, pattern):
    with pytest.raises(kind, match=pattern):
        comm.new_group(ranks)


@pytest.mark.parametrize("color,key,kind,pattern", [
    (-1, None, ValueError, "color must be an int >= 0 or None, got -1"),
    ("a", None, ValueError, "color must be an int"),
    (0, 1.5, TypeError, "key must be an int or None, got 1.5"),
])
def test_split_rejects_bad_arguments(comm, color, key, kind, pattern):
    with pytest.raises(kind, match=pattern):
        comm.split(color, key)


@pytest.mark.parametrize("version,eager", [(22304, True), (21700, False)],
                         ids=["commSplit", "new-unique-id"])
def test_device_subgroup_gets_its_nccl_communicator(monkeypatch, version, eager):
    from arrays import STANDIN
    monkeypatch.setattr(standin, "VERSION", version)
    with STANDIN.comm() as comm:
        comm.init_device()
        half = comm.split(comm.rank % 2)
        assert (half.parts.router.device is not None) == eager   # split now, or made on first device use
        total = half.all_reduce(standin.asarray(np.array([comm.rank], np.int64)))
        assert half.parts.router.device is not None
        assert_equal(STANDIN, total,
                     np.array([sum(members_of(comm, lambda r: r % 2))], np.int64))
        half.close()


@pytest.mark.parametrize("make", ["split", "new_group"])
def test_a_dropped_subgroup_is_never_destroyed_by_the_garbage_collector(make):
    """Issue 32 finding 7: CuPy's destructor runs ncclCommDestroy (stand-in rule 23) in
    whichever thread collects a communicator dropped unclosed, at any moment, waiting for
    its kernels and graphs. It warns instead, as an unclosed file does, and its NCCL
    communicator is destroyed at exit, on the main thread."""
    from arrays import STANDIN, in_new_thread
    from cupycomm import _bootstrap
    from cupycomm.backends import nccl
    with STANDIN.comm() as comm:
        comm.init_device()
        sub = comm.split(0) if make == "split" else comm.new_group(list(range(comm.size)))
        total = sub.all_reduce(standin.asarray(np.ones(2)))
        assert_equal(STANDIN, total, np.full(2, float(comm.size)))
        raw = weakref.ref(sub.parts.router.device._comm)
        sub.cycle = sub                              # collected by the cycle collector alone
        del sub
        with pytest.warns(ResourceWarning, match="collected unclosed on rank .*: close"):
            in_new_thread(gc.collect)                # (as the watchdog's thread may)
        kept = raw()
        assert kept is not None and kept.freed_by == ""
        assert nccl._close_dropped in _bootstrap._SAFE_POINT   # close_all runs it at exit
        nccl._close_dropped()
        assert kept.freed_by == "ncclCommDestroy"


def test_split_takes_numpy_integers(comm):
    half = comm.split(np.int64(comm.rank % 2), key=np.int32(-comm.rank))
    assert half.size == len(range(comm.rank % 2, comm.size, 2))
    assert half.rank == half.size - 1 - comm.rank // 2   # ordered by the negated rank
    half.close()
    with pytest.raises(ValueError, match=r"split: color must be an int >= 0 or None, got True"):
        comm.split(True)
