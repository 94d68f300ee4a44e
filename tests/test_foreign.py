"""Foreign arrays: objects of other libraries are used without a copy; in-place results land
in the caller's object, and results keep the caller's type where its library can make one."""
import array

import numpy as np
import pytest

import nccl_standin as sd
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


@pytest.mark.parametrize("provider", HOST_PROVIDERS)
def test_host_foreign_in_place_lands_in_the_callers_object(hcomm, provider):
    obj = HOST_PROVIDERS[provider]([hcomm.rank + 1.0] * 3)
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
