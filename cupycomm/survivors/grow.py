"""``comm.grow(n)``: ``n`` new processes join the survivors and take the lost ranks' places.

The survivors start them with MPI's ``Spawn``, send them the world ranks they take (the lost
ones, lowest first), merge with them and split keyed by world rank, so that the grown
communicator's ranks are in world-rank order again; a started process's ``init()`` joins
(:func:`join`). The old communicator is retired as after ``shrink()``. The guide, with the
newcomer's GPU and Open MPI's slots: docs/guide/survivors.md, "Growing back".

Example (4 ranks, world rank 1 killed)::

    comm = comm.shrink()     # comm.world_ranks == (0, 2, 3)
    comm = comm.grow(1)      # comm.world_ranks == (0, 1, 2, 3); rank 1 is a new process,
                             # whose cupycomm.init(on_peer_loss="raise") returned the same
"""
from __future__ import annotations

import numbers
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, cast

from mpi4py import MPI

from .. import _bootstrap, _env
from . import numbering
from .lost import peer_lost

__all__ = ["grow", "join", "spawned_to_join", "Grown"]

#: The spawn's info: Open MPI's keys (an MPI ignores keys it does not know).
_INFO = {"map_by": ":OVERSUBSCRIBE", "bind_to": "none", "PMIX_ENVAR": "CUPYCOMM_JOIN=1"}


class Grown(NamedTuple):
    """The grown MPI communicator, and the survivors' settings of the Communicator over it
    (``device``: this process's choice)."""
    mpi_comm: MPI.Comm
    name: str
    timeout: float
    debug: bool
    device: Optional[int]


def grow(comm: Any, parts: Any, n: int, command: Optional[Sequence[str]] = None) -> Grown:
    """The MPI communicator of the ranks of ``comm`` (a Communicator, whose ``parts`` are
    given) and ``n`` new processes running ``command`` (default: this program again), ranks
    in world-rank order; see the module. Collective over ``comm``'s ranks; the new processes
    join in their ``cupycomm.init()``."""
    argv = _command(comm.rank, n, command)
    tracker = parts.tracker
    with tracker.inside("grow"):
        mpi = cast(MPI.Intracomm, comm.mpi_comm)
        try:
            plan = mpi.bcast(_plan(comm, n) if comm.rank == 0 else None, root=0)
            spawned = mpi.Spawn(argv[0], argv[1:], maxprocs=n, root=0,
                                info=MPI.Info.Create(items=_INFO))
        except MPI.Exception as error:
            peer_lost(error, tracker, "grow", tracker.seq)   # a survivor lost meanwhile
            raise RuntimeError(f"grow: MPI could not start {n} process(es) running "
                               f"{' '.join(argv)!r}: {error} (rank {comm.rank})") from error
        spawned.bcast(plan, root=MPI.ROOT if comm.rank == 0 else MPI.PROC_NULL)
        refusal = spawned.bcast(None, root=0)   # the first new process's answer
        if refusal is not None:
            spawned.Disconnect()
            raise RuntimeError(f"grow: the new process(es) running {' '.join(argv)!r} did "
                               f"not join: {refusal} (rank {comm.rank})")
        grown = _merge(spawned, plan, comm.world_ranks[comm.rank], high=False)
        router = parts.router   # (its device: where the device module is loaded)
        _node_gpus(grown, False, router.device_number() if router.cupy is not None
                   else router.device_choice)
    return Grown(grown, plan["name"], plan["timeout"], plan["debug"], router.device_choice)


def spawned_to_join() -> bool:
    """Whether this process was started by ``comm.grow()`` (MPI's parent, and the variable
    the spawn set): its ``init()`` must join the survivors."""
    return _env.read("CUPYCOMM_JOIN") and MPI.Comm.Get_parent() != MPI.COMM_NULL


