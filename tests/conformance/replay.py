"""Replay recorded call shapes on the real CuPy, without a GPU.

CuPy's compiled functions check the number and the types of their arguments before they touch
a device: ``NcclCommunicator.__new__(NcclCommunicator).allReduce(...)`` with 5 arguments raises
TypeError, with 6 NcclError. So each recorded shape is called on the real CuPy, on an object
that owns no device resource (a communicator that was never initialised, an ExternalStream, an
Event without a handle), with the recorded arguments. A shape conforms when the call fails in
CUDA or NCCL (no GPU here) or succeeds; it is a mismatch when CuPy lacks the name, or the call
fails in Python's argument handling (TypeError, AttributeError, ValueError, OverflowError...).

    python -m tests.conformance.replay shapes/        # the files CUPYCOMM_RECORD_CALL_SHAPES wrote

prints ``N call shapes replayed on CuPy X: M mismatches`` (with each mismatch) and exits 1 on
any mismatch. It needs only CuPy (it runs in a venv without cupycomm or MPI).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import sys
import types
import warnings
from typing import Any, Callable, List, Optional

from . import shapes

# The errors of a call that reached CUDA or NCCL: by class name, as CuPy's live in several
# modules (cupy_backends.cuda.api.runtime, .driver, cupy_backends.cuda.libs.nccl...).
DEVICE_ERRORS = ("CUDARuntimeError", "CUDADriverError", "NcclError", "CompileException",
                 "OutOfMemoryError")
# CuPy 14's driver functions load libcuda on their first call: without a driver they raise this
# RuntimeError after taking their arguments, as a call that reached CUDA.
NO_DRIVER = "CuPy failed to load libcuda"
# Names some CuPy versions lack, which cupycomm looks for before it calls them.
GUARDED = {"cupy.cuda.nccl.NcclCommunicator.commSplit":
           "CuPy < 14 has no commSplit; NcclBackend.split checks hasattr(comm, 'commSplit') "
           "and then makes a new unique id",
           "cupy.cuda.runtime.threadExchangeStreamCaptureMode":
           "CuPy does not wrap it; cupycomm looks it up with getattr and otherwise calls the "
           "driver's cuThreadExchangeStreamCaptureMode (not replayed here)",
           "cupy.comm_revoke":
           "nccl4py's comm_revoke (ncclCommRevoke), not CuPy's: NcclBackend calls it only "
           "where nccl4py imports (not replayed here); the stand-in provides it"}
_HANDLE = 0x1000   # any non-null handle or address: the call fails before using it


def lookup(name: str) -> Any:
    """The CuPy object named ``name`` (``cupy.cuda.nccl.NcclCommunicator.allReduce``), reached
    by attribute from ``cupy`` as cupycomm reaches it; a submodule that is no attribute until
    imported (``cupy.cuda.nccl``) is imported. (Importing every prefix would be wrong:
    ``import cupy.cuda.runtime`` replaces the compiled module with a Python one that lacks its
    private names.)"""
    parts = name.split(".")
    found = importlib.import_module(parts[0])
    for depth, part in enumerate(parts[1:], start=2):
        if not hasattr(found, part) and isinstance(found, types.ModuleType):
            try:
                importlib.import_module(".".join(parts[:depth]))
            except ImportError:
                pass
        if not hasattr(found, part):
            raise LookupError(f"CuPy has no {name} ({part!r} is missing)")
        found = getattr(found, part)
    return found


def absent(name: str) -> bool:
    """Whether this CuPy lacks ``name``."""
    try:
        lookup(name)
    except LookupError:
        return True
    return False


def instance(class_name: str) -> Any:
    """An object of CuPy's class ``class_name`` that owns no device resource."""
    import cupy
    cuda = cupy.cuda
    if class_name == "cupy.cuda.Stream":
        with warnings.catch_warnings():   # CuPy 14 deprecates it; 13 has no other way
            warnings.simplefilter("ignore", DeprecationWarning)
            return cuda.ExternalStream(_HANDLE, 0)
    if class_name == "cupy.cuda.Event":
        event = cuda.Event.__new__(cuda.Event)
        event.ptr = 0
        return event
    if class_name == "cupy.cuda.Device":
        return cuda.Device(0)
    if class_name == "cupy.ndarray":   # 4 float32 at an address no one dereferences
        memory = cuda.UnownedMemory(_HANDLE, 16, None, 0)
        return cupy.ndarray((4,), "f", memptr=cuda.MemoryPointer(memory, 0))
    cls = lookup(class_name)
    return cls.__new__(cls)


