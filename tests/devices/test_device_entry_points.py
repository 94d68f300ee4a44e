"""Every device entry point, first called in a fresh interpreter with the real CuPy and no GPU,
must fail in CUDA or NCCL, never before in cupycomm's own attribute or type handling.

A fresh interpreter, without pytest and its plugins, imports only what the program imports:
inside the suite, a module imported as a side effect (``cupy.cuda.nccl`` by the stand-in's
fidelity tests) would hide a missing import. The arrays are real ``cupy.ndarray`` objects over
memory no one dereferences, and CuPy is told there are 2 devices (``getDeviceCount`` is the
one function replaced), so that cupycomm goes past its no-GPU checks into CUDA itself.
The call shapes of the later calls, which cannot be reached without a GPU, are replayed by
``tests/conformance`` (docs/guide/testing.md, "Conformance with the real CuPy").
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from arrays import GPU
from conformance.replay import DEVICE_ERRORS
from cupycomm.testing import launch_environment

pytest.importorskip("cupy", reason="CuPy is not installed: no real CuPy to fail in")
pytestmark = [
    pytest.mark.mpi(max_size=1),   # each test starts interpreters of its own
    pytest.mark.skipif(GPU is not None, reason="a GPU is here: the gpu tests run these calls "
                                               "for real (the arrays here point nowhere)"),
]

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, runpy, sys
import numpy as np
import cupy
cupy.cuda.runtime.getDeviceCount = lambda: 2   # as a 2-GPU machine would answer
from mpi4py import MPI
import cupycomm
from cupycomm import devices

def device_array(device=0, n=4):
    memory = cupy.cuda.UnownedMemory(0x1000, 4 * n, None, device)
    return cupy.ndarray((n,), "f", memptr=cupy.cuda.MemoryPointer(memory, 0))

x, y, z = device_array(), device_array(), device_array(1)
comm = cupycomm.init(MPI.COMM_SELF, device=0)
"""

REPORT = """
try:
{statement}
except BaseException as error:
    chain = []
    while error is not None:
        chain.append([type(error).__module__, type(error).__name__, str(error)])
        error = error.__cause__ or error.__context__
    print(json.dumps(chain))
else:
    print("[]")
"""

ENTRY_POINTS = {
    "init_device": "comm.init_device()",
    "all_reduce": "comm.all_reduce(x)",
    "all_reduce avg": "comm.all_reduce(x, op='avg')",
    "reduce": "comm.reduce(x, 0)",
    "broadcast": "comm.broadcast(x, 0)",
    "all_gather": "comm.all_gather(x)",
    "all_gather list": "comm.all_gather(x, out=[y])",
    "reduce_scatter": "comm.reduce_scatter(x)",
    "all_to_all": "comm.all_to_all(x)",
    "scatter": "comm.scatter(x, 0, out=y)",
    "gather": "comm.gather(x, 0)",
    "send": "comm.init_device(); comm.send(x, 0)",
    "sendrecv": "comm.init_device(); comm.sendrecv(x, 0, y, 0)",
    "Work.wait": "comm.all_reduce(x, async_op=True).wait()",
    "batch": "comm.init_device()\n    with comm.batch():\n        comm.send(x, 0)\n"
             "        comm.recv(y, 0)",
    "all_reduce_coalesced": "comm.all_reduce_coalesced([x, y])",
    "bucket": "comm.bucket([x, y]).all_reduce()",
    "split": "comm.init_device(); comm.split(0)",
    "devices.broadcast": "devices.broadcast(x, [0, 1])",
    "devices.broadcast_coalesced": "devices.broadcast_coalesced([x, y], [0, 1])",
    "devices.scatter": "devices.scatter(np.ones(4, np.float32), [0, 1])",
    "devices.gather": "devices.gather([x, z], destination=0)",
    "devices.reduce_add": "devices.reduce_add([x, z], destination=0)",
    "devices.reduce_add_coalesced": "devices.reduce_add_coalesced([[x], [z]], destination=0)",
    "devices.parallel_apply": "devices.parallel_apply(lambda a: a + 1, [x, z])",
    "prefetch": "next(iter(devices.prefetch([np.ones(4)], 0)))",
}


def program(statement: str) -> str:
    return PRELUDE + REPORT.format(statement="    " + statement)


def start(statement: str) -> subprocess.Popen:
    """A fresh interpreter running ``statement`` alone (not a rank of this mpiexec job)."""
    return subprocess.Popen([sys.executable, "-c", program(statement)], cwd=ROOT,
                            env=launch_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def started():
    """Every entry point's interpreter, started at once (they mostly wait on imports)."""
    jobs = {name: start(statement) for name, statement in ENTRY_POINTS.items()}
    yield jobs
    for job in jobs.values():
        if job.poll() is None:
            job.kill()
        job.communicate()


def failure_chain(job: subprocess.Popen) -> list:
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def assert_fails_in_cuda(chain: list) -> None:
    """The exception (with its causes, outermost first) ends in CuPy's CUDA or NCCL error, and
    nothing on the way is an attribute or type error."""
    assert chain, "it succeeded without a GPU: nothing reached CUDA"
    names = [name for _, name, _ in chain]
    module, root, message = chain[-1]
    assert root in DEVICE_ERRORS and module.startswith("cupy"), \
        f"failed in {module}.{root}: {message} (chain: {names})"
    assert not {"AttributeError", "TypeError"} & set(names), chain


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_first_call_fails_in_cuda(started, entry_point):
    assert_fails_in_cuda(failure_chain(started[entry_point]))


def test_an_attribute_error_before_cuda_is_caught():
    """The check itself: a program that fails in its own attribute handling does not pass."""
    job = start("cupy.cuda.no_such_module.f()")
    with pytest.raises(AssertionError, match="AttributeError"):
        assert_fails_in_cuda(failure_chain(job))


def test_the_self_checks_device_part_fails_in_cuda():
    """``python -m cupycomm`` as if on 2 GPUs: it stops in CUDA, or reports each device check
    as failed in CUDA."""
    job = start("sys.argv = ['cupycomm']; runpy.run_module('cupycomm', run_name='__main__')")
    out, err = job.communicate(timeout=120)
    chain = json.loads(out.strip().splitlines()[-1])
    if not chain or chain[0][1] != "SystemExit":
        assert_fails_in_cuda(chain)
        return
    device_lines = [line for line in out.splitlines() if line.strip().startswith("device")]
    assert device_lines, out + err
    for line in device_lines:
        assert "FAILED" in line and any(name in line for name in DEVICE_ERRORS), line
