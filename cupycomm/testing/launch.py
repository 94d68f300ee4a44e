"""Run ``mpiexec -n N python ...`` from a test, with a hard time bound.

For tests that must start a job of their own: fault scripts, examples, the plugin's own
scratch suites. The child job gets the parent's environment without the variables that MPI
launchers give their ranks (``PMI_*``, ``PMIX_*``, ``HYDI_*``/``HYDRA_*``, ``MPI_LOCAL*``,
``OMPI_*``/``PRTE_*``), so that it starts as a job of its own even when the test itself runs
under ``mpiexec``. :func:`no_auto_cleanup` gives the options that leave the ending of a failed
job to cupycomm.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = ["Launched", "run_mpiexec", "launch_environment", "no_auto_cleanup"]

_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID",
                      "OMPI_", "PRTE_")


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
    """This process's environment without the launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(extra or {})
    return env


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
        mpiexec: the launcher; default: the ``mpiexec`` next to this Python, else on PATH.
        mpiexec_args: options of the launcher, e.g. ``["-disable-auto-cleanup"]``.

    Example::

        job = run_mpiexec(2, "examples/mean_across_ranks.py", timeout=60)
        assert job.returncode == 0, job.output
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"run_mpiexec: n must be a number of ranks >= 1, got {n!r}")
    if not timeout > 0:
        raise ValueError(f"run_mpiexec: timeout must be a positive number of seconds, "
                         f"got {timeout!r}")
    launcher = mpiexec or _find_mpiexec()
    argv = [launcher, *mpiexec_args, "-n", str(n), sys.executable, *args]
    start = time.monotonic()
    # A session of its own: on timeout, one signal reaches mpiexec and every rank it started.
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace", env=launch_environment(env), cwd=cwd,
                          start_new_session=True) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            stdout, stderr = job.communicate()
            timed_out = True
    return Launched(argv, job.returncode, stdout, stderr, time.monotonic() - start, timed_out)


def no_auto_cleanup(mpiexec: Optional[str] = None) -> List[str]:
    """``["-disable-auto-cleanup"]`` for MPICH's mpiexec (hydra), else ``[]``.

    When a rank's process ends without MPI_Finalize (``os._exit``, a signal), hydra kills the
    other ranks itself, racing cupycomm's watchdog, and for an ``os._exit(0)`` its own exit
    status is then sometimes 0. With the option the survivors go on, and the watchdog (or the
    pytest plugin's hang guard) names the rank and ends the job non-zero. Other launchers
    (Open MPI's ``mpirun`` reports such an exit itself) get no option.

    Example::

        job = run_mpiexec(3, "scenario.py", timeout=60, mpiexec_args=no_auto_cleanup())
    """
    return list(_cleanup_options(mpiexec or _find_mpiexec()))


@functools.lru_cache(maxsize=None)
def _cleanup_options(launcher: str) -> tuple:
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                             errors="replace", timeout=60, env=launch_environment())
    return ("-disable-auto-cleanup",) if "HYDRA" in version.stdout + version.stderr else ()


def _find_mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("run_mpiexec: no mpiexec next to this Python or on PATH; "
                                "install one (pip install mpich) or pass mpiexec=")
    return found
