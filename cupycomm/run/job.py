"""``python -m cupycomm.run``: start an MPI job with the launcher at hand, forward Ctrl-C and
SIGTERM to it, and exit with a status that never lies.

Every rank's ``init()`` records how it ended in the job's directory
(:mod:`cupycomm.run.exit_records`): a rank that recorded no end, or processes in a world of
another size, make the status non-zero whatever the launcher said, and one line on stderr
says which rank and why. SIGINT and SIGTERM are forwarded once; a second, or a job still there
10 s later, is killed (status 128 + the signal). Why, and hydra's own failures:
docs/internals.md, "run/job.py".

Example::

    python -m cupycomm.run -n 4 --timeout 120 --prefix-output train.py --epochs 3
    cupycomm-run -n 2 -hosts nodeA:1,nodeB:1 -m pytest tests
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .._private import alive
from ..errors import SharedFileRefused
from . import exit_records, launchers, ranks

__all__ = ["Options", "UsageError", "parse", "verdict", "main", "USAGE", "GRACE",
           "LOST_GRACE"]

GRACE = 10.0
"""Seconds the job has to end after a forwarded signal, before it is killed."""
LOST_GRACE = 3.0
"""Seconds the job has to end after a rank on this host died without recording its end."""

USAGE = """\
usage: cupycomm-run -n N [options] [launcher options] PROGRAM

