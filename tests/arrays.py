"""The array libraries a test body runs on, and rank-known random inputs with NumPy references.

- ``host``: NumPy arrays, through MPI.
- ``torch``: torch CPU tensors, through MPI: the foreign-array path (DLPack views, results
  back in torch's type, bfloat16 as 16-bit words); skipped where torch is not installed.
- ``standin``: the NCCL backend's real code on the host-memory stand-in of CUDA and NCCL.
- ``gpu``: CuPy arrays on a real GPU, through real NCCL (marked ``gpu``; skipped without one).

Inputs are small integers (as the dtype), so sums and products are exact in every dtype and
every rank can compute the expected result of every other rank's input.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Tuple

import numpy as np
import pytest

import cupycomm
from cupycomm.testing import standin
from cupycomm import _bootstrap

REDUCERS: dict = {
    "sum": lambda a: np.add.reduce(a, axis=0, dtype=a.dtype),
    "prod": lambda a: np.multiply.reduce(a, axis=0, dtype=a.dtype),
    "min": lambda a: np.minimum.reduce(a, axis=0),
    "max": lambda a: np.maximum.reduce(a, axis=0),
}


class ArrayLibrary:
    """One array library: makes arrays from NumPy data, reads them back, builds communicators."""

    def __init__(self, name: str, module: Any, to_numpy: Callable[[Any], np.ndarray],
                 device_module: Any, is_device: bool) -> None:
        self.name = name
        self.module = module
        self.device_module = device_module   # what communicators take device arrays from
        self.is_device = is_device
        self._to_numpy = to_numpy

    def array(self, data: np.ndarray) -> Any:
        """A new array of this library holding a copy of ``data``."""
        return self.module.asarray(np.array(data, order="C"))

    def empty(self, shape: Any, dtype: Any) -> Any:
        return self.module.empty(shape, dtype)

    def numpy(self, a: Any) -> np.ndarray:
        return self._to_numpy(a)

    def comm(self, mpi_comm: Any = None, **kwargs: Any) -> cupycomm.Communicator:
        from mpi4py import MPI
        return cupycomm.init(mpi_comm or MPI.COMM_WORLD, device_module=self.device_module,
                             **kwargs)

    def synchronize(self) -> None:
        """Wait for all queued device work (a no-op on the host)."""
        if self.is_device:
            self.device_module.cuda.Device().synchronize()

    def __repr__(self) -> str:
        return self.name


class TorchLibrary(ArrayLibrary):
    """torch CPU tensors: made from NumPy data without going through cupycomm, read back
    the same way (bfloat16 through its 16-bit words, as NumPy has no bfloat16 of its own)."""

    def __init__(self, torch: Any) -> None:
        super().__init__("torch", torch, None, device_module=standin, is_device=False)
        self._dtypes = {np.dtype(dtype): getattr(torch, name) for dtype, name in [
            (np.bool_, "bool"), (np.int8, "int8"), (np.uint8, "uint8"), (np.int16, "int16"),
            (np.uint16, "uint16"), (np.int32, "int32"), (np.uint32, "uint32"),
            (np.int64, "int64"), (np.uint64, "uint64"), (np.float16, "float16"),
            (np.float32, "float32"), (np.float64, "float64"), (np.complex64, "complex64"),
            (np.complex128, "complex128")]}
        self._bfloat16 = {d for d in cupycomm.DTYPES if d.name == "bfloat16"}

    def array(self, data: np.ndarray) -> Any:
        data = np.array(data, order="C")
        if data.dtype in self._bfloat16:
            return self.module.from_numpy(data.view(np.int16)).view(self.module.bfloat16)
        return self.module.from_numpy(data)

    def empty(self, shape: Any, dtype: Any) -> Any:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if isinstance(dtype, self.module.dtype):
            return self.module.empty(shape, dtype=dtype)
        if np.dtype(dtype) in self._bfloat16:
            return self.module.empty(shape, dtype=self.module.bfloat16)
        return self.module.empty(shape, dtype=self._dtypes[np.dtype(dtype)])

    def numpy(self, a: Any) -> np.ndarray:
        if not isinstance(a, self.module.Tensor):
            return np.asarray(a)
        if a.dtype == self.module.bfloat16:
            return a.view(self.module.int16).numpy().view(next(iter(self._bfloat16)))
        return a.numpy()


def _torch_lib() -> Optional[ArrayLibrary]:
    try:
        import torch
    except ImportError:
        return None
    return TorchLibrary(torch)


def _gpu_lib() -> Optional[ArrayLibrary]:
    cupy = _bootstrap.import_cupy()
    if cupy is None or _bootstrap.choose_device(0, cupy) is None:
        return None
    return ArrayLibrary("gpu", cupy, cupy.asnumpy, device_module=cupy, is_device=True)


# Host communicators know the stand-in's array type too, so that mixing is detected.
HOST = ArrayLibrary("host", np, np.asarray, device_module=standin, is_device=False)
STANDIN = ArrayLibrary("standin", standin, standin.asnumpy, device_module=standin,
              is_device=True)
TORCH = _torch_lib()
GPU = _gpu_lib()
GPU_SKIP_REASON = "no GPU: CuPy is missing or sees no CUDA device (run on a GPU machine)"
TORCH_SKIP_REASON = "torch is not installed (pip install 'torch==2.13.0' for the CPU build)"


def lib_params(gpu: bool = True) -> list:
    """pytest params for the libraries: host, torch (marked, skipped without it), stand-in,
    and the GPU (marked, skipped if none)."""
    torch_marks = [pytest.mark.torch]
    if TORCH is None:
        torch_marks.append(pytest.mark.skip(reason=TORCH_SKIP_REASON))
    params = [pytest.param(HOST, id="host"), pytest.param(TORCH, id="torch", marks=torch_marks),
              pytest.param(STANDIN, id="standin")]
    if gpu:
        marks = [pytest.mark.gpu]
        if GPU is None:
            marks.append(pytest.mark.skip(reason=GPU_SKIP_REASON))
        params.append(pytest.param(GPU, id="gpu", marks=marks))
    return params


def rank_input(rank: int, shape: tuple, dtype: Any, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s known random input: small integers, never all zeros."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([rank, salt, abs(hash(shape)) % 1000, dtype.num])
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind == "u":
        return rng.integers(0, 4, shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.integers(-3, 4, shape) + 1j * rng.integers(-3, 4, shape)).astype(dtype)
    return rng.integers(-3, 4, shape).astype(dtype)


def all_inputs(size: int, shape: tuple, dtype: Any, salt: int = 0) -> np.ndarray:
    """Every rank's input, stacked along a new leading axis."""
    return np.stack([rank_input(r, shape, dtype, salt) for r in range(size)])