def join(device: Optional[int], device_module: Any, refusal: Optional[str] = None) -> Grown:
    """The grown MPI communicator, in a process that ``comm.grow()`` started (``init()`` calls
    it): the survivors' plan, the answer, the merge, the split in world-rank order.
    ``device`` and ``device_module`` are this process's; the name, timeout and debug mode the
    survivors'. With a ``refusal`` (why this process cannot join), the survivors' grow()
    raises it, and so does this call, on every side alike."""
    parent = MPI.Comm.Get_parent()
    plan = parent.bcast(None, root=0)
    parent.bcast(refusal, root=MPI.ROOT if parent.Get_rank() == 0 else MPI.PROC_NULL)
    if refusal is not None:
        parent.Disconnect()
        raise RuntimeError(f"init: {refusal}")
    grown = _merge(parent, plan, plan["ranks"][parent.Get_rank()], high=True)
    place, members = _node_gpus(grown, True, device)
    if device is None:
        device = _gpu_of_newcomer(place, members, device_module)
    return Grown(grown, plan["name"], plan["timeout"], plan["debug"], device)


def _plan(comm: Any, n: int) -> Dict[str, Any]:
    """What every rank (survivor and newcomer) follows: rank 0's numbering and settings."""
    return {"ranks": numbering.places(comm.world_ranks, n), "job": numbering.job(),
            "name": f"{comm.name}-grown", "timeout": comm.timeout, "debug": comm.debug,
            "members": comm.world_ranks}


def _merge(intercomm: MPI.Intercomm, plan: Dict[str, Any], me: int, high: bool) -> MPI.Comm:
    """The survivors (low) and the newcomers (high) of ``intercomm`` in one communicator,
    ordered by world rank (``me``, this process's); numbered from now on by it."""
    merged = intercomm.Merge(high=high)
    grown = merged.Split(0, me)
    merged.Free()
    intercomm.Disconnect()
    grown.Set_errhandler(MPI.ERRORS_RETURN)
    numbering.adopt(grown, sorted((*plan["members"], *plan["ranks"])), plan["job"], high)
    return grown


def _node_gpus(grown: MPI.Comm, late: bool, gpu: Optional[int]
               ) -> Tuple[int, List[Tuple[bool, Optional[int]]]]:
    """(this rank's place among the ranks of ``grown`` on its node, each one's (newcomer?,
    the GPU it uses or None)); collective over ``grown``, survivors and newcomers alike."""
    node = _bootstrap.node_comm(grown)
    try:
        return node.Get_rank(), node.allgather((late, gpu))
    finally:
        node.Free()


def _gpu_of_newcomer(place: int, members: List[Tuple[bool, Optional[int]]],
                     device_module: Any) -> Optional[int]:
    """The GPU of the newcomer at ``place`` among its node's ``members``: the GPUs no
    survivor there uses, shared out among the node's newcomers in order (round-robin over
    all where none is free, as :func:`~cupycomm._bootstrap.choose_device`); None (chosen by
    the local rank, as at ``init()``) where no survivor of the node uses a GPU.

    Example: survivors on GPUs 3, 1, 0 of 4, the lost rank's 2: the newcomer takes 2, where
    its local rank (1) would take a survivor's."""
    used = {gpu for late, gpu in members if not late and gpu is not None}
    if not used:
        return None
    cupy = device_module if device_module is not None else _bootstrap.import_cupy()
    count = _bootstrap.device_count(cupy) if cupy is not None else 0
    if count == 0:
        return None
    free = [gpu for gpu in range(count) if gpu not in used] or list(range(count))
    newcomers = [i for i, (late, _) in enumerate(members) if late]
    return free[newcomers.index(place) % len(free)]


def _command(rank: int, n: Any, command: Any) -> List[str]:
    """The argv to start (``command``, else this program again); TypeError or ValueError
    for a bad ``n`` or ``command``, on every rank alike, before any communication."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"grow: n must be an int (how many processes to start), got {n!r} "
                        f"on rank {rank}")
    if n < 1:
        raise ValueError(f"grow: n must be >= 1, got {n} on rank {rank}")
    if command is None:
        if not sys.argv or sys.argv[0] in ("", "-c"):
            raise ValueError(f"grow: this program was not started from a file (sys.argv "
                             f"{sys.argv!r}): pass command=[...] to say what the new processes "
                             f"run (rank {rank})")
        return [sys.executable, *sys.argv]
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence) or not command \
            or not all(isinstance(word, str) for word in command):
        raise TypeError(f"grow: command must be a non-empty list of str (the program and its "
                        f"arguments), got {command!r} on rank {rank}")
    return list(command)
