"""cupycomm.run.launchers: naming a launcher, the argv of a job, the environment of a nested job.

The table's rows are checked against fake launchers (each prints what the real one prints to
--version), and the environment rules against the launcher of this environment itself: a
variable it gives a rank must be dropped, one the user had must be kept.
"""
import ast
import dataclasses
import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest

from cupycomm.run import launchers
from cupycomm.run.launchers import Launcher, find, library_kind
from cupycomm.testing import launch_environment, run_mpiexec

PACKAGE = pathlib.Path(launchers.__file__).parent.parent

VERSIONS = {   # what each launcher prints to --version (first lines, as measured)
    "hydra": "HYDRA build details:\n    Version:                                 4.3.2\n",
    "openmpi": "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/\n",
    "intelmpi": "Intel(R) MPI Library for Linux* OS, Version 2021.18.1 Build 20260626\n"
                "Copyright 2003-2026, Intel Corporation.\n",
    "srun": "slurm 23.11.4\n",
    "other": "mpirun_rsh 2.3\n",
}

# Launcher.version: the first line, and the first with a version number where it has none.
VERSION_SAID = {
    "hydra": "HYDRA build details: Version: 4.3.2",
    "openmpi": "mpiexec (Open MPI) 5.0.11",
    "intelmpi": "Intel(R) MPI Library for Linux* OS, Version 2021.18.1 Build 20260626",
    "srun": "slurm 23.11.4",
    "other": "mpirun_rsh 2.3",
}


def fake(tmp_path, name, said, where="bin"):
    folder = tmp_path / where
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\ncat <<'END'\n{said}END\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture(autouse=True)
def fresh_cache():
    launchers._identify.cache_clear()
    yield
    launchers._identify.cache_clear()


@pytest.mark.parametrize("kind", sorted(VERSIONS))
def test_each_launcher_is_named_by_what_its_version_says(tmp_path, kind):
    launcher = find(fake(tmp_path, "mpiexec", VERSIONS[kind]))
    assert launcher.kind == kind
    assert launcher.version == VERSION_SAID[kind]
    assert os.path.isabs(launcher.executable)


@pytest.mark.parametrize("said", [
    "slurm-wlm 22.05.8\n",   # Debian's and Ubuntu's build
    "slurm 20.11.9\n",
    # an srun that finds no slurm.conf (SLURM_CONF unset, no DNS SRV record), as measured
    "srun: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
    "srun: fatal: Could not establish a configuration source\n",
])
def test_srun_is_recognised_in_every_spelling(tmp_path, said):
    launcher = find(fake(tmp_path, "srun", said))
    assert launcher.kind == "srun", launcher
    assert launcher.command(2, leave_cleanup_to_cupycomm=True)[1:] == [
        "--kill-on-bad-exit=0", "-n", "2"]


def test_another_launchers_words_are_not_srun(tmp_path):
    assert find(fake(tmp_path, "mpiexec", "slurmish 1.0\nsrun-like\n")).kind == "other"


def test_find_prefers_the_argument_then_MPIEXEC_then_the_one_beside_python_then_PATH(
        tmp_path, monkeypatch):
    on_path = fake(tmp_path, "mpiexec", VERSIONS["hydra"], where="path")
    named = fake(tmp_path, "srun", VERSIONS["srun"], where="named")
    monkeypatch.setenv("PATH", os.path.dirname(on_path) + os.pathsep + "/usr/bin:/bin")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "nowhere" / "python"))
    monkeypatch.delenv("MPIEXEC", raising=False)
    assert find().executable == on_path
    beside = fake(tmp_path, "mpiexec", VERSIONS["openmpi"], where="venv")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "python"))
    assert find().executable == beside
    monkeypatch.setenv("MPIEXEC", named)
    assert find().kind == "srun"
    assert find(on_path).kind == "hydra"


def test_a_missing_launcher_is_an_error_that_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.delenv("MPIEXEC", raising=False)
    with pytest.raises(FileNotFoundError, match=r"MPIEXEC.*srun"):
        find()
    monkeypatch.setenv("MPIEXEC", "no-such-mpiexec")
    with pytest.raises(FileNotFoundError, match=r"\$MPIEXEC 'no-such-mpiexec'"):
        find()


def test_a_launcher_that_cannot_run_is_other_and_says_why(tmp_path):
    path = tmp_path / "mpiexec"
    path.write_text("#!/no/such/interpreter\n")
    path.chmod(0o755)
    launcher = find(str(path))
    assert launcher.kind == "other" and "--version failed" in launcher.version


