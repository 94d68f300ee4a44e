"""The list and uneven layouts of the collectives that join or split per-rank parts:
all_gather into a list of arrays, reduce_scatter of a list, all_to_all with splits.

Each is checked in full on the calling rank, then runs as one call of the backend on one
array (the list's parts copied into it or out of it); uneven all_to_all sends the bytes of
each rank's rows.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .route import Router
from ..backends.shapes import JoinedShapes
from .checks import Checks

__all__ = ["Layouts"]


class Layouts:
    """The list and uneven layouts of one communicator, as a part of it.

    Example (on 2 ranks, inside Communicator)::

        layouts = Layouts(checks, router, JoinedShapes(2))
        b, x, spec = router.route("all_gather", "x", numpy.array([comm.rank]))
        layouts.all_gather_list(b, x, spec, [numpy.empty(1, int)] * 2, False, None)
    """

    def __init__(self, checks: Checks, router: Router, joined: JoinedShapes) -> None:
        self._checks = checks
        self._router = router
        self._joined = joined

    def all_gather_list(self, b: Any, x: Any, spec: Any, out: Sequence, async_op: bool,
                        stream: Any) -> Any:
        """all_gather into a list of ``size`` arrays: into one array, then copied to them."""
        out = self._router.check_parts("all_gather", "out", b, out, x)
        whole = b.empty(self._joined[x.shape][0], x.dtype, stream)
        parts = [whole[j, ...] for j in range(self._checks.size)]   # views, 0-d ones too
        return b.all_gather(x, whole, spec, async_op, stream, list(zip(out, parts)))

    def reduce_scatter_list(self, xs: Sequence, op: Any, out: Any, async_op: bool,
                            stream: Any) -> Any:
        """reduce_scatter of a list of ``size`` arrays: copied into one array first."""
        name, checks, router = "reduce_scatter", self._checks, self._router
        if not xs:
            raise checks.fail(ValueError, name, f"x is an empty list, expected {checks.size} "
                                                f"arrays (one per rank)")
        b, first, spec = router.route(name, "x[0]", xs[0], op, stream=stream)
        xs = router.check_parts(name, "x", b, xs, first, writes=False)
        if out is None:
            out = b.empty(first.shape, first.dtype, stream)
        else:
            out = router.check_out(name, "out", b, out, first, (first.shape,))
        whole = b.empty((checks.size,) + first.shape, first.dtype, stream)
        pack = [(whole[j, ...], part) for j, part in enumerate(xs)]   # copied by the backend
        return b.reduce_scatter(whole, out, spec, async_op, stream, pack)

    def all_to_all_v(self, b: Any, x: Any, spec: Any, out: Any,
                     in_splits: Optional[Sequence[int]], out_splits: Optional[Sequence[int]],
                     async_op: bool, stream: Any) -> Any:
        """all_to_all with uneven parts (``in_splits`` or ``out_splits`` given)."""
        checks = self._checks
        if x.ndim == 0:
            raise checks.fail(ValueError, "all_to_all", "x is 0-d: it has no leading axis to "
                                                        "split")
        if in_splits is None:
            checks.check_leading_axis("all_to_all", "x", x)
            in_splits = [x.shape[0] // checks.size] * checks.size
        sent = checks.check_splits("in_splits", in_splits, x.shape[0])
        if out_splits is not None:
            received = checks.check_splits("out_splits", out_splits, None)
            shape = (sum(received),) + x.shape[1:]
            if out is None:
                out = b.empty(shape, x.dtype, stream)
            else:
                out = self._router.check_out("all_to_all", "out", b, out, x, (shape,),
                                             " (sum(out_splits) rows)")
                self._router.check_apart("all_to_all", "out", b, out, x)
        else:
            received, out = self._received_splits(b, x, sent, out, stream)
        row = x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        return b.all_to_all_v(x, out, spec, [n * row for n in sent],
                              [n * row for n in received], async_op, stream)

    def _received_splits(self, b: Any, x: Any, sent: List[int], out: Any,
                         stream: Any) -> Tuple[List[int], Any]:
        """(rows from each rank, out or a new array) when only ``in_splits`` is known: the
        ranks gather every rank's in_splits and out rows, so that each knows what it
        receives and every rank finds a wrong ``out`` alike, before any data moves."""
        checks, rows = self._checks, -1
        if out is not None:
            out = self._router.check_kind("all_to_all", "out", b, out, x)
            if out.ndim == 0 or out.shape[1:] != x.shape[1:]:
                raise checks.fail(ValueError, "all_to_all", f"out has shape {out.shape}, "
                                                            f"expected (rows, *{x.shape[1:]})")
            self._router.check_apart("all_to_all", "out", b, out, x)
            rows = out.shape[0]
        table = self._router.host.gather_ints(sent + [rows], "all_to_all")
        expected = table[:, :-1].sum(axis=0)   # rank j receives column j
        for j, (given, want) in enumerate(zip(table[:, -1].tolist(), expected.tolist())):
            if given not in (-1, want):
                raise checks.fail(ValueError, "all_to_all", f"out of rank {j} has {given} "
                                                            f"rows, but the ranks' in_splits "
                                                            f"send it {want}")
        received = table[:, checks.rank].tolist()
        if out is None:
            out = b.empty((sum(received),) + x.shape[1:], x.dtype, stream)
        return received, out
