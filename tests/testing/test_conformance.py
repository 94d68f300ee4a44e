"""Conformance with the real CuPy (installed, no GPU): the constants cupycomm and the stand-in
use equal CuPy's, and the call-shape recorder and replay (tests/conformance) find what they
must: a call with the wrong number or type of arguments is a mismatch."""
import importlib
import json
import types

import numpy as np
import pytest

from cupycomm.testing import standin
from conformance import replay, shapes
from cupycomm import _dtypes

cupy = pytest.importorskip("cupy", reason="CuPy is not installed: nothing to compare against")
nccl = pytest.importorskip("cupy.cuda.nccl", reason="CuPy has no NCCL module here")
runtime = cupy.cuda.runtime
# The replay passes handles that point nowhere: only where CUDA finds no device (CI).
no_gpu = pytest.mark.skipif(replay.gpu_visible(), reason="a GPU is here: the replay is for "
                                                         "machines where CUDA finds none")


# -- constants --------------------------------------------------------------------------------------
def cupy_nccl_type(dtype: np.dtype):
    """CuPy's own choice of NCCL datatype and count factor for ``dtype`` (cupyx.distributed's
    table), or None where it has none."""
    from cupyx.distributed import _nccl_comm
    code = _nccl_comm._nccl_dtypes.get(dtype.char)
    return None if code is None else (code, 2 if dtype.kind == "c" else 1)


def test_nccl_datatype_of_each_dtype_is_cupys():
    compared = 0
    for dtype, row in _dtypes.DTYPES.items():
        theirs = cupy_nccl_type(dtype)
        if theirs is not None and row.nccl_type is not None:
            assert (row.nccl_type, row.nccl_count) == theirs, dtype
            compared += 1
    assert compared >= 10   # int8..uint64, float16..float64, complex64/128
    bfloat16 = [row for dtype, row in _dtypes.DTYPES.items() if dtype.name == "bfloat16"]
    assert [row.nccl_type for row in bfloat16] in ([], [nccl.NCCL_BFLOAT16])


def test_nccl_op_numbers_are_cupys():
    for op, code in _dtypes.NCCL_OPS.items():
        assert code == getattr(nccl, f"NCCL_{op.name}"), op


def test_cupycomms_nccl_constants_are_cupys():
    names = [name for name in vars(_dtypes) if name.startswith("NCCL_") and name != "NCCL_OPS"]
    assert len(names) >= 10
    for name in names:
        assert getattr(_dtypes, name) == getattr(nccl, name), name


def test_capture_mode_cupycomm_sets_is_cudas_relaxed():
    from cupycomm.backends import nccl as backend
    assert backend._RELAXED == runtime.streamCaptureModeRelaxed


def test_stand_in_constants_are_cupys():
    """Every number the stand-in's cuda.runtime and cuda.nccl publish (memcpy kinds, stream and
    capture flags...) is CuPy's: the recorded shapes carry them as they are."""
    compared = []
    standin_nccl = importlib.import_module("cupycomm.testing.standin.cuda.nccl")
    for ours, theirs in [(standin.cuda.runtime, runtime), (standin_nccl, nccl)]:
        for name, value in vars(ours).items():
            if isinstance(value, int) and not isinstance(value, bool):
                assert value == getattr(theirs, name), name
                compared.append(name)
    assert "memcpyDefault" in compared and "memcpyHostToDevice" in compared


def test_peer_access_already_enabled_is_cudas_status():
    from cupycomm.devices import copies
    assert runtime.CUDARuntimeError(copies.PEER_ACCESS_ALREADY_ENABLED).args[0].startswith(
        "cudaErrorPeerAccessAlreadyEnabled:")


def test_peer_copies_tolerate_access_enabled_before(monkeypatch):
    """Another library (CuPy's own peer copies) may have enabled it first: CUDA then says
    cudaErrorPeerAccessAlreadyEnabled, which is no error here."""
    from cupycomm import devices
    from cupycomm.devices import copies
    monkeypatch.setattr(standin, "DEVICE_COUNT", 2)
    monkeypatch.setattr(standin, "peer_access", {(1, 0)})
    monkeypatch.setattr(copies, "_kept", {})   # this process has enabled no access yet
    with standin.Device(0):
        x = standin.asarray(np.arange(4.0))
    parts = devices.scatter(x, [0, 1], device_module=standin)   # 1 reads 0's memory
    assert [standin.asnumpy(part).tolist() for part in parts] == [[0.0, 1.0], [2.0, 3.0]]
    assert standin.last_error() == 0   # CuPy reset it before raising (stand-in rule 14)


def test_cupys_runtime_resets_the_last_error_itself():
    """No getLastError to call, and none needed: CuPy's wrappers reset the thread's last
    error before they raise (stand-in rule 14 models this CuPy)."""
    assert not hasattr(runtime, "getLastError") and hasattr(runtime, "check_status")


