"""Foreign arrays: objects of other libraries are used without a copy; in-place results land
in the caller's object, and results keep the caller's type where its library can make one."""
import array

import numpy as np
import pytest

import cupycomm
from cupycomm.testing import standin as sd
from cupycomm.comm import foreign
from arrays import STANDIN


class ArrayInterface:
    """An object that only exposes __array_interface__ (as many host libraries do)."""

    def __init__(self, data):
        self._data = data
        self.__array_interface__ = data.__array_interface__


class DLPackOnly:
    """An object that only exposes the DLPack protocol (CPU)."""

    def __init__(self, data):
        self._data = data

    def __dlpack__(self, **kwargs):
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._data.__dlpack_device__()


class CudaArrayInterface:
    """A device object that only exposes __cuda_array_interface__ (numba, torch, JAX...)."""

    def __init__(self, data):
        self._data = data
        self.__cuda_array_interface__ = {
            "shape": data.shape, "typestr": data.dtype.str, "version": 3, "strides": None,
            "data": (data.data.ptr, False)}


HOST_PROVIDERS = {
    "array.array": lambda values: array.array("d", values),
    "array-interface": lambda values: ArrayInterface(np.array(values, np.float64)),
    "dlpack": lambda values: DLPackOnly(np.array(values, np.float64)),
}


def values_of(obj):
    return np.asarray(obj._data if hasattr(obj, "_data") else obj, dtype=np.float64)


@pytest.fixture
def hcomm():
    with STANDIN.comm() as comm:
        yield comm


# NumPy before 2.1 imports DLPack objects read-only: results cannot land in a DLPack-only one
DLPACK_READ_ONLY = tuple(int(part) for part in np.__version__.split(".")[:2]) < (2, 1)


def refused_as_read_only_dlpack(provider, call):
    """True where ``call()`` writes into a DLPack-only object under NumPy before 2.1, after
    checking that it is refused saying why (else False: the caller checks the result)."""
    if not (provider == "dlpack" and DLPACK_READ_ONLY):
        return False
    with pytest.raises(ValueError, match=r"__dlpack__, which NumPy \S+ \(before 2\.1\) "
                                         r"imports read-only.*use NumPy 2\.1 or newer"):
        call()
    return True


@pytest.mark.parametrize("provider", HOST_PROVIDERS)
def test_host_foreign_in_place_lands_in_the_callers_object(hcomm, provider):
    obj = HOST_PROVIDERS[provider]([hcomm.rank + 1.0] * 3)
    if refused_as_read_only_dlpack(provider, lambda: hcomm.all_reduce(obj)):
        return
    result = hcomm.all_reduce(obj)
    assert result is obj
    np.testing.assert_array_equal(values_of(obj), np.full(3, hcomm.size * (hcomm.size + 1) / 2))


@pytest.mark.parametrize("provider", HOST_PROVIDERS)
def test_host_foreign_new_results_and_out(hcomm, provider):
    obj = HOST_PROVIDERS[provider]([float(hcomm.rank)] * 2)
    gathered = hcomm.all_gather(obj)                      # no from_dlpack here: NumPy
    np.testing.assert_array_equal(gathered, np.repeat(np.arange(hcomm.size, dtype=float), 2)
                                  .reshape(hcomm.size, 2))
    out = HOST_PROVIDERS[provider]([0.0] * 2)
    if refused_as_read_only_dlpack(provider, lambda: hcomm.all_reduce(obj, out=out)):
        return
    assert hcomm.all_reduce(obj, out=out, op="max") is out
    np.testing.assert_array_equal(values_of(out), np.full(2, hcomm.size - 1.0))


def test_a_read_only_buffer_cannot_receive(hcomm):
    with pytest.raises(Exception, match="writ|read-only|readonly"):
        hcomm.all_reduce(memoryview(bytes(8)).cast("d"))


def test_numpy_scalars_are_refused(hcomm):
    with pytest.raises(TypeError, match="got numpy.float64"):
        hcomm.all_reduce(np.float64(1.0))


def test_device_object_with_cuda_array_interface(hcomm):
    hcomm.init_device()
    backing = sd.asarray(np.full(4, hcomm.rank + 1.0))
    obj = CudaArrayInterface(backing)
    assert hcomm.all_reduce(obj) is obj
    np.testing.assert_array_equal(sd.asnumpy(backing),
                                  np.full(4, hcomm.size * (hcomm.size + 1) / 2))
    gathered = hcomm.all_gather(obj)
    assert isinstance(gathered, sd.ndarray) and gathered.shape == (hcomm.size, 4)
    with pytest.raises(TypeError, match="one call takes host arrays or device arrays"):
        hcomm.all_reduce(obj, out=np.empty(4))


