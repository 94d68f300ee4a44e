"""Call shapes: every distinct CUDA/CuPy/NCCL call cupycomm makes on the stand-in, recorded.

A call shape is what CuPy's compiled signature sees of a call: the function's qualified name
as CuPy spells it (``cupy.cuda.nccl.NcclCommunicator.allReduce``), the number of positional
arguments, their types (an ``int`` in C ``int`` range or a 64-bit ``int`` such as a pointer,
a ``bool``, ``bytes`` of some length, a stream, an event...) and the names of the keyword
arguments. Enum arguments (NCCL datatypes and ops, memcpy kinds, capture modes) keep their
value, so that each datatype and op used is a shape of its own.

:func:`install` wraps the stand-in's functions and methods in place (the stand-in itself is
not edited); only calls made from the ``cupycomm`` package are recorded, not the tests' own
calls nor the stand-in's calls to itself. :func:`write` saves this process's shapes as JSON,
:func:`load` merges the files of every rank and run. ``tests/conformance/replay.py`` replays
them on the real CuPy.

    CUPYCOMM_RECORD_CALL_SHAPES=shapes/ mpiexec -n 2 python -m pytest tests -k standin
    python -m tests.conformance.replay shapes/
"""
from __future__ import annotations

import functools
import glob
import json
import os
import sys
import types
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy

ENVIRONMENT_VARIABLE = "CUPYCOMM_RECORD_CALL_SHAPES"

# Arguments whose value is part of the shape (enums): qualified name -> positions and keywords.
_NCCL_TYPED = {"allReduce": (3, 4), "reduce": (3, 4), "reduceScatter": (3, 4), "bcast": (2,),
               "broadcast": (3,), "allGather": (3,), "send": (2,), "recv": (2,)}
ENUMS: Dict[str, tuple] = {f"cupy.cuda.nccl.NcclCommunicator.{method}": positions
                           for method, positions in _NCCL_TYPED.items()}
ENUMS.update({"cupy.cuda.runtime.memcpyAsync": (3,), "cupy.cuda.runtime.memcpy2DAsync": (6,),
              "cupy.cuda.Stream.begin_capture": (0, "mode")})

# Arguments that are a value CuPy made, passed back unchanged: recorded as ``["from", maker]``
# (and replayed with what the real maker returns), as CuPy's type for them changed: NCCL's unique
# id is a tuple of 128 ints in CuPy 13, 128 bytes in CuPy 14 (the stand-in's). Any other type
# there is recorded as it is, and replays as a mismatch.
PRODUCED = {("cupy.cuda.nccl.NcclCommunicator", 1): ("cupy.cuda.nccl.get_unique_id",
                                                     (bytes, tuple))}

# Stand-in classes reachable from no namespace of the stand-in: the CuPy class they stand for.
CLASS_ALIASES = {"LocalNcclCommunicator": "cupy.cuda.nccl.NcclCommunicator",
                 "_Pointer": "cupy.cuda.MemoryPointer", "_NullStream": "cupy.cuda.Stream",
                 "Graph": "cupy.cuda.Graph"}

_INT32 = 2 ** 31
_INT64 = 2 ** 63
_RECORDED_CALLERS = "cupycomm"
_STANDIN = "cupycomm.testing.standin"   # inside the package, but its calls to itself are not cupycomm's


def describe(value: Any, class_names: Dict[type, str], enum: bool = False) -> list:
    """An argument as the compiled signature sees it: ``[type]`` or ``[type, detail]``.

    ``int`` is split by range (``int`` fits a C int, ``int64`` a 64-bit one: pointers and
    stream handles on a GPU, ``uint64``, ``negative``); an enum int keeps its value.
    """
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, numpy.integer):
        return ["numpy-int", numpy.dtype(type(value)).str]   # CuPy's C ints take it too
    if isinstance(value, int):
        if enum:
            return ["enum", int(value)]
        if value < 0:
            kind = "negative" if value >= -_INT32 else "int64-negative"
        else:
            kind = "int" if value < _INT32 else "int64" if value < _INT64 else "uint64"
        return [kind]
    if value is None:
        return ["None"]
    if isinstance(value, (float, str)):
        return [type(value).__name__]
    if isinstance(value, (bytes, bytearray)):
        return [type(value).__name__, len(value)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [describe(item, class_names) for item in value]]
    cls = type(value)
    if cls in class_names:
        return ["object", class_names[cls]]
    if isinstance(value, numpy.dtype) or isinstance(value, type) and issubclass(value,
                                                                                numpy.generic):
        return ["dtype", numpy.dtype(value).str]
    if cls is numpy.ndarray:
        return ["numpy.ndarray"]
    if hasattr(value, "__cuda_array_interface__"):   # torch, numba... arrays, seen by CuPy
        return ["cuda_array_interface"]
    if callable(value):
        return ["callable"]
    return ["other", f"{cls.__module__}.{cls.__qualname__}"]


