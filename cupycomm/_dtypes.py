"""The one table of dtypes and reduction ops, shared by the MPI and NCCL backends.

Each row says, for one NumPy/CuPy dtype, how MPI and NCCL reduce it and which ops are defined.
Collectives that only move data (broadcast, gathers, scatters, all_to_all, point-to-point) move
bytes and accept every dtype of the table; reductions look up the row.

Op rules, as in torch.distributed:

- ``avg`` is defined only for floating and complex dtypes (an integer mean would truncate).
- ``min``, ``max`` and ``prod`` are not defined for complex dtypes (NCCL reduces a complex
  array as pairs of reals, which is exact for sums only).
- ``bool`` reduces as logic: ``sum`` and ``max`` are *or*, ``prod`` and ``min`` are *and*.

``bfloat16`` (ml_dtypes' type, on the host) has a row when ml_dtypes is installed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

__all__ = ["ReduceOp", "DtypeRow", "DTYPES", "NCCL_OPS", "op_error"]


class ReduceOp(str, enum.Enum):
    """Reduction operators. Strings work too: ``op="max"`` is ``ReduceOp.MAX``."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    def __str__(self) -> str:
        return self.value


# NCCL's ABI constants (nccl.h); kept here so that host-only programs never import CuPy.
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_OPS: Mapping[ReduceOp, int] = {
    ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4,
}

_ALL = tuple(ReduceOp)
_NO_AVG = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
_SUM_AVG = (ReduceOp.SUM, ReduceOp.AVG)
_LOGIC = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX,
          ReduceOp.PROD: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN}


@dataclass(frozen=True)
class DtypeRow:
    """How one dtype is reduced.

    ``ops`` maps each allowed requested op to the op actually applied (only bool remaps).
    ``mpi_type`` is None where the MPI library has no such type; ``nccl_type`` is None where
    NCCL has none (NCCL has no 16-bit integers). ``nccl_count`` is the number of NCCL
    elements per array element (2 for complex: pairs of reals).
    """

    dtype: np.dtype
    ops: Mapping[ReduceOp, ReduceOp]
    mpi_type: Optional[MPI.Datatype]
    nccl_type: Optional[int]
    nccl_count: int = 1
    why_not: str = ""  # the reason shown when a requested op is missing from ``ops``
    carrier: Optional[np.dtype] = None   # see _row


def _mpi(name: str) -> Optional[MPI.Datatype]:
    datatype = getattr(MPI, name, MPI.DATATYPE_NULL)
    return None if datatype == MPI.DATATYPE_NULL else datatype


def _row(dtype: Any, ops: Union[Sequence[ReduceOp], Mapping[ReduceOp, ReduceOp]],
         mpi_name: str, nccl_type: Optional[int], nccl_count: int = 1,
         why_not: str = "") -> DtypeRow:
    """A row. ``carrier``: the unsigned integer dtype of the same size, which holds the
    dtype's bits wherever a library cannot take the dtype itself (NumPy exports no buffer
    of ml_dtypes' bfloat16; an MPI without a float16 type reduces it with an op of ours)."""
    dtype = np.dtype(dtype)
    mapping = dict(ops) if isinstance(ops, Mapping) else {op: op for op in ops}
    carrier = np.dtype(f"u{dtype.itemsize}") if dtype.itemsize in (1, 2, 4, 8) else None
    return DtypeRow(dtype, mapping, _mpi(mpi_name), nccl_type, nccl_count, why_not, carrier)


_INTEGER = "an integer mean would truncate: use op='sum' and divide"
_COMPLEX = "complex numbers have no order and NCCL multiplies them as pairs of reals"
_BOOL = "a mean of booleans is not a boolean"

_ROWS = [
    _row(np.bool_, _LOGIC, "UINT8_T", NCCL_UINT8, why_not=_BOOL),
    _row(np.int8, _NO_AVG, "INT8_T", NCCL_INT8, why_not=_INTEGER),
    _row(np.uint8, _NO_AVG, "UINT8_T", NCCL_UINT8, why_not=_INTEGER),
    _row(np.int16, _NO_AVG, "INT16_T", None, why_not=_INTEGER),
    _row(np.uint16, _NO_AVG, "UINT16_T", None, why_not=_INTEGER),
    _row(np.int32, _NO_AVG, "INT32_T", NCCL_INT32, why_not=_INTEGER),
    _row(np.uint32, _NO_AVG, "UINT32_T", NCCL_UINT32, why_not=_INTEGER),
    _row(np.int64, _NO_AVG, "INT64_T", NCCL_INT64, why_not=_INTEGER),
    _row(np.uint64, _NO_AVG, "UINT64_T", NCCL_UINT64, why_not=_INTEGER),
    _row(np.float16, _ALL, "FLOAT16_T", NCCL_FLOAT16),
    _row(np.float32, _ALL, "FLOAT", NCCL_FLOAT32),
    _row(np.float64, _ALL, "DOUBLE", NCCL_FLOAT64),
    _row(np.complex64, _SUM_AVG, "C_FLOAT_COMPLEX", NCCL_FLOAT32, 2, why_not=_COMPLEX),
    _row(np.complex128, _SUM_AVG, "C_DOUBLE_COMPLEX", NCCL_FLOAT64, 2, why_not=_COMPLEX),
]
try:   # bfloat16 comes with ml_dtypes (the optional extra "bfloat16")
    import ml_dtypes
except ImportError:
    pass
else:
    _ROWS.append(_row(ml_dtypes.bfloat16, _ALL, "BFLOAT16_T", NCCL_BFLOAT16))

DTYPES: Mapping[np.dtype, DtypeRow] = {row.dtype: row for row in _ROWS}
"""The dtypes cupycomm accepts, each with its row: the ops it allows, its MPI and NCCL types
(``bfloat16`` only where ml_dtypes is installed). ``numpy.dtype(x) in cupycomm.DTYPES`` tells
whether an array can be communicated."""


def op_error(row: DtypeRow, op: Any) -> str:
    """Why ``op`` cannot reduce ``row``'s dtype: an unknown op, or one the table denies."""
    try:
        known = ReduceOp(op)
    except (ValueError, TypeError):
        names = ", ".join(repr(o.value) for o in ReduceOp)
        return f"op must be one of {names} or a ReduceOp, got {op!r}"
    return f"op={known.value!r} is not defined for {row.dtype} ({row.why_not})"
