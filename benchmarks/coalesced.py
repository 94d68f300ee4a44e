"""Many small arrays: separate all_reduce calls against one coalesced call and a bucket.

    mpiexec -n 2 python benchmarks/coalesced.py [--arrays 256] [--bytes 1024] [--rounds 300]

Each round times, one after the other on every rank (a barrier before each): the arrays
all-reduced one raw mpi4py ``Allreduce`` at a time, one ``comm.all_reduce`` at a time,
``comm.all_reduce_coalesced(arrays)`` and ``bucket.all_reduce()`` on a bucket of the same
arrays. Rank 0 prints the medians over rounds (time of the slowest rank) and each one's
speed-up over the separate raw calls. Every result is checked against the known sum.
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import cupycomm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arrays", type=int, default=256)
    parser.add_argument("--bytes", type=int, default=1024, help="bytes per array (float32)")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    comm = cupycomm.init()
    mpi = comm.mpi_comm
    count = args.bytes // 4
    arrays = [np.empty(count, np.float32) for _ in range(args.arrays)]
    bucket = comm.bucket([np.empty(count, np.float32) for _ in range(args.arrays)])
    expected = comm.size * (comm.size + 1) / 2

    def raw():
        for a in arrays:
            mpi.Allreduce(MPI.IN_PLACE, a, MPI.SUM)

    def separate():
        for a in arrays:
            comm.all_reduce(a)

    methods = {"raw mpi4py, one call per array": (raw, arrays),
               "comm.all_reduce, one call per array": (separate, arrays),
               "comm.all_reduce_coalesced(arrays)": (lambda: comm.all_reduce_coalesced(arrays),
                                                     arrays),
               "bucket.all_reduce()": (bucket.all_reduce, bucket.arrays)}
    times = {name: [] for name in methods}
    for round_ in range(args.rounds + 10):
        for name, (run, data) in methods.items():
            for a in data:
                a.fill(comm.rank + 1)
            mpi.Barrier()
            start = time.perf_counter()
            run()
            elapsed = mpi.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if not all((a == expected).all() for a in data):
                raise SystemExit(f"{name}: wrong result on rank {comm.rank}")
            if round_ >= 10:
                times[name].append(elapsed)
    if comm.rank == 0:
        base = statistics.median(times["raw mpi4py, one call per array"])
        print(f"# {comm.size} ranks, {args.arrays} float32 arrays of {args.bytes} B, median of "
              f"{args.rounds} rounds (slowest rank); every result checked")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:38s} {median * 1e6:10.1f} us   {base / median:6.2f} x")


if __name__ == "__main__":
    main()
