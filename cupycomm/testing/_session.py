"""The pytest session of one rank in a run with several: agreement with the other ranks.

Registered by the plugin only when the world has more than one rank. Rank 0 reports; the
others report to it. Every decision pytest takes from a report (run the call phase, stop
after ``-x``, the exit status) is taken from the job's report, so every rank takes it alike.
"""
from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, Dict, Generator, List, Optional

import pytest
from _pytest.runner import runtestprotocol  # what pytest's own protocol runs, without logging

from .. import _bootstrap
from ..faults.abort import abort_world, report_stream, report_to
from . import _outcomes
from ..faults.board import Board
from ._hang_guard import END_OF_SESSION, FIELDS, FINISHED, IN_ROUND, RUNNING, HangGuard, position
from ._outcomes import Kind, by_value, ranks_label
from ._exchange import CODE, EXTRA, POINT, SEQ, Point, Round, Rounds

__all__ = ["MpiSession", "TIMEOUT", "worst_exit_status"]

TIMEOUT = pytest.StashKey[float]()  # on an item: its timeout in seconds (0: none)

# Worst first: the job's exit status is the worst of its ranks' (unknown codes, as given to
# pytest.exit(returncode=...), come before all).
_SEVERITY = [pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR,
             pytest.ExitCode.INTERRUPTED, pytest.ExitCode.TESTS_FAILED,
             pytest.ExitCode.NO_TESTS_COLLECTED, pytest.ExitCode.OK]
# Where each round puts a rank on the hang guard's board (see _hang_guard.position).
_STEP = {Point.MARKS: 1, Point.SETUP: 1, Point.END: 3, Point.COLLECT: 1, Point.COLLECT_IDS: 1}


def worst_exit_status(codes: List[int]) -> int:
    """The exit status of the job from its ranks' own.

    >>> worst_exit_status([1, 4, 0])
    4
    """
    return min(codes, key=lambda c: _SEVERITY.index(c) if c in _SEVERITY else -1)


