"""One outcome per test phase for the whole job, from each rank's own report.

A phase failed if it failed on any rank; a setup that skipped on some ranks is skipped on all
(the others must not run a body whose collectives the skipping ranks would never enter); a
call that skipped on some ranks only is a failure that says so. Rank 0's report shows each
failing rank's number and traceback.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["Kind", "kind_of", "detail_of", "summary", "agree", "apply", "ranks_label", "by_value",
           "why_skipped"]


class Kind(enum.IntEnum):
    """A phase's outcome on one rank."""
    PASSED = 0
    FAILED = 1
    SKIPPED = 2
    XFAILED = 3
    XPASSED = 4


def kind_of(report: Any) -> Kind:
    expected_failure = hasattr(report, "wasxfail")
    if report.failed:
        return Kind.FAILED
    if report.skipped:
        return Kind.XFAILED if expected_failure else Kind.SKIPPED
    return Kind.XPASSED if expected_failure else Kind.PASSED


def detail_of(report: Any, kind: Kind) -> Optional[Dict[str, Any]]:
    """What rank 0 needs to show this rank's outcome (None when it passed)."""
    if kind is Kind.PASSED:
        return None
    crash = getattr(report.longrepr, "reprcrash", None)
    return {
        "text": report.longreprtext,
        "skip": report.longrepr if isinstance(report.longrepr, tuple) else None,
        "crash": None if crash is None else (str(crash.path), crash.lineno, crash.message),
        "wasxfail": getattr(report, "wasxfail", None),
        "sections": list(report.sections) if kind is Kind.FAILED else [],
    }


def summary(detail: Optional[Dict[str, Any]]) -> str:
    """What a :func:`detail_of` says went wrong, for the hang guard's report ('' if nothing):
    the failure's text, or why the phase skipped."""
    if detail is None:
        return ""
    if detail["skip"] is not None:
        return f"skipped: {_bare(detail['skip'][-1])}"
    return detail["text"]


def agree(when: str, kinds: Sequence[Kind]) -> Optional[Kind]:
    """The outcome every rank reports for phase ``when``, or None where all ranks agree.

    >>> agree("setup", [Kind.PASSED, Kind.SKIPPED])
    <Kind.SKIPPED: 2>
    >>> agree("call", [Kind.PASSED, Kind.SKIPPED])    # a failure: ranks must skip alike
    <Kind.FAILED: 1>
    """
    distinct = set(kinds)
    if len(distinct) == 1:
        return None
    if Kind.FAILED in distinct:
        return Kind.FAILED
    if when == "setup":
        return Kind.SKIPPED if Kind.SKIPPED in distinct else Kind.XFAILED
    if distinct == {Kind.XFAILED, Kind.XPASSED}:
        return Kind.XFAILED
    return Kind.FAILED


def ranks_label(ranks: Sequence[int]) -> str:
    """'rank 1' or 'ranks 0, 2'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


@dataclasses.dataclass
class Crash:
    """Where a failure happened and its one-line message (for pytest's short summary)."""
    path: str
    lineno: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.lineno}: {self.message}"


class RankFailures:
    """The longrepr of a phase that failed on some ranks: each failure under its ranks.

    Ranks whose traceback reads the same share one entry.
    """

    def __init__(self, failures: List[Tuple[List[int], Any]], size: int,
                 reprcrash: Optional[Crash]) -> None:
        self.failures = failures
        self.size = size
        self.reprcrash = reprcrash

    def as_data(self) -> Dict[str, Any]:
        """The failures as JSON-ready data (tracebacks as text), for :meth:`from_data`."""
        crash = self.reprcrash
        return {"failures": [(ranks, str(longrepr)) for ranks, longrepr in self.failures],
                "size": self.size,
                "crash": None if crash is None else (crash.path, crash.lineno, crash.message)}

    @classmethod
    def from_data(cls, data: Dict[str, Any]) -> "RankFailures":
        """The failures that :meth:`as_data` wrote (in a job of isolated mode).

        >>> again = RankFailures.from_data(RankFailures([([1], "boom")], 2, None).as_data())
        >>> again.failures, again.size
        ([([1], 'boom')], 2)
        """
        crash = data["crash"]
        return cls([(list(ranks), text) for ranks, text in data["failures"]], data["size"],
                   None if crash is None else Crash(*crash))

    def toterminal(self, tw: Any) -> None:
        for ranks, longrepr in self.failures:
            tw.sep("-", f"{ranks_label(ranks)} of {self.size}")
            if isinstance(longrepr, str):
                tw.line(longrepr)
            else:
                longrepr.toterminal(tw)


