"""The run: options in; per collective, size and mode a case measured and checked; table out.

For each case every implementation is checked once on known inputs (``#wrong``, summed over
ranks), then timed interleaved with the others (see :mod:`cupycomm.bench.timing`), on inputs
loaded once before the timed calls (:func:`~cupycomm.bench.collectives.timed_input`). Rank 0
prints and writes the files; the other ranks stay quiet, except that rank 0 also shows a
progress line on stderr (:class:`Progress`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import shlex
import stat
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO

import numpy as np
from mpi4py import MPI

import cupycomm

from .. import _bootstrap, _env
from .._dtypes import DTYPES
from .cli import Options, UsageError, parse_args
from .collectives import (ROWS, Case, Collective, count_wrong, distinct_sizes, known_input,
                          timed_input)
from .libraries import (Arrays, Setup, device_setup, everywhere, host_setup,
                        load_device_module)
from .report import (IN_PLACE, OUT_OF_PLACE, Row, bandwidths, environment, format_table,
                     format_versus, load_average, versus, write_csv, write_json)
from .timing import against_first, interleaved, slowest_rank

__all__ = ["main", "Progress", "measure_collective"]


def _not_a_file(stream: TextIO) -> bool:
    """Whether ``stream`` is anything but a regular file: a terminal, or the pipe through
    which ``mpiexec`` forwards a rank's stderr to one (a rank never sees the terminal itself)."""
    try:
        return not stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):   # no file descriptor (io.StringIO...)
        return True


class Progress:
    """One line, rewritten at each step ("all_reduce 2M in-place [7/40]"), on ``stream``.

    ``enabled``: True shows it, False never (the ranks other than 0, ``--no-progress``), None
    shows it unless ``stream`` is a regular file, so that ``2> log`` gets no carriage returns
    while a terminal gets the line, through mpiexec's pipes as well.
    """

    def __init__(self, stream: TextIO, enabled: Optional[bool], total: int) -> None:
        self._stream = stream
        self._on = _not_a_file(stream) if enabled is None else enabled
        self._total = total
        self._done = 0
        self._width = 0

    def step(self, text: str) -> None:
        self._done += 1
        self._write(f"{text} [{self._done}/{self._total}]")

    def clear(self) -> None:
        self._write("")
        if self._on:
            self._stream.write("\r")
            self._stream.flush()

    def _write(self, text: str) -> None:
        if self._on:
            self._stream.write("\r" + text.ljust(self._width))
            self._stream.flush()
            self._width = len(text)


@contextlib.contextmanager
def _data_movement(module: Any, off: bool) -> Iterator[None]:
    """With ``off``, the stand-in's ``NO_WORK`` is set for the run and restored after it."""
    if not off:
        yield
        return
    if not hasattr(module, "NO_WORK"):
        raise UsageError(f"--no-work: {module.__name__} has no NO_WORK switch (is it a stand-in?)")
    saved = module.NO_WORK
    module.NO_WORK = True
    try:
        yield
    finally:
        module.NO_WORK = saved


def _setup(comm: Any, opts: Options, module: Any) -> Setup:
    if opts.root >= comm.size:
        raise UsageError(f"--root {opts.root} is not a rank of {comm.size}")
    backend = opts.backend
    if backend == "auto":
        backend = "device" if everywhere(comm, comm.device is not None) else "host"
    if backend == "host":
        return host_setup(comm, opts.compare)
    if opts.backend == "device" and not everywhere(comm, comm.device is not None):
        raise UsageError("--backend device: not every rank has a GPU (CuPy sees none); use "
                         "--backend host, or --device-module cupycomm.testing.standin to time the "
                         "device path on the host-memory stand-in")
    if DTYPES[opts.dtype].nccl_type is None and any(ROWS[n].reduces for n in opts.collectives):
        raise UsageError(f"NCCL has no {opts.dtype} to reduce: choose another --dtype, or only "
                         f"collectives that move data")
    stand_in = module is not None and module.__name__ != "cupy"
    return device_setup(comm, opts.compare, stand_in)


def _case(row: Collective, nbytes: int, in_place: bool, opts: Options, comm: Any,
          arrays: Arrays) -> Case:
    count, shown, x_len, y_len = row.layout(nbytes, opts.dtype.itemsize, comm.size)
    x = arrays.empty(x_len, opts.dtype)
    y = x if in_place else arrays.empty(y_len, opts.dtype)
    return Case(row.name, comm.rank, comm.size, opts.root, opts.op, opts.dtype, count, shown,
                in_place, opts.async_op, x, y)


