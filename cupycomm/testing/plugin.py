"""pytest plugin for suites run under ``mpiexec -n N python -m pytest`` (enabled by the
``pytest11`` entry point; ``-p no:cupycomm`` turns it off).

With more than one rank, the ranks act as one session (see ``_session``): rank 0 prints the
one report, a test fails if it fails on any rank, skips and collection agree, a hanging test
ends the job at its timeout with every rank's stack, and every rank exits with the job's
status. In one process the plugin adds a header line, the markers and the fixtures; in one
that no launcher started it also runs the tests meant for more ranks in ``mpiexec`` jobs of
their own (isolated mode, see ``_isolated``). Its markers (``mpi``, ``mpi_timeout``,
``gpu``), options and fixtures (``mpi_comm``, ``cupycomm_comm``, made before any fixture of
the test, since making one is collective) are tabled in docs/guide/testing.md.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy
import pytest
from mpi4py import MPI

import cupycomm
from cupycomm import _bootstrap
from cupycomm.run import launchers
from cupycomm.backends.nccl import library_version

from . import _isolated, _outcomes
from ._session import TIMEOUT, MpiSession

_FAILED = pytest.StashKey[bool]()  # on an item: its setup or call failed on this rank
_FRESH = pytest.StashKey[Dict[str, Any]]()  # on an item: its communicators not yet handed out
_KEPT = pytest.StashKey[List[Any]]()  # communicators of failed tests, never freed
_DEFAULT = pytest.StashKey[float]()  # the session's timeout per test
_SIZES = pytest.StashKey[Optional[List[int]]]()  # isolated mode's mpi_sizes; None: not on
_JOB = pytest.StashKey[Optional[Path]]()  # in a job of isolated mode: its directory
_DEFAULT_TIMEOUT = "60"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cupycomm", "tests under mpiexec (cupycomm.testing)")
    group.addoption("--mpi-timeout", type=float, dest="mpi_timeout", metavar="SECONDS",
                    help="end the MPI job when a test (or the start, the collection or the "
                         "end of the session) takes longer, after printing every rank's stack "
                         f"(default: the mpi_timeout ini value, else {_DEFAULT_TIMEOUT}; "
                         "0: no timeout)")
    parser.addini("mpi_timeout", "seconds a test may take under mpiexec (0: no timeout)",
                  default=_DEFAULT_TIMEOUT)
    group.addoption("--mpi-isolated", choices=("yes", "no"), dest="mpi_isolated",
                    help="in one process, run the tests meant for more ranks (mpi(n=...), "
                         "the ini value mpi_sizes) in mpiexec jobs of their own, one job per "
                         "world size (default: the mpi_isolated ini value, else yes; no: "
                         "skip them, as under mpiexec with another size)")
    parser.addini("mpi_isolated", "yes: run the tests meant for more ranks in mpiexec jobs "
                                  "when pytest runs in one process; no: skip them",
                  default="yes")
    parser.addini("mpi_sizes", "the world sizes at which a plain pytest runs each test that "
                               "has no mpi(n=...) marker, within its min_size and max_size "
                               "(sizes other than 1 in mpiexec jobs)", type="args",
                  default=["1"])
    group.addoption("--mpi-job", dest="mpi_job", metavar="DIRECTORY",
                    help="(internal) run as a job of isolated mode, whose tests and reports "
                         "are in DIRECTORY")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Only rank 0 writes the JUnit XML file (every rank would write the same one)."""
    if _bootstrap.world().Get_rank() != 0:
        config.option.xmlpath = None


@pytest.hookimpl(trylast=True)  # after the terminal reporter and the cache exist
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped where CuPy sees none")
    config.addinivalue_line("markers", "mpi(n=None, min_size=1, max_size=None): runs on n "
                                       "MPI ranks (a number or a list) or on min_size to "
                                       "max_size; skipped on every rank otherwise; in one "
                                       "process, run in an mpiexec job of each size n")
    config.addinivalue_line("markers", "mpi_timeout(seconds): this test's timeout under "
                                       "mpiexec (0: none)")
    config.stash[_KEPT] = []
    value = config.getoption("mpi_timeout")
    timeout = _seconds(config.getini("mpi_timeout") if value is None else value, "mpi_timeout")
    config.stash[_DEFAULT] = timeout
    job = config.getoption("mpi_job")
    config.stash[_JOB] = None if job is None else Path(job)
    config.stash[_SIZES] = _isolated_sizes(config)
    if config.stash[_JOB] is not None and _bootstrap.world().Get_rank() == 0:
        config.pluginmanager.register(_isolated.JobReports(config, config.stash[_JOB]),
                                      "cupycomm-job-reports")
    elif config.stash[_SIZES] is not None:
        config.pluginmanager.register(_isolated.IsolatedJobs(config, timeout),
                                      "cupycomm-isolated-jobs")
    if _bootstrap.world().Get_size() > 1:
        config.pluginmanager.register(MpiSession(config, timeout), "cupycomm-mpi-session")


