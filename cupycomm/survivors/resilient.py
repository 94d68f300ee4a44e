"""A loop of steps that goes on without the ranks it loses: each step is agreed on by the
survivors, committed when every rank finished it, and after a loss retried on the shrunk
communicator from the last committed state of the lowest surviving rank.

The pattern is Horovod elastic's (``hvd.elastic.run`` with a ``State`` that is committed,
restored after a failure and synced from one worker) with torchft's per-step decision (every
step either counts on every member or on none), on MPI's ULFM: ``agree`` decides, ``shrink``
removes the lost ranks, a broadcast over the shrunk communicator makes the state the same
everywhere; with ``grow=True`` new processes then take the lost ranks' places
(``comm.grow``) and enter the loop at that sync. It needs ``init(on_peer_loss="raise")``
(Open MPI 5 under ``mpiexec --with-ft ulfm``); see docs/guide/survivors.md.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Optional, Set, Tuple

import numpy as np

from ..comm.communicator import Communicator
from ..errors import CommClosedError, PeerLost, TooFewSurvivors
from . import policy
from .committed import State, settled
from .numbering import joined_late

__all__ = ["resilient"]

Step = Callable[[Communicator, State, int], Any]
OnShrink = Callable[[Communicator, State, Tuple[int, ...]], Any]


def resilient(step: Step, state: State, comm: Communicator, *, steps: int,
              min_size: int = 1, max_failures: Optional[int] = None, commit_every: int = 1,
              on_shrink: Optional[OnShrink] = None, grow: bool = False
              ) -> Tuple[Communicator, State]:
    """Run ``step(comm, state, i)`` for ``i`` from ``state.completed`` to ``steps - 1`` on
    every rank, going on without the ranks that are lost; returns the communicator of the
    ranks that finished (``comm`` itself if none was lost) and ``state``.

    First ``state`` is made rank 0's on every rank (:meth:`State.sync`; in a process that
    ``comm.grow()`` started, the lowest survivor's: see ``grow``). Then, for each step,
    the ranks agree (``comm.agree``) whether every one of them finished it without
    :class:`~cupycomm.errors.PeerLost`; if so the step counts (``state.completed`` becomes
    ``i + 1``, and every ``commit_every`` steps and after the last one ``state`` is
    committed). If not, every survivor alike shrinks the communicator, restores the last
    committed state, makes it that of the lowest surviving rank (rank 0 of the shrunk
    communicator), calls ``on_shrink(comm, state, lost)`` with the new communicator and the
    ranks lost since the last step that counted (world numbering), and retries from step
    ``state.completed``. With ``grow``, the survivors then grow the communicator back to its
    first size (``comm.grow``: new processes, this program again, in the lost world ranks)
    and sync the state from the lowest survivor once more, which the new processes, having
    called ``init()`` and then this function, take part in as their first sync: they enter
    the loop at step ``state.completed`` with the survivors' state (so a new process must
    reach this call without collectives on ``comm`` of its own). The first sync, the
    restore, ``on_shrink`` and the sync after a grow end with an agreement too: a loss during
    one of them shrinks again, on every survivor alike.

    A step must take its ranks and its share of the work from the ``comm`` it is given (it
    changes after a loss), change only ``state`` (or what is derived from it again after a
    restore) and let PeerLost propagate. A step that raises anything else ends the job as any
    uncaught exception does.

    Args:
        step: one step of the loop, called as ``step(comm, state, i)``.
        state: the values to keep (:class:`cupycomm.State`).
        comm: a communicator of a process that called ``init(on_peer_loss="raise")``.
        steps: the number of steps of the whole loop (those already in
            ``state.completed`` are not run again).
        min_size: the fewest ranks to go on with.
        max_failures: the most ranks that may be lost over the loop (None: as many as
            ``min_size`` allows); with ``grow``, missing at once (the lost are replaced).
        commit_every: commit every this many steps (a commit copies every array of
            ``state``; a loss then redoes up to ``commit_every - 1`` steps).
        on_shrink: called on every survivor after a loss, once the state is restored (to
            rescale a learning rate, say); its collectives may use the new ``comm`` (the
            survivors', before any grow).
        grow: after each loss, bring the communicator back to its first size with new
            processes (:meth:`~cupycomm.Communicator.grow`, the default command).

    Returns:
        ``(comm, state)``: the communicator that finished the loop and the final state.

    Raises:
        TooFewSurvivors: on every survivor, once the communicator has shrunk below
            ``min_size`` or lost more than ``max_failures`` ranks; it holds the shrunk
            communicator (``.comm``) and the restored, synced ``.state``.
        RuntimeError: where losing a peer ends the job (``on_peer_loss="abort"``).

    Example::

        comm = cupycomm.init(on_peer_loss="raise")   # mpiexec --with-ft ulfm ...
        state = cupycomm.State(w=numpy.zeros(3))

        def train_step(comm, state, i):
            grad = comm.all_reduce(local_gradient(state.w, comm.rank, comm.size), op="avg")
            state.w -= 0.1 * grad

        comm, state = cupycomm.resilient(train_step, state, comm, steps=100, min_size=2)
    """
    _check(step, state, comm, steps, min_size, max_failures, commit_every, on_shrink, grow)
    start = frozenset(comm.world_ranks)
    go_on = (start, min_size, max_failures, on_shrink, grow)
    if not _together(comm, _sync, comm, state, joined_late()):
        comm = _shrink(comm, state, *go_on)
    while state.completed < steps:
        i = state.completed
        if _together(comm, step, comm, state, i):
            state.completed = i + 1
            if state.completed % commit_every == 0 or state.completed == steps:
                state.commit()
        else:
            comm = _shrink(comm, state, *go_on)
    return comm, state


def _together(comm: Communicator, action: Callable[..., Any], *args: Any) -> bool:
    """Whether ``action(*args)`` ended on every rank of ``comm`` without PeerLost, a loss
    known, or a device collective cut short: one answer on each, so that all survivors take
    the same branch even where a loss broke a collective for some only. The vote waits for
    this rank's device work (:func:`settled`): a cut-short collective returned at launch, its
    result undefined (zeros on an H200:
    benchmarks/results/gpu_h200_2026-11-27_survivors_run1.log)."""
    try:
        action(*args)
        settled(comm, "resilient")
        finished = True
    except PeerLost:
        finished = False
    return comm.agree(finished and not comm.failed_ranks())


def _shrink(comm: Communicator, state: State, start: frozenset, min_size: int,
            max_failures: Optional[int], on_shrink: Optional[OnShrink],
            grow: bool) -> Communicator:
    """The survivors' communicator with the state restored and synced (grown back, with
    ``grow``); again while ranks are lost during it."""
    go_on = (start, min_size, max_failures, on_shrink, grow)
    lost: Set[int] = set()
    while True:
        before = comm.world_ranks
        comm = comm.shrink()
        lost |= set(before) - set(comm.world_ranks)
        if _together(comm, _restore, comm, state):
            break
    gone = sorted(start - set(comm.world_ranks))
    if comm.size < min_size or (max_failures is not None and len(gone) > max_failures):
        limit = (f"fewer than min_size={min_size}" if comm.size < min_size
                 else f"more than max_failures={max_failures}")
        raise TooFewSurvivors(
            f"resilient: {len(gone)} of {len(start)} ranks lost (world ranks "
            f"{', '.join(map(str, gone))}), {comm.size} left: {limit}; the state is that of "
            f"step {state.completed} on every survivor", comm=comm, state=state, lost=tuple(gone))
    if on_shrink is not None and not _together(comm, on_shrink, comm, state, tuple(sorted(lost))):
        return _shrink(comm, state, *go_on)
    if grow:   # the new processes' first sync (resilient's) is this one
        comm = comm.grow(len(start) - comm.size)
        if not _together(comm, _sync, comm, state, False):
            return _shrink(comm, state, *go_on)
    return comm


def _sync(comm: Communicator, state: State, new: bool) -> None:
    """Make ``state`` that of the lowest rank that is not ``new`` (a process grow() started,
    in its first sync) on every rank: rank 0 unless world rank 0 was lost and taken again."""
    root = comm.all_reduce(np.array(comm.size if new else comm.rank), op="min")
    state.sync(comm, int(root))


def _restore(comm: Communicator, state: State) -> None:
    state.restore()
    state.sync(comm)


def _check(step: Any, state: Any, comm: Any, steps: Any, min_size: Any, max_failures: Any,
           commit_every: Any, on_shrink: Any, grow: Any) -> None:
    """Every argument, on every rank alike, before any communication."""
    if not callable(step):
        raise TypeError(f"resilient: step must be callable as step(comm, state, i), "
                        f"got {step!r}")
    if not isinstance(state, State):
        raise TypeError(f"resilient: state must be a cupycomm.State, got "
                        f"{type(state).__module__}.{type(state).__name__}")
    if not isinstance(comm, Communicator):
        raise TypeError(f"resilient: comm must be a cupycomm.Communicator, got "
                        f"{type(comm).__module__}.{type(comm).__name__}")
    if on_shrink is not None and not callable(on_shrink):
        raise TypeError(f"resilient: on_shrink must be callable or None, got {on_shrink!r}")
    if not isinstance(grow, bool):
        raise TypeError(f"resilient: grow must be True or False, got {grow!r}")
    for name, value, low in (("steps", steps, 0), ("min_size", min_size, 1),
                             ("commit_every", commit_every, 1),
                             ("max_failures", 0 if max_failures is None else max_failures, 0)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"resilient: {name} must be an int, got {value!r}")
        if value < low:
            raise ValueError(f"resilient: {name} must be >= {low}, got {value}")
    if comm.closed:
        raise CommClosedError(f"resilient: {comm!r} is closed")
    if min_size > comm.size:
        raise ValueError(f"resilient: min_size={min_size} is more than the communicator's "
                         f"{comm.size} ranks")
    if not policy.raising():
        raise RuntimeError("resilient: losing a peer ends this job (init(on_peer_loss="
                           "'abort'), the default): call cupycomm.init(on_peer_loss='raise') "
                           "under Open MPI 5, started with `python -m cupycomm.run "
                           f"--survivors` (mpiexec {' '.join(policy.FLAGS)})")
