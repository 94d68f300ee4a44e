"""The test launcher's bound on a launcher that outlives its job (cupycomm.testing.launch).

Open MPI 5's prterun was seen to hang after every rank had ended through MPI_Abort (a whole CI
run's Open MPI pass, then 1 job in 20 under load here; open-mpi/ompi#12064): run_mpiexec ends
such a launcher once it has been alone in its session for a while, and says so, instead of
waiting out the test's bound.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from cupycomm.testing import launch

pytestmark = pytest.mark.mpi(max_size=1)   # starts processes of its own

#: A stand-in launcher: starts a short child (its "ranks"), then hangs.
OUTLIVES = "import subprocess, time; subprocess.run(['sleep', '0.5']); time.sleep(60)"
#: A launcher whose ranks never run in its session (as srun's, which slurmd starts).
ALONE_FROM_THE_START = "import time; time.sleep(60)"


def watch(code, monkeypatch, seconds):
    """How long until _Alone says the process running ``code`` outlived its children (None if
    it did not within ``seconds``)."""
    monkeypatch.setattr(launch, "_OUTLIVED", 0.5)
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        alone, start = launch._Alone(process.pid), time.monotonic()
        while time.monotonic() - start < seconds:
            if alone.outlived():
                return time.monotonic() - start
            time.sleep(0.1)
        return None
    finally:
        process.kill()
        process.wait()


def test_a_launcher_alone_after_its_children_ended_has_outlived_them(monkeypatch):
    took = watch(OUTLIVES, monkeypatch, seconds=20)
    assert took is not None and took >= 0.5, took


def test_a_launcher_that_never_had_children_in_its_session_is_left_alone(monkeypatch):
    assert watch(ALONE_FROM_THE_START, monkeypatch, seconds=2) is None


def test_the_session_holds_the_launcher_and_its_children():
    process = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30"], start_new_session=True)
    try:
        time.sleep(0.3)
        members = launch._session_members(process.pid)
        assert process.pid in members and len(members) == 3, members
    finally:
        os.killpg(process.pid, signal.SIGKILL)   # bash and both sleeps
        process.wait()