def apply(report: Any, kinds: Sequence[Kind], details: Dict[int, Dict[str, Any]],
          rank: int) -> None:
    """Turn this rank's ``report`` into the job's outcome; ``details`` (rank 0 only) holds
    every rank's :func:`detail_of`, this rank's own included."""
    combined = agree(report.when, kinds)
    if combined is None:
        return
    size = len(kinds)
    if hasattr(report, "wasxfail"):
        del report.wasxfail
    if combined is Kind.FAILED:
        report.outcome = "failed"
        failing = [r for r, k in enumerate(kinds) if k is Kind.FAILED]
        if rank == 0:
            report.longrepr = (_failures(report, failing, details, size) if failing
                               else _disagreement(report.when, kinds, details))
            report.sections = [(f"{title} (rank {r})", content)
                               for r in [0] + [r for r in failing if r]
                               for title, content in (report.sections if r == 0 else
                                                      details[r]["sections"])]
        elif kinds[rank] is not Kind.FAILED:
            report.longrepr = (f"{_verb(report.when)} on {ranks_label(failing)}" if failing
                               else f"the ranks disagree on the {report.when} phase")
        return
    report.outcome = "skipped"
    sources = [r for r, k in enumerate(kinds) if k is combined]
    if combined is Kind.XFAILED:
        report.wasxfail = details[sources[0]]["wasxfail"] if rank == 0 else "xfailed"
        if rank == 0:
            report.longrepr = details[sources[0]]["text"]
        return
    path, lineno = report.location[:2]
    if rank == 0:
        path, lineno, _ = details[sources[0]]["skip"]
        reason = "; ".join(f"on {ranks_label(group)} of {size}: {_bare(why)}"
                           for why, group in by_value({r: details[r]["skip"][-1]
                                                       for r in sources}))
    else:
        reason = f"on {ranks_label(sources)} of {size}"
    report.longrepr = (str(path), lineno, f"skipped {reason}")


def _bare(reason: str) -> str:
    """A skip reason without the 'Skipped: ' that pytest.skip() puts before it."""
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


# "skipped on rank 3 of 4: " (see apply): the ranks are not the reason.
_ON_RANKS = re.compile(r"^skipped on [^:]* of \d+: ")
_HEAD = re.compile(r"[:(;,]")
_SHOWN = 6  # the reasons named in the line; the rest are counted as "other"


def why_skipped(reasons: Sequence[str]) -> str:
    """One line of why tests skipped: the head of each reason (up to its first ':', '(', ';'
    or ','), with how many skipped for it, most first.

    >>> why_skipped(["no GPU: none here", "no GPU: none here", "Skipped: needs 2 ranks, has 1"])
    '3 skipped: no GPU 2, needs 2 ranks 1'
    """
    heads = collections.Counter(_HEAD.split(_ON_RANKS.sub("", _bare(reason)), 1)[0].strip()
                                for reason in reasons)
    ranked = sorted(heads.items(), key=lambda item: (-item[1], item[0]))
    parts = [f"{head or 'no reason given'} {count}" for head, count in ranked[:_SHOWN]]
    if len(ranked) > _SHOWN:
        parts.append(f"other {sum(count for _, count in ranked[_SHOWN:])}")
    return f"{len(reasons)} skipped: {', '.join(parts)}"


def _verb(when: str) -> str:
    return "failed" if when == "call" else f"error in {when}"


def by_value(values: Dict[int, Any]) -> List[Tuple[Any, List[int]]]:
    """[(value, the ranks with it)], in rank order.

    >>> by_value({0: "a", 1: "b", 2: "a"})
    [('a', [0, 2]), ('b', [1])]
    """
    groups: Dict[Any, List[int]] = {}
    for r in sorted(values):
        groups.setdefault(values[r], []).append(r)
    return list(groups.items())


def _failures(report: Any, failing: List[int], details: Dict[int, Dict[str, Any]],
              size: int) -> RankFailures:
    failures = []
    for text, ranks in by_value({r: details[r]["text"] for r in failing}):
        # Rank 0's own traceback keeps its markup; the others arrive as text.
        failures.append((ranks, report.longrepr if ranks[0] == 0 else text))
    first = details[failures[0][0][0]]["crash"]
    crash = None if first is None else Crash(first[0], first[1],
                                             f"[{ranks_label(failures[0][0])}] {first[2]}")
    return RankFailures(failures, size, crash)


def _disagreement(when: str, kinds: Sequence[Kind], details: Dict[int, Dict[str, Any]]) -> str:
    lines = [f"the ranks disagree on the outcome of the {when} phase:"]
    for kind in Kind:
        ranks = [r for r, k in enumerate(kinds) if k is kind]
        if ranks:
            why = details[ranks[0]]["skip"] if kind is Kind.SKIPPED else None
            lines.append(f"  {kind.name.lower()} on {ranks_label(ranks)}"
                         + (f" ({_bare(why[2])})" if why else ""))
    lines.append("a test must skip on every rank or on none: decide from facts every rank "
                 "shares (the world size, not the rank), or agree first with an allreduce")
    return "\n".join(lines)
