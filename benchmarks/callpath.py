"""What cupycomm's call path costs against the raw call, in microseconds: one process (or every
rank of a job), ``timeit``, the implementations of a row interleaved round by round, the best
round of each (a row's figure is the best of ``--rounds`` rounds of ``--number`` calls).

    python benchmarks/callpath.py                       # one process: host, async, device
    mpiexec -n 2 python benchmarks/callpath.py          # also: the watchdog on/off, 1-16 MiB

Sections:

- host: the raw typed mpi4py call (``Allreduce(IN_PLACE, [x, MPI.FLOAT], MPI.SUM)``...)
  against the ``comm`` call doing the same work, 8 B float32;
- async: ``Iallreduce(...).Wait()`` against ``comm.all_reduce(x, async_op=True).wait()``;
- watchdog (2+ ranks): ``comm.all_reduce`` of 1-16 MiB with the communicator watched by the
  watchdog thread and not watched, alternating, in one run (median of rounds);
- device: the NCCL backend's own Python on the test suite's stand-in with every CUDA and NCCL
  call replaced by a call that does nothing (``ZeroCost``), on an array whose ``data`` and
  ``device`` are read as CuPy's are (attributes; the stand-in's properties make a new object
  on each read, about 1 µs that the raw call does not pay); the few ns each no-op call still
  costs is measured (one no-op call, timed the same way) and subtracted, once per call counted
  on each side, so that the row is cupycomm's Python alone. The CUDA calls besides NCCL that
  one synchronous collective makes are counted too, on the null stream and on a stream of the
  caller's own (one cudaGetDevice: the backend makes the communicator's device current,
  and sets the previous one back, only where another one is current).
"""
from __future__ import annotations

import argparse
import os
import sys
import timeit
from types import SimpleNamespace
from typing import Callable, Dict, List

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import cupycomm  # noqa: E402
from cupycomm.faults.watchdog import unwatch, watch  # noqa: E402


def best(rows: Dict[str, Callable[[], object]], number: int, rounds: int) -> Dict[str, float]:
    """µs per call of each runner: the best of ``rounds`` rounds, runners interleaved."""
    times = {name: [] for name in rows}
    for _ in range(rounds):
        for name, run in rows.items():
            times[name].append(timeit.timeit(run, number=number) / number * 1e6)
    return {name: min(t) for name, t in times.items()}


def host_rows(comm: cupycomm.Communicator) -> List[tuple]:
    """(collective, raw call, cupycomm call) at 8 B float32 (one element per rank's part)."""
    c, size, rank = comm.mpi_comm, comm.size, comm.rank
    F, B, S, IP = MPI.FLOAT, MPI.BYTE, MPI.SUM, MPI.IN_PLACE
    x, o = np.zeros(2, np.float32), np.zeros(2, np.float32)
    part = np.zeros(1, np.float32)
    whole, whole2 = np.zeros(size, np.float32), np.zeros(size, np.float32)
    right, left = (rank + 1) % size, (rank - 1) % size
    at_root = whole if rank == 0 else None
    member = cupycomm.ReduceOp.SUM
    return [
        ("all_reduce (in place)", lambda: c.Allreduce(IP, [x, F], S), lambda: comm.all_reduce(x)),
        ("all_reduce op=ReduceOp.SUM", lambda: c.Allreduce(IP, [x, F], S),
         lambda: comm.all_reduce(x, op=member)),
        ("all_reduce (out)", lambda: c.Allreduce([x, F], [o, F], S),
         lambda: comm.all_reduce(x, out=o)),
        ("reduce (in place)", lambda: c.Reduce(IP if rank == 0 else [x, F],
                                               [x, F] if rank == 0 else None, S, 0),
         lambda: comm.reduce(x, 0)),
        ("broadcast", lambda: c.Bcast([x, B], 0), lambda: comm.broadcast(x, 0)),
        ("all_gather", lambda: c.Allgather([part, B], [whole, B]),
         lambda: comm.all_gather(part, out=whole)),
        ("reduce_scatter", lambda: c.Reduce_scatter_block([whole, F], [part, F], S),
         lambda: comm.reduce_scatter(whole, out=part)),
        ("all_to_all", lambda: c.Alltoall([whole, B], [whole2, B]),
         lambda: comm.all_to_all(whole, out=whole2)),
        ("gather", lambda: c.Gather([part, B], None if at_root is None else [at_root, B], 0),
         lambda: comm.gather(part, 0, out=at_root)),
        ("scatter", lambda: c.Scatter(None if at_root is None else [at_root, B], [part, B], 0),
         lambda: comm.scatter(at_root, 0, out=part)),
        ("sendrecv", lambda: c.Sendrecv([x, B], right, 0, [o, B], left, 0),
         lambda: comm.sendrecv(x, right, o, left)),
    ]


