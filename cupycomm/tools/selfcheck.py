"""The self-check (``mpiexec -n 4 python -m cupycomm``): every collective end to end, compared
with NumPy, on the host (MPI) and, where every rank has a GPU, on the device (NCCL).

It prints the environment (the MPI library, the launcher of this environment, the world size,
and per rank its host, device and NCCL version or "no GPU"), then one line per collective with
a verdict and a time, then ``self-check passed`` or ``self-check FAILED``. :func:`main` returns
the exit status: 1 if any check failed on any rank, else 0.

The checks and the way their verdicts are agreed on are also those of the field-test report
(:mod:`cupycomm.tools.fieldtest`), which runs them over several dtypes.
"""
from __future__ import annotations

import dataclasses
import platform
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import numpy as np
from mpi4py import MPI

import cupycomm
from ..run import launchers
from .._bootstrap import node_name
from ..backends.nccl import library_version

__all__ = ["Verdict", "NotRun", "collective_checks", "verdicts", "mpi_environment", "gpu_name",
           "main"]

Check = Callable[[], bool]


class NotRun(Exception):
    """Raised by a check, alike on every rank, that cannot run here; its message says why."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One check's outcome, agreed by every rank.

    Attributes:
        name: the check.
        verdict: ``"pass"``, ``"fail"`` or ``"not run"``.
        detail: why it failed (the first failing rank's error) or was not run; else ``""``.
        failed_on: the ranks where it failed.
        seconds: the slowest rank's time.
    """
    name: str
    verdict: str
    detail: str
    failed_on: Tuple[int, ...]
    seconds: float


def mpi_environment() -> Dict[str, str]:
    """The MPI library (``MPI.Get_library_version``, its first line, and its kind) and the
    launcher of this environment (:func:`cupycomm.run.launchers.find`: kind, path, version).
    Not collective; the launcher is asked by running it with ``--version``.

    Example::

        mpi_environment()["mpi_kind"]   # 'mpich'
    """
    library = MPI.Get_library_version().strip()
    found: Dict[str, str] = {"mpi_library": library.splitlines()[0].strip() if library else "",
                             "mpi_kind": launchers.library_kind(library),
                             "mpi4py": sys.modules["mpi4py"].__version__}
    try:
        launcher = launchers.find()
    except FileNotFoundError as error:
        found.update(launcher="none found", launcher_path="", launcher_version=str(error))
    else:
        found.update(launcher=launcher.kind, launcher_path=launcher.executable,
                     launcher_version=launcher.version)
    return found