def _isolated_sizes(config: pytest.Config) -> Optional[List[int]]:
    """The ini value mpi_sizes where tests get an id per world size: in one process that no
    launcher started, with isolated mode on, and in its jobs (whose tests must have the same
    ids); else None."""
    if config.stash[_JOB] is None:
        value = config.getoption("mpi_isolated") or config.getini("mpi_isolated")
        if value not in ("yes", "no"):
            raise pytest.UsageError(f"mpi_isolated must be yes or no, got {value!r}")
        # A launcher's ranks run the tests they were given, at any size (mpiexec -n 1 too).
        if value == "no" or launchers.started_by_a_launcher(os.environ):
            return None
    sizes = config.getini("mpi_sizes")
    try:
        numbers = [int(size) for size in sizes]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        raise pytest.UsageError(f"mpi_sizes must be numbers of ranks >= 1, got {sizes!r}")
    return sorted(set(numbers))


@pytest.hookimpl(trylast=True)  # the size last in the id: test_x[float32-mpi3]
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """In isolated mode, a test per world size it runs at (other than 1 alone)."""
    sizes = metafunc.config.stash[_SIZES]
    if sizes is None:
        return
    try:
        low, high, exact = _sizes(metafunc.definition)
    except pytest.UsageError:
        return  # a usage error of the session, raised once the tests are collected
    _isolated.parametrize(metafunc, exact or [n for n in sizes if low <= n and
                                              (high is None or n <= high)] or [1])


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    """One line on the MPI world and the libraries (rank 0 only; CUDA is not touched)."""
    if _bootstrap.world().Get_rank() != 0:
        return None
    import mpi4py
    vendor, version = MPI.get_vendor()
    size = _bootstrap.world().Get_size()
    parts = [f"{size} MPI rank{'s' if size > 1 else ''} ({vendor} "
             f"{'.'.join(map(str, version))}, MPI {'.'.join(map(str, MPI.Get_version()))})",
             f"mpi4py {mpi4py.__version__}", f"NumPy {numpy.__version__}", _cupy_versions(),
             f"Python {platform.python_version()}"]
    timeout = f"mpi_timeout {config.stash[_DEFAULT]:g} s"
    if size == 1:
        timeout += " (not enforced in one process)"
    sizes = config.stash[_SIZES]
    if sizes is not None and sizes != [1] and config.stash[_JOB] is None:
        timeout += (f"; mpi_sizes {' '.join(map(str, sizes))} (past 1 in mpiexec jobs: "
                    f"isolated mode)")
    return f"cupycomm.testing: {', '.join(parts)}; {timeout}"