def async_rows(comm: cupycomm.Communicator) -> List[tuple]:
    c, x = comm.mpi_comm, np.zeros(2, np.float32)
    F, S, IP = MPI.FLOAT, MPI.SUM, MPI.IN_PLACE
    return [("all_reduce async", lambda: c.Iallreduce(IP, [x, F], S).Wait(),
             lambda: comm.all_reduce(x, async_op=True).wait()),
            ("broadcast async", lambda: c.Ibcast([x, MPI.BYTE], 0).Wait(),
             lambda: comm.broadcast(x, async_op=True).wait())]


def table(title: str, rows: List[tuple], number: int, rounds: int, rank: int) -> None:
    lines = [f"| {title} | raw µs | cupycomm µs | + µs |", "|---|---|---|---|"]
    for name, raw, mine in rows:
        t = best({"raw": raw, "mine": mine}, number, rounds)
        lines.append(f"| {name} | {t['raw']:.3f} | {t['mine']:.3f} | "
                     f"{t['mine'] - t['raw']:+.3f} |")
    if rank == 0:
        print("\n".join(lines) + "\n", flush=True)


def watchdog_table(comm: cupycomm.Communicator, rounds: int) -> None:
    lines = ["| all_reduce, watchdog | on µs | off µs | on / off |", "|---|---|---|---|"]
    for mib in (1, 2, 4, 8, 16):
        x = np.zeros(mib * 2**18, np.float32)
        pairs = []
        for _ in range(rounds):
            comm.mpi_comm.Barrier()
            on = timeit.timeit(lambda: comm.all_reduce(x), number=3) / 3
            unwatch(comm.parts.tracker)
            comm.mpi_comm.Barrier()
            off = timeit.timeit(lambda: comm.all_reduce(x), number=3) / 3
            watch(comm.parts.tracker)
            pairs.append((on, off))
        on, off = (float(np.median([p[i] for p in pairs])) for i in (0, 1))
        ratio = float(np.median([a / b for a, b in pairs]))
        lines.append(f"| {mib} MiB | {on * 1e6:.0f} | {off * 1e6:.0f} | {ratio:.4f} |")
    if comm.rank == 0:
        print("\n".join(lines) + "\n", flush=True)


# -- the device path on a stand-in whose CUDA and NCCL calls cost nothing --------------------------
class ZeroCost:
    """Every CUDA and NCCL object the NCCL backend calls on its call path, as no-op calls;
    ``counted`` collects the names of the CUDA calls (not NCCL's) while counting is on."""

    def __init__(self) -> None:
        self.counting = False
        self.counted: List[str] = []
        zero = self

        def cuda(name: str) -> Callable:
            def call(*args, **kwargs):
                if zero.counting:
                    zero.counted.append(name)
            return call

        class Stream:
            ptr = 0
            wait_event = staticmethod(cuda("cudaStreamWaitEvent"))
            is_capturing = staticmethod(lambda: zero.counting and zero.counted.append(
                "cudaStreamIsCapturing") and False)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

        class Event:
            record = staticmethod(cuda("cudaEventRecord"))
            done = True

        get_device = cuda("cudaGetDevice")

        class Nccl:
            allReduce = bcast = reduce = allGather = reduceScatter = send = recv = \
                staticmethod(lambda *args: None)

        self.stream, self.event, self.nccl = Stream(), Event(), Nccl()
        self.current = lambda device_id=-1: self.stream
        self.get_device = lambda: get_device() or 0   # (device 0: the communicator's)
        self.new_event = lambda **kwargs: Event()

    def install(self, backend) -> None:
        backend._stream = self.stream
        backend._ready = backend._finished = self.event
        backend._get_device = self.get_device
        backend._current_stream = self.current
        backend._new_event = self.new_event
        backend._comm = self.nccl


