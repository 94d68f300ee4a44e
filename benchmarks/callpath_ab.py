"""Before and after in ONE process: the host call path of two versions of cupycomm against
the raw mpi4py call, interleaved round by round, so that a change's cost is a ratio measured
side by side rather than across runs on a noisy machine.

Each version's package is copied under its own name (``cupycomm_before``, ``cupycomm_after``;
the call path imports itself relatively), both make a communicator over ``COMM_SELF``, and
each row times the raw call, then the two versions' calls, ``--rounds`` times. Figures: the
best round in µs per call, and what each version adds over the raw call::

    python benchmarks/callpath_ab.py --before bf4ed34              # that commit vs the tree
    python benchmarks/callpath_ab.py --before main --after HEAD --rounds 50
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import timeit

import numpy as np
from mpi4py import MPI

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _package(ref: str, into: pathlib.Path, name: str) -> None:
    """cupycomm's package at git ``ref`` (or the working tree, for ``ref`` ".") as ``name``."""
    if ref == ".":
        shutil.copytree(ROOT / "cupycomm", into / name)
        return
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "cupycomm"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "cupycomm").rename(into / name)


def _rows(x: np.ndarray, out: np.ndarray) -> dict:
    """Row -> (the raw mpi4py call, the cupycomm call made from a communicator)."""
    c, f, total, here, byte = MPI.COMM_SELF, MPI.FLOAT, MPI.SUM, MPI.IN_PLACE, MPI.BYTE
    return {
        "all_reduce in place": (lambda: c.Allreduce(here, [x, f], total),
                                lambda m: lambda: m.all_reduce(x)),
        "all_reduce out=": (lambda: c.Allreduce([x, f], [out, f], total),
                            lambda m: lambda: m.all_reduce(x, out=out)),
        "reduce in place": (lambda: c.Reduce(here, [x, f], total, 0),
                            lambda m: lambda: m.reduce(x, 0)),
        "broadcast": (lambda: c.Bcast([x, byte], 0), lambda m: lambda: m.broadcast(x, 0)),
        "all_gather out=": (lambda: c.Allgather([x, byte], [out, byte]),
                            lambda m: lambda: m.all_gather(x, out=out)),
        "sendrecv": (lambda: c.Sendrecv([x, byte], 0, 0, [out, byte], 0, 0),
                     lambda m: lambda: m.sendrecv(x, 0, out, 0)),
        "all_reduce async + wait": (lambda: c.Iallreduce(here, [x, f], total).Wait(),
                                    lambda m: lambda: m.all_reduce(x, async_op=True).wait()),
        "all_reduce op=avg (general path)": (lambda: c.Allreduce(here, [x, f], total),
                                             lambda m: lambda: m.all_reduce(x, op="avg")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a git revision")
    parser.add_argument("--after", default=".", help="a git revision (default: the tree)")
    parser.add_argument("--number", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        where = pathlib.Path(scratch)
        _package(args.before, where, "cupycomm_before")
        _package(args.after, where, "cupycomm_after")
        sys.path.insert(0, scratch)
        versions = {v: importlib.import_module(f"cupycomm_{v}") for v in ("before", "after")}
        comms = {v: module.init(MPI.COMM_SELF) for v, module in versions.items()}
        print(f"# one process, {args.rounds} rounds x {args.number} calls, interleaved; "
              f"before {args.before}, after {args.after}; µs per call, best round (median)")
        print("| call | raw | before | after | + over raw: before -> after | ratio |")
        print("|---|---|---|---|---|---|")
        x, out = np.zeros(2, np.float32), np.zeros(2, np.float32)
        for name, (raw, make) in _rows(x, out).items():
            calls = {"raw": raw, **{v: make(comm) for v, comm in comms.items()}}
            times: dict = {k: [] for k in calls}
            for _ in range(args.rounds):
                for k, call in calls.items():
                    times[k].append(timeit.timeit(call, number=args.number) / args.number * 1e6)
            best = {k: min(v) for k, v in times.items()}
            median = {k: statistics.median(v) for k, v in times.items()}
            over = {v: best[v] - best["raw"] for v in comms}
            print(f"| {name} | " + " | ".join(f"{best[k]:.3f} ({median[k]:.3f})" for k in calls)
                  + f" | +{over['before']:.3f} -> +{over['after']:.3f} | "
                  f"{best['after'] / best['before']:.3f} |", flush=True)
        for comm in comms.values():
            comm.close()


if __name__ == "__main__":
    main()
