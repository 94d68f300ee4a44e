"""Data-parallel training of a 2-layer MLP written with hand-made gradients, on CPUs or GPUs.

    mpiexec -n 4 python examples/train_data_parallel.py --epochs 10

Each rank holds an equal shard of a synthetic data set. Rank 0's initial parameters are
broadcast to every rank; each rank's batches are prefetched to its device on a background
stream (passed through on CPUs); the gradients are averaged across ranks with the coalesced
all_reduce (op="avg", asynchronously: the reduction of the second layer's gradients runs while
the first layer's are computed). Rank 0 reports the loss per epoch (a progress bar on a
terminal, else a line per epoch) and, at the end, checks that the parameters equal those of
single-process training on the same global batches, within float tolerance. The same file
runs on GPUs unchanged (comm.xp).
"""
import argparse
import sys

import numpy as np

import cupycomm

SAMPLES, FEATURES, HIDDEN = 960, 8, 16   # 960 rows split evenly over 1, 2, 3 or 4 ranks


def make_data(seed: int = 0):
    """A binary classification set from a fixed random teacher."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, FEATURES))
    teacher = rng.normal(size=FEATURES)
    y = (np.tanh(x @ teacher) + 0.3 * rng.normal(size=SAMPLES) > 0).astype(np.float64)
    return x, y


def init_params(seed: int):
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=0.5, size=(FEATURES, HIDDEN)), np.zeros(HIDDEN),
            rng.normal(scale=0.5, size=HIDDEN), np.zeros(())]


def forward(xp, params, x):
    w1, b1, w2, b2 = params
    hidden = xp.tanh(x @ w1 + b1)
    return hidden, 1 / (1 + xp.exp(-(hidden @ w2 + b2)))


def loss_of(xp, p, y):
    eps = 1e-12
    return float(-(y * xp.log(p + eps) + (1 - y) * xp.log(1 - p + eps)).mean())


def output_gradients(xp, y, hidden, p):
    """Mean cross-entropy gradients of the output layer, and the signal for the first one."""
    delta = (p - y) / len(y)
    return [hidden.T @ delta, xp.asarray(delta.sum())], delta


def hidden_gradients(xp, x, hidden, delta, params):
    back = xp.outer(delta, params[2]) * (1 - hidden ** 2)
    return [x.T @ back, back.sum(axis=0)]


def batches(x, y, count):
    """``count`` equal consecutive batches of a shard."""
    rows = len(y) // count
    for i in range(count):
        yield x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]


def train(comm, epochs, batch_count, lr):
    xp = comm.xp
    x, y = make_data()
    shard = slice(comm.rank * SAMPLES // comm.size, (comm.rank + 1) * SAMPLES // comm.size)
    params = [xp.asarray(p) for p in init_params(seed=comm.rank)]   # differ by rank...
    for p in params:
        comm.broadcast(p, root=0)                                    # ...until rank 0's win
    for epoch in range(epochs):
        losses = []
        for xb, yb in cupycomm.prefetch(batches(x[shard], y[shard], batch_count),
                                        device=comm.device):
            hidden, p = forward(xp, params, xb)
            losses.append(loss_of(xp, p, yb))
            outer, delta = output_gradients(xp, yb, hidden, p)
            reducing = comm.all_reduce_coalesced(outer, op="avg", async_op=True)
            inner = hidden_gradients(xp, xb, hidden, delta, params)   # overlaps the reduction
            grads = comm.all_reduce_coalesced(inner, op="avg") + reducing.wait()
            for param, grad in zip(params, grads):
                param -= lr * grad
        loss = comm.all_reduce(np.array([np.mean(losses)]), op="avg")[0]
        if comm.rank == 0:   # on stdout, the result's stream, so the two never interleave
            if sys.stdout.isatty():   # a bar, redrawn
                done = (epoch + 1) * 30 // epochs
                sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] epoch {epoch + 1}/"
                                 f"{epochs} loss {loss:.4f}" + ("\n" if epoch + 1 == epochs
                                                                else ""))
            else:   # a log: a line per epoch
                sys.stdout.write(f"epoch {epoch + 1}/{epochs} loss {loss:.4f}\n")
            sys.stdout.flush()
    return [np.asarray(p.get() if hasattr(p, "get") else p) for p in params], loss


def train_in_one_process(size, epochs, batch_count, lr):
    """The reference: one process, the same global batches (every rank's batch i together)."""
    x, y = make_data()
    params = init_params(seed=0)
    shards = [slice(r * SAMPLES // size, (r + 1) * SAMPLES // size) for r in range(size)]
    for _ in range(epochs):
        for parts in zip(*[batches(x[s], y[s], batch_count) for s in shards]):
            xb = np.concatenate([p[0] for p in parts])
            yb = np.concatenate([p[1] for p in parts])
            hidden, p = forward(np, params, xb)
            outer, delta = output_gradients(np, yb, hidden, p)
            grads = hidden_gradients(np, xb, hidden, delta, params) + outer
            for param, grad in zip(params, grads):
                param -= lr * grad
    return params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batches", type=int, default=4, help="batches per epoch and rank "
                                                               "(1: full-batch training)")
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args(argv)
    comm = cupycomm.init()
    params, loss = train(comm, args.epochs, args.batches, args.lr)
    if comm.rank == 0:
        reference = train_in_one_process(comm.size, args.epochs, args.batches, args.lr)
        worst = max(float(np.max(np.abs(p - r))) for p, r in zip(params, reference))
        assert worst < 1e-9, f"data-parallel parameters differ from one process by {worst:g}"
        ranks = f"{comm.size} rank{'s' if comm.size > 1 else ''}"
        print(f"trained on {ranks} for {args.epochs} epochs: loss {loss:.4f}; "
              f"parameters equal single-process training (max difference {worst:.1e})")


if __name__ == "__main__":
    main()