class MpiSession:
    """The hooks that make the ranks of one ``mpiexec`` run act as one pytest session."""

    def __init__(self, config: pytest.Config, default_timeout: float) -> None:
        self.config = config
        self.default_timeout = default_timeout
        # pytest's capture takes fd 2 during tests, and what it captured is lost when the job
        # aborts: the hang guard's and the watchdog's reports and stacks go to the terminal.
        terminal = os.fdopen(os.dup(2), "w")
        report_to(terminal)
        self.guard = HangGuard(_bootstrap.world().Get_rank(), terminal)
        # A rank that failed before this point (say, in a conftest) never comes.
        self.guard.arm(default_timeout, "the start of the session")
        self.rounds = Rounds(_bootstrap.world().Dup())
        self.rank, self.size = self.rounds.rank, self.rounds.size
        node = _bootstrap.node_comm(self.rounds.comm)
        board = Board(node, FIELDS, self.rounds.comm)
        ranks = [int(rank) for rank in node.allgather(self.rank)]
        node.Free()
        self.guard.know_node(board, ranks)
        self.rounds.allgather_ints([0])  # every rank's pid is on its node's board
        self.guard.disarm()
        self._session: Optional[pytest.Session] = None
        self._seq = 0
        self._marks: Optional[str] = None
        self._final: Optional[Round] = None
        self._collect_errors: List[tuple] = []
        self._collecting = True
        self._ending = ""
        self._devnull: Optional[Any] = None
        if self.rank != 0:
            self._quiet(config)

    def _quiet(self, config: pytest.Config) -> None:
        """Ranks other than 0 print nothing of their own (their failures reach rank 0) and
        write no cache: every rank reads the cache rank 0 wrote, so ``--lf`` agrees."""
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
            self._devnull = open(os.devnull, "w")
            config.pluginmanager.register(pytest.TerminalReporter(config, self._devnull),
                                          "terminalreporter")
        cache = getattr(config, "cache", None)
        if cache is not None:
            cache.set = lambda key, value: None

    # -- collection -------------------------------------------------------------------------------
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if self._collecting and report.failed:
            self._collect_errors.append((report.nodeid, report.longreprtext))

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Every rank must have collected the same tests; a collection error on any rank stops
        all of them before the first test."""
        self._collecting = False
        ids = [item.nodeid for item in session.items]
        self.guard.arm(self.default_timeout, "collection")
        done = self._exchange(Point.COLLECT, code=len(self._collect_errors),
                              extra=_digest(ids), detail=self._collect_errors or None)
        listed = None
        if done is not None and len(set(done.column(EXTRA))) > 1:
            listed = self._exchange(Point.COLLECT_IDS, detail=ids)
        self.guard.disarm()
        self.guard.tests = ids
        if done is None:
            return
        for nodeid, text in self._errors_elsewhere(done):
            session.ihook.pytest_collectreport(report=pytest.CollectReport(
                nodeid, "failed", text, []))
        if listed is not None:
            session.items[:] = []
            nodeid, text = (_mismatch(listed) if self.rank == 0
                            else ("", "the ranks collected different tests"))
            session.ihook.pytest_collectreport(report=pytest.CollectReport(
                nodeid, "failed", text, []))

    def _errors_elsewhere(self, done: Round) -> List[tuple]:
        """[(nodeid, text)] of the collection errors of other ranks that this rank lacks."""
        counts = done.column(CODE)
        others = [r for r in range(self.size) if counts[r] and r != self.rank]
        if not others:
            return []
        if self.rank != 0:  # only its count matters (so that it stops before the tests too)
            return [] if self._collect_errors else [("", f"collection failed on "
                                                         f"{ranks_label(others)}")]
        mine = {nodeid for nodeid, _ in self._collect_errors}
        found: Dict[str, tuple] = {}
        for r in others:
            for nodeid, text in done.details[r]:
                if nodeid not in mine:
                    ranks, first = found.get(nodeid, ([], text))
                    found[nodeid] = (ranks + [r], first)
        return [(nodeid, f"on {ranks_label(ranks)} of {self.size}:\n{text}")
                for nodeid, (ranks, text) in found.items()]

    # -- tests ------------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Optional[pytest.Item]) -> bool:
        """Run the test as pytest does, but log its reports once the ranks agree on them: on
        the setup before the call, on the call and the teardown together after them."""
        self._seq += 1
        # skipif and xfail conditions may read differently on different ranks: then the ranks
        # agree on them before any fixture is set up (fixtures may be collective).
        self._marks = "due" if any(item.iter_markers("skipif")) or any(
            item.iter_markers("xfail")) else None
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        self.guard.at(position(self._seq, 0), RUNNING)
        self.guard.arm(item.stash.get(TIMEOUT, self.default_timeout), item.nodeid)
        try:
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
            self._agree_on_the_end(reports[1:])
        finally:
            self.guard.disarm()
        if any(report.failed for report in reports):
            self.guard.earlier.append(item.nodeid)
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def pytest_runtest_setup(self) -> None:
        """Runs after the marks are evaluated (a rank they skip does not get here, and tells
        its outcome at the end of its setup) and before the fixtures."""
        if self._marks == "due":
            self._marks = "agreed"
            done = self._exchange(Point.MARKS, self._seq, Kind.PASSED, extra=1)
            self.guard.at(position(self._seq, 0), RUNNING)
            if done is None or done.column(CODE).any():
                self._marks = "stopped"
                pytest.skip("the marks did not pass on every rank")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self) -> Generator[None, Any, Any]:
        """The setup's report becomes the job's before pytest decides to run the call."""
        report = yield
        if report.when == "setup":
            kind = _outcomes.kind_of(report)
            done = self._agree_on_setup(kind, _outcomes.detail_of(report, kind))
            self.guard.at(position(self._seq, 2), RUNNING)
            if done is not None:
                _outcomes.apply(report, _kinds(done, CODE), done.details, self.rank)
            elif report.passed:
                report.outcome = "skipped"
                report.longrepr = (*report.location[:2], f"not run: {self._ending}")
        return report

    def _agree_on_setup(self, kind: Kind, detail: Any) -> Optional[Round]:
        marks, self._marks = self._marks, None
        if marks == "due":  # the marks stopped this rank: this round carries its outcome
            done = self._exchange(Point.MARKS, self._seq, kind, detail=detail,
                                  failure=_outcomes.summary(detail))
            if done is None or not done.column(EXTRA).any():
                return done
        if marks == "stopped":  # the setup stopped for the others' outcome, not its own
            kind, detail = Kind.PASSED, None
        return self._exchange(Point.SETUP, self._seq, kind, detail=detail,
                              failure=_outcomes.summary(detail))

    def _agree_on_the_end(self, reports: List[pytest.TestReport]) -> None:
        """One round for the call (where the setup passed) and the teardown."""
        kinds = [_outcomes.kind_of(r) for r in reports]
        details = {r.when: _outcomes.detail_of(r, k) for r, k in zip(reports, kinds)}
        done = self._exchange(Point.END, self._seq, kinds[0], kinds[-1],
                              details if any(details.values()) else None,
                              failure="\n".join(filter(None, map(_outcomes.summary,
                                                                  details.values()))))
        if done is None:
            for report in reports:
                if report.passed:
                    report.outcome = "failed"
                    report.longrepr = f"not finished on every rank: {self._ending}"
            return
        for report, column in zip(reports, (CODE, EXTRA)[-len(reports):]):
            phase = {r: d[report.when] for r, d in done.details.items() if d[report.when]}
            _outcomes.apply(report, _kinds(done, column), phase, self.rank)

    def _exchange(self, point: Point, seq: int = 0, code: int = 0, extra: int = 0,
                  detail: Any = None, failure: str = "") -> Optional[Round]:
        """A round with the other ranks; None once some rank has left the session (then this
        one stops after the current test, and reports no more). ``code`` (and, at the end of
        a test, ``extra``) is this rank's outcome, ``failure`` what went wrong, if anything,
        for the hang guard's report."""
        if self._final is not None:
            return None
        outcome = {Point.MARKS: code, Point.SETUP: code, Point.END: code or extra}
        self.guard.at(position(seq, _STEP[point]), IN_ROUND, Kind(outcome.get(point, 0)),
                      failure)
        done = self.rounds.exchange(point, seq, code, extra, detail)
        left = done.final_ranks()
        if left:
            self._final = done
            self._ending = f"{ranks_label(left)} left the session"
            if self._session is not None:
                self._session.shouldstop = self._ending
            return None
        if (done.column(POINT) != point).any() or (done.column(SEQ) != seq).any():
            self._out_of_step(done)
        return done

    def _out_of_step(self, done: Round) -> None:
        where = "; ".join(f"rank {r}: {Point(p).name.lower()} #{s}" for r, (p, s) in
                          enumerate(done.table[:, [POINT, SEQ]]))
        stream = report_stream()
        stream.write(f"cupycomm.testing: the ranks are out of step ({where}); a plugin "
                     f"that reruns or reorders tests on some ranks only? aborting\n")
        abort_world(pytest.ExitCode.INTERNAL_ERROR)

    # -- the end ----------------------------------------------------------------------------------
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._session = session

    def pytest_keyboard_interrupt(self, excinfo: Any) -> None:
        self._ending = excinfo.exconly()

    def pytest_internalerror(self, excrepr: Any) -> None:
        self._ending = "INTERNALERROR"
        if self.rank != 0:
            for line in str(excrepr).split("\n"):
                sys.stderr.write(f"[rank {self.rank}] INTERNALERROR> {line}\n")
            sys.stderr.flush()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Generator[None, Any, Any]:
        """Every rank ends with the job's exit status (so MPI's OR of them is that status)."""
        result = yield
        self.guard.arm(self.default_timeout, "the end of the session")
        pending = self.rounds.finish_pending()
        if self._final is None and pending is not None and pending.final_ranks():
            self._final = pending
        if self._final is None:
            status = int(session.exitstatus)
            # Stopped on its own (interrupted, an internal error): others may be in a test.
            alone = status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED,
                                   pytest.ExitCode.NO_TESTS_COLLECTED)
            self.guard.at(END_OF_SESSION, IN_ROUND, Kind.FAILED if alone else Kind.PASSED,
                          self._ending or f"exit status {status}")
            self._final = self.rounds.exchange(Point.FINAL, code=status,
                                               detail=self._ending or None)
        self.guard.at(END_OF_SESSION, FINISHED)
        self.guard.disarm()
        table = self._final.table
        codes = [int(c) if p == Point.FINAL else pytest.ExitCode.INTERRUPTED
                 for p, c in table[:, [POINT, CODE]]]
        status = worst_exit_status(codes)
        if self.rank == 0:
            self._tell(status, codes, session.exitstatus)
        session.exitstatus = status
        return result

    def _tell(self, status: int, codes: List[int], own: int) -> None:
        """Rank 0 says why other ranks ended as they did, and the job's status if it is not
        rank 0's own."""
        mine = self._final.details.get(0)
        lines = [f"{ranks_label(ranks)}: {text}" for text, ranks in by_value(
            {r: text for r, text in self._final.details.items() if r and text != mine})]
        if status != own:
            lines.append(f"exit status {status} on every rank (the ranks' own: {codes})")
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        for line in lines:
            reporter.write_line(f"cupycomm.testing: {line}")

    def pytest_unconfigure(self) -> None:
        report_to(None)
        self.guard.close()  # and the terminal's stream
        self.rounds.comm.Free()
        if self._devnull is not None:
            self._devnull.close()


