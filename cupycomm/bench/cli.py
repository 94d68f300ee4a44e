"""The command line of ``python -m cupycomm.bench``: nccl-tests sizes, flags and their checks."""
from __future__ import annotations

import argparse
import importlib.util
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from .._dtypes import DTYPES, ReduceOp
from .collectives import TABLE

__all__ = ["Options", "UsageError", "parse_size", "size_series", "parse_args"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"(\d+)\s*([KMG]?)(I?B)?", re.IGNORECASE)
# nccl-tests' type names first (its "float" is 32-bit), then any NumPy name of a table dtype.
_NCCL_TEST_TYPES = {"half": "float16", "float": "float32", "double": "float64"}


class UsageError(ValueError):
    """A bad command line; the same on every rank, so every rank stops alike."""


def parse_size(text: str) -> int:
    """Bytes from an nccl-tests size: binary K, M, G suffixes, optionally followed by B or iB.

    Example::

        parse_size("8"), parse_size("1K"), parse_size("64M")   # 8, 1024, 67108864
    """
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise UsageError(f"size {text!r} is not a number of bytes such as 8, 1K, 64M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def size_series(begin: int, end: int, factor: int) -> List[int]:
    """The sizes nccl-tests runs for ``-b begin -e end -f factor``: begin, begin*factor, ...
    up to and including ``end`` (a size past ``end`` is not run, as in nccl-tests).

    Example::

        size_series(8, 64 << 20, 4)[:4]   # [8, 32, 128, 512]; the last is 32M
    """
    if begin < 0 or end < begin:
        raise UsageError(f"sizes: need 0 <= minbytes <= maxbytes, got -b {begin} -e {end}")
    if begin == end:
        return [begin]
    if factor < 2 or begin == 0:
        raise UsageError(f"sizes: -f must be >= 2 and -b > 0 to step from {begin} to {end}, "
                         f"got -f {factor}")
    sizes = []
    size = begin
    while size <= end:
        sizes.append(size)
        size *= factor
    return sizes


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _dtype(text: str) -> np.dtype:
    dtype: Optional[np.dtype]
    try:
        dtype = np.dtype(_NCCL_TEST_TYPES.get(text, text))
    except TypeError:
        dtype = None
    if dtype is None or dtype not in DTYPES:
        names = ", ".join(str(d) for d in DTYPES)
        raise argparse.ArgumentTypeError(f"dtype {text!r} is not one of cupycomm's ({names}; "
                                         f"nccl-tests' half, float, double too)")
    return dtype


@dataclass(frozen=True)
class Options:
    """What to run, parsed from the command line (see ``python -m cupycomm.bench --help``)."""

    collectives: List[str]
    sizes: List[int]
    dtype: np.dtype
    op: str
    root: int
    iters: int
    warmup: int
    backend: str
    async_op: bool
    check: bool
    compare: bool
    device_module: Optional[str]
    no_work: bool
    csv: Optional[str]
    json: Optional[str]
    plot: Optional[str]
    progress: Optional[bool] = None


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing on every rank; help prints on rank 0 only."""

    def __init__(self, rank: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self._rank = rank

    def error(self, message: str):
        raise UsageError(message)

    def print_help(self, file=None) -> None:
        if self._rank == 0:
            super().print_help(file)


def _parser(rank: int) -> argparse.ArgumentParser:
    names = [row.name for row in TABLE]
    p = _Parser(rank, prog="python -m cupycomm.bench",
                description="nccl-tests-style tables for cupycomm's collectives, optionally side "
                            "by side with the raw libraries (run under mpiexec -n N).")
    p.add_argument("collectives", nargs="*", metavar="collective",
                   help=f"any of {', '.join(names)} (default: all)")
    p.add_argument("-b", "--minbytes", type=_size, default=parse_size("8"),
                   help="smallest size, e.g. 8, 1K, 64M (default 8)")
    p.add_argument("-e", "--maxbytes", type=_size, default=parse_size("64M"),
                   help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4,
                   help="multiply the size by this from one size to the next (default 4)")
    p.add_argument("-d", "--dtype", type=_dtype, default=np.dtype(np.float32),
                   help="element type (default float32)")
    p.add_argument("-o", "--op", choices=[op.value for op in ReduceOp], default="sum",
                   help="reduction op of the reducing collectives (default sum)")
    p.add_argument("-r", "--root", type=int, default=0,
                   help="root of broadcast, reduce, gather, scatter (default 0)")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="timed calls per size and implementation (default 20)")
    p.add_argument("-w", "--warmup-iters", type=int, default=5,
                   help="untimed calls first (default 5)")
    p.add_argument("--backend", choices=["host", "device", "auto"], default="auto",
                   help="host: NumPy arrays over MPI; device: CuPy arrays over NCCL; auto: "
                        "device where every rank has a GPU (default)")
    p.add_argument("--async", dest="async_op", action="store_true",
                   help="call with async_op=True and wait for the Work (raw MPI: I-calls)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="check every size against NumPy and count #wrong (default on)")
    p.add_argument("--compare", action="store_true",
                   help="time the raw libraries too, interleaved call for call: mpi4py on "
                        "the host; NcclCommunicator, cupyx.distributed, torch.distributed on "
                        "the device")
    p.add_argument("--device-module", metavar="MODULE",
                   help="the device module cupycomm.init(device_module=) gets: a module name "
                        "such as cupycomm.testing.standin (a host-memory stand-in: rows are "
                        "labelled stand-in, never GPU numbers) or a .py file")
    p.add_argument("--no-work", action="store_true",
                   help="with a stand-in device module: set its NO_WORK, so that only the "
                        "Python cost of the calls is timed (implies --no-check)")
    p.add_argument("--csv", metavar="FILE", help="write every row to a CSV file")
    p.add_argument("--json", metavar="FILE", help="write every row to a JSON file")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw time and busbw against size (needs matplotlib: the plot extra)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress line on rank 0's stderr (default: unless stderr is a "
                        "regular file; under mpiexec a rank's stderr is a pipe, so say "
                        "--no-progress when the launcher's stderr goes to a file)")
    return p


def parse_args(argv: Optional[Sequence[str]], rank: int = 0) -> Options:
    """Options from ``argv`` (default ``sys.argv[1:]``); raises :class:`UsageError`.

    Example::

        parse_args(["all_reduce", "-b", "8", "-e", "1K", "--compare"]).sizes   # [8, 32, 128, 512]
    """
    a = _parser(rank).parse_args(argv)
    names = {row.name for row in TABLE}
    unknown = [name for name in a.collectives if name not in names]
    if unknown:
        raise UsageError(f"unknown collective {unknown[0]!r}; choose from "
                         f"{', '.join(row.name for row in TABLE)}")
    if a.iters < 1 or a.warmup_iters < 0:
        raise UsageError(f"need --iters >= 1 and --warmup-iters >= 0, got {a.iters} and "
                         f"{a.warmup_iters}")
    if a.root < 0:
        raise UsageError(f"--root must be a rank, got {a.root}")
    if a.no_work and a.device_module is None:
        raise UsageError("--no-work applies to a stand-in device module: add --device-module "
                         "cupycomm.testing.standin")
    if a.device_module is not None and a.backend == "host":
        raise UsageError("--device-module is for the device backend; drop --backend host")
    row = DTYPES[a.dtype]
    if a.op not in {op.value for op in row.ops}:
        raise UsageError(f"--op {a.op} is not defined for {a.dtype} ({row.why_not})")
    if a.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'cupycomm[plot]'")
    return Options(collectives=list(dict.fromkeys(a.collectives)) or [r.name for r in TABLE],
                   sizes=size_series(a.minbytes, a.maxbytes, a.stepfactor), dtype=a.dtype,
                   op=a.op, root=a.root, iters=a.iters, warmup=a.warmup_iters,
                   backend="device" if a.device_module else a.backend,
                   async_op=a.async_op, check=a.check and not a.no_work, compare=a.compare,
                   device_module=a.device_module, no_work=a.no_work, csv=a.csv, json=a.json,
                   plot=a.plot, progress=a.progress)
