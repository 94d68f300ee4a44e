"""Isolated mode: in a plain single-process ``pytest``, the tests that run on several ranks run
in ``mpiexec`` jobs, and their reports join this session.

The plugin gives such a test an id per world size (``test_x[mpi3]``, :func:`parametrize`),
puts the tests of each size after the in-process ones (:func:`by_size`), and runs all the
tests of one size in one job (:class:`IsolatedJobs`, :class:`Job`): ``mpiexec -n N python -m
pytest`` on their modules, told by ``--mpi-job`` which tests to keep (:func:`keep_listed`).
Rank 0 of the job writes each test's start and its reports (the job's, agreed by the ranks),
serialised by pytest, to a file, a line at a time (:class:`JobReports`); this process reads
them as they come and logs them as its own. When the job ends inside a test (a rank crashed or
aborted, or the plugin's hang guard ended the job at the timeout), that test fails with what
the job printed (the rank, every rank's stack) and the tests after it run in a new job; a job
that ends before its first test fails the tests it had, with its output.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest

from ..faults.abort import abort_world, report_stream
from ..faults.board import alive
from ..faults.watchdog import unwatch, watch
from ._outcomes import Crash, RankFailures
from ._session import TIMEOUT
from .launch import kill, no_auto_cleanup, start_mpiexec

__all__ = ["SIZE_ARG", "LISTED", "size_of", "parametrize", "by_size", "keep_listed", "JobReports",
           "Job", "IsolatedJobs"]

SIZE_ARG = "_cupycomm_mpi_size"  # the parameter that gives a test its world size
LISTED = "tests.json"  # in a job's directory: the node ids it runs, in order
_EVENTS = "events"  # in a job's directory: what rank 0 writes, a JSON object a line
_RANK_FAILURES = "cupycomm_rank_failures"  # a report's RankFailures, in its serialised form
_GUARD_REPORT = re.compile(r"^=+ cupycomm\.testing: .+ =+\n(?P<why>.*?); the failure \(if any\)",
                           re.MULTILINE)
_SLACK = 30.0  # seconds past the job's own bounds before this process kills a silent job


def size_of(item: pytest.Item) -> int:
    """The world size ``item`` runs at: its :data:`SIZE_ARG` parameter, else 1."""
    callspec = getattr(item, "callspec", None)
    return 1 if callspec is None else callspec.params.get(SIZE_ARG, 1)


def parametrize(metafunc: pytest.Metafunc, sizes: Sequence[int]) -> None:
    """One test per world size of ``sizes`` (ids ``mpi1``, ``mpi3``, ...); none added for a
    test that runs in this process only (``sizes == [1]``)."""
    if list(sizes) != [1]:
        metafunc.fixturenames.append(SIZE_ARG)
        metafunc.parametrize(SIZE_ARG, list(sizes), ids=[f"mpi{n}" for n in sizes])


def by_size(items: List[pytest.Item]) -> None:
    """The in-process tests first, then those of each size in a job, each in its order."""
    items.sort(key=size_of)


def keep_listed(config: pytest.Config, items: List[pytest.Item], listed: Path) -> None:
    """Keep the tests a job was given, in the order given (the other tests of their modules,
    those of other sizes among them, are deselected)."""
    order = {nodeid: i for i, nodeid in enumerate(json.loads(listed.read_text())["tests"])}
    kept = sorted((item for item in items if item.nodeid in order),
                  key=lambda item: order[item.nodeid])
    dropped = [item for item in items if item.nodeid not in order]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


class JobReports:
    """Rank 0 of a job: each test's start and its reports, a JSON line each, written as they
    happen, so that a crash loses only the test that was running. The job ends when the
    session that started it has gone (killed, by a CI timeout say): none outlives it."""

    timeout = 0.0  # for the watchdog, which looks at the session: this never waits

    def __init__(self, config: pytest.Config, directory: Path) -> None:
        self._config = config
        self._directory = directory
        self._session = json.loads((directory / LISTED).read_text())["session"]
        self._out = (directory / _EVENTS).open("a", buffering=1)  # a line, a write
        watch(self)

    def check(self, now: float) -> bool:
        """On the watchdog thread: abort the job if the session that started it has gone."""
        if not alive(self._session):
            report_stream().write(f"cupycomm.testing: the pytest session that started this job "
                                  f"(pid {self._session}) has gone; aborting the job\n")
            shutil.rmtree(self._directory, ignore_errors=True)
            abort_world(1)
        return False

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._write({"start": nodeid})

    # Rank 0 reaches a test's call only once every rank's setup passed (the ranks agree on
    # the setup first): a crash after this line is the call's.
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        self._write({"phase": "call", "nodeid": item.nodeid})

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self._write({"phase": "teardown", "nodeid": item.nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self._config.hook.pytest_report_to_serializable(config=self._config,
                                                               report=report)
        if isinstance(report.longrepr, RankFailures):
            data["longrepr"], data[_RANK_FAILURES] = None, report.longrepr.as_data()
        self._write({"report": data})

    def _write(self, event: Dict[str, Any]) -> None:
        self._out.write(json.dumps(event, default=str) + "\n")

    def pytest_unconfigure(self) -> None:
        unwatch(self)
        self._out.close()


def _report(config: pytest.Config, data: Dict[str, Any]) -> pytest.TestReport:
    """A report of a job, as pytest's hooks made it there (JSON turned tuples into lists)."""
    failures = data.pop(_RANK_FAILURES, None)
    report = config.hook.pytest_report_from_serializable(config=config, data=data)
    report.location = tuple(report.location)
    if isinstance(report.longrepr, list):  # a skip's (path, line, reason)
        report.longrepr = tuple(report.longrepr)
    if failures is not None:
        report.longrepr = RankFailures.from_data(failures)
    return report


