"""The stand-in must keep CuPy's interface: the names and argument lists the NCCL backend uses,
and NCCL's constants, checked against the installed CuPy (which imports without a GPU)."""
import inspect
import re

import pytest

from cupycomm.testing import standin
from cupycomm import _dtypes

cupy = pytest.importorskip("cupy", reason="CuPy is not installed: nothing to compare against")
nccl = pytest.importorskip("cupy.cuda.nccl", reason="CuPy has no NCCL module here")

METHODS = ["allReduce", "reduce", "bcast", "broadcast", "allGather", "reduceScatter", "send",
           "recv", "abort", "destroy", "check_async_error", "rank_id", "size", "device_id"]


def cupy_parameters(method, owner=None):
    """Parameter names from CuPy's Cython signature line, e.g. 'allReduce(self, intptr_t ...)'."""
    owner = nccl.NcclCommunicator if owner is None else owner
    doc = getattr(owner, method).__doc__ or ""
    match = re.search(re.escape(method) + r"\((.*?)\)", doc)
    if match is None:
        pytest.fail(f"no signature in CuPy's docstring of {owner.__name__}.{method}")
    return [part.split()[-1].split("=")[0] for part in match.group(1).split(",") if part.strip()]


@pytest.mark.parametrize("method", METHODS)
def test_nccl_communicator_methods_have_cupys_parameters(method):
    ours = list(inspect.signature(getattr(standin.NcclCommunicator, method)).parameters)
    assert ours == cupy_parameters(method)


def test_comm_split_is_cupys_where_it_has_one_and_optional_for_the_backend(dcomm, monkeypatch):
    """CuPy 14 has NcclCommunicator.commSplit, CuPy 13.6 does not (pyproject allows both):
    the backend then makes subgroup communicators from new unique ids."""
    if hasattr(nccl.NcclCommunicator, "commSplit"):
        ours = list(inspect.signature(standin.NcclCommunicator.commSplit).parameters)
        assert ours == cupy_parameters("commSplit")
    backend = dcomm.init_device()
    monkeypatch.delattr(standin.NcclCommunicator, "commSplit")
    assert backend.split(0, dcomm.rank) is None


def test_nccl_constants_match():
    for name, ours in [("NCCL_INT8", _dtypes.NCCL_INT8), ("NCCL_UINT8", _dtypes.NCCL_UINT8),
                       ("NCCL_INT32", _dtypes.NCCL_INT32), ("NCCL_UINT32", _dtypes.NCCL_UINT32),
                       ("NCCL_INT64", _dtypes.NCCL_INT64), ("NCCL_UINT64", _dtypes.NCCL_UINT64),
                       ("NCCL_FLOAT16", _dtypes.NCCL_FLOAT16),
                       ("NCCL_FLOAT32", _dtypes.NCCL_FLOAT32),
                       ("NCCL_FLOAT64", _dtypes.NCCL_FLOAT64),
                       ("NCCL_BFLOAT16", _dtypes.NCCL_BFLOAT16)]:
        assert getattr(nccl, name) == ours, name
    for op, code in _dtypes.NCCL_OPS.items():
        assert getattr(nccl, f"NCCL_{op.name}") == code, op


def test_cuda_names_the_backend_uses_exist_in_cupy():
    for owner, names in [(cupy.cuda, ["Device", "Stream", "Event", "get_current_stream"]),
                         (cupy.cuda.Stream, ["wait_event", "synchronize", "done", "null",
                                             "ptds"]),
                         (cupy.cuda.Event, ["record", "synchronize", "done"]),
                         (nccl, ["get_unique_id", "NcclCommunicator", "groupStart", "groupEnd",
                                 "NcclError", "get_version"])]:
        for name in names:
            assert hasattr(owner, name), f"{owner.__name__}.{name}"
            stand_in = {cupy.cuda: standin.cuda, cupy.cuda.Stream: standin.Stream,
                        cupy.cuda.Event: standin.Event, nccl: standin.nccl}[owner]
            assert hasattr(stand_in, name), f"the stand-in lacks {name}"


def test_real_unique_id_is_128_bytes_like_the_stand_ins():
    assert len(nccl.get_unique_id()) == len(standin.get_unique_id()) == 128


# -- one process, several devices (cupycomm.devices and cupycomm.prefetch) ------------------------
LOCAL_METHODS = ["broadcast", "reduce", "rank_id", "size", "device_id", "destroy"]
RUNTIME_FUNCTIONS = ["memcpyAsync", "memcpy2DAsync", "deviceCanAccessPeer",
                     "_deviceEnsurePeerAccess", "getDevice", "setDevice"]


@pytest.mark.parametrize("method", LOCAL_METHODS)
def test_one_process_communicators_have_cupys_parameters(method):
    ours = list(inspect.signature(getattr(standin.LocalNcclCommunicator, method)).parameters)
    assert ours == cupy_parameters(method)


def test_init_all_and_pinned_memory_have_cupys_parameters():
    assert list(inspect.signature(standin.NcclCommunicator.initAll).parameters) == \
        cupy_parameters("initAll")
    assert list(inspect.signature(standin.alloc_pinned_memory).parameters) == \
        cupy_parameters("alloc_pinned_memory", cupy.cuda)


@pytest.mark.parametrize("function", RUNTIME_FUNCTIONS)
def test_runtime_functions_have_cupys_parameters(function):
    ours = list(inspect.signature(getattr(standin.runtime, function)).parameters)
    assert ours == cupy_parameters(function, cupy.cuda.runtime)


def test_memcpy_kinds_match_and_streams_know_their_device():
    for name in ["memcpyHostToHost", "memcpyHostToDevice", "memcpyDeviceToHost",
                 "memcpyDeviceToDevice", "memcpyDefault"]:
        assert getattr(standin.runtime, name) == getattr(cupy.cuda.runtime, name), name
    assert "~Stream.device_id (int)" in cupy.cuda.Stream.__doc__   # an attribute of instances
    assert standin.Stream().device_id == 0 and standin.Stream.null.device_id == -1
    assert hasattr(cupy.cuda, "PinnedMemoryPointer") and hasattr(cupy.cuda.runtime,
                                                                 "CUDARuntimeError")