def device_section(number: int, rounds: int) -> None:
    from cupycomm.testing import standin

    class Array(standin.ndarray):
        """The stand-in's array with CuPy's cost of ``data`` and ``device``: attributes read
        (C attributes in CuPy), not the objects the stand-in's properties make on each read."""
        data = device = None

    comm = cupycomm.init(MPI.COMM_SELF, device_module=standin)
    backend = comm.init_device()
    zero = ZeroCost()
    zero.install(backend)
    x = standin.zeros(2, np.float32).view(Array)
    x.data = SimpleNamespace(ptr=x.__array_interface__["data"][0])
    x.device = SimpleNamespace(id=0)
    ptr = x.data.ptr
    nccl, stream, noop = zero.nccl, zero.stream, zero.nccl.allReduce
    zero.counting = True
    comm.all_reduce(x)
    cuda_calls = list(zero.counted)
    zero.counted.clear()
    zero.stream.ptr = 0x1000   # a stream of the caller's own: it may be capturing
    comm.all_reduce(x)
    own_stream_calls = list(zero.counted)
    zero.counted.clear()
    zero.stream.ptr = 0
    comm.all_reduce(x, async_op=True).wait()
    async_calls = list(zero.counted)
    zero.counting = False
    one = best({"noop": lambda: noop(ptr, ptr, 2, 7, 0, stream.ptr)}, number, rounds)["noop"]
    t = best({"raw": lambda: nccl.allReduce(ptr, ptr, 2, 7, 0, stream.ptr),
              "mine": lambda: comm.all_reduce(x),
              "mine async": lambda: comm.all_reduce(x, async_op=True).wait()}, number, rounds)
    own = t["mine"] - t["raw"] - len(cuda_calls) * one
    own_async = t["mine async"] - t["raw"] - len(async_calls) * one
    print("| device (stand-in, CUDA and NCCL at no cost) | µs |\n|---|---|\n"
          f"| raw NcclCommunicator.allReduce (a no-op) | {t['raw']:.3f} |\n"
          f"| one no-op call (subtracted per CUDA call) | {one:.3f} |\n"
          f"| comm.all_reduce: cupycomm's own Python | {own:+.3f} |\n"
          f"| comm.all_reduce(async_op=True).wait(): cupycomm's own Python | {own_async:+.3f} |\n"
          f"| CUDA calls besides NCCL, synchronous | {len(cuda_calls)}: {', '.join(cuda_calls)} |\n"
          f"| the same on a stream of the caller's own | {len(own_stream_calls)}: "
          f"{', '.join(own_stream_calls)} |\n"
          f"| CUDA calls besides NCCL, async + wait | {len(async_calls)}: "
          f"{', '.join(async_calls)} |\n", flush=True)
    comm.parts.router.device = None   # its CUDA objects are no-ops now: nothing to free
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    a = parser.parse_args()
    comm = cupycomm.init()
    if comm.rank == 0:
        print(f"# benchmarks/callpath.py on {comm.size} rank(s): {' '.join(sys.argv)}; "
              f"best of {a.rounds} rounds x {a.number} calls, implementations interleaved\n")
    table("host, 8 B float32", host_rows(comm), a.number, a.rounds, comm.rank)
    table("async", async_rows(comm), a.number, a.rounds, comm.rank)
    if comm.size > 1:
        watchdog_table(comm, a.rounds)
    elif comm.rank == 0:
        device_section(a.number, a.rounds)
    comm.close()


if __name__ == "__main__":
    main()
