"""Fixtures shared by the suite: the array library of a test and a fresh communicator for it.

With ``CUPYCOMM_RECORD_CALL_SHAPES=<directory>``, every call cupycomm makes on the stand-in is
recorded as a call shape, written there when the session ends (see tests/conformance).
"""
import os

import pytest

import nccl_standin
from arrays import STANDIN, lib_params
from conformance import shapes
from cupycomm.testing import release

_SHAPES_DIRECTORY = os.environ.get(shapes.ENVIRONMENT_VARIABLE)
_RECORDER = shapes.install(nccl_standin) if _SHAPES_DIRECTORY else None


def pytest_sessionfinish(session):
    if _RECORDER is not None:
        _RECORDER.write(_SHAPES_DIRECTORY)


@pytest.fixture(params=lib_params())
def lib(request):
    """The array library the test body runs on (host, standin, gpu)."""
    return request.param


@pytest.fixture
def comm(lib, request):
    """A fresh communicator over every rank, for ``lib``'s arrays, its NCCL communicator
    created up front for device libraries (so point-to-point works at once); closed after
    the test, or kept if it failed (see cupycomm.testing.release)."""
    communicator = lib.comm()
    if lib.is_device:
        communicator.init_device()
    yield communicator
    release(request, communicator, communicator.close)


@pytest.fixture
def dcomm(request):
    """A world communicator with its NCCL communicator on the stand-in, for tests of the
    device backend's own behaviour."""
    communicator = STANDIN.comm()
    communicator.init_device()
    yield communicator
    release(request, communicator, communicator.close)
