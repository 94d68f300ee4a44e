"""Timing: one call at a time, ranks aligned by a barrier; implementations interleaved call for
call; per iteration the slowest rank; then the median over iterations.

- Host arrays (and a device stand-in): ``MPI_Barrier``, then ``time.perf_counter`` (a monotonic
  clock) around the call.
- Real GPUs: ``MPI_Barrier`` with the device idle, then CUDA events recorded on the current
  stream around the call; the call's host cost shows in the interval, because the device has
  nothing else to do until the collective is launched.

A call's time is the slowest rank's, since a collective is done when every rank is done; the
figure reported is the median of those over the iterations. ``ratio`` and ``+time`` against
another implementation are medians of the per-iteration quotients and differences, which cancel
most of what the two calls of one round share (the barrier's skew, the machine's noise).
"""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .collectives import Runner

__all__ = ["HostClock", "CudaEvents", "interleaved", "slowest_rank", "against_first"]


class HostClock:
    """Seconds one call takes on this rank, between a barrier and its return.

    Example::

        clock = HostClock(comm.mpi_comm.Barrier)
        seconds = clock(lambda: comm.all_reduce(x))
    """

    def __init__(self, barrier: Runner, settle: Optional[Runner] = None) -> None:
        self._barrier = barrier
        self._settle = settle   # after the clock stops: wait for queued device work

    def __call__(self, run: Runner) -> float:
        self._barrier()
        start = time.perf_counter()
        run()
        elapsed = time.perf_counter() - start
        if self._settle is not None:
            self._settle()
        return elapsed


class CudaEvents:
    """Seconds between CUDA events recorded on the current stream before and after one call."""

    def __init__(self, cuda: Any, barrier: Runner) -> None:
        self._barrier = barrier
        self._start = cuda.Event()
        self._end = cuda.Event()
        self._elapsed = cuda.get_elapsed_time   # milliseconds

    def __call__(self, run: Runner) -> float:
        self._barrier()
        self._start.record()
        run()
        self._end.record()
        self._end.synchronize()
        return self._elapsed(self._start, self._end) * 1e-3


def interleaved(runners: Sequence[Runner], timer: Callable[[Runner], float], warmup: int,
                iters: int) -> np.ndarray:
    """Time every runner ``iters`` times, call for call (A, B, A, B...), after ``warmup``
    untimed rounds; the order rotates each round so that no runner always goes first.
    Returns seconds, shape ``(len(runners), iters)``.

    Example::

        times = interleaved([mine, raw], HostClock(barrier), warmup=5, iters=20)
    """
    k = len(runners)
    for _ in range(warmup):
        for run in runners:
            run()
    times = np.empty((k, iters))
    for i in range(iters):
        for j in range(k):
            slot = (i + j) % k
            times[slot, i] = timer(runners[slot])
    return times


def slowest_rank(mpi_comm: MPI.Comm, times: np.ndarray) -> np.ndarray:
    """Per call, the slowest rank's time (collective: every rank passes its own times)."""
    mpi_comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times


def against_first(times: np.ndarray) -> List[Tuple[float, Optional[float], Optional[float]]]:
    """Per runner: (median seconds, ratio, added seconds) against the first runner, both paired
    call by call: the median of first / it and of first - it over the rounds, so that what the
    two calls of a round share (the barrier's skew, a busy moment of the machine) cancels.
    The first runner gets None for the last two.

    Example::

        against_first(np.array([[2., 3., 2., 9.], [1., 1., 1., 3.]]))
        # [(2.5, None, None), (1.0, 2.5, 1.5)]
    """
    medians = np.median(times, axis=1)
    out: List[Tuple[float, Optional[float], Optional[float]]] = [(float(medians[0]), None, None)]
    for j in range(1, len(times)):
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = float(np.median(times[0] / times[j]))
        out.append((float(medians[j]), ratio, float(np.median(times[0] - times[j]))))
    return out
