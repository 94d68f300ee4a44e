"""Device entry points in a fresh interpreter with the real CuPy: without a GPU they must fail
inside CUDA or NCCL, never in cupycomm's own attribute or type handling (a pytest process
hides such faults: the suite imports modules, ``cupy.cuda.nccl`` among them, as a side
effect)."""
import subprocess
import sys

import pytest

from cupycomm.testing import launch_environment

pytest.importorskip("cupy", reason="CuPy is not installed: nothing to run the device path on")

NCCL_BACKEND_ON_COMM_SELF = """
import cupy
from mpi4py import MPI
from cupycomm.backends.nccl import NcclBackend
from cupycomm.faults.watchdog import Tracker

try:
    NcclBackend(MPI.COMM_SELF, 0, cupy, Tracker("fresh", 0, 1, 60.0))
except Exception as error:
    print(f"{type(error).__module__}.{type(error).__qualname__}: {error}")
else:
    print("constructed")
"""


def run_fresh(code: str) -> str:
    """What ``code`` prints in a new interpreter, started as a job of its own."""
    done = subprocess.run([sys.executable, "-c", code], env=launch_environment(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_nccl_backend_fails_in_cuda_not_in_cupycomm():
    outcome = run_fresh(NCCL_BACKEND_ON_COMM_SELF)
    if outcome == "constructed":   # a GPU with a working NCCL: nothing failed at all
        return
    assert outcome.startswith(("cupy_backends.", "cupy.")), outcome
    assert "Error" in outcome.split(":")[0], outcome
