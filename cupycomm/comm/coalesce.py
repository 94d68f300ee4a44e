"""Many small arrays in few collectives: ``all_reduce_coalesced`` and ``Bucket``.

Latency-bound reductions (the gradients of a model's many small layers) cost a few calls
instead of hundreds. ``comm.all_reduce_coalesced(arrays)`` packs the arrays, grouped by
dtype, into flat buffers of at most ``bucket_bytes`` (default 25 MiB, as DDP's buckets),
all-reduces each buffer once and copies the results back; buffers and views are kept from
call to call (``Staging``). ``comm.bucket(arrays)`` is the persistent form (DDP's
gradient-as-bucket-view): ``bucket.arrays`` are views into one flat buffer per dtype. Both
run through the communicator's own collectives. The guide: docs/guide/coalescing.md.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .route import MOVES
from ..backends.shapes import views_of
from .checks import kind_name
from ..faults import debug
from ..work import Work, WorkGroup

__all__ = ["DEFAULT_BUCKET_BYTES", "all_reduce_coalesced", "Bucket", "Plan", "Staging",
           "runs_by_dtype"]

DEFAULT_BUCKET_BYTES = 25 * 2 ** 20


def runs_by_dtype(arrays: Sequence[Any], limit: Optional[int]) -> List[List[int]]:
    """Indices of ``arrays`` split by dtype into runs of at most ``limit`` bytes (an array
    larger than that alone; ``limit`` None: one run per dtype), ordered by first index.

    Example::

        runs_by_dtype([np.ones(4), np.ones(2, np.int8), np.ones(4)], limit=40)  # [[0, 2], [1]]
    """
    runs: List[List[int]] = []
    open_runs: Dict[Any, List[Any]] = {}   # dtype -> [its open run, that run's bytes]
    for i, array in enumerate(arrays):
        current = open_runs.get(array.dtype)
        nbytes = array.nbytes
        if current is not None and (limit is None or current[1] + nbytes <= limit):
            current[0].append(i)
            current[1] += nbytes
        else:
            run = [i]
            runs.append(run)
            open_runs[array.dtype] = [run, nbytes]
    return runs


def _runs(comm: Any, name: str, arrays: Sequence[Any], op: Any,
          limit: Optional[int]) -> Tuple[List[List[int]], List[Any], Any]:
    """Check the arrays (one kind, each valid for ``op``, or for moving data where it is
    ``MOVES``); return their :func:`runs_by_dtype`, the arrays as NumPy/CuPy views and the
    array module. Per array only kind and contiguity are checked, the op once per dtype (this
    loop sets the pace of a call on many small arrays); anything unusual (a foreign or device
    array, a failed check) takes the communicator's full check, which explains the error."""
    checks, router = comm.parts.checks, comm.parts.router
    if not isinstance(arrays, (list, tuple)):
        raise checks.fail(TypeError, name, f"arrays must be a list of arrays, got "
                                          f"{type(arrays).__name__}")
    natives: List[Any] = []
    first = None
    backends = router.backends
    for i, array in enumerate(arrays):
        backend = backends.get(type(array))
        if (backend is None or backend.device_id is not None
                or not (flags := array.flags).c_contiguous or not flags.writeable):
            backend, array, _ = router.route(name, ("arrays", i), array, op, writes=True)
            backend = getattr(backend, "inner", backend)   # a foreign array's own backend
        if backend is not first:
            if first is not None:
                raise checks.fail(TypeError, name, f"arrays[{i}] is {kind_name(arrays[i])} "
                                                   f"but arrays[0] is {kind_name(arrays[0])}; "
                                                   f"one call takes host arrays or device arrays")
            first = backend
        natives.append(array)
    runs = runs_by_dtype(natives, limit)
    checked = set()
    for run in runs:   # each dtype, and the op for it, once
        if natives[run[0]].dtype not in checked:
            checked.add(natives[run[0]].dtype)
            router.route(name, ("arrays", run[0]), natives[run[0]], op)
    return runs, natives, (router.array_module(first) if first is not None else None)


