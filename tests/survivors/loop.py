"""A cupycomm.resilient loop that loses ranks, for tests/survivors/test_resilient.py: run under
Open MPI's ULFM (``python -m cupycomm.run --survivors -n 4 loop.py ...``).

    python loop.py --steps 8 --kill 3@2 --kill 1@5 [--min-size N] [--max-failures N]
                   [--commit-every K] [--device] [--grow] [--busy --kill-after-vote R@S]

Each step adds the sum over the ranks of ones (the communicator's size) to a committed
total (with ``--device``, also to one on the device, the NCCL stand-in, whose communicator
the shrink replaces and over which the state is synced). ``--kill R@S`` makes world rank R
kill itself (SIGKILL) first thing in step S, so the survivors go back to the last commit
and run the steps from there on one rank fewer (with ``--grow``, on as many: a new process,
this program again, takes the lost rank's place and enters the loop at the state's sync;
it prints its world rank and total at the end). Rank 0 of those that finish prints the
total and the one expected from the kills; on TooFewSurvivors every survivor prints what it
caught. ``--busy`` (with ``--device``): each step's device all_reduce runs on a stream of a
busy GPU (the stand-in holds its work back, and lets it on as it is asked), in place on a
device value that each step multiplies by the communicator's size: the step returns before
its device collective ran. ``--kill-after-vote R@S``: world rank R kills itself right after
the vote on step S (that step counts: every rank finished it).
"""
import argparse
import os
import signal

import numpy as np

import cupycomm
from cupycomm.testing import standin


def counted_sizes(size, kill_steps, steps, commit_every, grow=False):
    """The communicator's size in each step that counted: a kill at step s rewinds the loop
    to its last commit, and the steps from there are run again on one rank fewer (as many,
    with ``grow``)."""
    sizes, committed, i, pending = {}, 0, 0, sorted(kill_steps)
    while i < steps:
        if pending and pending[0] == i:
            while pending and pending[0] == i:
                pending.pop(0)
                size -= 0 if grow else 1
            i = committed
            continue
        sizes[i] = size
        i += 1
        if i % commit_every == 0 or i == steps:
            committed = i
    return [sizes[i] for i in range(steps)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill", action="append", default=[], help="RANK@STEP")
    parser.add_argument("--min-size", type=int, default=1)
    parser.add_argument("--max-failures", type=int, default=None)
    parser.add_argument("--device", action="store_true")
    parser.add_argument("--commit-every", type=int, default=1)
    parser.add_argument("--grow", action="store_true")
    parser.add_argument("--busy", action="store_true")
    parser.add_argument("--kill-after-vote", action="append", default=[], help="RANK@STEP")
    args = parser.parse_args()
    kills = [tuple(map(int, k.split("@"))) for k in args.kill]   # (rank, step)
    after_vote = [tuple(map(int, k.split("@"))) for k in args.kill_after_vote]
    comm = cupycomm.init(on_peer_loss="raise", device_module=standin if args.device else None)
    me, size = comm.rank, comm.size
    values = {"total": np.zeros(1)}
    if args.device:
        values["on_device"] = standin.asarray(np.zeros(1))
    if args.busy:
        values["product"] = standin.asarray(np.ones(1))
        busy = standin.Stream(non_blocking=True, deferred=True)
        busy.busy = True
    shrinks, current = [], [None]
    if after_vote:
        agree = cupycomm.Communicator.agree

        def agree_then_die(comm, flag):
            agreed = agree(comm, flag)
            if (me, current[0]) in after_vote:   # the vote on that step
                os.kill(os.getpid(), signal.SIGKILL)
            return agreed
        cupycomm.Communicator.agree = agree_then_die

    def step(comm, state, i):
        current[0] = i
        if (me, i) in kills and not cupycomm.joined_late():   # a newcomer took its place
            os.kill(os.getpid(), signal.SIGKILL)
        state.total += comm.all_reduce(np.ones(1))   # a loss is seen here, by MPI
        if args.device:
            state.on_device += comm.all_reduce(standin.asarray(np.ones(1)))
        if args.busy:   # returns at launch; the step's result is written later
            with busy:
                comm.all_reduce(state.product)

    def on_shrink(comm, state, lost):
        shrinks.append((lost, comm.size, state.completed))

    try:
        comm, state = cupycomm.resilient(step, cupycomm.State(**values), comm,
                                         steps=args.steps, min_size=args.min_size,
                                         max_failures=args.max_failures, on_shrink=on_shrink,
                                         commit_every=args.commit_every, grow=args.grow)
    except cupycomm.TooFewSurvivors as stop:
        print(f"world rank {me} stopped: lost {stop.lost}, {stop.comm.size} left, state of "
              f"step {stop.state.completed}, total {stop.state.total[0]:g}: {stop}", flush=True)
        return
    lost_at = [s for _, s in kills] + [s + 1 for _, s in after_vote]   # where it is seen
    sizes = counted_sizes(size, lost_at, args.steps, args.commit_every, args.grow)
    if cupycomm.joined_late():
        print(f"world rank {comm.world_ranks[comm.rank]} joined late and finished: total "
              f"{state.total[0]:g}, expected {sum(sizes)}", flush=True)
    if args.device:
        assert float(standin.asnumpy(state.on_device)[0]) == sum(sizes), state.on_device
    if args.busy:
        product = float(standin.asnumpy(state.product)[0])
        assert product == np.prod(sizes, dtype=float), (product, sizes)
    if comm.rank == 0:
        print(f"finished on {comm.size} ranks {comm.world_ranks}: total {state.total[0]:g}, "
              f"expected {sum(sizes)}; shrinks {shrinks}", flush=True)


if __name__ == "__main__":
    main()