class JobEnded:
    """The longrepr of a test that a job did not finish: what happened, then the job's
    report (the guard's reason, each rank's stack) or the end of its output."""

    def __init__(self, text: str, reprcrash: Crash) -> None:
        self.text = text
        self.reprcrash = reprcrash

    def toterminal(self, tw: Any) -> None:
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self) -> str:
        return self.text


class Job:
    """``mpiexec -n size python -m pytest`` on ``items``' modules, running ``items`` (in this
    order, each with the session's ``timeout`` unless marked), in a temporary directory of
    its own.

    Example::

        job = Job(config, 3, 60.0, items)
        if job.wait_for(items[0].nodeid, silence=None):
            reports = job.reports_of(items[0])
        job.close()
    """

    def __init__(self, config: pytest.Config, size: int, timeout: float,
                 items: List[pytest.Item]) -> None:
        self.size = size
        self.listed = [item.nodeid for item in items]
        self.started: List[str] = []
        self._phases: Dict[str, str] = {}  # the phase a test is in (on rank 0)
        self._config = config
        self._data: Dict[str, List[Dict[str, Any]]] = {}
        self._partial = ""
        self._silent_since = time.monotonic()
        self._killed_after: Optional[float] = None
        self.directory = Path(tempfile.mkdtemp(prefix="cupycomm-isolated-"))
        (self.directory / LISTED).write_text(json.dumps({"session": os.getpid(),
                                                          "tests": self.listed}))
        (self.directory / _EVENTS).touch()
        self._events = (self.directory / _EVENTS).open()
        files = list(dict.fromkeys(str(item.path) for item in items))
        self.argv: List[str] = []
        with (self.directory / "stdout").open("w") as out, \
                (self.directory / "stderr").open("w") as err:
            try:
                self.process: Any = start_mpiexec(
                    size, "-m", "pytest", *job_arguments(config, self.directory, timeout), *files,
                    cwd=str(config.invocation_params.dir), mpiexec_args=no_auto_cleanup(),
                    # Its temporary files (tmp_path, a crashed rank's stack file) go with it.
                    env={"TMPDIR": str(self.directory)}, stdout=out, stderr=err)
                self.argv = self.process.args
            except (OSError, ValueError) as error:  # no launcher, or one that cannot start
                self.process = None
                err.write(f"could not start the job: {error}\n")

    @property
    def ended(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def finished(self, nodeid: str) -> bool:
        return any(data["when"] == "teardown" for data in self._data.get(nodeid, ()))

    def wait_for(self, nodeid: str, silence: Optional[float]) -> bool:
        """Wait until the job has finished test ``nodeid`` (True) or has ended (False); kill
        it when it has written nothing for ``silence`` seconds (None: wait for ever)."""
        pause = 0.001
        while True:
            ended = self.ended  # before reading: what it wrote before it ended is read now
            self._read()
            if self.finished(nodeid):
                return True
            if ended:
                return False
            if silence is not None and time.monotonic() - self._silent_since > silence:
                kill(self.process)
                self._killed_after = silence
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _read(self) -> None:
        text = self._partial + self._events.read()
        lines = text.split("\n")
        self._partial = lines.pop()  # '' or a line still being written
        for line in lines:
            self._silent_since = time.monotonic()
            event = json.loads(line)
            if "start" in event:
                self.started.append(event["start"])
            elif "phase" in event:
                self._phases[event["nodeid"]] = event["phase"]
            else:
                self._data.setdefault(event["report"]["nodeid"], []).append(event["report"])

    def reports_of(self, item: pytest.Item) -> List[pytest.TestReport]:
        """The job's reports of ``item``; where it did not finish the test, a failure of the
        phase it was in (setup, also where it never started, call or teardown), after the
        phases before it passed (as they did on every rank: the ranks agree on the setup
        before the call)."""
        reports = [_report(self._config, data) for data in self._data.get(item.nodeid, [])]
        if self.finished(item.nodeid):
            return reports
        failure = self._failure(item)
        phases = {"setup": [("setup", failure), ("teardown", None)],
                  "call": [("setup", None), ("call", failure), ("teardown", None)],
                  "teardown": [("setup", None), ("teardown", failure)]}
        have = {report.when for report in reports}
        return reports + [_made(item, when, outcome) for when, outcome
                          in phases[self._phases.get(item.nodeid, "setup")] if when not in have]

    def _failure(self, item: pytest.Item) -> JobEnded:
        if self._killed_after is not None:
            how = (f"was killed: nothing from it for {self._killed_after:g} s (its own "
                   f"timeouts did not end it)")
        elif self.process is None:
            how = "could not start"
        else:
            how = f"ended with exit status {self.process.returncode}"
        if item.nodeid in self.started:
            when = "during this test"
        elif self.started:
            when = "and did not run this test (not collected on its ranks?)"
        else:
            when = "before its first test"
        err = (self.directory / "stderr").read_text(errors="replace")
        found = _GUARD_REPORT.search(err)
        if found is not None:
            output, message = err[found.start():], found["why"]
        else:
            output = err or (self.directory / "stdout").read_text(errors="replace")
            message = f"the MPI job of {self.size} ranks {how}"
        lines = output.splitlines()
        tail = "\n".join(lines[-400:])
        text = (f"the MPI job of {self.size} ranks {how} {when}:\n  {' '.join(self.argv)}\n"
                f"{'(its first lines left out)' if len(lines) > 400 else ''}\n{tail}")
        return JobEnded(text, Crash(str(item.path), item.location[1] + 1, message))

    def close(self) -> None:
        """Kill the job if it still runs, and remove its directory."""
        if not self.ended:
            kill(self.process)
        self._events.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _made(item: pytest.Item, when: str, failure: Optional[JobEnded]) -> pytest.TestReport:
    """A report of ``item``'s phase ``when``: failed with ``failure``, or passed."""
    return pytest.TestReport(item.nodeid, item.location, {name: 1 for name in item.keywords},
                             "passed" if failure is None else "failed", failure, when)


def job_arguments(config: pytest.Config, directory: Path, timeout: float) -> List[str]:
    """The options of this session that a job's pytest needs to collect and run its tests as
    this one would (the same rootdir and ini file, plugins, overrides, capture, traceback
    style and verbosity, timeout), and ``--mpi-job``. Selection (``-k``, ``-m``, ``--lf``)
    is not passed on: the job is told its tests; nor are outputs (``--junitxml``): this
    session writes them."""
    option = config.option
    args = [f"--rootdir={config.rootpath}", f"--mpi-job={directory}",
            f"--mpi-timeout={timeout:g}",
            f"--capture={option.capture}", f"--tb={option.tbstyle}",
            f"--import-mode={option.importmode}"]
    if config.inipath is not None:
        args += ["-c", str(config.inipath)]
    for plugin in option.plugins or ():
        args += ["-p", plugin]
    for override in option.override_ini or ():
        args += ["-o", override]
    for warning in option.pythonwarnings or ():
        args += ["-W", warning]
    args += [flag for flag, on in (("--showlocals", option.showlocals),
                                   ("--runxfail", option.runxfail),
                                   ("--strict-markers", option.strict_markers)) if on]
    args.append(f"-{'v' * option.verbose}" if option.verbose > 0 else "-q")
    # Its own cache (rank 0 writes it), so that this session's --lf is not overwritten.
    return args + ["-o", f"cache_dir={directory / 'cache'}"]


class IsolatedJobs:
    """The hooks of a plain ``pytest`` session that run tests of more than one rank in jobs:
    at a test of size N with no job of size N running it, a job for it and every later test
    of that size; the test's reports, once the job has them, logged here."""

    def __init__(self, config: pytest.Config, default_timeout: float) -> None:
        self._config = config
        self._default = default_timeout
        self._jobs: Dict[int, Job] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Optional[bool]:
        size = size_of(item)
        if size == 1:
            return None
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in self._reports(item, size):
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _reports(self, item: pytest.Item, size: int) -> List[pytest.TestReport]:
        job = self._jobs.get(size)
        if job is None or item.nodeid not in job.listed:
            job = self._start(item, size)
        if (not job.wait_for(item.nodeid, self._silence(item)) and job.started
                and item.nodeid not in job.started):
            job = self._start(item, size)  # it ended between tests: the rest in a new one
            job.wait_for(item.nodeid, self._silence(item))
        return job.reports_of(item)

    def _start(self, item: pytest.Item, size: int) -> Job:
        """A job for ``item`` and the later tests of its size (one job runs at a time)."""
        self.pytest_sessionfinish()
        items = item.session.items
        later = items[items.index(item):]
        job = self._jobs[size] = Job(self._config, size, self._default,
                                     [i for i in later if size_of(i) == size])
        return job

    def _silence(self, item: pytest.Item) -> Optional[float]:
        """How long a job may write nothing: its start, collection and this test are each
        bounded by its own timeouts, which end it; this is the bound of last resort."""
        timeout = item.stash.get(TIMEOUT, self._default)
        return None if not (timeout and self._default) else 2 * self._default + timeout + _SLACK

    def pytest_sessionfinish(self) -> None:
        for job in self._jobs.values():
            job.close()
        self._jobs.clear()