Starts PROGRAM on N ranks with the launcher at hand (the environment's mpiexec, or srun) and
exits non-zero, naming the rank, if any rank did not finish: a launcher can say 0 for a job
that lost a rank.

PROGRAM is script.py [args], -m module [args], or -- command [args] (anything else).
Arguments between the options below and PROGRAM go to the launcher as they are.

options:
  -n N, -np N        the number of ranks
  --timeout S        every rank's collective timeout, in seconds (CUPYCOMM_TIMEOUT)
  --debug            every rank checks that all call each collective alike (CUPYCOMM_DEBUG)
  --survivors        for programs that go on past a lost rank (init(on_peer_loss="raise")):
                     starts the launcher so (Open MPI 5's --with-ft ulfm ...); the job then
                     succeeds if the ranks that finished went on without every rank that
                     did not (comm.shrink())
  --prefix-output    prefix each line of output with its rank (the launcher's option)
  --mpiexec PATH     the launcher (default: $MPIEXEC, the mpiexec beside this Python, PATH)
  --job-dir DIR      where the job's directory goes: a directory every node sees
                     (default: the current directory)
  -h, --help         this text

exit status:
  0                  every rank finished
  1                  a rank did not finish though the launcher said 0 (else the launcher's
                     own status, which a line on stderr explains)
  2                  a command line that cannot be run (the line says why)
  128 + N            stopped by signal N (Ctrl-C: 130), forwarded to the job
"""
"""The text of ``--help`` (its first line names the tool as it was called)."""


@dataclasses.dataclass
class Options:
    """What the command line asked for (see :data:`USAGE`)."""
    n: int
    program: List[str]
    launcher_args: List[str] = dataclasses.field(default_factory=list)
    timeout: Optional[float] = None
    debug: bool = False
    survivors: bool = False
    prefix_output: bool = False
    mpiexec: Optional[str] = None
    job_dir: Optional[str] = None


class UsageError(ValueError):
    """A command line that cannot be run; the message says why."""


def _value(argv: Sequence[str], i: int) -> str:
    if i + 1 >= len(argv):
        raise UsageError(f"{argv[i]} needs a value")
    return argv[i + 1]


def parse(argv: Sequence[str]) -> Options:
    """The options of ``argv`` (the arguments after ``python -m cupycomm.run``).

    Raises:
        UsageError: a missing or bad value, no ``-n``, no program.

    Example::

        parse(["-n", "2", "-hosts", "a:1,b:1", "x.py", "-v"]).launcher_args  # ['-hosts', 'a:1,b:1']
    """
    found: Dict[str, object] = {"launcher_args": []}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            raise UsageError("")
        if arg == "--":
            found["program"] = list(argv[i + 1:])
            break
        if arg == "-m" or arg.endswith(".py"):
            found["program"] = [sys.executable, *argv[i:]]
            break
        if arg in ("-n", "-np"):
            raw = _value(argv, i)
            if not raw.isdigit() or int(raw) < 1:
                raise UsageError(f"{arg} must be a number of ranks >= 1, got {raw!r}")
            found["n"], i = int(raw), i + 2
        elif arg == "--timeout":
            raw = _value(argv, i)
            try:
                seconds = float(raw)
            except ValueError:
                seconds = 0.0
            if not seconds > 0:
                raise UsageError(f"--timeout must be a positive number of seconds, got {raw!r}")
            found["timeout"], i = seconds, i + 2
        elif arg in ("--mpiexec", "--job-dir"):
            found[arg[2:].replace("-", "_")], i = _value(argv, i), i + 2
        elif arg in ("--debug", "--prefix-output", "--survivors"):
            found[arg[2:].replace("-", "_")], i = True, i + 1
        else:
            found["launcher_args"].append(arg)   # type: ignore[attr-defined]
            i += 1
    if "n" not in found:
        raise UsageError("-n N (the number of ranks) is required")
    if not found.get("program"):
        raise UsageError("no program: give script.py, -m module, or -- command")
    return Options(**found)   # type: ignore[arg-type]


def _job_argv(options: Options, launcher: launchers.Launcher,
              variables: Sequence[str]) -> List[str]:
    command = launcher.command(options.n, leave_cleanup_to_cupycomm=True,
                               survivors=options.survivors)
    row = launchers.KINDS[launcher.kind]
    extra = list(row.prefix_output) if options.prefix_output else []
    for name in variables if row.export else ():
        extra += [row.export, name]
    return [command[0], *extra, *options.launcher_args, *command[1:], *options.program]


class _Forwarder:
    """Forwards SIGINT/SIGTERM to the launcher, and kills its session on a second signal.

    The handlers, installed before the launcher starts, only count what arrived; the main
    thread acts on it while it waits for the launcher (:meth:`wait`), so a signal that
    arrives before the launcher has a pid is forwarded once it has one, and never twice.
    """

    def __init__(self, stop: int = signal.SIGKILL, survivors: bool = False) -> None:
        self.signal: Optional[int] = None   # the first signal that arrived
        self._stop = stop   # what ends the launcher's session first (Kind.stop)
        self._survivors = survivors   # a rank that died does not end the job (--survivors)
        self.died: List[int] = []   # ranks of this host seen dead without an end recorded
        # ranks of this host whose processes ended before they recorded anything, their pids
        self.before_init: List[Tuple[int, Optional[int]]] = []   # (None: never seen)
        self._arrived = 0
        self._previous = {s: signal.signal(s, self._handle)
                          for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is None:
            self.signal = signum
        self._arrived += 1

    def wait(self, child: subprocess.Popen, directory: exit_records.JobDirectory,
             size: int) -> int:
        """``child``'s exit status, once it has ended. The first signal is forwarded to it; a
        second one, GRACE s without an end after the first, or LOST_GRACE s after a rank of
        this host died without recording its end (its peers could wait in ``MPI_Finalize``
        forever; the watchdog names it first where they wait in a collective), or ended
        before it recorded anything (its peers wait in ``MPI_Init``: seen on two looks in a
        row, so that a rank still starting is not taken for one), end its session: with the
        launcher's stop signal, then SIGKILL GRACE s later."""
        forwarded_at = lost_at = stopped_at = None
        next_look = time.monotonic()
        here = ranks.Ranks(child.pid, directory.path, size)
        gone: List[int] = []
        while True:
            now = time.monotonic()
            if self.signal is not None and forwarded_at is None:
                forwarded_at = now
                _send(os.kill, child.pid, self.signal)
            if lost_at is None and now >= next_look:
                next_look = now + 1.0
                records = directory.read(size)
                self.died = _died_here(records)
                before, gone = gone, ([rank for rank in here.gone() if records[rank] is None]
                                      if None in records else [])   # else: no /proc to read
                self.before_init = [(rank, here.pids.get(rank)) for rank in gone
                                    if rank in before] + [
                    (r["rank"], r["pid"]) for r in records   # raised, alive in MPI_Finalize
                    if r is not None and r.get("before_init") and r["rank"] not in gone]
                if (self.died or self.before_init) and not self._survivors:
                    lost_at = now
            if (self._arrived > 1 or (forwarded_at is not None and now - forwarded_at > GRACE)
                    or (lost_at is not None and now - lost_at > LOST_GRACE)):
                if stopped_at is None:
                    stopped_at = now
                    _send(os.killpg, child.pid, self._stop)
                elif now - stopped_at > GRACE:
                    _send(os.killpg, child.pid, signal.SIGKILL)
            try:
                return child.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def _send(kill, pid: int, number: int) -> None:
    try:
        kill(pid, number)
    except ProcessLookupError:   # it has just ended
        pass


class _Copy:
    """Copies one of the launcher's streams to ``target`` (ours) as it comes, noting whether
    it said its ``row``'s own failure, and what it said of a rank that a signal ended (hydra's
    "Killed (signal 9)", on its stdout). A copy that cannot be written (our stream closed) still
    drains the launcher's, which must not block on a full pipe."""

    def __init__(self, pipe, target, row: launchers.Kind) -> None:
        self.said = False
        self.killed = ""
        self._pipe, self._target, self._row = pipe, target, row
        self._thread = threading.Thread(target=self._copy, daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        last = b""
        for chunk in iter(lambda: os.read(self._pipe.fileno(), 1 << 16), b""):
            try:
                self._target.buffer.write(chunk)
                self._target.buffer.flush()
            except (OSError, ValueError):
                pass
            seen = last[-200:] + chunk
            self.said = self.said or self._row.own_failure.encode() in seen
            killed = re.search(self._row.says_killed.encode(), seen)
            if killed and not self.killed:
                self.killed = killed[1].decode(errors="replace")
            last = chunk

    def finish(self) -> None:
        """Wait for the rest (not for ranks that outlive the launcher, holding the pipe)."""
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self._pipe.close()


def _died_here(records: Sequence[Optional[dict]]) -> List[int]:
    """The ranks on this host (as the OS knows it: simulated nodes share it) that have died
    without recording their end (ranks elsewhere are the watchdog's and the heartbeats' to
    judge)."""
    host = socket.gethostname()
    return [r["rank"] for r in records if r is not None and r["state"] == exit_records.RUNNING
            and r["host"] == host and not alive(r["pid"])]


def _who(record: dict) -> str:
    """The rank, on the node its launcher gave it (a simulated node's name, where the OS knows
    one host), as cupycomm's other messages say it."""
    return f"rank {record['rank']} (host {record['node']}, pid {record['pid']})"


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def verdict(records: Sequence[Optional[dict]], returncode: int, launcher: str = "mpiexec",
            stopped_by: Optional[int] = None, died: Sequence[int] = (),
            launcher_failed: bool = False, strays: Sequence[dict] = (),
            killed: str = "",
            before_init: Sequence[Tuple[int, Optional[int]]] = ()) -> Tuple[int, str]:
    """(exit status, one line saying why; '' when the job succeeded) of a job whose ranks
    left ``records`` (:meth:`cupycomm.run.exit_records.JobDirectory.read`) and whose
    launcher exited with ``returncode`` (negative: killed by that signal); ``died``: ranks
    seen dead while the job ran (named first: the others were killed after them);
    ``launcher_failed``: the launcher said it failed on its own at the job's end (see the
    module's docstring); ``strays``: the records of processes whose world was not the job's
    (:meth:`cupycomm.run.exit_records.JobDirectory.read_strays`); ``killed``: what the
    launcher said of a rank that a signal ended ("Killed (signal 9)": hydra's status is then
    9); ``before_init``: (rank, pid or None: never seen) of the ranks on this host seen gone
    before they recorded anything (``cupycomm.run.ranks``), while the job went on.

    Example::

        verdict([{"rank": 0, "state": "ended", ...}, {"rank": 1, "state": "running", ...}], 0)
        # (1, 'cupycomm.run: rank 1 (host a, pid 7) ended without finishing (it recorded no
        #  end: os._exit, a signal or a crash); mpiexec exited 0')
    """
    status = 128 - returncode if returncode < 0 else returncode
    exited = (f"{launcher} was killed by signal {-returncode}" if returncode < 0
              else f"{launcher} exited {returncode}")
    if stopped_by is not None:
        return 128 + stopped_by, (f"cupycomm.run: stopped by {signal.Signals(stopped_by).name}, "
                                  f"forwarded to the job; {exited}")
    if before_init:
        gone, pid = before_init[0]
        others = [rank for rank, _ in before_init[1:]]
        where = socket.gethostname() + (f", pid {pid}" if pid is not None else "")
        too = f"; {_ranks(others)} too" if others else ""
        said = records[gone] if gone < len(records) else None
        how = (f"raised {said['detail']}" if said is not None and said.get("before_init")
               else "ended")
        return status or 1, (
            f"cupycomm.run: rank {gone} (host {where}) {how} before calling cupycomm.init() "
            f"(its output says why), while the other ranks waited for it (in MPI_Init or "
            f"init()){too}; {exited}")
    written = [r for r in records if r is not None]
    if not written and strays:
        sizes = sorted({s["size"] for s in strays})
        raised = next((s for s in strays if s["state"] != exit_records.RUNNING), strays[0])
        # the first sentence: the processes have printed the whole of it
        said = raised["detail"].split(". ")[0].rstrip(".")
        why = f"; pid {raised['pid']} on {raised['node']} {raised['state']}: {said}" if said else ""
        return status or 1, (
            f"cupycomm.run: {len(strays)} process{'es' * (len(strays) != 1)} called "
            f"cupycomm.init() in a world of {' or '.join(map(str, sizes))} "
            f"rank{'s' * (sizes != [1])}, none in the job's world of {len(records)}{why}; "
            f"{exited}")
    if not written:
        if status:
            return status, f"cupycomm.run: {exited}; no rank called cupycomm.init()"
        return 0, ""
    by_state: Dict[str, List[dict]] = {}
    for r in written:
        by_state.setdefault(r["state"], []).append(r)
    missing = [rank for rank, r in enumerate(records) if r is None]
    unfinished = [r["rank"] for r in by_state.get(exit_records.RUNNING, [])]
    if len(by_state.get(exit_records.ENDED, [])) == len(records):
        if status and launcher_failed and returncode > 0:
            return 0, (f"cupycomm.run: every rank reached its end; {exited} after failing on "
                       f"its own as the job ended (hydra's race with its exiting proxies)")
        if status and killed:
            return status, (f"cupycomm.run: every rank reached its end, but then a rank was "
                            f"ended by a signal ({launcher} said: {killed}); {exited}")
        if status:
            return status, (f"cupycomm.run: every rank reached its end, but {exited} (a rank "
                            f"called sys.exit with a non-zero code?)")
        return 0, ""
    recovered = _recovered(records, by_state)
    if recovered:
        return 0, f"cupycomm.run: {recovered}; {exited}"
    if exit_records.RAISED in by_state or exit_records.ABORTED in by_state:
        first = (by_state.get(exit_records.RAISED) or by_state[exit_records.ABORTED])[0]
        how = "raised" if first["state"] == exit_records.RAISED else "ended the job:"
        reason = f"{_who(first)} {how} {first['detail']}"
    else:
        running = by_state.get(exit_records.RUNNING, [])
        first = next((r for r in running if r["rank"] in died), running[0] if running else None)
        unfinished = [rank for rank in unfinished if first is None or rank != first["rank"]]
        reason = (f"{_who(first)} ended without finishing (it recorded no end: os._exit, a "
                  f"signal or a crash)" if first else "")
    parts = [reason] if reason else []
    if unfinished:
        parts.append(f"{_ranks(unfinished)} did not finish")
    if missing:
        parts.append(f"{_ranks(missing)} never called cupycomm.init()")
    parts.append(exited)
    return status or 1, "cupycomm.run: " + "; ".join(parts)


def _recovered(records: Sequence[Optional[dict]], by_state: Dict[str, List[dict]]) -> str:
    """A line naming the lost ranks, where the program said that it recovered from losing
    them: every rank recorded its end, or ended without one and each rank that ended went on
    without it (its ``survived``: ``comm.shrink()``); else ''. A survivor's own non-zero
    ``sys.exit`` is not told apart (the launcher's status mixes it with the lost ranks')."""
    ended = by_state.get(exit_records.ENDED, [])
    lost = by_state.get(exit_records.RUNNING, [])
    if not lost or not ended or len(ended) + len(lost) != len(records):
        return ""
    gone = {r["rank"] for r in lost}
    if any(not gone <= set(r.get("survived", ())) for r in ended):
        return ""
    return (f"{'; '.join(_who(r) for r in lost)} lost: {_ranks([r['rank'] for r in ended])} "
            f"went on without {'it' if len(lost) == 1 else 'them'} (comm.shrink()) and "
            f"finished")


def _job_directory(parent: Optional[str]) -> exit_records.JobDirectory:
    where = parent or os.getcwd()
    if not os.access(where, os.W_OK):
        if parent:
            raise UsageError(f"--job-dir {parent!r} is not a writable directory")
        where = tempfile.gettempdir()
    return exit_records.JobDirectory(tempfile.mkdtemp(prefix=".cupycomm-run-", dir=where))


def _prog() -> str:
    """How the user called this tool: ``cupycomm-run`` or ``python -m cupycomm.run``."""
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    return name if name == "cupycomm-run" else "python -m cupycomm.run"


class _Refused(Exception):
    """A command line that parses but cannot run here; the message says why, in one line."""


def _check(options: Options, launcher: launchers.Launcher) -> None:
    row = launchers.KINDS[launcher.kind]
    if options.survivors and not row.survivors:
        raise _Refused(f"--survivors: {launcher.executable} ({launcher.kind}) cannot let "
                       f"ranks go on past a lost one; Open MPI 5's mpiexec can")
    consent = row.root_consent
    if (consent and os.geteuid() == 0 and not all(name in os.environ for name in consent)
            and "--allow-run-as-root" not in options.launcher_args):
        raise _Refused(f"{launcher.executable} ({launcher.kind}) refuses to run as root: "
                       f"set {' '.join(f'{name}=1' for name in consent)} (or pass "
                       f"--allow-run-as-root)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the job that ``argv`` (default: ``sys.argv[1:]``) describes; return its status."""
    try:
        options = parse(sys.argv[1:] if argv is None else argv)
        launcher = launchers.find(options.mpiexec)
        _check(options, launcher)
        directory = _job_directory(options.job_dir)
    except UsageError as why:
        usage = USAGE.replace("cupycomm-run", _prog(), 1)
        if not str(why):
            sys.stdout.write(usage)
            return 0
        sys.stderr.write(f"{usage}\ncupycomm.run: {why}\n")
        return 2
    except (_Refused, FileNotFoundError, SharedFileRefused) as why:
        sys.stderr.write(f"cupycomm.run: {why}\n")
        return 2
    variables = {"CUPYCOMM_RUN_DIR": directory.path, "CUPYCOMM_RUN_SIZE": str(options.n)}
    if options.timeout is not None:
        variables["CUPYCOMM_TIMEOUT"] = repr(options.timeout)
    if options.debug:
        variables["CUPYCOMM_DEBUG"] = "1"
    env = launcher.environment(os.environ)
    env.update(variables)
    argv_ = _job_argv(options, launcher, list(variables))
    row = launchers.KINDS[launcher.kind]
    forwarder = _Forwarder(row.stop, options.survivors)
    try:
        piped = subprocess.PIPE if row.own_failure else None
        # SIGPIPE stays ignored, as in this Python: hydra with simulated nodes was killed by
        # it (status -13) after every rank had finished, writing to a proxy already gone
        child = subprocess.Popen(argv_, env=env, start_new_session=True, stdout=piped,
                                 stderr=piped, restore_signals=False)
        copies = ([_Copy(child.stdout, sys.stdout, row), _Copy(child.stderr, sys.stderr, row)]
                  if row.own_failure else [])
        returncode = forwarder.wait(child, directory, options.n)
        for copy in copies:
            copy.finish()
        status, line = verdict(directory.read(options.n), returncode,
                               os.path.basename(launcher.executable), forwarder.signal,
                               forwarder.died, any(copy.said for copy in copies),
                               directory.read_strays(),
                               next((copy.killed for copy in copies if copy.killed), ""),
                               forwarder.before_init)
    finally:
        forwarder.restore()
        directory.remove()
    if line:
        sys.stderr.write(line + "\n")
    return status