def _kinds(done: Round, column: int) -> List[Kind]:
    return [Kind(k) for k in done.column(column)]


def _digest(strings: List[str]) -> int:
    data = "\n".join(strings).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _mismatch(listed: Round) -> tuple:
    """(nodeid, message) naming the ranks whose tests differ from rank 0's and where."""
    lists = listed.details
    reference = lists[0]
    lines = ["the ranks collected different tests; every rank must collect the same tests in "
             "the same order (no test defined, parametrized or deselected from rank-dependent "
             "values)"]
    nodeid = ""
    others = {r: tuple(ids) for r, ids in lists.items() if r and ids != reference}
    for ids, ranks in by_value(others):
        i = next(i for i, (a, b) in enumerate(zip(reference + [None], list(ids) + [None]))
                 if a != b)
        ours = reference[i] if i < len(reference) else "nothing more"
        theirs = ids[i] if i < len(ids) else "nothing more"
        nodeid = nodeid or (theirs if i < len(ids) else ours)
        lines.append(f"  {ranks_label(ranks)} collected {len(ids)} tests, rank 0 "
                     f"{len(reference)}; the first difference is test {i + 1}: rank 0 has "
                     f"{ours}, {ranks_label(ranks)} {'has' if len(ranks) == 1 else 'have'} "
                     f"{theirs}")
    return nodeid, "\n".join(lines)
