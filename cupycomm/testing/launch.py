"""Run ``mpiexec -n N python ...`` from a test, with a hard time bound.

For tests that must start a job of their own: fault scripts, examples, the plugin's own
scratch suites. The launcher is the environment's (:func:`cupycomm.run.launchers.find`), with the
options it needs (Open MPI's ``--oversubscribe`` past the cores). The child job gets the
parent's environment without the variables that MPI launchers give their ranks, keeping the
user's launcher configuration (:meth:`cupycomm.run.launchers.Launcher.environment`), so that it
starts as a job of its own even when the test itself runs under ``mpiexec``.
:func:`no_auto_cleanup` gives the options that leave the ending of a failed job to cupycomm;
:func:`simulated_nodes`, those that spread a job's ranks over nodes that exist in name only.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set

from ..run import launchers

__all__ = ["Launched", "run_mpiexec", "run_job", "start_mpiexec", "kill", "launch_environment",
           "no_auto_cleanup", "simulated_nodes", "SIMULATES_NODES"]

#: The kinds of launcher (:attr:`cupycomm.run.launchers.Launcher.kind`) that can simulate nodes
#: (:attr:`cupycomm.run.launchers.Kind.simulates_nodes`).
SIMULATES_NODES = tuple(kind for kind, row in launchers.KINDS.items() if row.simulates_nodes)


@dataclasses.dataclass(frozen=True)
class Launched:
    """What a job did: its exit status, its output, how long it ran.

    ``timed_out`` is True when the job outlived its bound and was killed; ``returncode`` is
    then the kill signal's negative number.
    """
    argv: Sequence[str]
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    timed_out: bool

    @property
    def output(self) -> str:
        """stdout then stderr, for assertions on what was printed anywhere."""
        return self.stdout + self.stderr


def launch_environment(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """This process's environment without the launcher's variables and cupycomm.run's job
    directory (a job of its own records its ranks' ends apart), plus ``extra``."""
    env = launchers.nested_environment(os.environ)
    env.update(extra or {})
    return env


def _check_job(caller: str, n: Any, timeout: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{caller}: n must be a number of ranks >= 1, got {n!r}")
    if not timeout > 0:
        raise ValueError(f"{caller}: timeout must be a positive number of seconds, got "
                         f"{timeout!r}")


def run_mpiexec(n: int, *args: str, timeout: float, env: Optional[Mapping[str, str]] = None,
                cwd: Optional[str] = None, mpiexec: Optional[str] = None,
                mpiexec_args: Sequence[str] = ()) -> Launched:
    """Run ``mpiexec *mpiexec_args -n n python *args`` and wait at most ``timeout`` seconds.

    Args:
        n: the number of ranks.
        *args: the arguments of python: a script and its arguments, or ``-m module ...``.
        timeout: the hard bound; past it the whole job (mpiexec, its proxies and the ranks,
            one process group) is killed and ``timed_out`` is set.
        env: variables to add to the scrubbed environment (see :func:`launch_environment`).
        cwd: the directory to run in.
        mpiexec: the launcher; default: :func:`cupycomm.run.launchers.find`'s (``$MPIEXEC``,
            the ``mpiexec`` next to this Python, else the one on PATH).
        mpiexec_args: more options of the launcher, e.g. :func:`no_auto_cleanup`'s.

    Example::

        job = run_mpiexec(2, "examples/mean_across_ranks.py", timeout=60)
        assert job.returncode == 0, job.output
    """
    _check_job("run_mpiexec", n, timeout)
    start = time.monotonic()
    note = ""
    with start_mpiexec(n, *args, env=env, cwd=cwd, mpiexec=mpiexec, mpiexec_args=mpiexec_args,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE) as job:
        timed_out, alone = False, _Alone(job.pid)
        while True:
            try:   # retried after a timeout, communicate() loses no output
                stdout, stderr = job.communicate(timeout=_POLL)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - start >= timeout:
                    timed_out = True
                elif not alone.outlived():
                    continue
                else:
                    note = (f"\nrun_mpiexec: the launcher outlived every process it started "
                            f"by {_OUTLIVED:g} s: killed (Open MPI 5's prterun was seen to hang "
                            f"so after MPI_Abort; open-mpi/ompi#12064)\n")
                kill(job)
                stdout, stderr = job.communicate()
                break
    return Launched(job.args, job.returncode, stdout, stderr + note, time.monotonic() - start,
                    timed_out)


_POLL = 0.5       # seconds between looks at a running job
_OUTLIVED = 2.0   # how long a launcher may outlive every process it started


class _Alone:
    """Whether a launcher (``pid``, the leader of the job's session) has been alone in its
    session for ``_OUTLIVED`` seconds after others (its ranks, proxies) were seen in it: the
    job is over and the launcher hangs. A launcher whose ranks never run in its session
    (srun: slurmd starts them) is never alone in this sense."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._seen = False
        self._since: Optional[float] = None

    def outlived(self) -> bool:
        if _session_members(self._pid) - {self._pid}:
            self._seen, self._since = True, None
            return False
        if not self._seen:
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
        return now - self._since >= _OUTLIVED


def _session_members(session: int) -> Set[int]:
    """The live (not zombie) processes of ``session``, from /proc (empty where there is
    none: then no launcher is ever found alone)."""
    members: Set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue   # gone meanwhile
        if fields[0] != "Z" and int(fields[3]) == session:
            members.add(int(name))
    return members


def start_mpiexec(n: int, *args: str, env: Optional[Mapping[str, str]] = None,
                  cwd: Optional[str] = None, mpiexec: Optional[str] = None,
                  mpiexec_args: Sequence[str] = (), stdout: Any = None,
                  stderr: Any = None) -> "subprocess.Popen[str]":
    """Start ``mpiexec *mpiexec_args -n n python *args`` and return at once (the arguments
    as :func:`run_mpiexec`'s; ``stdout`` and ``stderr`` as :class:`subprocess.Popen`'s).

    The job runs in a session of its own: :func:`kill` ends mpiexec, its proxies and the
    ranks together.

    Example::

        with open("job.log", "w") as log:
            job = start_mpiexec(3, "-m", "pytest", "tests/", stdout=log, stderr=log)
        ...
        if job.poll() is None:
            kill(job)
    """
    command = launchers.find(mpiexec).command(n)  # which checks n
    argv = [command[0], *mpiexec_args, *command[1:], sys.executable, *args]
    # SIGPIPE left ignored, as in this Python: hydra with simulated nodes was seen killed by it
    # (status -13) after every rank had finished; ignored, a write to a gone proxy just fails
    return subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, errors="replace",
                            env=launch_environment(env), cwd=cwd, start_new_session=True,
                            restore_signals=False)


def kill(job: "subprocess.Popen[str]") -> None:
    """Kill a job that :func:`start_mpiexec` started: mpiexec and every rank it started (one
    signal to its process group), then reap mpiexec.

    Example::

        kill(job)
        assert job.returncode == -signal.SIGKILL
    """
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already (and mpiexec ended)
        pass
    job.wait()


def run_job(n: int, *args: str, timeout: float, env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None, options: Sequence[str] = ()) -> Launched:
    """Run ``python -m cupycomm.run -n n *options *args`` (a job whose exit status is non-zero
    if any rank did not finish) and wait at most ``timeout`` seconds.

    ``args`` are the program (``script.py ...`` or ``-m module ...``), ``options`` those of
    cupycomm.run and of the launcher; ``env`` and ``cwd`` as :func:`run_mpiexec`'s. Past
    ``timeout``, cupycomm.run gets SIGTERM (it ends the job, killing it 10 s later if need
    be; SIGKILL follows 15 s later) and ``timed_out`` is set.

    Example::

        job = run_job(4, "examples/mean_across_ranks.py", timeout=60)
        assert job.returncode == 0, job.output
    """
    _check_job("run_job", n, timeout)
    argv = [sys.executable, "-m", "cupycomm.run", "-n", str(n), *options, *args]
    start = time.monotonic()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace", env=launch_environment(env), cwd=cwd,
                          stdin=subprocess.DEVNULL, start_new_session=True) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                stdout, stderr = job.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                kill(job)
                stdout, stderr = job.communicate()
            timed_out = True
    return Launched(argv, job.returncode, stdout, stderr, time.monotonic() - start, timed_out)


def no_auto_cleanup(mpiexec: Optional[str] = None) -> List[str]:
    """The launcher's options that leave the ending of a failed job to cupycomm.

    ``["-disable-auto-cleanup"]`` for hydra (MPICH's and Intel MPI's mpiexec),
    ``["--kill-on-bad-exit=0"]`` for srun, else ``[]``: see
    :attr:`cupycomm.run.launchers.Launcher.cleanup_options`.

    Example::

        job = run_mpiexec(3, "scenario.py", timeout=60, mpiexec_args=no_auto_cleanup())
    """
    return launchers.find(mpiexec).cleanup_options


def simulated_nodes(*ranks_per_node: int, mpiexec: Optional[str] = None) -> List[str]:
    """The launcher's options that put ``ranks_per_node[i]`` ranks on a node named
    ``node0``, ``node1``, ... of this machine, for a job of ``sum(ranks_per_node)`` ranks.

    hydra believes the host names it is given: with its ``fork`` launcher every rank runs
    here, but MPI's shared-memory split (local ranks, the node board) and the heartbeats
    between nodes see several nodes. Other launchers cannot: RuntimeError.

    Example::

        job = run_mpiexec(4, "train.py", timeout=60, mpiexec_args=simulated_nodes(3, 1))
    """
    if not ranks_per_node or any(isinstance(count, bool) or not isinstance(count, int)
                                 or count < 1 for count in ranks_per_node):
        raise ValueError(f"simulated_nodes: ranks_per_node must be numbers of ranks >= 1, "
                         f"got {ranks_per_node!r}")
    launcher = launchers.find(mpiexec)
    if not launchers.KINDS[launcher.kind].simulates_nodes:
        raise RuntimeError(f"simulated_nodes: {launcher.executable} ({launcher.kind}) cannot "
                           f"simulate nodes; MPICH's hydra can (Intel MPI's fails on made-up "
                           f"host names)")
    hosts = ",".join(f"node{i}:{count}" for i, count in enumerate(ranks_per_node))
    return ["-launcher", "fork", "-hosts", hosts]