@no_gpu
def test_a_private_runtime_name_is_a_mismatch():
    """``import cupy.cuda.runtime`` anywhere rebinds cupy.cuda.runtime to a Python module of
    the public names: a private one cupycomm reached through it would be gone."""
    assert replay.replay(shape("cupy.cuda.runtime.deviceEnablePeerAccess", ["int"])) is None
    why = replay.replay(shape("cupy.cuda.runtime._deviceEnsurePeerAccess", ["int"]))
    assert why is not None and "import cupy.cuda.runtime" in why
    assert "cupy_backends" in type(cupy.cuda.runtime).__repr__(cupy.cuda.runtime)   # untouched


def test_stand_in_reads_nccl_datatypes_and_ops_as_nccl_defines_them():
    for name, dtype in [("INT8", np.int8), ("UINT8", np.uint8), ("INT32", np.int32),
                        ("UINT32", np.uint32), ("INT64", np.int64), ("UINT64", np.uint64),
                        ("FLOAT16", np.float16), ("FLOAT32", np.float32),
                        ("FLOAT64", np.float64)]:
        assert standin._NCCL_DTYPES[getattr(nccl, f"NCCL_{name}")] == np.dtype(dtype)
    for name, ufunc in [("SUM", np.add), ("PROD", np.multiply), ("MAX", np.maximum),
                        ("MIN", np.minimum), ("AVG", np.add)]:
        assert standin._NUMPY_OPS[getattr(nccl, f"NCCL_{name}")] is ufunc


# -- the replay ---------------------------------------------------------------------------------------
POINTER = ["int64"]
ALL_REDUCE = "cupy.cuda.nccl.NcclCommunicator.allReduce"


def shape(name, *args, kind="call", **kwargs):
    return {"name": name, "kind": kind, "args": list(args), "kwargs": kwargs}


def float32_sum(*extra):
    return [POINTER, POINTER, ["int"], ["enum", nccl.NCCL_FLOAT32], ["enum", nccl.NCCL_SUM],
            *extra]


@no_gpu
@pytest.mark.parametrize("right", [
    shape(ALL_REDUCE, *float32_sum(["int"])),
    shape(ALL_REDUCE, POINTER, POINTER, ["numpy-int", "<i8"], *float32_sum(["int"])[3:]),
    shape("cupy.cuda.Stream.wait_event", ["object", "cupy.cuda.Event"]),
    shape("cupy.asarray", ["cuda_array_interface"]),
    shape("cupy.cuda.nccl.NcclCommunicator", ["int"], ["from", "cupy.cuda.nccl.get_unique_id"],
          ["int"]),
    shape("cupy.cuda.runtime.getDevice"),
    shape("cupy.cuda.runtime.setDevice", ["int"]),
    shape("cupy.cuda.Graph.launch", ["object", "cupy.cuda.Stream"]),
], ids=["allReduce", "numpy-count", "wait_event", "foreign-array", "unique-id", "getDevice",
        "setDevice", "graph-launch"])
def test_a_right_call_conforms(right):
    assert replay.replay(right) is None


@no_gpu
@pytest.mark.parametrize("wrong", [
    shape(ALL_REDUCE, *float32_sum()),                                    # 5 arguments, not 6
    shape(ALL_REDUCE, *float32_sum(["int"], ["int"])),                    # 7
    shape(ALL_REDUCE, *float32_sum(["object", "cupy.cuda.Stream"])),      # a Stream, not its ptr
    shape(ALL_REDUCE, *float32_sum(["float"])),                           # a float handle
    shape("cupy.cuda.nccl.NcclCommunicator.bcast", POINTER, ["negative"], ["enum", 0], ["int"],
          ["int"]),                                                      # a negative size_t
    shape("cupy.cuda.Stream.wait_event", ["int"]),                        # an int, not an Event
    shape("cupy.cuda.Stream", non_blocking=["bool", True], flags=["int"]),   # no such keyword
    shape("cupy.cuda.nccl.NcclCommunicator.allreduce", *float32_sum(["int"])),  # no such method
    shape("cupy.cuda.runtime.memcpyAsync", POINTER, POINTER, ["int"], ["enum", 4]),  # 4 of 5
    shape("cupy.cuda.Event.finished", kind="attribute"),                  # no such property
], ids=["arity-5", "arity-7", "stream-object", "float", "negative-count",
        "wait-int", "keyword", "method-name", "memcpy-arity", "attribute"])
def test_a_wrong_call_is_a_mismatch(wrong):
    why = replay.replay(wrong)
    assert why is not None and why.split(":")[0] in (
        "TypeError", "AttributeError", "OverflowError", "LookupError"), why