def gpu_name(cupy: Any, device_id: int) -> str:
    """The name CUDA gives device ``device_id`` ("stand-in" for a device module without
    ``getDeviceProperties``).

    Example::

        gpu_name(cupy, 0)   # 'NVIDIA H100 80GB HBM3'
    """
    ask = getattr(cupy.cuda.runtime, "getDeviceProperties", None)
    if ask is None:
        return "stand-in"
    name = ask(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def collective_checks(comm: cupycomm.Communicator, xp: Any,
                      dtype: Any = np.float64) -> List[Tuple[str, Check]]:
    """(name, check) pairs: each check runs one collective on ``xp`` arrays of ``dtype`` and
    says whether every result equals NumPy's (small integers: exact in every dtype).

    Example::

        for name, check in collective_checks(comm, numpy, numpy.float32):
            assert check(), name
    """
    n, r = comm.size, comm.rank
    dtype = np.dtype(dtype)
    host = np.asarray if xp is np else xp.asnumpy

    def fresh(a: np.ndarray) -> Any:   # a new array of xp (a collective may write into it)
        return xp.asarray(np.array(a))
    base = np.arange(6) % 4

    def rank_data(j: int) -> np.ndarray:
        return (base + j).astype(dtype)
    mine = rank_data(r)
    everyone = np.stack([rank_data(j) for j in range(n)])
    right, left = (r + 1) % n, (r - 1) % n
    can_order = dtype.kind != "c"   # no min/max on complex

    def same(got: Any, expected: Any, exact: bool = True) -> bool:
        if got is None or expected is None:
            return got is None and expected is None
        got = host(got)
        if got.dtype != expected.dtype or got.shape != expected.shape:
            return False
        if exact:
            return bool(np.array_equal(got, expected))
        # NCCL's average may divide before it adds: close, not always bit-exact
        return bool(np.allclose(got, expected, rtol=2e-3 if dtype == np.float16 else 1e-6))

    def all_reduce():
        return same(comm.all_reduce(fresh(mine)), everyone.sum(0, dtype=dtype))

    def average():
        expected = (everyone.sum(0, dtype=dtype) / n).astype(dtype)
        return same(comm.all_reduce(fresh(mine), op="avg"), expected, exact=False)

    def reduce():
        op, expected = ("max", everyone.max(0)) if can_order else ("sum", everyone.sum(0))
        return same(comm.reduce(fresh(mine), 0, op=op), expected if r == 0 else None)

    def broadcast():
        return same(comm.broadcast(fresh(mine), n - 1), everyone[n - 1])

    def all_gather():
        return same(comm.all_gather(fresh(mine)), everyone)

    def reduce_scatter():
        halves = np.stack([(np.arange(2 * n) % 4 + j).astype(dtype) for j in range(n)])
        return same(comm.reduce_scatter(fresh(halves[r])),
                    halves.sum(0, dtype=dtype)[2 * r:2 * r + 2])

    def all_to_all():
        parts = np.array([j + 2 * r for j in range(n)], dtype)
        return same(comm.all_to_all(fresh(parts)),
                    np.array([r + 2 * j for j in range(n)], dtype))

    def scatter():
        parts = fresh(everyone) if r == 0 else None
        return same(comm.scatter(parts, 0, out=xp.empty(6, dtype)), mine)

    def gather():
        return same(comm.gather(fresh(mine), 0), everyone if r == 0 else None)

    def sendrecv():
        return same(comm.sendrecv(fresh(mine), right, xp.empty(6, dtype), left),
                    everyone[left])

    def async_all_reduce():
        return same(comm.all_reduce(fresh(mine), async_op=True).wait(),
                    everyone.sum(0, dtype=dtype))

    checks = [("all_reduce", all_reduce), ("all_reduce avg", average), ("reduce", reduce),
              ("broadcast", broadcast), ("all_gather", all_gather),
              ("reduce_scatter", reduce_scatter), ("all_to_all", all_to_all),
              ("scatter", scatter), ("gather", gather), ("sendrecv", sendrecv),
              ("all_reduce async", async_all_reduce)]
    if dtype.kind in "biu":   # integer avg is an error, not a silent floor
        checks = [(name, check) for name, check in checks if name != "all_reduce avg"]
    return checks


def verdicts(comm: cupycomm.Communicator, checks: Sequence[Tuple[str, Check]],
             synchronize: Callable[[], None] = lambda: None) -> Iterator[Verdict]:
    """Run each check on every rank (after a barrier, then ``synchronize()`` so that device
    work is in its time) and yield the verdict every rank agrees on: failed if it failed or
    raised anywhere, not run if it raised :class:`NotRun`, else passed. An exception is a
    failed check, not the end of the run. Collective."""
    for name, check in checks:
        comm.barrier()
        start = time.perf_counter()
        try:
            outcome, detail = ("pass", "") if check() else ("fail", "a result differs from "
                                                                    "NumPy's")
            synchronize()
        except NotRun as why:
            outcome, detail = "not run", str(why)
        except Exception as error:   # reported, and the run goes on to the next check
            outcome, detail = "fail", f"{type(error).__name__}: {error}"
        seconds = comm.mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        everyone = comm.mpi_comm.allgather((outcome, detail))
        failed_on = tuple(j for j, (o, _) in enumerate(everyone) if o == "fail")
        if failed_on:
            agreed, reason = "fail", f"rank {failed_on[0]}: {everyone[failed_on[0]][1]}"
        elif any(o == "not run" for o, _ in everyone):
            agreed, reason = "not run", next(d for o, d in everyone if o == "not run")
        else:
            agreed, reason = "pass", ""
        yield Verdict(name, agreed, reason, failed_on, seconds)


def _environment(comm: cupycomm.Communicator) -> List[str]:
    device = comm.device
    if device is None:
        where = "no GPU"
    else:
        cupy = comm.xp
        where = (f"GPU {device.id} ({gpu_name(cupy, device.id)}), NCCL "
                 f"{library_version(cupy) or 'missing'}, CuPy "
                 f"{getattr(cupy, '__version__', 'stand-in')}")
    mine = f"rank {comm.rank}: host {node_name()}, local rank {comm.local_rank}, {where}"
    return comm.mpi_comm.gather(mine, root=0) or []


def _run_checks(comm: cupycomm.Communicator, backend: str, xp: Any, say) -> bool:
    synchronize = (lambda: None) if xp is np else (
        lambda: xp.cuda.get_current_stream().synchronize())
    all_passed = True
    for v in verdicts(comm, collective_checks(comm, xp), synchronize):
        verdict = ("ok" if v.verdict == "pass"
                   else f"FAILED on ranks {list(v.failed_on)}: {v.detail}")
        say(f"  {backend:6s} {v.name:18s} {v.seconds * 1e3:8.2f} ms  {verdict}")
        all_passed = all_passed and v.verdict == "pass"
    return all_passed


def main(comm: cupycomm.Communicator) -> int:
    """Run the self-check on ``comm`` (every rank) and print on rank 0; returns the exit
    status (0 passed, 1 a check failed on some rank). Collective."""
    say = (lambda line: print(line, flush=True)) if comm.rank == 0 else (lambda line: None)
    say(f"cupycomm {cupycomm.__version__} self-check: Python {platform.python_version()}, "
        f"NumPy {np.__version__}, mpi4py {sys.modules['mpi4py'].__version__}")
    if comm.rank == 0:
        mpi = mpi_environment()
        say(f"MPI: {mpi['mpi_library']}; world size {comm.size}")
        say(f"launcher: {mpi['launcher']} {mpi['launcher_path']}: {mpi['launcher_version']}")
    for line in _environment(comm):
        say("  " + line)
    passed = _run_checks(comm, "host", np, say)
    with_gpu = comm.mpi_comm.allreduce(comm.device is not None, op=MPI.LAND)
    if with_gpu:
        passed = _run_checks(comm, "device", comm.xp, say) and passed
    else:
        say("  device checks skipped: not every rank has a GPU")
    say("self-check " + ("passed" if passed else "FAILED"))
    return 0 if passed else 1
