"""What cupycomm knows about MPI launchers: how to name one, the flags a job needs, its variables.

Each kind of launcher, and the MPI it starts, is a row (:class:`Kind`) of :data:`KINDS` (the
reference prints it), told apart by what its ``--version`` prints; anything else is ``other``:
it gets a plain ``-n N``. :func:`find` names the launcher of the environment we run in;
:meth:`Launcher.command` gives the argv of a job up to the program, and
:meth:`Launcher.environment` the environment of a job started from inside a rank. ``python -m
cupycomm.run.launchers -n 3`` prints that argv, shell-quoted (``tests/run.sh`` uses it).
:data:`JOB_VARIABLES` lists the variables by which a launcher tells its ranks about their job;
:func:`started_by_a_launcher` tells a launcher's rank from a process started on its own by
them. :func:`library_kind` names the MPI library from ``MPI.Get_library_version()``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Launcher", "find", "nested_environment", "started_by_a_launcher", "library_kind",
           "Kind", "KINDS", "JobVariable", "JOB_VARIABLES", "job_variables"]


@dataclasses.dataclass(frozen=True)
class Kind:
    """A row of :data:`KINDS`: what cupycomm knows of a launcher and of the MPI it starts.

    Example::

        KINDS["openmpi"].prefix_output   # ('--tag-output',)
    """
    signature: str                                #: a regex on what ``--version`` prints
    cleanup: Tuple[str, ...] = ()                 #: options that leave a failed job to cupycomm
    oversubscribe: Tuple[str, ...] = ()           #: options to start more ranks than cores
    gives: Tuple[str, ...] = ()                   #: variables given to ranks (``X_*`` a prefix)
    gives_as_configuration: Tuple[str, ...] = ()  #: given ones named like the user's settings
    survivors: Tuple[str, ...] = ()               #: options letting ranks outlive a lost one
    prefix_output: Tuple[str, ...] = ()           #: options prefixing output lines with the rank
    export: str = ""                              #: the option passing a variable to other nodes
    stop: int = signal.SIGKILL                    #: the signal that ends its session first
    root_consent: Tuple[str, ...] = ()            #: variables (each =1) it needs to run as root
    own_failure: str = ""                         #: what it says failing on its own at a job's end
    says_killed: str = r"(?!)"                    #: a regex whose group 1 names a rank's signal
    simulates_nodes: bool = False                 #: it can run ranks on nodes of made-up names
    mpi: str = ""                                 #: :func:`library_kind`'s name of its MPI
    library: str = r"(?!)"                        #: a regex on its MPI's library version
    mpi_name: str = ""                            #: its MPI, as messages name it


# Measured by diffing `env` in a rank against its parent (the MPICH 4, Open MPI 5.0.11 and
# Intel MPI 2021 wheels) and, for Slurm, from srun(1)'s OUTPUT ENVIRONMENT VARIABLES. Order
# matters for recognition: Intel's mpiexec is a hydra too, so it is tried first.
#: The row of each kind of launcher, by name (:class:`Kind`).
KINDS: Dict[str, Kind] = {
    "intelmpi": Kind(
        signature=r"Intel\(R\) MPI",
        cleanup=("-disable-auto-cleanup",),
        gives=("PMI_*", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "HYDI_*", "HYDRA_BSTRAP_*",
               "HYDRA_IP_VERSION", "HYDRA_LAUNCH_TYPE", "I_MPI_INFO_*", "I_MPI_PIN_INFO",
               "I_MPI_PIN_MAPPING", "I_MPI_HYDRA_UUID", "I_MPI_HYDRA_TOPOLIB",
               "I_MPI_BIND_WIN_ALLOCATE", "I_MPI_INTERNAL_MEM_POLICY",
               "I_MPI_RETURN_WIN_MEM_NUMA"),
        # no simulated nodes: made-up host names fail ("Unable to run bstrap_proxy on node0")
        prefix_output=("-prepend-rank",), mpi="intelmpi", library=r"Intel\(R\) MPI",
        mpi_name="Intel MPI"),
    "hydra": Kind(
        signature=r"HYDRA",
        cleanup=("-disable-auto-cleanup",),
        gives=("PMI_*", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "HYDI_*"),
        # with -disable-auto-cleanup on several nodes, at a rank's exit (see cupycomm.run.job)
        prefix_output=("-prepend-rank",), own_failure="unable to send SIGUSR1 downstream",
        says_killed=r"EXIT STRING: (\w[\w ]* \(signal \d+\))",   # its status: the number
        simulates_nodes=True, mpi="mpich", library=r"MPICH|MVAPICH", mpi_name="MPICH"),
    "openmpi": Kind(
        signature=r"Open MPI|OpenRTE|PRRTE|prterun",
        oversubscribe=("--oversubscribe",),
        gives=("OMPI_*", "PMIX_*", "PRTE_*", "OPAL_USER_PARAMS_GIVEN"),
        # 5.x sets the first four; 4.x's mpirun the orte_*, ess and pmix ones
        gives_as_configuration=("OMPI_MCA_PREFIXES", "OMPI_MCA_cpu_type",
                                "OMPI_MCA_initial_wdir", "OMPI_MCA_num_procs",
                                "OMPI_MCA_orte_*", "OMPI_MCA_ess", "OMPI_MCA_ess_base_*",
                                "OMPI_MCA_pmix", "OMPI_MCA_shmem_RUNTIME_QUERY_hint"),
        # MPI's ULFM; the TCP transport, without which a rank's non-zero exit or MPI_Abort is
        # not reported to the survivors (PRRTE reports it as PMIX_ERR_EXIT_NONZERO_TERM, which
        # ULFM does not listen for); no fence at the start of MPI_Finalize, where survivors
        # were seen waiting for ever (5.0.11: 2 jobs of 10). See cupycomm.survivors.
        survivors=("--with-ft", "ulfm", "--mca", "btl", "tcp,self",
                   "--mca", "async_mpi_finalize", "1"),
        # it passes on only the variables it is told to; as root, without consent, it refuses
        prefix_output=("--tag-output",), export="-x",
        root_consent=("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"),
        mpi="openmpi", library=r"Open MPI", mpi_name="Open MPI"),
    "srun": Kind(
        # Debian and Ubuntu spell their build slurm-wlm; an srun that finds no slurm.conf
        # prints only its complaints, each starting "srun: "
        signature=r"^slurm(-wlm)? \d|^srun: ",
        cleanup=("--kill-on-bad-exit=0",),
        gives=("PMI_*", "PMIX_*", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
               "SLURM_GTIDS", "SLURM_TASK_PID", "SLURM_STEP_*", "SLURM_STEPID",
               "SLURM_SRUN_COMM_*", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_CPU_BIND*",
               "SLURM_TOPOLOGY_ADDR*", "SLURM_PRIO_PROCESS", "SLURM_UMASK",
               "SLURM_DISTRIBUTION", "SLURMD_NODENAME"),
        # killed, it gives back no allocation it made (the job stays RUNNING with no task,
        # unless InactiveLimit is set); on SIGTERM it ends its tasks and gives it back
        prefix_output=("--label",), stop=signal.SIGTERM),
    "other": Kind(signature=r"(?!)", mpi="other", mpi_name="this MPI"),
}

# The user's configuration inside the launchers' namespaces: kept although a prefix above
# (OMPI_*, PMIX_*, PRTE_*) matches, unless a row lists the name in gives_as_configuration.
_CONFIGURATION = ("OMPI_MCA_*", "PMIX_MCA_*", "PRTE_MCA_*", "OMPI_ALLOW_RUN_AS_ROOT",
                  "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "OMPI_CC", "OMPI_CXX", "OMPI_FC",
                  "OMPI_CPPFLAGS", "OMPI_CFLAGS", "OMPI_CXXFLAGS", "OMPI_FCFLAGS",
                  "OMPI_LDFLAGS", "OMPI_LIBS")
# cupycomm.run is a launcher too: its job directory and size belong to that job alone, not to
# a job one of its ranks starts (whose ranks would overwrite the outer ranks' records).
_GIVEN = tuple(p for row in KINDS.values() for p in row.gives) + ("CUPYCOMM_RUN_DIR",
                                                                   "CUPYCOMM_RUN_SIZE")
_GIVEN_AS_CONFIGURATION = tuple(p for row in KINDS.values() for p in row.gives_as_configuration)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


def _given_by_a_launcher(name: str) -> bool:
    if _matches(name, _GIVEN_AS_CONFIGURATION):
        return True
    return _matches(name, _GIVEN) and not _matches(name, _CONFIGURATION)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # macOS
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class Launcher:
    """A launcher found on this machine.

    Attributes:
        kind: its row's name in :data:`KINDS` (``"hydra"``, ``"openmpi"``, ... ``"other"``).
        executable: the absolute path of mpiexec / mpirun / srun.
        version: the first line its ``--version`` printed, and the first line with a
            version number where the first has none (hydra's).
    """
    kind: str
    executable: str
    version: str

    @property
    def cleanup_options(self) -> List[str]:
        """The options that leave the ending of a failed job to cupycomm (``[]`` if none).

        hydra (MPICH's and Intel's) kills every rank itself when one exits without
        ``MPI_Finalize``, racing cupycomm's watchdog, and for an ``os._exit(0)`` then sometimes
        exits 0; with ``-disable-auto-cleanup`` the survivors go on and the watchdog (or the
        pytest plugin's hang guard) names the rank and ends the job non-zero. srun gets
        ``--kill-on-bad-exit=0`` for the same reason. Open MPI reports such an exit itself and
        gets nothing.
        """
        return list(KINDS[self.kind].cleanup)

    def command(self, n: int, *, leave_cleanup_to_cupycomm: bool = False,
                survivors: bool = False) -> List[str]:
        """The argv of an ``n``-rank job up to the program.

        ``[mpiexec, "-n", "3", ...]`` plus the options this launcher needs: Open MPI's
        ``--oversubscribe`` when ``n`` is more than this machine's cores, with
        ``leave_cleanup_to_cupycomm`` the :attr:`cleanup_options`, and with ``survivors``
        those that let ranks go on past a lost one (``init(on_peer_loss="raise")``: Open
        MPI's ``--with-ft ulfm --mca btl tcp,self ...``; ValueError for a launcher that
        cannot).

        Example::

            argv = find().command(3) + [sys.executable, "train.py"]
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Launcher.command: n must be a number of ranks >= 1, got {n!r}")
        row = KINDS[self.kind]
        if survivors and not row.survivors:
            raise ValueError(f"Launcher.command: {self.executable} ({self.kind}) cannot let "
                             f"ranks go on past a lost one; Open MPI 5's mpiexec can (with "
                             f"--with-ft ulfm)")
        argv = [self.executable, *(row.cleanup if leave_cleanup_to_cupycomm else ()),
                *(row.survivors if survivors else ()), "-n", str(n)]
        if n > _cores():
            argv += row.oversubscribe
        return argv

    def environment(self, environ: Mapping[str, str]) -> Dict[str, str]:
        """The environment for a job started from inside a rank.

        Drops the variables that MPI launchers give their ranks (every kind's, not only this
        one's: a test run under srun may start a job with mpiexec), so that the job starts as a
        job of its own; keeps the user's configuration (``OMPI_MCA_*``, ``PMIX_MCA_*``, the
        run-as-root consent, ``I_MPI_*`` and ``MPIR_CVAR_*`` settings, ``HYDRA_*``, the Slurm
        allocation's ``SLURM_JOB_*``).

        Example::

            env = find().environment(os.environ)
            assert "PMI_RANK" not in env
        """
        return nested_environment(environ)


def nested_environment(environ: Mapping[str, str]) -> Dict[str, str]:
    """:meth:`Launcher.environment`, for when no launcher is at hand yet."""
    return {k: v for k, v in environ.items() if not _given_by_a_launcher(k)}


@dataclasses.dataclass(frozen=True)
class JobVariable:
    """A variable by which a launcher tells each rank it starts about its job."""
    name: str
    says: str      # "size" (the ranks it started), "rank", "local rank" or "node" (its name)
    set_by: str    # the launchers that set it, as messages name them


# Measured with srun 22.05 and the MPICH 4, Intel MPI 2021 and Open MPI 5 wheels' launchers.
# A launcher started from inside another's rank (hydra's proxies under srun, say) leaves the
# outer one's variables beside its own. The salloc/sbatch shell's SLURM_NTASKS is the
# allocation's, not a job's (srun's is SLURM_STEP_NUM_TASKS), and a batch script has
# SLURM_PROCID and SLURM_LOCALID too: neither tells a launcher's rank.
#: The variables by which each launcher tells its ranks about their job (its size, a rank, a
#: rank's place on its node, the node's name), whatever the job's size. The one table that
#: ``started_by_a_launcher()``, ``init()``'s checks and ``node_name()`` read.
JOB_VARIABLES: Tuple[JobVariable, ...] = (
    JobVariable("PMI_SIZE", "size",
                "a PMI launcher (MPICH's or Intel MPI's mpiexec, srun --mpi=pmi2)"),
    JobVariable("OMPI_COMM_WORLD_SIZE", "size", "Open MPI's mpiexec"),
    JobVariable("SLURM_STEP_NUM_TASKS", "size", "srun"),
    JobVariable("PMI_RANK", "rank", "a PMI launcher"),
    JobVariable("PMIX_RANK", "rank", "a PMIx launcher (PRRTE, srun --mpi=pmix)"),
    JobVariable("OMPI_COMM_WORLD_RANK", "rank", "Open MPI's mpiexec"),
    JobVariable("OMPI_COMM_WORLD_LOCAL_RANK", "local rank", "Open MPI's mpiexec"),
    JobVariable("MPI_LOCALRANKID", "local rank", "MPICH's or Intel MPI's mpiexec"),
    JobVariable("SLURM_LOCALID", "local rank", "srun"),
    JobVariable("PMI_HOSTNAME", "node", "MPICH's mpiexec (a simulated node's name too)"),
    JobVariable("SLURMD_NODENAME", "node", "srun (its slurmd's)"),
)


def job_variables(says: str) -> Dict[str, str]:
    """The :data:`JOB_VARIABLES` that say ``says``, each with who sets it.

    Example::

        assert job_variables("size")["SLURM_STEP_NUM_TASKS"] == "srun"
    """
    return {v.name: v.set_by for v in JOB_VARIABLES if v.says == says}


def started_by_a_launcher(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is that of a rank a launcher started (``mpiexec -n 1`` and ``srun
    -n 1`` included), rather than of a process started on its own (an MPI singleton): it
    has a variable of :data:`JOB_VARIABLES` that says a rank or a job's size.

    Example::

        if not started_by_a_launcher(os.environ):
            print("not under mpiexec: this process is a world of one")
    """
    return any(v.name in environ for v in JOB_VARIABLES if v.says in ("rank", "size"))


def find(executable: Optional[str] = None) -> Launcher:
    """The launcher of the environment we run in.

    ``executable`` (a path or a name on PATH), else ``$MPIEXEC``, else the ``mpiexec`` beside
    ``sys.executable`` (a virtual environment's MPI wheel), else the one on PATH.

    Raises:
        FileNotFoundError: there is none, or ``executable``/``$MPIEXEC`` names none.
    """
    wanted = executable or os.environ.get("MPIEXEC") or None
    if wanted:
        path = shutil.which(wanted)
        if path is None:
            source = "executable" if executable else "$MPIEXEC"
            raise FileNotFoundError(f"launchers.find: {source} {wanted!r} is not an "
                                    f"executable file or a command on PATH")
    else:
        here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        path = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
        if path is None:
            raise FileNotFoundError(
                "launchers.find: no mpiexec beside this Python or on PATH, and MPIEXEC is "
                "not set; install an MPI (pip install 'cupycomm[mpich]', or your system's) "
                "or set MPIEXEC=/path/to/mpiexec (or srun)")
    return _identify(os.path.abspath(path))


@functools.lru_cache(maxsize=None)
def _identify(path: str) -> Launcher:
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True,
                              errors="replace", timeout=60, stdin=subprocess.DEVNULL,
                              env=nested_environment(os.environ))
        said = (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        said = f"({path} --version failed: {e})"
    kind = next((k for k, row in KINDS.items()
                 if re.search(row.signature, said, re.MULTILINE)), "other")
    lines = [" ".join(line.split()) for line in said.splitlines() if line.strip()]
    version = lines[0] if lines else ""
    if lines and not _VERSION.search(version):   # hydra: "HYDRA build details:", then it
        version = " ".join([version, next((line for line in lines if _VERSION.search(line)),
                                          "")]).strip()
    return Launcher(kind, path, version)


_VERSION = re.compile(r"\d+\.\d+")


def library_kind(version: str) -> str:
    """The MPI library that ``MPI.Get_library_version()`` describes (its row's
    :attr:`Kind.mpi`): ``"mpich"``, ``"openmpi"``, ``"intelmpi"`` or ``"other"`` (hydra starts
    MPICH's ranks, ``openmpi`` Open MPI's, ``intelmpi`` Intel's; srun any built with its PMI).

    Example::

        library_kind("Open MPI v5.0.11, package: ...")   # 'openmpi'
    """
    return next((row.mpi for row in KINDS.values() if re.search(row.library, version)), "other")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cupycomm.run.launchers",
        description="Print the argv (shell-quoted) that starts an N-rank job with the launcher "
                    "of this environment; without -n, say which launcher that is.")
    parser.add_argument("-n", type=int, help="the number of ranks")
    parser.add_argument("--leave-cleanup-to-cupycomm", action="store_true",
                        help="add the launcher's option that lets cupycomm end a failed job")
    parser.add_argument("--mpiexec", help="the launcher (default: $MPIEXEC, the mpiexec "
                                          "beside this Python, the one on PATH)")
    args = parser.parse_args(argv)
    try:
        launcher = find(args.mpiexec)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    if args.n is None:
        print(f"{launcher.kind} {launcher.executable}: {launcher.version}")
        return 0
    if args.n < 1:
        parser.error(f"-n must be >= 1, got {args.n}")
    argv_ = launcher.command(args.n, leave_cleanup_to_cupycomm=args.leave_cleanup_to_cupycomm)
    print(" ".join(shlex.quote(a) for a in argv_))
    return 0


if __name__ == "__main__":
    sys.exit(main())
