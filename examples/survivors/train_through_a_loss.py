"""Data-parallel training that goes on after a rank is lost: the MLP of train_data_parallel.py,
one gradient step per batch, on 4 ranks of which one kills itself (SIGKILL) at a given step;
the 3 survivors shrink the communicator, take the last committed parameters from the lowest
surviving rank, retry that step and finish (cupycomm.resilient).

    python -m cupycomm.run --survivors -n 4 \\
        examples/survivors/train_through_a_loss.py --kill-rank 1 --kill-at 5

(``--survivors``: Open MPI 5's ``mpiexec --with-ft ulfm --mca btl tcp,self --mca
async_mpi_finalize 1``; the job exits 0 if the survivors went on without the lost rank.)

Rank 0 of the survivors prints the final loss, checks that the parameters equal those of one
process trained on the same global batches (all 4 shards before the kill, the survivors' 3
after it) and prints the time from the kill to the next completed step (from the moment the
survivors start the step in which the victim kills itself, first thing, to the moment they
start the next one, that step being committed on all). ``--resume-at K`` without a kill
trains on the ranks given from the 4-rank state after K steps, uninterrupted: on 3 ranks,
the run the killed one must equal.
"""
import argparse
import itertools
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import cupycomm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_data_parallel import (SAMPLES, batches, forward, hidden_gradients,  # noqa: E402
                                 init_params, loss_of, make_data, output_gradients)

DATA = make_data()


def batch(xp, rank, size, i, count):
    """Batch ``i`` (of ``count`` per epoch) of the shard of ``rank`` among ``size`` ranks."""
    shard = slice(rank * SAMPLES // size, (rank + 1) * SAMPLES // size)
    xb, yb = next(itertools.islice(batches(DATA[0][shard], DATA[1][shard], count),
                                   i % count, None))
    return xp.asarray(xb), xp.asarray(yb)


def gradients(xp, params, xb, yb):
    hidden, p = forward(xp, params, xb)
    outer, delta = output_gradients(xp, yb, hidden, p)
    return hidden_gradients(xp, xb, hidden, delta, params) + outer


def in_one_process(sizes, count, lr):
    """The reference: step i on the global batch of ``sizes[i]`` shards, in one process."""
    params = init_params(seed=0)
    for i, size in enumerate(sizes):
        parts = [batch(np, r, size, i, count) for r in range(size)]
        xb, yb = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        for param, grad in zip(params, gradients(np, params, xb, yb)):
            param -= lr * grad
    return params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batches", type=int, default=4, help="batches per epoch and rank")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--kill-rank", type=int, default=1, help="the world rank that dies")
    parser.add_argument("--kill-at", type=int, default=5, help="the step at which it dies")
    parser.add_argument("--resume-at", type=int, default=None,
                        help="no kill: start from the 4-rank state after this many steps")
    args = parser.parse_args(argv)
    comm = cupycomm.init(on_peer_loss="raise")
    xp, me, first_size = comm.xp, comm.rank, comm.size
    if args.resume_at is None:
        state = cupycomm.State(params=[xp.asarray(p) for p in init_params(seed=me)])
    else:
        state = cupycomm.State(params=[xp.asarray(p) for p in
                                       in_one_process([4] * args.resume_at, args.batches,
                                                      args.lr)])
        state.completed = args.resume_at
    started = {}   # step -> when this rank first started it

    def train_step(comm, state, i):
        started.setdefault(i, time.perf_counter())
        if args.resume_at is None and i == args.kill_at and me == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        xb, yb = batch(xp, comm.rank, comm.size, i, args.batches)
        grads = comm.all_reduce_coalesced(gradients(xp, state.params, xb, yb), op="avg")
        for param, grad in zip(state.params, grads):
            param -= args.lr * grad

    def on_shrink(comm, state, lost):
        if comm.rank == 0:
            print(f"world rank(s) {', '.join(map(str, lost))} lost; {comm.size} ranks go on "
                  f"from step {state.completed}", flush=True)

    comm, state = cupycomm.resilient(train_step, state, comm, steps=args.steps,
                                     min_size=2, on_shrink=on_shrink)
    finished = time.perf_counter()
    if comm.rank != 0:
        return
    params = [np.asarray(p.get() if hasattr(p, "get") else p) for p in state.params]
    loss = loss_of(np, forward(np, params, DATA[0])[1], DATA[1])
    if args.resume_at is None:
        sizes = [first_size] * args.kill_at + [comm.size] * (args.steps - args.kill_at)
        recovered = started.get(args.kill_at + 1, finished) - started[args.kill_at]
        usual = np.median([started[i + 1] - started[i] for i in started
                           if i + 1 in started and i != args.kill_at])
        print(f"time from the kill to the next completed step: {recovered * 1e3:.1f} ms "
              f"(a step without a loss: {usual * 1e3:.1f} ms)", flush=True)
        story = f"on {first_size} ranks, then {comm.size} from step {args.kill_at}"
    else:
        sizes = [4] * args.resume_at + [comm.size] * (args.steps - args.resume_at)
        story = f"on {comm.size} ranks from the 4-rank state of step {args.resume_at}"
    reference = in_one_process(sizes, args.batches, args.lr)
    worst = max(float(np.max(np.abs(p - r))) for p, r in zip(params, reference))
    assert worst < 1e-9, f"the parameters differ from one process by {worst:g}"
    print(f"trained {args.steps} steps {story}: final loss {loss:.10f}; parameters equal "
          f"one-process training (max difference {worst:.1e})", flush=True)


if __name__ == "__main__":
    main()
