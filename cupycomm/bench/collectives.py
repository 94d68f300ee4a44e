"""The benchmark's one table: per collective, its buffers, its calls in each library, its check.

A :class:`Case` is one collective at one size in one mode (out-of-place or in-place) with its
buffers allocated. A :class:`Collective` row says how a byte size becomes buffers, what the
result must be (computed with NumPy), the nccl-tests bus-bandwidth factor, and how each
library makes the call (``cupycomm``, the raw baselines ``mpi`` and ``nccl``, the peers
``cupyx`` and ``torch``): a zero-argument callable built once, so that the timed loop only
calls it, or a string saying why the library has none. Adding a collective is adding one row
to :data:`TABLE`. Sizes, baselines and bus bandwidth as the guide says them
(docs/guide/benchmarks.md); the rest: docs/internals.md, "bench/collectives.py".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
from mpi4py import MPI

from .._dtypes import DTYPES, NCCL_INT8, ReduceOp
from ..backends.nccl import NcclBackend

__all__ = ["Case", "Collective", "TABLE", "ROWS", "distinct_sizes", "known_input", "timed_input",
           "reduced", "count_wrong"]

Runner = Callable[[], Any]
Call = Callable[[Any, "Case"], Union[Runner, str]]
Inputs = Callable[[int], np.ndarray]

_MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
           "avg": np.add}


@dataclass
class Case:
    """One collective at one size, in one mode, on ``ranks`` ranks, with its buffers.

    ``y is x`` in place. ``unit`` is nccl-tests' count: elements per rank's part.
    """

    name: str
    rank: int
    ranks: int
    root: int
    op: str
    dtype: np.dtype
    unit: int
    nbytes: int
    in_place: bool
    async_op: bool
    x: Any
    y: Any

    # -- what every library needs
    @property
    def out(self) -> Any:
        """cupycomm's ``out=``: None in place."""
        return None if self.in_place else self.y

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    def at_root(self, value: Any) -> Any:
        """``value`` on the root, None elsewhere (arguments only the root reads)."""
        return value if self.rank == self.root else None

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.ranks

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.ranks

    @property
    def peers(self) -> range:
        return range(self.ranks)

    # -- MPI
    def pick(self, blocking: Any, nonblocking: Any) -> Any:
        """The nonblocking MPI call under ``--async``, else the blocking one."""
        return nonblocking if self.async_op else blocking

    @property
    def mpi_view(self) -> Optional[np.dtype]:
        """The dtype a user views the arrays as for mpi4py: None where mpi4py takes them as
        they are; the unsigned integer of the same size for a dtype NumPy exports no buffer
        of (ml_dtypes' bfloat16)."""
        return DTYPES[self.dtype].carrier if self.dtype.kind == "V" else None

    def _for_mpi(self, a: Any) -> Any:
        view = self.mpi_view
        return a if view is None or a is None else a.view(view)

    @property
    def mx(self) -> Any:
        """``x`` as a user hands it to mpi4py (see :attr:`mpi_view`)."""
        return self._for_mpi(self.x)

    @property
    def my(self) -> Any:
        """``y`` as a user hands it to mpi4py (see :attr:`mpi_view`)."""
        return self._for_mpi(self.y)

    @property
    def mpi_send(self) -> Any:
        return MPI.IN_PLACE if self.in_place else self.mx

    @property
    def mpi_op(self) -> Optional[MPI.Op]:
        """The MPI op a user passes, or None where MPI has none (avg; arithmetic on bool)."""
        return None if self.dtype == np.bool_ else _MPI_OPS.get(self.op)

    # -- NCCL: pointers and byte counts
    @property
    def px(self) -> int:
        return self.x.data.ptr

    @property
    def py(self) -> int:
        return self.y.data.ptr

    @property
    def part_bytes(self) -> int:
        return self.unit * self.dtype.itemsize

    def part(self, ptr: int, j: int) -> int:
        """Address of part ``j`` of a buffer that holds one part per rank."""
        return ptr + j * self.part_bytes

    def nccl_reduction(self, elements: int) -> Tuple[int, int, int]:
        """(NCCL count, NCCL datatype, NCCL op) reducing ``elements`` array elements."""
        datatype, factor, op = NcclBackend.reductions[self.dtype][ReduceOp(self.op)]
        return elements * factor, datatype, op

    def stacked(self, a: Any) -> Any:
        """``a`` viewed as ``(ranks, unit)`` (cupyx.distributed wants that shape)."""
        return a.reshape(self.ranks, self.unit)


