"""Survivors on a GPU: ranks lost one after the other while the others go on with CuPy arrays.

The device side of ``init(on_peer_loss="raise")`` that the stand-in can only model: the old
NCCL communicator aborted on a real GPU, a new one made over the survivors, a device
collective that a dead peer blocks. Three ranks (sharing one GPU: benchmarks/with_hostid),
under Open MPI's ULFM with cupycomm's flags (``cupycomm.survivors.policy.FLAGS``):

    mpiexec --with-ft ulfm --mca btl tcp,self --mca async_mpi_finalize 1 -n 3 \\
        benchmarks/with_hostid python benchmarks/gpu_survivors.py DIR

- Round 1: world rank 2 kills itself (SIGKILL); the others' host all_reduce raises PeerLost;
  they shrink and run a device all_reduce on 2 ranks, checked against NumPy.
- Round 2: world rank 1 kills itself while world rank 0 waits in a device all_reduce
  (what only the watchdog can end); rank 0 gets PeerLost, shrinks to 1 rank and runs a device
  all_reduce again.

Each survivor prints one line per round (what it saw, the time from the kill to the next
good collective) and exits 0 only if both rounds went as said; ``--device-module`` runs it
on the stand-in (cupycomm.testing.standin) to try the plumbing without a GPU.
"""
import argparse
import importlib
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, Optional

import numpy as np

import cupycomm


def kill_self(directory: str, world_rank: int) -> None:
    """Write the time in DIR/kill-<rank>, then SIGKILL this process."""
    with open(os.path.join(directory, f"kill-{world_rank}"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def since_kill(directory: str, world_rank: int) -> float:
    with open(os.path.join(directory, f"kill-{world_rank}")) as f:
        return time.time() - float(f.read())


def device_sum(comm: Any, xp: Any, me: int) -> np.ndarray:
    """A device all_reduce of [me + 1, ...] on ``comm``, back on the host."""
    y = comm.all_reduce(xp.asarray(np.full(4, me + 1.0)))
    return np.asarray(getattr(xp, "asnumpy", np.asarray)(y))


def go_on(comm: Any, xp: Any, me: int, directory: str, round_number: int, victim: int,
          work: Callable[[Any], None]) -> Optional[Any]:
    """One round: ``work(comm)``, which the victim's end must make raise PeerLost, then the
    shrink and a device all_reduce of the survivors, checked; the shrunk communicator, or
    None (said) where nothing was raised."""
    try:
        work(comm)
    except cupycomm.PeerLost as lost:
        seen = f"PeerLost(ranks={lost.ranks}, call={lost.call!r}, seq={lost.seq})"
    else:
        print(f"world rank {me}: round {round_number}: no PeerLost", flush=True)
        return None
    comm = comm.shrink()
    expected = float(sum(r + 1 for r in comm.world_ranks))
    np.testing.assert_array_equal(device_sum(comm, xp, me), np.full(4, expected))
    print(f"world rank {me}: round {round_number}: {seen}; shrunk to {comm.size} rank(s) "
          f"{comm.world_ranks}; device all_reduce ok {since_kill(directory, victim):.3f} s "
          "after the kill", flush=True)
    return comm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--device-module", default="cupy")
    args = parser.parse_args()
    xp = importlib.import_module(args.device_module)
    options: Dict[str, Any] = {} if args.device_module == "cupy" else {"device_module": xp}
    comm: Any = cupycomm.init(on_peer_loss="raise", timeout=30, **options)
    me = comm.rank
    expected = np.full(4, float(sum(r + 1 for r in range(comm.size))))
    np.testing.assert_array_equal(device_sum(comm, xp, me), expected)
    print(f"world rank {me}: device all_reduce on {comm.size} ranks ok", flush=True)
    # Every rank has its result before the kill: NCCL's proxy of a rank whose kernel is done
    # may still be sending to a peer (seen on an H200: a peer's result all zeros, no error).
    comm.barrier()

    # Round 1: a loss that a host call sees.
    if me == 2:
        kill_self(args.directory, me)
    comm = go_on(comm, xp, me, args.directory, 1, 2, lambda c: c.all_reduce(np.ones(1)))
    if comm is None:
        return 1

    # Round 2: a loss that blocks a device collective.
    if me == 1:
        time.sleep(0.5)   # rank 0 is waiting in its device all_reduce by then
        kill_self(args.directory, me)

    def blocked(c: Any) -> None:
        device_sum(c, xp, me)          # the dead peer never sends: the watchdog ends it
        c.all_reduce(np.ones(1))       # the loss, if the device call did not raise it
    comm = go_on(comm, xp, me, args.directory, 2, 1, blocked)
    if comm is None:
        return 1
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
