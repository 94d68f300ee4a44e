"""Docs generated from the code, so that they cannot drift: the README's dtype x op table."""
from __future__ import annotations

import numpy as np

from ._dtypes import DTYPES, ReduceOp
from .backends.mpi import MPIBackend
from .backends.nccl import NcclBackend


def _backend_cell(backend: type, dtype: np.dtype) -> str:
    specs = backend.reductions.get(dtype)
    if specs is None:
        return "moves only"
    emulated = backend is MPIBackend and next(iter(specs.values()))[3] is not None
    return "yes (NumPy op)" if emulated else "yes"


def dtype_table() -> str:
    """The dtype x op matrix as a Markdown table, with what each backend can reduce."""
    ops = list(ReduceOp)
    lines = ["| dtype | " + " | ".join(o.value for o in ops) + " | MPI | NCCL |",
             "|---" * (len(ops) + 3) + "|"]
    logic = {ReduceOp.MAX: "or", ReduceOp.MIN: "and"}
    for dtype, row in DTYPES.items():
        cells = []
        for op in ops:
            applied = row.ops.get(op)
            if applied is None:
                cells.append("-")
            else:
                cells.append(logic[applied] if dtype == np.bool_ else "yes")
        lines.append(f"| {dtype} | " + " | ".join(cells) + f" | {_backend_cell(MPIBackend, dtype)}"
                     f" | {_backend_cell(NcclBackend, dtype)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(dtype_table())
