"""The general path of the Communicator's collectives and point-to-point calls: every call
that its method's common-case test does not send to a prepared host call (CuPy arrays,
foreign arrays, lists, splits, ``stream=``, a bad argument) runs here.

Each method routes the array to its backend (``Router.route``, which makes every check of
the array alone), checks the other arguments in the same order on every rank, so that a bad
one fails alike everywhere before any communication, and calls the backend. The fast paths
in ``communicator.py`` reject exactly what these checks reject
(``tests/backends/test_prepared.py``).

Example (on 2 ranks, inside Communicator)::

    general = GeneralPath(checks, router, Layouts(checks, router, joined), joined)
    general.all_reduce(cupy.ones(3), "sum", None, False, None)
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .route import Router
from .layouts import Layouts
from ..backends.shapes import JoinedShapes
from .checks import Checks

__all__ = ["GeneralPath"]


class GeneralPath:
    """The general path of one communicator, as a part of it: one method per collective and
    point-to-point call, taking the public method's arguments in order (positionally)."""

    __slots__ = ("_rank", "_size", "_checks", "_router", "_route", "_layouts", "_joined")

    def __init__(self, checks: Checks, router: Router, layouts: Layouts,
                 joined: JoinedShapes) -> None:
        self._rank, self._size = checks.rank, checks.size
        self._checks = checks
        self._router = router
        self._route = router.route
        self._layouts = layouts
        self._joined = joined

    # -- collectives ------------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: Any, out: Any, async_op: bool, stream: Any) -> Any:
        """``Communicator.all_reduce``."""
        b, x, spec = self._route("all_reduce", "x", x, op, writes=out is None, stream=stream)
        out = x if out is None else self._reduced_into("all_reduce", b, out, x)
        return b.all_reduce(x, out, spec, async_op, stream)

    def scan(self, x: Any, op: Any, out: Any, async_op: bool, stream: Any) -> Any:
        """``Communicator.scan``."""
        b, x, spec = self._prefix("scan", x, op, out is None, stream)
        out = x if out is None else self._reduced_into("scan", b, out, x)
        return b.scan(x, out, spec, async_op, stream)

    def exscan(self, x: Any, op: Any, out: Any, async_op: bool, stream: Any) -> Any:
        """``Communicator.exscan``."""
        b, x, spec = self._prefix("exscan", x, op, False, stream)
        if out is None:
            out = b.empty(x.shape, x.dtype, stream)
        else:   # (MPI leaves rank 0's undefined: never x, which stays the caller's)
            out = self._router.check_out("exscan", "out", b, out, x, (x.shape,))
            self._router.check_apart("exscan", "out", b, out, x)
        return b.exscan(x, out, spec, async_op, stream)

    def _reduced_into(self, name: str, b: Any, out: Any, x: Any) -> Any:
        """``out`` of an elementwise reduction of ``x``, checked (``x`` where it is ``x``'s
        very memory: the in-place form)."""
        out = self._router.check_out(name, "out", b, out, x, (x.shape,))
        return self._router.check_apart(name, "out", b, out, x, in_place=True)

    def _prefix(self, name: str, x: Any, op: Any, writes: bool, stream: Any) -> Any:
        """(backend, array, spec) of a prefix reduction: host arrays only, no average."""
        device = self._router.classify(x) == "device"   # (refused before a backend is made)
        if not device:
            b, x, spec = self._route(name, "x", x, op, writes=writes, stream=stream)
        if device or b.device_id is not None:
            self._checks.check_open(name)
            raise self._checks.fail(TypeError, name, f"NCCL has no {name}, so it takes host "
                                                     f"arrays only; for device arrays, "
                                                     f"all_gather, then reduce the first parts")
        if spec.avg:
            raise self._checks.fail(ValueError, name, f"op 'avg' has no {name} (each rank would "
                                                      f"divide by its own count): sum, then "
                                                      f"divide by the ranks summed")
        return b, x, spec

    def reduce(self, x: Any, root: int, op: Any, out: Any, async_op: bool,
               stream: Any) -> Any:
        """``Communicator.reduce``."""
        b, x, spec = self._route("reduce", "x", x, op, writes=out is None, stream=stream)
        self._checks.check_rank("reduce", "root", root)
        if out is not None:   # checked wherever given, so that every rank fails alike
            out = self._reduced_into("reduce", b, out, x)
        if self._rank != root:
            out = None
        elif out is None:
            out = x
        return b.reduce(x, out, spec, root, async_op, stream)

    def broadcast(self, x: Any, root: int, async_op: bool, stream: Any) -> Any:
        """``Communicator.broadcast``."""
        b, x, spec = self._route("broadcast", "x", x, writes=True, stream=stream)
        self._checks.check_rank("broadcast", "root", root)
        return b.broadcast(x, spec, root, async_op, stream)

    def all_gather(self, x: Any, out: Any, async_op: bool, stream: Any) -> Any:
        """``Communicator.all_gather``."""
        b, x, spec = self._route("all_gather", "x", x, stream=stream)
        shapes = self._joined[x.shape]
        if out is None:
            return b.all_gather(x, b.empty(shapes[0], x.dtype, stream), spec, async_op, stream)
        if type(out) is not type(x) and isinstance(out, (list, tuple)):
            return self._layouts.all_gather_list(b, x, spec, out, async_op, stream)
        out = self._router.check_out("all_gather", "out", b, out, x, shapes,
                                     " (size parts shaped like x)")
        self._router.check_apart("all_gather", "out", b, out, x)
        return b.all_gather(x, out, spec, async_op, stream)

    def reduce_scatter(self, x: Any, op: Any, out: Any, async_op: bool, stream: Any) -> Any:
        """``Communicator.reduce_scatter``."""
        if isinstance(x, (list, tuple)):
            return self._layouts.reduce_scatter_list(x, op, out, async_op, stream)
        b, x, spec = self._route("reduce_scatter", "x", x, op, stream=stream)
        self._checks.check_leading_axis("reduce_scatter", "x", x)
        part = (x.shape[0] // self._size,) + x.shape[1:]
        if out is None:
            out = b.empty(part, x.dtype, stream)
        else:
            shapes = (part, x.shape[1:]) if x.shape[0] == self._size else (part,)
            out = self._router.check_out("reduce_scatter", "out", b, out, x, shapes)
            self._router.check_apart("reduce_scatter", "out", b, out, x)
        return b.reduce_scatter(x, out, spec, async_op, stream)

    def all_to_all(self, x: Any, out: Any, in_splits: Optional[Sequence[int]],
                   out_splits: Optional[Sequence[int]], async_op: bool, stream: Any) -> Any:
        """``Communicator.all_to_all``."""
        b, x, spec = self._route("all_to_all", "x", x, stream=stream)
        if in_splits is None and out_splits is None:
            self._checks.check_leading_axis("all_to_all", "x", x)
            if out is None:
                out = b.empty(x.shape, x.dtype, stream)
            else:
                out = self._router.check_out("all_to_all", "out", b, out, x, (x.shape,))
                self._router.check_apart("all_to_all", "out", b, out, x)
            return b.all_to_all(x, out, spec, async_op, stream)
        return self._layouts.all_to_all_v(b, x, spec, out, in_splits, out_splits, async_op, stream)

    def scatter(self, x: Any, root: int, out: Any, async_op: bool, stream: Any) -> Any:
        """``Communicator.scatter``."""
        b, out, spec = self._route("scatter", "out", out, writes=True, stream=stream)
        self._checks.check_rank("scatter", "root", root)
        if x is not None or self._rank == root:   # checked wherever given: alike on every rank
            x = self._router.check_out("scatter", "x", b, x, out, self._joined[out.shape],
                                       " (size parts shaped like out)", writes=False)
            self._router.check_apart("scatter", "x", b, x, out)
        return b.scatter(x, out, spec, root, async_op, stream)

    def gather(self, x: Any, root: int, out: Any, async_op: bool, stream: Any) -> Any:
        """``Communicator.gather``."""
        b, x, spec = self._route("gather", "x", x, stream=stream)
        self._checks.check_rank("gather", "root", root)
        shapes = self._joined[x.shape]
        if out is not None:   # checked wherever given, so that every rank fails alike
            out = self._router.check_out("gather", "out", b, out, x, shapes,
                                         " (size parts shaped like x)")
            self._router.check_apart("gather", "out", b, out, x)
        if self._rank != root:
            out = None
        elif out is None:
            out = b.empty(shapes[0], x.dtype, stream)
        return b.gather(x, out, spec, root, async_op, stream)

    # -- point to point ---------------------------------------------------------------------------
    def send(self, x: Any, dst: int, async_op: bool, stream: Any) -> Any:
        """``Communicator.send``."""
        self._checks.check_peer("send", "dst", dst)
        b, x, spec = self._route("send", "x", x, collective=False, stream=stream)
        return b.send(x, spec, dst, async_op, stream)

    def recv(self, buf: Any, src: int, async_op: bool, stream: Any) -> Any:
        """``Communicator.recv``."""
        self._checks.check_peer("recv", "src", src)
        b, buf, spec = self._route("recv", "buf", buf, collective=False, writes=True,
                                   stream=stream)
        return b.recv(buf, spec, src, async_op, stream)

    def sendrecv(self, x: Any, dst: int, buf: Any, src: int, async_op: bool,
                 stream: Any) -> Any:
        """``Communicator.sendrecv``."""
        self._checks.check_rank("sendrecv", "dst", dst)
        self._checks.check_rank("sendrecv", "src", src)
        b, x, spec = self._route("sendrecv", "x", x, collective=False, stream=stream)
        buf = self._router.check_kind("sendrecv", "buf", b, buf, x)
        return b.sendrecv(x, spec, dst, buf, src, async_op, stream)