def argument(descriptor: list, value: Any) -> Any:
    """A value of the recorded type (the recorded value where there is one)."""
    kind = descriptor[0]
    if kind == "enum" or kind == "bool":
        return descriptor[1]
    if kind == "numpy-int":
        import numpy
        return numpy.dtype(descriptor[1]).type(1 if value is None else value)
    if value is not None:
        return value
    if kind in ("int", "int64", "uint64", "negative", "int64-negative"):
        return {"int": 1, "int64": 2 ** 40, "uint64": 2 ** 63, "negative": -1,
                "int64-negative": -2 ** 40}[kind]
    if kind == "None":
        return None
    if kind in ("float", "str"):
        return {"float": 1.0, "str": "x"}[kind]
    if kind in ("bytes", "bytearray"):
        return bytes(descriptor[1]) if kind == "bytes" else bytearray(descriptor[1])
    if kind in ("tuple", "list"):
        items = [argument(item, None) for item in descriptor[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dtype":
        import numpy
        return numpy.dtype(descriptor[1])
    if kind == "numpy.ndarray":
        import numpy
        return numpy.zeros(4, numpy.uint8)
    if kind == "cuda_array_interface":   # 4 float32 of device memory, in another library
        return types.SimpleNamespace(__cuda_array_interface__={
            "shape": (4,), "typestr": "<f4", "data": (_HANDLE, False), "version": 3})
    if kind == "callable":
        return lambda *args: None
    if kind == "object":
        return instance(descriptor[1])
    if kind == "from":   # a value CuPy made (NCCL's unique id), passed back unchanged
        return lookup(descriptor[1])()
    raise LookupError(f"cannot make an argument of type {descriptor}")


def _call(shape: dict) -> Callable[[], Any]:
    """The call a shape stands for, ready to run on the real CuPy."""
    name, kind = shape["name"], shape["kind"]
    values = shape.get("values") or [None] * len(shape["args"])
    args = [argument(d, v) for d, v in zip(shape["args"], values)]
    kwargs = {k: argument(d, None) for k, d in shape["kwargs"].items()}
    target = lookup(name)
    owner_name, _, member = name.rpartition(".")
    owner = lookup(owner_name) if owner_name else None
    if isinstance(owner, type):   # a method, property or context-manager method of a class
        receiver = instance(owner_name)
        if kind == "attribute":
            return lambda: getattr(receiver, member)
        if member == "__exit__":   # after a successful __enter__ only: replayed with it
            return lambda: _enter_exit(receiver)
        return lambda: getattr(receiver, member)(*args, **kwargs)
    return lambda: target(*args, **kwargs)


def _enter_exit(receiver: Any) -> None:
    with receiver:
        pass


def replay(shape: dict) -> Optional[str]:
    """None if the shape conforms (the call failed in CUDA/NCCL, or succeeded), else why not."""
    # A constructor that failed in CUDA leaves an object whose __del__ then fails too.
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
        return _outcome(shape)
    finally:
        sys.unraisablehook = hook


@functools.lru_cache(maxsize=None)
def python_runtime_module() -> Optional[types.ModuleType]:
    """What ``import cupy.cuda.runtime`` anywhere in a program makes ``cupy.cuda.runtime``: a
    Python module re-exporting the compiled one's public names only (loaded here aside, so as
    not to rebind it in this process); None where this CuPy has no such module."""
    spec = importlib.util.find_spec(".runtime", "cupy.cuda")
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RUNTIME = "cupy.cuda.runtime."


def _outcome(shape: dict) -> Optional[str]:
    name = shape["name"]
    if name in GUARDED and absent(name):
        return None
    if name.startswith(_RUNTIME) and not absent(name):
        rebound = python_runtime_module()
        function = name[len(_RUNTIME):].split(".")[0]
        if rebound is not None and not hasattr(rebound, function):
            return (f"LookupError: cupy.cuda.runtime.{function} is gone once a program runs "
                    f"`import cupy.cuda.runtime` (which binds a Python module of the public "
                    f"names only)")
    try:
        call = _call(shape)
    except Exception as error:   # a missing name or an argument CuPy cannot take
        return f"{type(error).__name__}: {error}"
    try:
        call()
    except Exception as error:
        if type(error).__name__ in DEVICE_ERRORS or NO_DRIVER in str(error):
            return None
        return f"{type(error).__name__}: {error}"
    return None


def gpu_visible() -> bool:
    """Whether CUDA sees a device here (the replay is only safe where it sees none)."""
    import cupy
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:   # no driver, no device: what the replay expects
        return False


def describe(shape: dict) -> str:
    """``name(int, int64, enum=7)`` for a message."""
    def one(descriptor: list) -> str:
        return descriptor[0] if len(descriptor) == 1 else f"{descriptor[0]}={descriptor[1]}"
    args = [one(d) for d in shape["args"]] + [f"{k}: {one(d)}" for k, d in shape["kwargs"].items()]
    return f"{shape['name']}({', '.join(args)})" if shape["kind"] == "call" else shape["name"]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance.replay",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="shape files, or directories of them")
    options = parser.parse_args(argv)
    import cupy
    import cupy.cuda.nccl  # noqa: F401  (a submodule `import cupy` does not load)
    if gpu_visible():
        print("a GPU is visible: the replay passes handles that point nowhere, which a GPU "
              "would use; run it where CUDA finds no device (as CI)", file=sys.stderr)
        return 2
    recorded = shapes.load(options.paths)
    mismatches = [(shape, why) for shape in recorded
                  for why in [replay(shape)] if why is not None]
    for shape, why in mismatches:
        print(f"MISMATCH {describe(shape)}: {why}")
    guarded = sorted({s["name"] for s in recorded if s["name"] in GUARDED and absent(s["name"])})
    for name in guarded:
        print(f"absent, and looked for first: {name} ({GUARDED[name]})")
    print(f"{len(recorded)} call shapes replayed on CuPy {cupy.__version__}: "
          f"{len(mismatches)} mismatches")
    if not recorded:
        print("no call shapes recorded: was CUPYCOMM_RECORD_CALL_SHAPES set?", file=sys.stderr)
        return 1
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
