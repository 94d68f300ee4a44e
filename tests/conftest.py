"""Fixtures shared by the suite: the array library of a test and a communicator for it (fresh,
except on a real GPU and in the modules that set ``SHARED_COMM``, where the tests of one module
share one per library while they pass).

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
# benchmarks/gpu_validate's time); a module of thousands of tests that sets SHARED_COMM would
# spend a quarter of its time or more making and closing communicators (collective, with 4
# ranks on CI's 2 cores). The `comm` tests of such a module share one per library, until a test fails on some
# rank, closes it or leaves its NCCL communicator aborted.
_shared_comm: dict = {}   # (test module name, library name) -> communicator
# where the ranks agree whether the shared one can be reused
_AGREE = MPI.COMM_WORLD.Dup()


def pytest_configure(config):
    config.addinivalue_line("markers", "torch: runs on torch tensors (a `lib` parameter); "
                                       "skipped where torch is not installed")


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
    GPU and in a module that sets ``SHARED_COMM = True`` (see ``_shared``)."""
    if lib.name == "gpu" or getattr(request.module, "SHARED_COMM", False):
        yield from _shared(lib, request)
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


def _shared(lib, request):
    """The module's shared communicator for ``lib``, or a new one where it cannot be reused on
    some rank (the ranks agree first: making one is collective)."""
    key = (request.module.__name__, lib.name)
    shared = _shared_comm.pop(key, None)
    usable = shared is not None and not shared.closed and not (
        lib.is_device and shared.init_device()._aborted)
    if not _AGREE.allreduce(usable, op=MPI.LAND):   # (dropped where unusable: kept unfreed,
        shared = lib.comm()                         # as release keeps a failed test's)
        if lib.is_device:
            shared.init_device()
    yield shared
    passed = []
    release(request, shared, lambda: passed.append(True))
    if passed:
        # the test's device work is part of it (a non-root's gather send may still be queued:
        # the stand-in's streams progress only when the host waits, a GPU's on their own)
        lib.synchronize()
        _shared_comm[key] = shared


@pytest.fixture(scope="module", autouse=True)
def _close_the_shared_comms(request):
    yield
    module = request.module.__name__
    if not (GPU is not None or getattr(request.module, "SHARED_COMM", False)):
        return
    for param in lib_params():   # the same keys, in the same order, on every rank
        shared = _shared_comm.pop((module, param.id), None)
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