def _wrong_elements(run: Any, case: Case, expected: Optional[np.ndarray], mine: np.ndarray,
                    arrays: Arrays) -> int:
    """Run once on known inputs (the output zeroed first) and count the wrong elements."""
    arrays.load(case.x, mine)
    if not case.in_place:
        arrays.load(case.y, np.zeros(case.y.size, case.dtype))
    run()
    arrays.settle()
    return 0 if expected is None else count_wrong(arrays.host(case.y), expected)


def _measure(row: Collective, case: Case, setup: Setup, opts: Options, comm: Any,
             notes: Dict[str, None]) -> List[Row]:
    impls, runners = [], []
    for impl in setup.impls:
        run = impl.runner(row, case)
        if isinstance(run, str):
            notes[f"{impl.label}: {run}"] = None
        else:
            impls.append(impl)
            runners.append(run)
    inputs = functools.lru_cache(maxsize=None)(
        lambda j: known_input(j, case.x.size, case.dtype))
    wrong: List[Optional[int]] = [None] * len(runners)
    if opts.check:
        expected = row.expected(inputs, case)
        counts = np.array([_wrong_elements(run, case, expected, inputs(case.rank), setup.arrays)
                           for run in runners], dtype=np.int64)
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
        wrong = [int(n) for n in counts]
    # Timed on known values (never on garbage, nor on values the calls keep growing), loaded
    # here once: nothing is added inside the timed region.
    setup.arrays.load(case.x, timed_input(row, case, inputs(case.rank)))
    times = slowest_rank(comm.mpi_comm,
                         interleaved(runners, setup.timer, opts.warmup, opts.iters))
    factor = row.bus_factor(case.ranks)
    rows = []
    for impl, n_wrong, (seconds, ratio, added) in zip(impls, wrong, against_first(times)):
        algbw, busbw = bandwidths(case.nbytes, seconds, factor)
        rows.append(Row(row.name, impl.label, IN_PLACE if case.in_place else OUT_OF_PLACE,
                        case.nbytes, case.unit, str(case.dtype),
                        case.op if row.reduces else "none", case.root if row.rooted else -1,
                        seconds * 1e6, algbw, busbw, n_wrong, ratio,
                        None if added is None else added * 1e6))
    return rows


def _header(meta: Dict[str, Any], setup: Setup, opts: Options) -> List[str]:
    lines = [f"# cupycomm.bench: {meta['command']}",
             f"# {meta['date']} on {meta['machine']} ({meta['cpu']}; {meta['os']}); load "
             f"average {meta['load_average']}",
             f"# cupycomm {meta['cupycomm']}"
             + (f" (source {meta['cupycomm_source']})" if meta["cupycomm_source"] else "")
             + f", Python {meta['python']}, NumPy {meta['numpy']}, "
             f"mpi4py {meta['mpi4py']}, {meta['mpi_library']}"
             + "".join(f", {k} {v}" for k, v in setup.versions.items()),
             f"# {meta['world_size']} ranks, backend {setup.backend}, "
             f"{'async_op=True + wait, ' if opts.async_op else ''}time per call: "
             f"{setup.timing}; median over {opts.iters} calls of the slowest rank, after "
             f"{opts.warmup} warm-up calls",
             f"# implementations: {', '.join(i.label for i in setup.impls)}"
             + ("; interleaved call for call" if len(setup.impls) > 1 else "")]
    if len(setup.impls) > 1:
        lines.append("# ratio, +time: cupycomm against that implementation, the medians over "
                     "rounds of the quotient and the difference of the two calls of a round")
    if any(impl.stand_in for impl in setup.impls):
        work = ("NO_WORK=True: no data moves, only the calls' own cost is timed"
                if opts.no_work else "data moves through MPI in host memory")
        lines.append(f"# STAND-IN: device rows run on {meta.get('device_module')} (host "
                     f"memory, {work}); they are not GPU numbers")
    if any(ROWS[name].reduces and True in ROWS[name].modes for name in opts.collectives):
        lines.append("# in-place reductions are timed on the op's identity (0 for sum and avg, 1 "
                     "for prod), which repeated calls leave as it is (no overflow to inf)")
    if not opts.check:
        lines.append("# #wrong: N/A, results not checked")
    return lines + [f"# note: {note}" for note in setup.notes]