def all_reduce_coalesced(comm: Any, arrays: Sequence[Any], op: Any = "sum",
                         bucket_bytes: Optional[int] = None,
                         async_op: bool = False) -> Union[List[Any], Work]:
    """See :meth:`cupycomm.Communicator.all_reduce_coalesced`."""
    name = "all_reduce_coalesced"
    limit = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    if type(limit) is not int or limit <= 0:
        raise comm.parts.checks.fail(ValueError, name, f"bucket_bytes must be a positive "
                                                       f"int, got {bucket_bytes!r}")
    runs, natives, xp = _runs(comm, name, arrays, op, limit)
    if comm.debug:
        debug.check_list(comm.parts, name, natives, op=op, bucket_bytes=limit)
    with _device_of(comm, xp):
        return _all_reduce_runs(comm, name, arrays, runs, natives, xp, op, async_op)


def _device_of(comm: Any, xp: Any) -> Any:
    """The communicator's device as a context for device arrays (buffers and copies belong
    there, whatever device is current; the device backend's, which sets no context-less
    device 0 back), else nothing."""
    router = comm.parts.router
    device = xp is not None and xp is router.cupy
    return router.device.on_device() if device else contextlib.nullcontext()


def _all_reduce_runs(comm: Any, name: str, arrays: Sequence[Any], runs: list, natives: list,
                     xp: Any, op: Any, async_op: bool) -> Union[List[Any], Work]:
    staging = comm.parts.staging
    plans: List[Tuple[Plan, List[Any]]] = []
    works = []
    for run in runs:
        members = [natives[i] for i in run]
        if len(members) == 1:   # alone in its bucket: reduced where it is, nothing to copy
            works.append(comm.all_reduce(members[0], op=op, async_op=async_op))
            continue
        plan = staging.take(xp, members)
        xp.concatenate(members, axis=None, out=plan.flat)
        plans.append((plan, members))
        works.append(comm.all_reduce(plan.flat, op=op, async_op=async_op))

    def unpack() -> None:   # (after wait(), whatever device is current then)
        with _device_of(comm, xp):
            for plan, members in plans:
                for member, view in zip(members, plan.views):
                    member[...] = view
                staging.give(plan)
    result = list(arrays)
    if async_op:
        return WorkGroup(works, result, f"{name} of {len(arrays)} arrays", finish=unpack)
    unpack()
    return result


class Plan:
    """A flat buffer for arrays of one dtype and given shapes, and its views shaped as them
    (copying a view back into its array is the cheapest copy per array NumPy makes; a
    :class:`Bucket` hands the views out in place of the arrays). ``key`` is what
    :class:`Staging` keeps it under; for device arrays, ``stream`` is the stream of its
    last use once given back (``cuda``, the device module's ``cuda``; ``event`` orders a
    use on another stream after it)."""

    __slots__ = ("key", "flat", "views", "cuda", "stream", "event")

    def __init__(self, key: tuple, xp: Any, members: List[Any]) -> None:
        self.key = key
        self.flat = xp.empty(sum(m.size for m in members), members[0].dtype)
        self.views = views_of(self.flat, members)
        self.cuda: Any = getattr(xp, "cuda", None)   # (NumPy has none: host memory)
        self.stream: Any = None
        self.event: Any = None


