"""What a run reports: the rows, the nccl-tests table, the comparison summary, CSV and JSON.

A :class:`Row` is one implementation at one size in one mode. The table prints, per size and
implementation, the out-of-place and in-place columns side by side as nccl-tests does; with
``--compare`` each baseline's line also carries ``ratio`` (cupycomm's time / the baseline's) and
``+time`` (what cupycomm adds per call, in µs), both paired call by call (see
:mod:`cupycomm.bench.timing`). CSV and JSON files hold every row together with
the run's metadata (machine, versions, world size, date, command), so each row stands alone.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, cast

import numpy as np
from mpi4py import MPI

import cupycomm
from .. import _private as private

__all__ = ["Row", "OUT_OF_PLACE", "IN_PLACE", "SUMMARY_FROM", "bandwidths", "human_size",
           "load_average", "format_table", "Versus", "versus", "format_versus", "environment",
           "replacing", "write_csv", "write_json"]

OUT_OF_PLACE, IN_PLACE = "out-of-place", "in-place"
SUMMARY_FROM = 64 << 10
"""The summary's worst ratio is taken over sizes from here up (the issue's 64 KiB target)."""


@dataclass(frozen=True)
class Row:
    """One implementation at one size in one mode. ``wrong`` is None when not checked;
    ``ratio`` and ``added_us`` compare cupycomm with this implementation (None for cupycomm)."""

    collective: str
    impl: str
    mode: str
    size: int
    count: int
    dtype: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: Optional[int]
    ratio: Optional[float]
    added_us: Optional[float]


def bandwidths(size: int, seconds: float, bus_factor: float) -> tuple:
    """(algbw, busbw) in GB/s as nccl-tests computes them: size / time, times the factor.

    Example::

        bandwidths(1_000_000, 1e-3, 2 * (2 - 1) / 2)   # (1.0, 1.0)
    """
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * bus_factor


def human_size(nbytes: int) -> str:
    """'8', '64K', '2M', '1G' for exact binary multiples; plain bytes otherwise."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _time(us: float) -> str:
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def _maybe(value: Optional[float], fmt: str) -> str:
    return "" if value is None else format(value, fmt)


@dataclass(frozen=True)
class _Column:
    title: str
    unit: str
    width: int
    cell: Callable[[Row], str]
    left: bool = False

    def fit(self, text: str) -> str:
        return text.ljust(self.width) if self.left else text.rjust(self.width)


_BASE = [
    _Column("size", "(B)", 12, lambda r: str(r.size)),
    _Column("count", "(elements)", 12, lambda r: str(r.count)),
    _Column("type", "", 10, lambda r: r.dtype),
    _Column("redop", "", 6, lambda r: r.redop),
    _Column("root", "", 5, lambda r: str(r.root)),
    _Column("  impl", "", 22, lambda r: "  " + r.impl, left=True),
]
_MODE = [
    _Column("time", "(us)", 9, lambda r: _time(r.time_us)),
    _Column("algbw", "(GB/s)", 8, lambda r: f"{r.algbw:.2f}"),
    _Column("busbw", "(GB/s)", 8, lambda r: f"{r.busbw:.2f}"),
    _Column("#wrong", "", 7, lambda r: "N/A" if r.wrong is None else str(r.wrong)),
]
_VERSUS = [
    _Column("ratio", "cc/this", 8, lambda r: _maybe(r.ratio, ".3f")),
    _Column("+time", "(us)", 8, lambda r: _maybe(r.added_us, "+.2f")),
]


def format_table(rows: Sequence[Row], compare: bool) -> List[str]:
    """The nccl-tests table of one collective's rows: a line per size and implementation, the
    out-of-place then the in-place columns (blank where the collective has no such form).

    Example::

        print("\\n".join(format_table(rows_of_all_reduce, compare=True)))
    """
    mode_columns = _MODE + (_VERSUS if compare else [])
    columns = _BASE + mode_columns * 2

    def line(texts: Sequence[str]) -> str:
        return " ".join(c.fit(t) for c, t in zip(columns, texts)).rstrip()

    span = sum(c.width + 1 for c in mode_columns)
    heading = (" " * sum(c.width + 1 for c in _BASE) + OUT_OF_PLACE.center(span)
               + IN_PLACE.center(span))
    lines = ["#" + text[1:] for text in (heading.rstrip(), line([c.title for c in columns]),
                                         line([c.unit for c in columns]))]
    by_line: Dict[tuple, Dict[str, Row]] = {}
    for row in rows:
        by_line.setdefault((row.size, row.impl), {})[row.mode] = row
    for by_mode in by_line.values():
        first = next(iter(by_mode.values()))
        texts = [c.cell(first) for c in _BASE]
        for mode in (OUT_OF_PLACE, IN_PLACE):
            found = by_mode.get(mode)
            texts += [c.cell(found) if found else "-" if c is mode_columns[0] else ""
                      for c in mode_columns]
        lines.append(line(texts))
    return lines