@pytest.mark.parametrize("kind, leave, expected", [
    ("hydra", False, ["-n", "3"]),
    ("hydra", True, ["-disable-auto-cleanup", "-n", "3"]),
    ("intelmpi", True, ["-disable-auto-cleanup", "-n", "3"]),
    ("openmpi", True, ["-n", "3"]),
    ("srun", True, ["--kill-on-bad-exit=0", "-n", "3"]),
    ("other", True, ["-n", "3"]),
])
def test_command_has_the_flags_each_launcher_needs(monkeypatch, kind, leave, expected):
    monkeypatch.setattr(launchers, "_cores", lambda: 4)
    launcher = Launcher(kind, "/x/mpiexec", "")
    assert launcher.command(3, leave_cleanup_to_cupycomm=leave) == ["/x/mpiexec", *expected]


@pytest.mark.parametrize("kind", sorted(VERSIONS))
def test_only_open_mpi_asks_for_oversubscription_and_only_past_the_cores(monkeypatch, kind):
    monkeypatch.setattr(launchers, "_cores", lambda: 2)
    launcher = Launcher(kind, "/x/mpiexec", "")
    assert "--oversubscribe" not in launcher.command(2)
    assert ("--oversubscribe" in launcher.command(3)) == (kind == "openmpi")


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_command_refuses_a_number_of_ranks_that_is_not_one(n):
    with pytest.raises(ValueError, match=r"n must be a number of ranks >= 1, got"):
        Launcher("hydra", "/x/mpiexec", "").command(n)


# What a rank saw, less its parent's environment (measured: `mpiexec -n 1 env`), plus the
# user's configuration that must survive.
GIVEN = {
    "hydra": ["PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_HOSTNAME", "HYDI_CONTROL_FD",
              "MPI_LOCALNRANKS", "MPI_LOCALRANKID"],
    "openmpi": ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_UNIVERSE_SIZE",
                "OMPI_FILE_LOCATION", "OMPI_MCA_PREFIXES", "OMPI_MCA_initial_wdir",
                "OMPI_MCA_num_procs", "OMPI_MCA_cpu_type", "OMPI_MCA_orte_hnp_uri",
                "PMIX_NAMESPACE", "PMIX_RANK", "PMIX_SERVER_URI41", "PRTE_LAUNCHED",
                "OPAL_USER_PARAMS_GIVEN"],
    "intelmpi": ["PMI_RANK", "PMI_FD", "HYDRA_BSTRAP_UPSTREAM_FD", "HYDRA_LAUNCH_TYPE",
                 "I_MPI_HYDRA_UUID", "I_MPI_INFO_NP", "I_MPI_PIN_MAPPING"],
    "srun": ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_STEPID",
             "SLURM_SRUN_COMM_PORT", "SLURM_CPU_BIND_LIST", "PMI_RANK", "PMIX_RANK",
             "SLURM_STEP_NUM_TASKS", "SLURMD_NODENAME"],
}
CONFIGURATION = ["OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_rmaps_base_oversubscribe",
                 "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "PMIX_MCA_gds",
                 "PRTE_MCA_prte_default_hostfile", "I_MPI_FABRICS", "I_MPI_DEBUG",
                 "MPIR_CVAR_CH4_NETMOD", "HYDRA_LAUNCHER", "HYDRA_HOST_FILE", "SLURM_JOB_ID",
                 "SLURM_CONF", "SLURM_MPI_TYPE", "OPAL_PREFIX", "PATH", "CUPYCOMM_TIMEOUT"]


@pytest.mark.parametrize("kind", sorted(GIVEN))
def test_a_nested_job_loses_the_rank_variables_and_keeps_the_configuration(kind):
    environ = {name: "1" for name in GIVEN[kind] + CONFIGURATION}
    # whatever launcher starts the nested job: a rank of one launcher may start another's
    for nested in VERSIONS:
        assert Launcher(nested, "/x", "").environment(environ) == {
            name: "1" for name in CONFIGURATION}


@pytest.mark.mpi(max_size=1)
def test_the_real_launcher_gives_nothing_that_a_nested_job_keeps(tmp_path):
    """Measured on this environment's own launcher: a rank's environment, through
    environment(), is its parent's (the wrapper of Open MPI's wheel sets its library path)."""
    launcher = find()
    parent = launcher.environment(dict(os.environ, OMPI_MCA_cupycomm_user_setting="kept"))
    # a file per rank: two ranks' long lines on one pipe may interleave
    write = (f"import os, json; json.dump(dict(os.environ), "
             f"open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w'))")
    job = run_mpiexec(2, "-c", write, timeout=60,
                      env={"OMPI_MCA_cupycomm_user_setting": "kept"})
    assert job.returncode == 0, job.output
    ranks = [json.loads(path.read_text()) for path in tmp_path.iterdir()]
    assert len(ranks) == 2
    for rank in ranks:
        assert set(rank) - set(parent), "the launcher gives its ranks variables of its own"
        left = launcher.environment(rank)
        added = set(left) - set(parent) - {"_", "GFORTRAN_UNBUFFERED_PRECONNECTED",
                                           "LD_LIBRARY_PATH", "OPAL_PREFIX"}
        assert not added, f"{launcher.kind} gives these, and a nested job would keep them"
        assert left["OMPI_MCA_cupycomm_user_setting"] == "kept"