class Staging:
    """Plans kept from one coalesced call to the next, by array module, dtype and shapes: a
    training loop packs the same shapes every step, and a fresh buffer of many MiB costs
    more in page faults than the copies into it. At most :attr:`KEEP` plans are kept (the
    least recently used go), so that a program whose shapes keep changing does not grow.

    A device plan is used in stream order: packed, reduced and unpacked on one stream (or
    unpacked after ``wait()`` on the stream then current). Taken on another stream than
    its last use's, that stream first waits for an event recorded on the last one (which
    is past the last unpack), so that a pack never overwrites what a call still reads; taken
    in a capture, which cannot wait on outside work, a new plan is made instead."""

    KEEP = 16

    def __init__(self) -> None:
        self._free: "OrderedDict[tuple, Plan]" = OrderedDict()

    def take(self, xp: Any, members: List[Any]) -> Plan:
        """A plan for ``members`` (arrays of one dtype): the kept one, or a new one."""
        key = (id(xp), members[0].dtype, tuple([m.shape for m in members]))
        plan = self._free.pop(key, None)
        if plan is None:
            return Plan(key, xp, members)
        if plan.stream is not None:
            here = plan.cuda.get_current_stream()
            if here is not plan.stream:
                if here.ptr not in (0, 1) and here.is_capturing():
                    self._free[key] = plan   # (kept for the stream of its last use)
                    return Plan(key, xp, members)
                if plan.event is None:
                    plan.event = plan.cuda.Event(disable_timing=True)
                plan.event.record(plan.stream)
                here.wait_event(plan.event)
        return plan

    def give(self, plan: Plan) -> None:
        """``plan`` is free again (its collective and the copies out are issued, on the
        current stream for device arrays)."""
        if plan.cuda is not None:
            plan.stream = plan.cuda.get_current_stream()
        self._free[plan.key] = plan
        if len(self._free) > self.KEEP:
            self._free.popitem(last=False)


class Bucket:
    """Arrays kept as views of one flat buffer per dtype; collectives on it need no packing.

    Example (2 ranks)::

        bucket = comm.bucket([numpy.ones(3), numpy.ones((2, 2))])
        w, b = bucket.arrays            # use these from now on: they are views of the buffer
        w *= comm.rank + 1
        bucket.all_reduce(op="avg")     # one call for both: w == [1.5, 1.5, 1.5], b all 1
    """

    def __init__(self, comm: Any, arrays: Sequence[Any]) -> None:
        runs, natives, xp = _runs(comm, "bucket", arrays, MOVES, None)
        self._comm = comm
        self.flats: List[Any] = []
        views: List[Any] = [None] * len(arrays)
        with _device_of(comm, xp):
            for indices in runs:
                members = [natives[i] for i in indices]
                plan = Plan((), xp, members)
                xp.concatenate(members, axis=None, out=plan.flat)
                for i, view in zip(indices, plan.views):
                    views[i] = view
                self.flats.append(plan.flat)
        #: The arrays as views of the bucket's buffers; use these in place of the originals.
        self.arrays: List[Any] = views

    def _each(self, name: str, call, **arguments: Any) -> Union[List[Any], Work]:
        if self._comm.debug:
            debug.check_list(self._comm.parts, name, self.arrays, **arguments)
        works = [call(flat) for flat in self.flats]
        if works and isinstance(works[0], Work):
            return WorkGroup(works, self.arrays, f"bucket of {len(self.arrays)} arrays")
        return self.arrays

    def all_reduce(self, op: Any = "sum", async_op: bool = False) -> Union[List[Any], Work]:
        """All-reduce every array of the bucket: one call per dtype. Returns ``arrays``."""
        for flat in self.flats:   # op against every dtype first: all calls are made, or none
            self._comm.parts.router.route("bucket.all_reduce", "op", flat, op)
        return self._each("bucket.all_reduce",
                          lambda flat: self._comm.all_reduce(flat, op=op, async_op=async_op),
                          op=op)

    def broadcast(self, root: int = 0, async_op: bool = False) -> Union[List[Any], Work]:
        """Root's values of every array of the bucket everywhere: one call per dtype."""
        return self._each("bucket.broadcast",
                          lambda flat: self._comm.broadcast(flat, root, async_op=async_op),
                          root=root)

    def __repr__(self) -> str:
        return f"<cupycomm.Bucket of {len(self.arrays)} arrays in {len(self.flats)} buffers>"
