"""Fixtures shared by the suite: the array library of a test and a communicator for it (fresh,
except on a real GPU, where the tests of one module share one while they pass).

With ``CUPYCOMM_RECORD_CALL_SHAPES=<directory>``, every call cupycomm makes on the stand-in is
recorded as a call shape, written there when the session ends (see tests/conformance).
"""
import os

import pytest
from mpi4py import MPI

from cupycomm.testing import standin
from arrays import GPU, STANDIN, lib_params
from conformance import shapes
from cupycomm.testing import launch_environment, release

_SHAPES_DIRECTORY = os.environ.get(shapes.ENVIRONMENT_VARIABLE)
_RECORDER = shapes.install(standin) if _SHAPES_DIRECTORY else None

# On a real GPU each NCCL communicator costs its creation (on one GPU shared by 4 ranks, most of
# benchmarks/gpu_validate's time): the `comm` tests of one module share one, until a test fails
# on some rank, closes it or leaves its NCCL communicator aborted.
_shared_gpu_comm: dict = {}   # test module name -> communicator
# where the ranks agree whether the shared one can be reused (no GPU: nothing to agree on)
_AGREE = MPI.COMM_WORLD.Dup() if GPU is not None else None


def pytest_sessionfinish(session):
    if _RECORDER is not None:
        _RECORDER.write(_SHAPES_DIRECTORY)


@pytest.fixture
def pytester(pytester, monkeypatch):
    """pytest's, whose sessions in this process are plain ones even where this one runs
    under a launcher (``mpiexec -n 1``): they get none of its variables, as a job would not."""
    for name in set(os.environ) - set(launch_environment()):
        monkeypatch.delenv(name)
    return pytester


@pytest.fixture(params=lib_params())
def lib(request):
    """The array library the test body runs on (host, standin, gpu)."""
    return request.param


@pytest.fixture
def comm(lib, request):
    """A communicator over every rank, for ``lib``'s arrays, its NCCL communicator created up
    front for device libraries (so point-to-point works at once); closed after the test, or
    kept if it failed (see cupycomm.testing.release). Fresh for each test, except on a real
    GPU (see ``_shared_gpu``)."""
    if lib.name == "gpu":
        yield from _shared_gpu(lib, request)
        return
    communicator = lib.comm()
    if lib.is_device:
        communicator.init_device()
    yield communicator
    release(request, communicator, communicator.close)


@pytest.fixture(params=["world", "dup", "split"])
def any_comm(comm, request):
    """``comm`` itself, a copy of it (``split(0)``: every rank, same order, its own context)
    and its half of a parity split, for tests about what every communicator must do alike;
    the derived ones are closed after the test (or kept if it failed, see ``release``)."""
    if request.param == "world":
        yield comm
        return
    derived = comm.split(0 if request.param == "dup" else comm.rank % 2)
    yield derived
    release(request, derived, derived.close)


def _shared_gpu(lib, request):
    """The module's shared GPU communicator, or a new one where it cannot be reused on some
    rank (the ranks agree first: making one is collective)."""
    module = request.module.__name__
    shared = _shared_gpu_comm.pop(module, None)
    usable = shared is not None and not shared.closed and not shared.init_device()._aborted
    if not _AGREE.allreduce(usable, op=MPI.LAND):   # (dropped where unusable: kept unfreed,
        shared = lib.comm()                         # as release keeps a failed test's)
        shared.init_device()
    yield shared
    passed = []
    release(request, shared, lambda: passed.append(True))
    if passed:
        _shared_gpu_comm[module] = shared


@pytest.fixture(scope="module", autouse=True)
def _close_the_shared_gpu_comm(request):
    yield
    if _AGREE is None:
        return
    shared = _shared_gpu_comm.pop(request.module.__name__, None)
    if _AGREE.allreduce(shared is not None, op=MPI.LAND):
        shared.close()


@pytest.fixture
def dcomm(request):
    """A world communicator with its NCCL communicator on the stand-in, for tests of the
    device backend's own behaviour."""
    communicator = STANDIN.comm()
    communicator.init_device()
    yield communicator
    release(request, communicator, communicator.close)