@pytest.mark.parametrize("given", [{"PMI_RANK": "0", "PMI_SIZE": "1"}, {"PMIX_RANK": "0"},
                                   {"OMPI_COMM_WORLD_RANK": "0"}, {"SLURM_STEP_NUM_TASKS": "1"}],
                         ids=["hydra", "pmix", "openmpi", "srun"])
def test_a_rank_of_any_launcher_is_told_from_a_process_started_on_its_own(given):
    # what a shell inside an allocation (a batch script's too), or the user's configuration,
    # has is no launcher's
    own = {"PATH": "/usr/bin", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
           "SLURM_NTASKS": "4", "OMPI_MCA_btl": "self", "HYDRA_LAUNCHER": "fork"}
    assert not launchers.started_by_a_launcher(own)
    assert launchers.started_by_a_launcher({**own, **given})


LIBRARIES = {   # what each MPI's MPI.Get_library_version() says (first lines)
    "mpich": ["MPICH Version:\t4.3.2\nMPICH Release date: ...", "MVAPICH Version 3.0"],
    "openmpi": ["Open MPI v5.0.11, package: Open MPI ..."],
    "intelmpi": ["Intel(R) MPI Library 2021.18 for Linux* OS\n"],
    "other": ["Cray MPI"],
}


@pytest.mark.parametrize("mpi", sorted(LIBRARIES))
def test_library_kind_names_each_mpi(mpi):
    assert [library_kind(said) for said in LIBRARIES[mpi]] == [mpi] * len(LIBRARIES[mpi])


def test_a_new_launcher_or_mpi_is_a_row_and_its_test():
    """The fake --version and library outputs above cover every row, each field is set by a
    row and read from one by the code, and each row has what its fields need."""
    assert set(launchers.KINDS) == set(VERSIONS)
    assert {row.mpi for row in launchers.KINDS.values()} - {""} == set(LIBRARIES)
    read = {node.attr for path in PACKAGE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
            and any(word in ast.unparse(node.value) for word in ("row", "KINDS"))}
    for field in dataclasses.fields(launchers.Kind):
        assert field.name in read, f"Kind.{field.name}: no module reads it"
        assert any(getattr(row, field.name) != field.default
                   for row in launchers.KINDS.values()), f"Kind.{field.name}: no row sets it"
    for kind, row in launchers.KINDS.items():
        assert bool(row.mpi) == bool(row.mpi_name), kind
        assert (row.library == "(?!)") == (row.mpi in ("", "other")), kind
        assert bool(row.own_failure) == (row.says_killed != "(?!)"), kind   # both read output


def test_no_module_but_the_table_names_a_kind():
    """What cupycomm knows of a launcher or an MPI is its row: no other module of the package
    names a kind (a dict keyed by kinds, a comparison with one)."""
    kinds = set(launchers.KINDS) | {row.mpi for row in launchers.KINDS.values()} - {""}
    named = [f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}"
             for path in PACKAGE.rglob("*.py") if path != pathlib.Path(launchers.__file__)
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value in kinds]
    assert not named, f"kinds named outside cupycomm/run/launchers.py's KINDS: {named}"


@pytest.mark.parametrize("kind", ["hydra", "openmpi"])
def test_the_command_line_prints_the_argv_shell_quoted(tmp_path, kind):
    exe = fake(tmp_path, "mpi exec", VERSIONS[kind])
    run = [sys.executable, "-m", "cupycomm.run.launchers", "--mpiexec", exe]
    said = subprocess.run(run + ["-n", "64", "--leave-cleanup-to-cupycomm"],
                          capture_output=True, text=True, check=True).stdout
    expected = {"hydra": f"'{exe}' -disable-auto-cleanup -n 64\n",
                "openmpi": f"'{exe}' -n 64 --oversubscribe\n"}[kind]
    assert said == expected
    said = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert said == f"{kind} {exe}: {VERSION_SAID[kind]}\n"


def test_the_command_line_without_a_launcher_fails_with_the_advice(tmp_path):
    env = launch_environment({"PATH": str(tmp_path), "MPIEXEC": str(tmp_path / "none")})
    done = subprocess.run([sys.executable, "-m", "cupycomm.run.launchers", "-n", "2"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "is not an executable file" in done.stderr