def test_coalesced_and_bucket_take_foreign_arrays(hcomm):
    objs = [HOST_PROVIDERS["array.array"]([hcomm.rank + 1.0] * 2),
            HOST_PROVIDERS["dlpack"]([1.0, 2.0, 3.0])]
    if refused_as_read_only_dlpack("dlpack", lambda: hcomm.all_reduce_coalesced(objs)):
        return
    result = hcomm.all_reduce_coalesced(objs)
    assert result[0] is objs[0] and result[1] is objs[1]
    np.testing.assert_array_equal(values_of(objs[0]), np.full(2, hcomm.size * (hcomm.size + 1) / 2))
    np.testing.assert_array_equal(values_of(objs[1]), np.array([1.0, 2.0, 3.0]) * hcomm.size)
    bucket = hcomm.bucket(objs)
    assert all(isinstance(a, np.ndarray) for a in bucket.arrays)


def test_torch_tensors_where_torch_is_installed(hcomm):
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    t = torch.full((3,), float(hcomm.rank + 1))
    assert hcomm.all_reduce(t) is t
    assert torch.equal(t, torch.full((3,), hcomm.size * (hcomm.size + 1) / 2))
    gathered = hcomm.all_gather(torch.tensor([hcomm.rank]))
    assert isinstance(gathered, torch.Tensor)
    assert gathered.flatten().tolist() == list(range(hcomm.size))
    work = hcomm.broadcast(torch.arange(4.0) * hcomm.rank, hcomm.size - 1, async_op=True)
    assert torch.equal(work.wait(), torch.arange(4.0) * (hcomm.size - 1))


def _torch_case(torch, comm, case):
    """(what the call returns, what NumPy says it must hold) for the calls that broke when
    cupycomm's own buffers came back as torch tensors."""
    n, r = comm.size, comm.rank
    if case == "reduce_scatter-list":
        got = comm.reduce_scatter([torch.full((3,), float(r + j)) for j in range(n)])
        return got, np.full(3, float(sum(i + r for i in range(n))))
    if case == "reduce_scatter-avg":
        got = comm.reduce_scatter(torch.arange(3.0 * n) * (r + 1), op="avg")
        return got, np.arange(3.0 * n)[3 * r:3 * r + 3] * (n + 1) / 2
    if case == "all_gather-zero-size":
        return comm.all_gather(torch.empty(0, 3)), np.empty((n, 0, 3))
    if case == "all_gather-0d-list":
        out = [np.full((), -1.0) for _ in range(n)]
        assert comm.all_gather(np.array(5.0 + r), out=out) == out
        return np.array(out), 5.0 + np.arange(n)
    if case == "all_reduce-bfloat16":
        x = torch.full((2,), float(r + 1), dtype=torch.bfloat16)
        assert comm.all_reduce(x) is x
        return x.float(), np.full(2, n * (n + 1) / 2)
    if case == "all_gather-bfloat16":
        got = comm.all_gather(torch.full((2,), float(r), dtype=torch.bfloat16))
        assert got.dtype == torch.bfloat16
        return got.float(), np.repeat(np.arange(n, dtype=float), 2).reshape(n, 2)
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["reduce_scatter-list", "reduce_scatter-avg",
                                  "all_gather-zero-size", "all_gather-0d-list",
                                  "all_reduce-bfloat16", "all_gather-bfloat16"])
def test_calls_that_returned_cupycomms_own_buffers_as_the_callers_type(hcomm, case):
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    if "bfloat16" in case and not any(d.name == "bfloat16" for d in cupycomm.DTYPES):
        pytest.skip("ml_dtypes is not installed: bfloat16 has no NumPy type here")
    got, expected = _torch_case(torch, hcomm, case)
    if isinstance(got, torch.Tensor):
        got = got.numpy()
    np.testing.assert_array_equal(got, expected)


def test_bfloat16_without_ml_dtypes_is_a_type_error_naming_call_dtype_and_rank(hcomm,
                                                                               monkeypatch):
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    monkeypatch.setattr(foreign, "_BFLOAT16", None)
    with pytest.raises(TypeError, match=rf"all_reduce: x has dtype torch.bfloat16, which needs "
                                        rf"ml_dtypes' bfloat16 here: pip install "
                                        rf"'cupycomm\[bfloat16\]' on rank {hcomm.rank}"):
        hcomm.all_reduce(torch.ones(2, dtype=torch.bfloat16))
    assert hcomm.all_reduce(torch.ones(2)).tolist() == [hcomm.size] * 2   # still usable
