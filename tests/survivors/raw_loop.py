"""The survivors' raw loop of the README (catch PeerLost, ``comm.shrink()``, redo the step),
without :func:`cupycomm.resilient`, for tests/survivors/test_survivors.py and
benchmarks/survivors_raw_loop.py: run under Open MPI's ULFM
(``mpiexec --with-ft ulfm --mca btl tcp,self ... -n 4``).

    python raw_loop.py [--steps 6] [--kill 2@2] [--agree] [--uneven]

Each step all-reduces ``[world rank + 1, step]`` and checks the result against the sums of
the ranks of the communicator it ran on (each rank prints ``WRONG ...`` for a step that
differs). ``--kill R@S``: world rank R kills itself (SIGKILL) first thing in step S. A step
that raises PeerLost is redone on ``comm.shrink()``'s communicator; with ``--agree`` the
ranks first agree whether the step counts (``comm.agree``: every survivor redoes the same
step). ``--uneven`` makes the loss break a step on some survivors only, every time: at the
end of step S - 1 the victim sends a message to each other rank but the last, waits for
their answers and kills itself, while the last one waits for its message (so it raises
PeerLost in step S - 1, the others in step S). Each rank that finishes prints
``world rank R: N steps right, sizes [...]``; where ``shrink()`` refuses, ``world rank R
refused: ...`` (and exits 3).
"""
import argparse
import os
import signal
import sys

import numpy as np

import cupycomm


def exchange(comm, victim):
    """The victim sends to every other rank but the last and waits for their answers, then
    dies; the last rank waits for a message that never comes."""
    me, box = comm.world_ranks[comm.rank], np.zeros(1)
    if me == victim:
        for rank in range(comm.size - 1):
            if rank != comm.rank:
                comm.send(np.ones(1), rank)
                comm.recv(box, rank)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.recv(box, comm.world_ranks.index(victim))
    comm.send(box, comm.world_ranks.index(victim))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill", default="2@2", help="RANK@STEP")
    parser.add_argument("--agree", action="store_true")
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()
    victim, kill_step = map(int, args.kill.split("@"))
    comm = cupycomm.init(on_peer_loss="raise", timeout=args.timeout)
    me = comm.world_ranks[comm.rank]
    step, right, sizes = 0, 0, []
    while step < args.steps:
        if me == victim and step == kill_step and not args.uneven:
            os.kill(os.getpid(), signal.SIGKILL)
        x = np.array([me + 1.0, step])
        try:
            comm.all_reduce(x)
            if args.uneven and step == kill_step - 1 and victim in comm.world_ranks:
                exchange(comm, victim)
            finished = True
        except cupycomm.PeerLost:
            finished = False
        try:
            if not (comm.agree(finished and not comm.failed_ranks()) if args.agree
                    else finished):
                comm = comm.shrink()
                continue
        except RuntimeError as refusal:
            if isinstance(refusal, cupycomm.PeerLost):
                raise
            print(f"world rank {me} refused: {refusal}", flush=True)
            sys.exit(3)
        expected = [sum(r + 1.0 for r in comm.world_ranks), step * comm.size]
        if x.tolist() == expected:
            right += 1
        else:
            print(f"WRONG world rank {me} step {step}: {x.tolist()}, expected {expected}",
                  flush=True)
        sizes.append(comm.size)
        step += 1
    print(f"world rank {me}: {right} steps right, sizes {sizes}", flush=True)


if __name__ == "__main__":
    main()
