"""Docs generated from the code, so that they cannot drift: the dtype x op table, the calls,
the variables and the launchers (``python -m cupycomm.tools.docs`` prints them)."""
from __future__ import annotations

import dataclasses
from typing import Type, Union

import numpy as np

from .._collectives import CALLS, INTERNAL
from .._dtypes import DTYPES, ReduceOp
from .._env import VARIABLES
from ..backends.mpi import MPIBackend
from ..backends.nccl import NcclBackend
from ..run.launchers import KINDS, Kind


def _backend_cell(backend: Union[Type[MPIBackend], Type[NcclBackend]], dtype: np.dtype) -> str:
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


def call_table() -> str:
    """The calls users make, who takes part, what runs them, and whether debug mode checks
    them, as a Markdown table."""
    lines = ["| call | ranks | MPI | NCCL | checked in debug mode |", "|---|---|---|---|---|"]
    for call in CALLS:
        if call.kind != INTERNAL:
            lines.append(f"| `{call.name}` | {call.kind} | {call.mpi_call} | "
                         f"{call.nccl_call or '-'} | {'yes' if call.checked else '-'} |")
    return "\n".join(lines)


def variable_table() -> str:
    """The CUPYCOMM_* environment variables as a Markdown table."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{v.name}` | `{v.default!r}` | {v.meaning} |" for v in VARIABLES]
    return "\n".join(lines)


def launcher_table() -> str:
    """``cupycomm.run.launchers.KINDS`` as a Markdown table: a column a kind, a line a field."""
    def cell(value: object) -> str:
        items = value if isinstance(value, tuple) else (getattr(value, "name", value),)
        said = " ".join(f"`{i}`".replace("|", "\\|") for i in items if i and i != "(?!)")
        return "yes" if value is True else said or "-"
    lines = ["| | " + " | ".join(f"`{kind}`" for kind in KINDS) + " |",
             "|---" * (len(KINDS) + 1) + "|"]
    lines += [f"| `{field.name}` | " + " | ".join(cell(getattr(row, field.name))
                                                  for row in KINDS.values()) + " |"
              for field in dataclasses.fields(Kind)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(dtype_table(), call_table(), variable_table(), launcher_table(), sep="\n\n")