@dataclass(frozen=True)
class Versus:
    """cupycomm against one baseline on one collective: the added µs per call at the smallest
    size that is a message (above 0 B: 8 B, or for the collectives whose buffers hold one part
    per rank, one element per part, 12 B of float32 on 3 ranks), and the worst time ratio over
    sizes >= :data:`SUMMARY_FROM` (worst of both modes)."""

    collective: str
    baseline: str
    smallest: int
    added_us: float
    worst_ratio: Optional[float]
    worst_at: str


def versus(rows: Iterable[Row], threshold: int = SUMMARY_FROM) -> List[Versus]:
    """The summary of every (collective, baseline) pair in ``rows``.

    Example::

        for v in versus(rows):
            print(v.collective, v.baseline, v.added_us, v.worst_ratio)
    """
    pairs: Dict[tuple, List[Row]] = {}
    for row in rows:
        if row.ratio is not None:
            pairs.setdefault((row.collective, row.impl), []).append(row)
    out = []
    for (collective, baseline), group in pairs.items():
        smallest = min((r.size for r in group if r.size > 0), default=0)
        added = max(cast(float, r.added_us) for r in group if r.size == smallest)   # has a ratio
        large = [r for r in group if r.size >= threshold]
        worst = max(large, key=lambda r: cast(float, r.ratio)) if large else None
        out.append(Versus(collective, baseline, smallest, added,
                          worst.ratio if worst else None,
                          f"{human_size(worst.size)} {worst.mode}" if worst else ""))
    return out


def format_versus(summary: Sequence[Versus], threshold: int = SUMMARY_FROM) -> List[str]:
    """The summary as lines for the output (empty when nothing was compared)."""
    if not summary:
        return []
    lines = [f"# cupycomm against each baseline: +time per call at the smallest message measured "
             f"(size, in bytes), worst time ratio (cupycomm / baseline) at sizes >= "
             f"{human_size(threshold)} (worst of both modes)",
             f"#{'collective':>20} {'baseline':<22} {'size':>6} {'+time(us)':>10} "
             f"{'worst ratio':>12}  at"]
    for v in summary:
        ratio = "-" if v.worst_ratio is None else f"{v.worst_ratio:.3f}"
        lines.append(f" {v.collective:>20} {v.baseline:<22} {human_size(v.smallest):>6} "
                     f"{v.added_us:>+10.2f} {ratio:>12}  {v.worst_at}".rstrip())
    return lines


# -- metadata and files ---------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages: how busy it was besides the run."""
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def source() -> str:
    """Which cupycomm ran: the git commit of its checkout, with "+changes" when its files
    differ from that commit (then the numbers are of code no commit holds); "" outside a
    checkout or without git."""
    package = os.path.dirname(os.path.abspath(cupycomm.__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", package, *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", package)
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{commit}+changes" if changed else commit


def environment(world_size: int, command: str, extra: Dict[str, str]) -> Dict[str, Any]:
    """The run's metadata: date, the command as run (see :func:`cupycomm.bench.run.
    command_line`), machine, versions, world size (plus ``extra``)."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": socket.gethostname(),
        "cpu": f"{_cpu_model()} x {os.cpu_count()}",
        "os": platform.platform(),
        "world_size": world_size,
        "load_average": load_average(),
        "python": platform.python_version(),
        "cupycomm": cupycomm.__version__,
        "cupycomm_source": source(),
        "numpy": np.__version__,
        "mpi4py": sys.modules["mpi4py"].__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        **extra,
    }


def _records(meta: Dict[str, Any], rows: Sequence[Row]) -> List[Dict[str, Any]]:
    return [{**meta, **dataclasses.asdict(row)} for row in rows]


def replacing(path: str, mode: str = "w", **kwargs: Any) -> ContextManager[Any]:
    """A file object whose text replaces ``path`` once written: the package's one writer of
    files at paths the user named (:func:`cupycomm._private.replacing`: a run that fails
    midway leaves the file it would have replaced as it was, nothing planted beside it or at
    its name is followed or stops it), with the mode a new file takes by the umask.

    Example::

        with replacing("rows.csv", newline="") as out:
            out.write("size,time\\n")
    """
    return private.replacing(path, mode, permissions=0o666, **kwargs)


def write_csv(path: str, meta: Dict[str, Any], rows: Sequence[Row]) -> None:
    """Every row, each with the metadata, as CSV."""
    records = _records(meta, rows)
    fields = list(meta) + [f.name for f in dataclasses.fields(Row)]
    with replacing(path, newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        writer.writerows(records)


def write_json(path: str, meta: Dict[str, Any], rows: Sequence[Row]) -> None:
    """Every row, each with the metadata, as a JSON list."""
    with replacing(path) as out:
        json.dump(_records(meta, rows), out, indent=1)
        out.write("\n")