def _say(rank: int) -> Any:
    if rank == 0:
        return lambda line="": print(line, flush=True)
    return lambda line="": None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark on every rank of MPI_COMM_WORLD; returns the exit status (0 passed,
    1 some result was wrong, 2 a bad command line).

    Example::

        main(["all_reduce", "-b", "8", "-e", "1K", "--compare"])   # under mpiexec -n 2
    """
    command = command_line(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    world = _bootstrap.world()
    rank = world.Get_rank()
    try:
        opts = parse_args(argv, rank)
        module = load_device_module(opts.device_module) if opts.device_module else None
        with _data_movement(module, opts.no_work):
            return _run(world, command, opts, module, _say(rank))
    except (UsageError, FileNotFoundError) as error:   # alike on every rank: all stop
        if rank == 0:
            print(f"python -m cupycomm.bench: error: {error}", file=sys.stderr, flush=True)
        return 2


def command_line(argv: Optional[Sequence[str]]) -> str:
    """The command that ran, as exactly as a rank can know it: the environment variable
    CUPYCOMM_BENCH_COMMAND where a script sets it (``benchmarks/run_matrix`` does: the ranks
    cannot see the launcher's own command line); else this rank's Python command line (its
    interpreter, ``-m cupycomm.bench`` and the arguments as given); else, for ``main(argv)``
    called from Python, that call."""
    exact = _env.read("CUPYCOMM_BENCH_COMMAND")
    if exact:
        return exact
    if argv is not None:
        return f"cupycomm.bench.main({list(argv)!r})"
    python = getattr(sys, "orig_argv", None) or [sys.executable, "-m", "cupycomm.bench",
                                                 *sys.argv[1:]]
    return shlex.join(python)


def _run(world: MPI.Comm, command: str, opts: Options, module: Any, say: Any) -> int:
    comm = cupycomm.init(world, device_module=module)
    setup: Optional[Setup] = None
    try:
        setup = _setup(comm, opts, module)
        meta = environment(comm.size, command, {"backend": setup.backend, **setup.versions})
        for line in _header(meta, setup, opts):
            say(line)
        progress = Progress(sys.stderr, opts.progress if comm.rank == 0 else False, sum(
            len(_sizes(ROWS[name], opts, comm.size)) * len(ROWS[name].modes)
            for name in opts.collectives))
        rows: List[Row] = []
        for name in opts.collectives:
            rows += measure_collective(ROWS[name], opts, comm, setup, progress, say)
        return _finish(comm, rows, meta, setup, opts, say)
    finally:
        if setup is not None:
            setup.close()
        comm.close()


def _sizes(row: Collective, opts: Options, ranks: int) -> List[int]:
    return distinct_sizes(row, opts.sizes, opts.dtype.itemsize, ranks)


def measure_collective(row: Collective, opts: Options, comm: Any, setup: Setup,
                       progress: Progress, say: Any) -> List[Row]:
    """Every size and mode of one collective, measured and checked, then its table (through
    ``say``); returns the rows. Collective. The field-test report calls it too."""
    notes: Dict[str, None] = {}
    rows: List[Row] = []
    for nbytes in _sizes(row, opts, comm.size):
        for in_place in row.modes:
            case = _case(row, nbytes, in_place, opts, comm, setup.arrays)
            progress.step(f"cupycomm.bench: {row.name} {case.nbytes} B "
                          f"{IN_PLACE if in_place else OUT_OF_PLACE}")
            rows += _measure(row, case, setup, opts, comm, notes)
    progress.clear()
    say()
    say(f"# Collective test: {row.name}")
    for line in format_table(rows, compare=len(setup.impls) > 1):
        say(line)
    for note in notes:
        say(f"# note: {note}")
    return rows


def _finish(comm: Any, rows: List[Row], meta: Dict[str, Any], setup: Setup, opts: Options,
            say: Any) -> int:
    say()
    for line in format_versus(versus(rows)):
        say(line)
    checked = [r.wrong for r in rows if r.wrong is not None]
    total_wrong = sum(checked)
    say(f"# #wrong in all: {total_wrong if checked else 'N/A (not checked)'}")
    say(f"# load average at the end: {load_average()}")
    if comm.rank == 0:
        if opts.csv:
            write_csv(opts.csv, meta, rows)
        if opts.json:
            write_json(opts.json, meta, rows)
        if opts.plot:
            from .plot import plot
            plot(opts.plot, rows, f"cupycomm.bench: {meta['world_size']} ranks, {setup.backend}, "
                                  f"{opts.dtype} {opts.op}; {meta['machine']}, {meta['date']}")
        for path in (opts.csv, opts.json, opts.plot):
            if path:
                say(f"# wrote {path}")
    return 1 if total_wrong else 0