def _cupy_versions() -> str:
    cupy = _bootstrap.import_cupy()
    if cupy is None:
        return "no CuPy"
    version = library_version(cupy)
    return f"CuPy {cupy.__version__} " + (f"with NCCL {version}" if version else "without NCCL")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """In a job of isolated mode keep its tests; in one process in isolated mode, put the
    tests of each size together. Check the markers' arguments once, skip the tests that need
    another number of ranks (on every rank alike), and give each test its timeout."""
    if config.stash[_JOB] is not None:
        _isolated.keep_listed(config, items, config.stash[_JOB] / _isolated.LISTED)
    elif config.stash[_SIZES] is not None:
        _isolated.by_size(items)
    world = _bootstrap.world().Get_size()
    for item in items:
        low, high, exact = _sizes(item)
        size = _isolated.size_of(item) if config.stash[_SIZES] is not None else world
        if exact is not None and size not in exact:
            wanted = " or ".join(map(str, exact))
            item.add_marker(pytest.mark.skip(
                reason=f"runs on {wanted} MPI ranks, has {size} (mpiexec -n {exact[0]} ...)"))
        elif size < low or (high is not None and size > high):
            wanted = f"at least {low}" if high is None else f"{low} to {high}"
            item.add_marker(pytest.mark.skip(
                reason=f"needs {wanted} MPI ranks, has {size} (mpiexec -n {low} ...)"))
        mark = item.get_closest_marker("mpi_timeout")
        item.stash[TIMEOUT] = (config.stash[_DEFAULT] if mark is None else
                               _seconds(_one_arg(item, mark, "seconds"), f"{item.nodeid}: "
                                                                          "mpi_timeout"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line of why tests skipped (rank 0; ``-rs`` lists each test)."""
    skipped = [report for report in terminalreporter.stats.get("skipped", ())
               if isinstance(getattr(report, "longrepr", None), tuple)]
    if skipped and _bootstrap.world().Get_rank() == 0:
        terminalreporter.write_line(f"cupycomm.testing: "
                                    f"{_outcomes.why_skipped([r.longrepr[2] for r in skipped])}"
                                    f" (-rs lists each)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[Any]:
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


# The per-test communicators: how each is made and freed.
_MAKERS: Dict[str, Callable[[], Any]] = {
    "mpi_comm": lambda: _bootstrap.world().Dup(),
    "cupycomm_comm": lambda: cupycomm.init(_bootstrap.world()),
}


def _free(comm: Any) -> None:
    (comm.close if isinstance(comm, cupycomm.Communicator) else comm.Free)()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Make the test's communicators now, on every rank, before its fixtures run: one that
    skips or fails on some ranks would otherwise keep the others in a collective forever.
    (With several ranks this runs after the ranks agreed on the test's marks.)"""
    names = [name for name in _MAKERS if name in getattr(item, "fixturenames", ())]
    if names:
        item.stash[_FRESH] = {name: _MAKERS[name]() for name in names}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Release the communicators that no fixture took (a fixture before it failed)."""
    try:
        return (yield)
    finally:
        for comm in item.stash.get(_FRESH, {}).values():
            _release(item, comm, lambda comm=comm: _free(comm))
        item.stash[_FRESH] = {}


def _fresh(request: pytest.FixtureRequest, name: str) -> Any:
    """The communicator made for this test, or a new one (for a test that asked for the
    fixture by name at run time; making it then is collective)."""
    made = request.node.stash.get(_FRESH, {})
    return made.pop(name) if name in made else _MAKERS[name]()


@pytest.fixture
def mpi_comm(request: pytest.FixtureRequest) -> Iterator[MPI.Comm]:
    """A duplicate of COMM_WORLD for this test alone, so that a test that failed half way
    cannot shift the next test's messages or collectives.

    Example::

        def test_sum(mpi_comm):
            assert mpi_comm.allreduce(1) == mpi_comm.Get_size()
    """
    comm = _fresh(request, "mpi_comm")
    yield comm
    release(request, comm, comm.Free)


@pytest.fixture
def cupycomm_comm(request: pytest.FixtureRequest) -> Iterator[cupycomm.Communicator]:
    """A cupycomm communicator over every rank for this test alone (closed after it).

    Example::

        def test_all_reduce(cupycomm_comm):
            x = numpy.ones(3)
            assert (cupycomm_comm.all_reduce(x) == cupycomm_comm.size).all()
    """
    comm = _fresh(request, "cupycomm_comm")
    yield comm
    release(request, comm, comm.close)


def release(request: pytest.FixtureRequest, comm: Any, free: Any) -> None:
    """End of a per-test communicator fixture: ``free()`` it, unless the test failed.

    After a failure, messages may still be in flight on the communicator, and MPI would give
    its context id to the next one created, so they would reach the next test: it is kept.
    (A new communicator's id is one free on every rank, so keeping it on one rank suffices.)

    Example::

        @pytest.fixture
        def comm(request):
            communicator = cupycomm.init(mpi4py.MPI.COMM_WORLD)
            yield communicator
            release(request, communicator, communicator.close)
    """
    _release(request.node, comm, free)


def _release(item: Any, comm: Any, free: Callable[[], None]) -> None:
    if item.stash.get(_FAILED, False):
        item.config.stash[_KEPT].append(comm)
    else:
        free()


def _seconds(value: Any, what: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise pytest.UsageError(f"{what} must be a number of seconds >= 0 (0: no timeout), "
                                f"got {value!r}")
    return seconds


def _one_arg(item: pytest.Item, mark: pytest.Mark, name: str) -> Any:
    values = list(mark.args) + ([mark.kwargs[name]] if name in mark.kwargs else [])
    if len(values) != 1 or set(mark.kwargs) - {name}:
        raise pytest.UsageError(f"{item.nodeid}: the {mark.name} marker takes one argument, "
                                f"{name}; got args={mark.args} kwargs={mark.kwargs}")
    return values[0]


def _sizes(item: Any) -> tuple:
    """(min_size, max_size or None, the sizes n as a sorted list or None) of the test's
    ``mpi`` marker."""
    mark = item.get_closest_marker("mpi")
    if mark is None:
        return 1, None, None
    if "n" in mark.kwargs:
        n = mark.kwargs["n"]
        exact = sorted(set(n)) if isinstance(n, (list, tuple)) else [n]
        if mark.args or set(mark.kwargs) != {"n"} or not exact or not all(map(_count, exact)):
            raise pytest.UsageError(f"{item.nodeid}: use mpi(n=N) or mpi(n=[N, ...]) with "
                                    f"N >= 1, without min_size and max_size; got "
                                    f"args={mark.args} kwargs={mark.kwargs}")
        return exact[0], exact[-1], exact
    low, high = mark.kwargs.get("min_size", 1), mark.kwargs.get("max_size")
    if (mark.args or set(mark.kwargs) - {"min_size", "max_size"}
            or not _count(low) or not (high is None or (_count(high) and high >= low))):
        raise pytest.UsageError(f"{item.nodeid}: use mpi(min_size=N, max_size=M) with "
                                f"1 <= N <= M; got args={mark.args} kwargs={mark.kwargs}")
    return low, high, None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