class Recorder:
    """The distinct call shapes seen in this process, with the first call's int values (a
    replay makes the very call that was recorded)."""

    def __init__(self) -> None:
        self.shapes: Dict[str, dict] = {}
        self.class_names: Dict[type, str] = {}

    def record(self, name: str, kind: str, args: tuple, kwargs: dict) -> None:
        enums = ENUMS.get(name, ())
        described = [self._produced(name, i, a) or describe(a, self.class_names, i in enums)
                     for i, a in enumerate(args)]
        keywords = {k: describe(v, self.class_names, k in enums) for k, v in sorted(kwargs.items())}
        key = json.dumps([name, kind, described, keywords])
        if key not in self.shapes:
            self.shapes[key] = {"name": name, "kind": kind, "args": described,
                                "kwargs": keywords, "values": [_plain(a) for a in args]}

    @staticmethod
    def _produced(name: str, position: int, value: Any) -> Optional[list]:
        maker, types_ = PRODUCED.get((name, position), (None, ()))
        return ["from", maker] if isinstance(value, types_) else None

    def write(self, directory: str) -> str:
        """Save the shapes as ``directory/shapes-<pid>.json``; returns the path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"shapes-{os.getpid()}.json")
        with open(path, "w") as file:
            json.dump(sorted(self.shapes.values(), key=_order), file, indent=1)
        return path


def _plain(value: Any) -> Any:
    """An int argument's value (what a replay passes); None for anything else."""
    return int(value) if isinstance(value, (int, numpy.integer)) and not isinstance(
        value, bool) else None


def _order(shape: dict) -> str:
    return json.dumps([shape["name"], shape["kind"], shape["args"], shape["kwargs"]])


def key(shape: dict) -> str:
    """What makes two recorded shapes the same (the values a replay passes do not)."""
    return _order(shape)


def load(paths: Iterable[str]) -> List[dict]:
    """The distinct shapes in the given files and directories (``*.json`` in each)."""
    merged: Dict[str, dict] = {}
    for path in paths:
        files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
        for name in files:
            with open(name) as file:
                for shape in json.load(file):
                    merged.setdefault(key(shape), shape)
    return sorted(merged.values(), key=_order)


# -- installing the recorder on the stand-in -------------------------------------------------------
def _called_from_cupycomm() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return ((caller == _RECORDED_CALLERS or caller.startswith(_RECORDED_CALLERS + "."))
            and not caller.startswith(_STANDIN))


def _recording(function: Callable, name: str, kind: str, recorder: Recorder,
               bound: bool) -> Callable:
    # __exit__'s arguments are the interpreter's (the exception leaving the with block)
    exit_ = name.endswith(".__exit__")

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _called_from_cupycomm():
            recorder.record(name, kind, () if exit_ else args[int(bound):], kwargs)
        return function(*args, **kwargs)
    return wrapper


def _namespaces(standin: types.ModuleType) -> List[tuple]:
    """(CuPy path, namespace) of the stand-in module and every namespace inside it
    (``cuda``, ``cuda.nccl``, ``cuda.runtime``...), deepest first."""
    found: List[tuple] = []
    todo = [("cupy", standin)]
    while todo:
        path, namespace = todo.pop()
        if any(namespace is seen for _, seen in found):
            continue
        found.append((path, namespace))
        for attribute, value in list(vars(namespace).items()):
            if attribute.startswith("__"):
                continue
            if isinstance(value, types.SimpleNamespace):
                todo.append((f"{path}.{attribute}", value))
            elif (isinstance(value, types.ModuleType)   # named as CuPy's, wherever it is kept
                  and value.__name__.startswith(standin.__name__ + ".")):
                todo.append(("cupy" + value.__name__[len(standin.__name__):], value))
    return sorted(found, key=lambda item: -item[0].count("."))


_METHOD_DUNDERS = ("__init__", "__enter__", "__exit__")


def _wrap_class(cls: type, name: str, recorder: Recorder) -> None:
    for attribute, value in list(vars(cls).items()):
        if attribute.startswith("_") and attribute not in _METHOD_DUNDERS:
            continue
        qualified = name if attribute == "__init__" else f"{name}.{attribute}"
        if isinstance(value, staticmethod):
            setattr(cls, attribute, staticmethod(
                _recording(value.__func__, qualified, "call", recorder, bound=False)))
        elif isinstance(value, types.FunctionType):
            setattr(cls, attribute, _recording(value, qualified, "call", recorder, bound=True))
        elif isinstance(value, property) and value.fget is not None:
            setattr(cls, attribute, property(
                _recording(value.fget, qualified, "attribute", recorder, bound=True),
                value.fset, value.fdel, value.__doc__))


def install(standin: types.ModuleType, recorder: Optional[Recorder] = None) -> Recorder:
    """Record the calls cupycomm makes to ``standin`` (``cupycomm.testing.standin``) from now on.

    Functions are replaced by recording wrappers in each namespace of the stand-in; the
    stand-in's classes get recording methods, properties and constructors in place.
    """
    recorder = recorder or Recorder()
    namespaces = _namespaces(standin)
    classes: Dict[type, str] = {cls: CLASS_ALIASES[cls.__name__] for cls in vars(standin).values()
                                if isinstance(cls, type) and cls.__name__ in CLASS_ALIASES}
    for path, namespace in namespaces:   # deepest first: cupy.cuda.Stream, not cupy.Stream
        for attribute, value in vars(namespace).items():
            if isinstance(value, type) and value.__module__ == standin.__name__:
                classes.setdefault(value, f"{path}.{attribute}")
    for cls in vars(standin).values():   # the stand-in's own: a call to one is a mismatch
        if isinstance(cls, type) and cls.__module__ == standin.__name__ and cls not in classes:
            classes[cls] = f"cupy.<stand-in>.{cls.__name__}"
    recorder.class_names.update(classes)
    for cls, name in classes.items():
        if not issubclass(cls, BaseException):
            _wrap_class(cls, name, recorder)
    for path, namespace in namespaces:
        for attribute, value in list(vars(namespace).items()):
            internal = namespace is standin and attribute.startswith("_")
            if (isinstance(value, types.FunctionType) and value.__module__ == standin.__name__
                    and not internal):
                setattr(namespace, attribute, _recording(
                    value, f"{path}.{attribute}", "call", recorder, bound=False))
    return recorder