@dataclass(frozen=True)
class Collective:
    """One row of the table (the module docstring says its fields)."""

    name: str
    bus_factor: Callable[[int], float]
    x_parts: bool
    y_parts: bool
    modes: Tuple[bool, ...]   # the in_place values cupycomm offers
    reduces: bool
    rooted: bool
    expected: Callable[[Inputs, Case], Optional[np.ndarray]]
    cupycomm: Call
    mpi: Call
    nccl: Call
    cupyx: Call
    torch: Call

    def layout(self, nbytes: int, itemsize: int, ranks: int) -> Tuple[int, int, int, int]:
        """(count, size shown, x elements, y elements) for a requested size, as nccl-tests,
        except that a size above 0 is never an empty message: at least one element (per
        rank's part, for the collectives whose buffers hold one part per rank)."""
        count = nbytes // itemsize
        if not (self.x_parts or self.y_parts):
            count = max(count, 1) if nbytes else 0
            return count, count * itemsize, count, count
        unit = max(count // ranks, 1) if nbytes else 0
        return (unit, unit * ranks * itemsize, unit * (ranks if self.x_parts else 1),
                unit * (ranks if self.y_parts else 1))


def distinct_sizes(row: Collective, sizes: Sequence[int], itemsize: int,
                   ranks: int) -> List[int]:
    """The requested ``sizes`` whose message differs from every smaller one's: on 3 ranks,
    8 B and 16 B of float32 are both one element per rank (12 B), measured once.

    Example::

        distinct_sizes(ROWS["all_gather"], [8, 16, 32], 4, 3)   # [8, 32]: 12 B, 24 B
    """
    seen, out = set(), []
    for nbytes in sizes:
        shown = row.layout(nbytes, itemsize, ranks)[1]
        if shown not in seen:
            seen.add(shown)
            out.append(nbytes)
    return out


# -- known inputs and NumPy references ------------------------------------------------------------
def known_input(rank: int, elements: int, dtype: np.dtype) -> np.ndarray:
    """Rank ``rank``'s input: small random integers (1..4) as ``dtype``, so that sums, products,
    minima and maxima of a few ranks are exact in every dtype; the same on every rank.

    Example::

        known_input(1, 4, np.dtype(np.float32))   # the same 4 values wherever it is computed
    """
    rng = np.random.default_rng([rank, elements, dtype.num])
    ints = rng.integers(1, 5, elements, dtype=np.uint8)
    if dtype == np.bool_:
        return (ints & 1).astype(np.bool_)
    if dtype.kind == "c":
        return (ints + 1j * rng.integers(1, 5, elements, dtype=np.uint8)).astype(dtype)
    return ints.astype(dtype)


def timed_input(row: Collective, case: Case, known: np.ndarray) -> np.ndarray:
    """What the timed calls of ``case`` start from. An in-place reduction feeds its result
    back into its input at every call (a sum on 2 ranks doubles it: float32 reaches inf after
    about 128 calls, float16 after 16), so it is timed on the op's identity, which every call
    leaves as it is: 0 for sum and avg, 1 for prod (min and max leave any input as it is
    after one call). Everything else is timed on its ``known`` input. The buffers are loaded
    once, before the timed calls, so that nothing is added inside the timed region.

    Example::

        timed_input(ROWS["all_reduce"], in_place_sum_case, known)   # zeros like known
    """
    if not (row.reduces and case.in_place):
        return known
    if case.op in ("sum", "avg"):
        return np.zeros_like(known)
    if case.op == "prod":
        return np.ones_like(known)
    return known


def reduced(inputs: Inputs, case: Case) -> np.ndarray:
    """Every rank's input reduced with ``case.op`` in ``case.dtype`` (bool as logic: sum and
    max are or, prod and min are and; avg divides complex values as pairs of reals)."""
    total = np.array(inputs(0))
    ufunc = _UFUNCS[case.op]
    for j in range(1, case.ranks):
        ufunc(total, inputs(j), out=total)
    if case.op == "avg":
        reals = total.view(total.real.dtype) if total.dtype.kind == "c" else total
        np.true_divide(reals, case.ranks, out=reals)
    return total


def count_wrong(got: np.ndarray, expected: np.ndarray) -> int:
    """Elements of ``got`` that differ from ``expected``: integers and bool exactly, floating
    types within a few units of rounding (an average divides, NCCL may reorder a product).

    Example::

        count_wrong(np.array([1., 2., 3.]), np.array([1., 2., 4.]))   # 1
    """
    got = np.asarray(got).reshape(-1)
    expected = np.asarray(expected).reshape(-1)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return max(got.size, expected.size)
    if expected.dtype.kind in "fc":
        rtol = 8 * float(np.finfo(expected.dtype).eps)
        return int(np.count_nonzero(~np.isclose(got, expected, rtol=rtol, atol=0,
                                                equal_nan=True)))
    return int(np.count_nonzero(got != expected))


def _slice(a: np.ndarray, case: Case, j: int) -> np.ndarray:
    return a[j * case.unit:(j + 1) * case.unit]


def _joined(inputs: Inputs, case: Case) -> np.ndarray:
    return np.concatenate([inputs(j) for j in case.peers])


# -- NCCL point-to-point groups (collectives NCCL has no call for) --------------------------------
def _grouped(h: Any, case: Case, sends: Sequence[Tuple[int, int]],
             recvs: Sequence[Tuple[int, int]]) -> Runner:
    """One NCCL group of sends and receives of ``case.part_bytes`` each: (address, peer) pairs."""
    nbytes, stream, comm = case.part_bytes, h.stream, h.comm
    calls = ([(comm.send, (ptr, nbytes, NCCL_INT8, peer, stream)) for ptr, peer in sends]
             + [(comm.recv, (ptr, nbytes, NCCL_INT8, peer, stream)) for ptr, peer in recvs])
    start, end = h.nccl.groupStart, h.nccl.groupEnd

    def run() -> None:
        start()
        for call, args in calls:
            call(*args)
        end()
    return run


def _all_parts(case: Case, ptr: int) -> List[Tuple[int, int]]:
    return [(case.part(ptr, j), j) for j in case.peers]


def _all_reduce_bus(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks


def _spread_bus(ranks: int) -> float:
    return (ranks - 1) / ranks


def _unit_bus(ranks: int) -> float:
    return 1.0


# -- the coalesced all_reduce: many small arrays, against one call per array ----------------------
PIECE_BYTES = 1024   # the buffer is cut into arrays of 1 KiB (at most MAX_PIECES of them)
MAX_PIECES = 256


def pieces(a: Any) -> List[Any]:
    """``a`` (1-d) cut into views of about PIECE_BYTES each, at most MAX_PIECES of them."""
    count = max(1, min(MAX_PIECES, a.nbytes // PIECE_BYTES))
    edges = [a.size * i // count for i in range(count + 1)]
    return [a[edges[i]:edges[i + 1]] for i in range(count)]


class _Requests:
    """Several MPI requests waited as one (the async baseline of the coalesced row)."""

    def __init__(self, requests: List[Any]) -> None:
        self.requests = requests

    def Wait(self) -> None:   # noqa: N802 (mpi4py's name)
        MPI.Request.Waitall(self.requests)


def _one_call_each(call: Callable, arguments: List[tuple], async_op: bool = False) -> Runner:
    """What a user does without coalescing: ``call(*args)`` for each array."""
    def run() -> Any:
        results = [call(*args) for args in arguments]
        return _Requests(results) if async_op else None
    return run


_p = functools.partial
_BOTH = (False, True)
_OUT = (False,)
_IN = (True,)

TABLE: List[Collective] = [
    Collective(
        "all_reduce", _all_reduce_bus, False, False, _BOTH, reduces=True, rooted=False,
        expected=reduced,
        cupycomm=lambda h, c: (lambda f=h.all_reduce, x=c.x, op=c.op, out=c.out, a=c.async_op:
                               f(x, op=op, out=out, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Allreduce, h.Iallreduce), c.mpi_send, c.my, c.mpi_op),
        nccl=lambda h, c: _p(h.comm.allReduce, c.px, c.py, *c.nccl_reduction(c.unit), h.stream),
        cupyx=lambda h, c: _p(h.all_reduce, c.x, c.y, c.op),
        torch=lambda h, c: ((lambda f=h.dist.all_reduce, t=h.tensor(c.x), op=h.op(c.op):
                             f(t, op=op)) if c.in_place
                            else "torch.distributed has no out-of-place all_reduce")),
    Collective(
        "broadcast", _unit_bus, False, False, _IN, reduces=False, rooted=True,
        expected=lambda inputs, c: inputs(c.root),
        cupycomm=lambda h, c: (lambda f=h.broadcast, x=c.x, root=c.root, a=c.async_op:
                               f(x, root, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Bcast, h.Ibcast), c.mx, c.root),
        nccl=lambda h, c: _p(h.comm.bcast, c.px, c.x.nbytes, NCCL_INT8, c.root, h.stream),
        cupyx=lambda h, c: _p(h.broadcast, c.x, c.root),
        torch=lambda h, c: _p(h.dist.broadcast, h.tensor(c.x), c.root)),
    Collective(
        "reduce", _unit_bus, False, False, _BOTH, reduces=True, rooted=True,
        expected=lambda inputs, c: reduced(inputs, c) if c.is_root else None,
        cupycomm=lambda h, c: (lambda f=h.reduce, x=c.x, root=c.root, op=c.op,
                               out=c.at_root(c.out), a=c.async_op:
                               f(x, root, op=op, out=out, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Reduce, h.Ireduce), c.mpi_send if c.is_root else c.mx,
                            c.at_root(c.my), c.mpi_op, c.root),
        nccl=lambda h, c: _p(h.comm.reduce, c.px, c.py, *c.nccl_reduction(c.unit), c.root,
                             h.stream),
        cupyx=lambda h, c: _p(h.reduce, c.x, c.y, c.root, c.op),
        torch=lambda h, c: ((lambda f=h.dist.reduce, t=h.tensor(c.x), root=c.root,
                             op=h.op(c.op): f(t, root, op=op))
                            if c.in_place else "torch.distributed has no out-of-place reduce")),
    Collective(
        "all_gather", _spread_bus, False, True, _OUT, reduces=False, rooted=False,
        expected=_joined,
        cupycomm=lambda h, c: (lambda f=h.all_gather, x=c.x, out=c.y, a=c.async_op:
                               f(x, out=out, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Allgather, h.Iallgather), c.mx, c.my),
        nccl=lambda h, c: _p(h.comm.allGather, c.px, c.py, c.part_bytes, NCCL_INT8, h.stream),
        cupyx=lambda h, c: _p(h.all_gather, c.x, c.y, c.unit),
        torch=lambda h, c: _p(h.dist.all_gather_into_tensor, h.tensor(c.y), h.tensor(c.x))),
    Collective(
        "reduce_scatter", _spread_bus, True, False, _OUT, reduces=True, rooted=False,
        expected=lambda inputs, c: _slice(reduced(inputs, c), c, c.rank),
        cupycomm=lambda h, c: (lambda f=h.reduce_scatter, x=c.x, op=c.op, out=c.y,
                               a=c.async_op: f(x, op=op, out=out, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Reduce_scatter_block, h.Ireduce_scatter_block), c.mx, c.my,
                            c.mpi_op),
        nccl=lambda h, c: _p(h.comm.reduceScatter, c.px, c.py, *c.nccl_reduction(c.unit),
                             h.stream),
        cupyx=lambda h, c: _p(h.reduce_scatter, c.x, c.y, c.unit, c.op),
        torch=lambda h, c: (lambda f=h.dist.reduce_scatter_tensor, t=h.tensor(c.y),
                            u=h.tensor(c.x), op=h.op(c.op): f(t, u, op=op))),
    Collective(
        "all_to_all", _spread_bus, True, True, _OUT, reduces=False, rooted=False,
        expected=lambda inputs, c: np.concatenate([_slice(inputs(j), c, c.rank)
                                                   for j in c.peers]),
        cupycomm=lambda h, c: (lambda f=h.all_to_all, x=c.x, out=c.y, a=c.async_op:
                               f(x, out=out, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Alltoall, h.Ialltoall), c.mx, c.my),
        nccl=lambda h, c: _grouped(h, c, _all_parts(c, c.px), _all_parts(c, c.py)),
        cupyx=lambda h, c: _p(h.all_to_all, c.stacked(c.x), c.stacked(c.y)),
        torch=lambda h, c: _p(h.dist.all_to_all_single, h.tensor(c.y), h.tensor(c.x))),
    Collective(
        "gather", _spread_bus, False, True, _OUT, reduces=False, rooted=True,
        expected=lambda inputs, c: _joined(inputs, c) if c.is_root else None,
        cupycomm=lambda h, c: (lambda f=h.gather, x=c.x, root=c.root, out=c.at_root(c.y),
                               a=c.async_op: f(x, root, out=out, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Gather, h.Igather), c.mx, c.at_root(c.my), c.root),
        nccl=lambda h, c: _grouped(h, c, [(c.px, c.root)],
                                   _all_parts(c, c.py) if c.is_root else []),
        cupyx=lambda h, c: _p(h.gather, c.x, c.stacked(c.y), c.root),
        torch=lambda h, c: _p(h.dist.gather, h.tensor(c.x), c.at_root(h.parts(c.y, c)),
                              c.root)),
    Collective(
        "scatter", _spread_bus, True, False, _OUT, reduces=False, rooted=True,
        expected=lambda inputs, c: _slice(inputs(c.root), c, c.rank),
        cupycomm=lambda h, c: (lambda f=h.scatter, x=c.at_root(c.x), root=c.root, out=c.y,
                               a=c.async_op: f(x, root, out=out, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Scatter, h.Iscatter), c.at_root(c.mx), c.my, c.root),
        nccl=lambda h, c: _grouped(h, c, _all_parts(c, c.px) if c.is_root else [],
                                   [(c.py, c.root)]),
        cupyx=lambda h, c: _p(h.scatter, c.stacked(c.x), c.y, c.root),
        torch=lambda h, c: _p(h.dist.scatter, h.tensor(c.y), c.at_root(h.parts(c.x, c)),
                              c.root)),
    Collective(
        "sendrecv", _unit_bus, False, False, _OUT, reduces=False, rooted=False,
        expected=lambda inputs, c: inputs(c.left),
        cupycomm=lambda h, c: (lambda f=h.sendrecv, x=c.x, dst=c.right, y=c.y, src=c.left,
                               a=c.async_op: f(x, dst, y, src, async_op=a)),
        mpi=lambda h, c: _p(c.pick(h.Sendrecv, h.Isendrecv), c.mx, c.right, 0, c.my, c.left, 0),
        nccl=lambda h, c: _grouped(h, c, [(c.px, c.right)], [(c.py, c.left)]),
        cupyx=lambda h, c: (_p(h.send_recv, c.x, c.y, c.right) if c.right == c.left else
                            "cupyx.distributed's send_recv has one peer: no ring of 3+ ranks"),
        torch=lambda h, c: h.sendrecv(c.x, c.right, c.y, c.left)),
]

TABLE.append(Collective(
    "all_reduce_coalesced", _all_reduce_bus, False, False, _IN, reduces=True, rooted=False,
    expected=reduced,
    cupycomm=lambda h, c: (lambda f=h.all_reduce_coalesced, xs=pieces(c.x), op=c.op,
                           a=c.async_op: f(xs, op=op, async_op=a)),
    mpi=lambda h, c: _one_call_each(c.pick(h.Allreduce, h.Iallreduce),
                                    [(MPI.IN_PLACE, p, c.mpi_op) for p in pieces(c.x)],
                                    c.async_op),
    nccl=lambda h, c: _one_call_each(h.comm.allReduce, [
        (p.data.ptr, p.data.ptr, *c.nccl_reduction(p.size), h.stream) for p in pieces(c.x)]),
    cupyx=lambda h, c: _one_call_each(h.all_reduce, [(p, p, c.op) for p in pieces(c.x)]),
    torch=lambda h, c: _one_call_each(h.dist.all_reduce, [(h.tensor(p),) for p in pieces(c.x)])))

ROWS = {row.name: row for row in TABLE}
