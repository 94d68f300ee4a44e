"""Self-check: ``mpiexec -n 4 python -m cupycomm``.

Prints the environment (MPI library, world size, and per rank its host, device and NCCL
version or "no GPU"), then runs every collective end to end on each available backend, host
(MPI) always and device (NCCL) where every rank has a GPU, and prints one line per
collective with a verdict and a time. Exits 1 if any check failed on any rank.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

import cupycomm
from cupycomm._bootstrap import node_name
from cupycomm.backends.nccl import library_version


def _environment(comm: cupycomm.Communicator) -> List[str]:
    device = comm.device
    if device is None:
        where = "no GPU"
    else:
        cupy = comm.xp
        gpu_name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode()
        where = (f"GPU {device.id} ({gpu_name}), NCCL {library_version(cupy) or 'missing'}, "
                 f"CuPy {cupy.__version__}")
    mine = f"rank {comm.rank}: host {node_name()}, local rank {comm.local_rank}, {where}"
    return comm.mpi_comm.gather(mine, root=0) or []


def _checks(comm: cupycomm.Communicator, xp: Any) -> List[Tuple[str, Callable[[], bool]]]:
    """(name, check) pairs; each check runs one collective and compares with NumPy."""
    n, r = comm.size, comm.rank
    host = np.asarray if xp is np else xp.asnumpy
    base = np.arange(6, dtype=np.float64)
    mine = base + 10 * r
    everyone = np.stack([base + 10 * j for j in range(n)])
    right, left = (r + 1) % n, (r - 1) % n

    def same(got, expected) -> bool:
        return got is None and expected is None or np.array_equal(host(got), expected)

    def all_reduce():
        return same(comm.all_reduce(xp.array(mine)), everyone.sum(0))

    def average():
        return same(comm.all_reduce(xp.array(mine), op="avg"), everyone.mean(0))

    def reduce():
        return same(comm.reduce(xp.array(mine), 0, op="max"),
                    everyone.max(0) if r == 0 else None)

    def broadcast():
        return same(comm.broadcast(xp.array(mine), n - 1), everyone[n - 1])

    def all_gather():
        return same(comm.all_gather(xp.array(mine)), everyone)

    def reduce_scatter():
        whole = np.arange(2 * n, dtype=np.float64) + r
        total = sum(np.arange(2 * n, dtype=np.float64) + j for j in range(n))
        return same(comm.reduce_scatter(xp.array(whole)), total[2 * r:2 * r + 2])

    def all_to_all():
        parts = np.arange(n, dtype=np.float64) + 100 * r
        return same(comm.all_to_all(xp.array(parts)), np.arange(n) * 100.0 + r)

    def scatter():
        parts = xp.array(everyone) if r == 0 else None
        return same(comm.scatter(parts, 0, out=xp.empty(6)), mine)

    def gather():
        return same(comm.gather(xp.array(mine), 0), everyone if r == 0 else None)

    def sendrecv():
        return same(comm.sendrecv(xp.array(mine), right, xp.empty(6), left),
                    everyone[left])

    def async_all_reduce():
        return same(comm.all_reduce(xp.array(mine), async_op=True).wait(), everyone.sum(0))

    return [("all_reduce", all_reduce), ("all_reduce avg", average), ("reduce", reduce),
            ("broadcast", broadcast), ("all_gather", all_gather),
            ("reduce_scatter", reduce_scatter), ("all_to_all", all_to_all),
            ("scatter", scatter), ("gather", gather), ("sendrecv", sendrecv),
            ("all_reduce async", async_all_reduce)]


def _run_checks(comm: cupycomm.Communicator, backend: str, xp: Any, say) -> bool:
    all_passed = True
    for name, check in _checks(comm, xp):
        comm.barrier()
        start = time.perf_counter()
        try:
            passed, error = check(), ""
            if xp is not np:
                xp.cuda.get_current_stream().synchronize()
        except Exception as exc:   # report it and go on: the verdict says which check failed
            passed, error = False, f": {type(exc).__name__}: {exc}"
        elapsed = comm.mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        failed_on = [j for j, ok in enumerate(comm.mpi_comm.allgather(passed)) if not ok]
        verdict = "ok" if not failed_on else f"FAILED on ranks {failed_on}{error}"
        say(f"  {backend:6s} {name:18s} {elapsed * 1e3:8.2f} ms  {verdict}")
        all_passed = all_passed and not failed_on
    return all_passed


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupycomm",
                                     description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    comm = cupycomm.init()
    say = (lambda line: print(line, flush=True)) if comm.rank == 0 else (lambda line: None)
    say(f"cupycomm {cupycomm.__version__} self-check: Python {platform.python_version()}, "
        f"NumPy {np.__version__}, mpi4py {sys.modules['mpi4py'].__version__}")
    say(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}; world size {comm.size}")
    for line in _environment(comm):
        say("  " + line)
    passed = _run_checks(comm, "host", np, say)
    with_gpu = comm.mpi_comm.allreduce(comm.device is not None, op=MPI.LAND)
    if with_gpu:
        passed = _run_checks(comm, "device", comm.xp, say) and passed
    else:
        say("  device checks skipped: not every rank has a GPU")
    say("self-check " + ("passed" if passed else "FAILED"))
    comm.close()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
