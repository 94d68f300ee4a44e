"""The tools that need no MPI start none, so they work where MPI_Init would fail: started from
inside a rank, whose launcher's variables they inherit (MPICH's PMI_Init then reads a PMI_FD
that is not theirs and dies with "Bad file descriptor")."""
import os
import subprocess
import sys

import pytest

from cupycomm.testing import launch_environment

pytestmark = pytest.mark.mpi(max_size=1)   # each starts fresh interpreters

BOUND = 60   # seconds
# What a rank of MPICH's hydra inherits, with a descriptor that is no PMI server's.
RANK_OF_A_JOB = {"PMI_RANK": "0", "PMI_SIZE": "1", "PMI_FD": "1000"}
# Runs the module as python -m does, then says on stderr whether mpi4py.MPI was imported:
# under another MPI than MPICH the variables above do not stop MPI_Init, this does.
WATCHED = """
import atexit, runpy, sys
atexit.register(lambda: print(f"mpi4py.MPI imported: {'mpi4py.MPI' in sys.modules}",
                              file=sys.stderr))
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module, args, status, said", [
    ("cupycomm.run", ["--help"], 0, "usage: python -m cupycomm.run"),
    ("cupycomm.run", [], 2, "usage: python -m cupycomm.run"),
    ("cupycomm.tools.flight", ["{empty}"], 2, "no rank-<r>.json in"),
    ("cupycomm.run.launchers", ["-n", "2"], 0, "-n 2"),
], ids=["run --help", "run", "flight", "launchers"])
def test_a_tool_run_from_inside_a_rank_starts_no_mpi(tmp_path, module, args, status, said):
    args = [arg.format(empty=tmp_path) for arg in args]
    done = subprocess.run([sys.executable, "-c", WATCHED, module, *args],
                          env=launch_environment(RANK_OF_A_JOB), capture_output=True,
                          text=True, timeout=BOUND)
    assert done.returncode == status, done.stdout + done.stderr
    assert said in done.stdout + done.stderr
    assert done.stderr.endswith("mpi4py.MPI imported: False\n"), done.stderr


def test_the_console_script_run_from_inside_a_rank_prints_its_help():
    script = os.path.join(os.path.dirname(sys.executable), "cupycomm-run")
    done = subprocess.run([script, "--help"], env=launch_environment(RANK_OF_A_JOB),
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 0 and "usage: cupycomm-run" in done.stdout, done.stdout