def reduce_reference(stacked: np.ndarray, op: str, size: int) -> np.ndarray:
    """What reducing ``stacked`` over its first axis with ``op`` gives, bool logic included."""
    if stacked.dtype == np.bool_:
        logic = {"sum": "max", "max": "max", "prod": "min", "min": "min"}[op]
        return REDUCERS[logic](stacked)
    if op == "avg":   # complex values divide as pairs of reals, as NCCL's average does
        total = np.array(REDUCERS["sum"](stacked))
        reals = total.reshape(-1).view(total.real.dtype) if total.dtype.kind == "c" else total
        np.true_divide(reals, size, out=reals)
        return total
    return REDUCERS[op](stacked)


def assert_equal(lib: ArrayLibrary, actual: Any, expected: np.ndarray, op: str = "sum") -> None:
    got = lib.numpy(actual)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    if op == "avg" and lib.name == "gpu":   # NCCL may pre-multiply: not bit-exact
        np.testing.assert_allclose(got, expected, rtol=2e-3 if got.dtype == np.float16 else 1e-6)
    else:
        np.testing.assert_array_equal(got, expected)


def in_new_thread(call: Callable[[], Any]) -> Any:
    """What ``call()`` returns or raises in a new thread (whose current device is 0 and
    capture mode CUDA's default, global)."""
    outcome = []

    def run():
        try:
            outcome.append(call())
        except Exception as error:
            outcome.append(error)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return outcome[0]


def held_inside(monkeypatch: Any, owner: Any, name: str) -> Tuple[threading.Event,
                                                                   threading.Event]:
    """(inside, release): ``owner.name`` made to set ``inside`` when a thread enters it,
    then to wait for ``release`` (at most 10 s) before it runs: a thread kept inside a call."""
    inside, release = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def held(*args: Any) -> Any:
        inside.set()
        release.wait(10)
        return real(*args)
    monkeypatch.setattr(owner, name, held)
    return inside, release