@no_gpu
def test_replay_prints_the_count_and_fails_on_a_mismatch(tmp_path, capsys):
    good = shape(ALL_REDUCE, *float32_sum(["int"]))
    (tmp_path / "shapes-1.json").write_text(json.dumps([good]))
    (tmp_path / "shapes-2.json").write_text(json.dumps([good]))   # merged: one shape
    assert replay.main([str(tmp_path)]) == 0
    assert f"1 call shapes replayed on CuPy {cupy.__version__}: 0 mismatches" in \
        capsys.readouterr().out
    (tmp_path / "shapes-3.json").write_text(json.dumps([shape(ALL_REDUCE, *float32_sum())]))
    assert replay.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"MISMATCH {ALL_REDUCE}(int64, int64, int, enum=7, enum=0)" in out
    assert "2 call shapes replayed" in out and ": 1 mismatches" in out


# -- the recorder -------------------------------------------------------------------------------------
def fake_standin():
    """A tiny stand-in module: cuda.nccl with a communicator class and a function."""
    module = types.ModuleType("fake_standin")

    class NcclCommunicator:
        __module__ = "fake_standin"

        def __init__(self, ndev, commId, rank):
            pass

        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
            return "reduced"

        @property
        def ready(self):
            return True

    def groupStart():
        return None
    groupStart.__module__ = "fake_standin"
    nccl = types.SimpleNamespace(NcclCommunicator=NcclCommunicator, groupStart=groupStart)
    module.cuda = types.SimpleNamespace(nccl=nccl)
    module.NcclCommunicator = NcclCommunicator
    return module


def run_as(module_name: str, source: str, **names):
    """Run ``source`` as code of the module ``module_name`` (the recorder looks at callers)."""
    exec(source, {"__name__": module_name, **names})


def test_recorder_keeps_cupycomms_calls_only_with_their_types():
    standin = fake_standin()
    recorder = shapes.install(standin)
    code = ("comm = cuda.nccl.NcclCommunicator(2, bytes(128), 0)\n"
            "comm.allReduce(2 ** 45, 2 ** 45 + 64, 16, 7, 0, 4096)\n"
            "comm.allReduce(2 ** 46, 2 ** 46 + 64, 99, 7, 0, 8192)\n"   # the same shape
            "comm.allReduce(2 ** 46, 2 ** 46 + 64, 99, 9, 4, 8192)\n"   # bfloat16 avg: another
            "comm.ready\n"
            "cuda.nccl.groupStart()\n")
    run_as("tests.not_cupycomm", code, cuda=standin.cuda)
    assert recorder.shapes == {}
    run_as("cupycomm.backends.fake", code, cuda=standin.cuda)
    recorded = sorted((s["kind"], s["name"], json.dumps(s["args"])) for s in
                      recorder.shapes.values())
    assert recorded == sorted([
        ("call", "cupy.cuda.nccl.NcclCommunicator",
         json.dumps([["int"], ["from", "cupy.cuda.nccl.get_unique_id"], ["int"]])),
        ("call", ALL_REDUCE, json.dumps(float32_sum(["int"]))),
        ("call", ALL_REDUCE, json.dumps([POINTER, POINTER, ["int"], ["enum", 9], ["enum", 4],
                                         ["int"]])),
        ("attribute", "cupy.cuda.nccl.NcclCommunicator.ready", "[]"),
        ("call", "cupy.cuda.nccl.groupStart", "[]")])


def test_recorded_files_merge_across_ranks(tmp_path):
    for rank, count in [(0, 16), (1, 32), (2, 2 ** 33)]:   # one shape, and one past a C int
        recorder = shapes.Recorder()
        recorder.record(ALL_REDUCE, "call", (2 ** 45, 2 ** 45, count, 7, 0, 4096), {})
        recorder.write(str(tmp_path / f"rank{rank}"))
    merged = shapes.load(sorted(str(path) for path in tmp_path.iterdir()))
    assert [s["args"][2] for s in merged] == [["int"], ["int64"]]


def test_split_works_without_comm_split_as_on_cupy_13(monkeypatch):
    """What replay.GUARDED says of commSplit, which CuPy 13 lacks: cupycomm looks first."""
    from arrays import STANDIN
    monkeypatch.delattr(standin.NcclCommunicator, "commSplit")
    with STANDIN.comm() as comm:
        comm.init_device()
        half = comm.split(comm.rank % 2)
        assert half.parts.router.device is None   # made from a new unique id on first use instead
        total = half.all_reduce(standin.asarray(np.array([1], np.int64)))
        assert standin.asnumpy(total).tolist() == [half.size]
        half.close()
    assert "cupy.cuda.nccl.NcclCommunicator.commSplit" in replay.GUARDED
