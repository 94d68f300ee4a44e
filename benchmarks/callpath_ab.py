"""Before and after in ONE process: the host call path of two versions of cupycomm against
the raw mpi4py call, interleaved round by round, so that a change's cost is a ratio measured
side by side rather than across runs on a noisy machine.

Each version's package is copied under its own name (``cupycomm_before``, ``cupycomm_after``;
the call path imports itself relatively), both make a communicator over ``COMM_SELF``, and
each row times the raw call, then the two versions' calls, ``--rounds`` times. The device
rows run each version's NCCL backend on its own stand-in with CUDA and NCCL at no cost
(``callpath.ZeroCost``; raw: the no-op NCCL call). Figures: the best round in µs per call,
and what each version adds over the raw call::

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
from typing import Any, Callable

from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from callpath import ZeroCost

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


def _device_rows(versions: dict) -> tuple:
    """(rows as ``_rows`` gives them, each version's communicator): over ``COMM_SELF`` on the
    version's own stand-in, its CUDA and NCCL calls made no-ops."""
    comms, arrays, zero = {}, {}, ZeroCost()
    for v, module in versions.items():
        standin = importlib.import_module(f"{module.__name__}.testing.standin")

        class Array(standin.ndarray):   # CuPy's cost of data and device (see callpath.py)
            data = device = None

        comm = comms[v] = module.init(MPI.COMM_SELF, device_module=standin)
        zero.install(comm.init_device())
        x = arrays[comm] = standin.zeros(2, np.float32).view(Array)
        x.data = SimpleNamespace(ptr=x.__array_interface__["data"][0])
        x.device = SimpleNamespace(id=0)
    nccl, stream, ptr = zero.nccl, zero.stream, x.data.ptr

    def blocking(m: Any) -> Callable[[], Any]:
        x = arrays[m]
        return lambda: m.all_reduce(x)

    def started(m: Any) -> Callable[[], Any]:
        x = arrays[m]
        return lambda: m.all_reduce(x, async_op=True).wait()

    raw = lambda: nccl.allReduce(ptr, ptr, 2, 7, 0, stream.ptr)  # noqa: E731
    return {"device all_reduce (stand-in, general path)": (raw, blocking),
            "device all_reduce async + wait (stand-in)": (raw, started)}, comms


def _table(rows: dict, comms: dict, number: int, rounds: int) -> None:
    for name, (raw, make) in rows.items():
        calls = {"raw": raw, **{v: make(comm) for v, comm in comms.items()}}
        times: dict = {k: [] for k in calls}
        for _ in range(rounds):
            for k, call in calls.items():
                times[k].append(timeit.timeit(call, number=number) / number * 1e6)
        best = {k: min(v) for k, v in times.items()}
        median = {k: statistics.median(v) for k, v in times.items()}
        over = {v: best[v] - best["raw"] for v in comms}
        print(f"| {name} | " + " | ".join(f"{best[k]:.3f} ({median[k]:.3f})" for k in calls)
              + f" | +{over['before']:.3f} -> +{over['after']:.3f} | "
              f"{best['after'] / best['before']:.3f} |", flush=True)


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
        _table(_rows(x, out), comms, args.number, args.rounds)
        device_rows, device_comms = _device_rows(versions)
        _table(device_rows, device_comms, args.number, args.rounds)
        for comm in comms.values():
            comm.close()
        for comm in device_comms.values():
            if hasattr(comm, "parts"):   # a tree before issue 25's façade: left to its exit
                comm.parts.router.device = None   # its CUDA objects are no-ops: nothing to free
                comm.close()


if __name__ == "__main__":
    main()
