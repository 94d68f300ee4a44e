"""What a loop that survives lost ranks must not lose: named arrays and values, a copy of them
as of the last step that every rank finished (``commit``), put back after a loss
(``restore``) and made the same on every survivor from one of them (``sync``).

As Horovod elastic's ``State``, but kept in each rank's memory (survivors go on from the step
they were in) and restored in place (arrays the program also holds elsewhere change back).

Example::

    state = State(params=[numpy.zeros(3), numpy.zeros(())], epoch=0)
    state.params[0] += 1.0
    state.restore()          # back to the committed copy: state.params[0] is zeros again
    state.epoch = 1
    state.commit()           # the new starting point of a retry
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

from ..comm.communicator import Communicator

__all__ = ["State", "settled"]


def settled(comm: Communicator, call: str) -> None:
    """Return once the device collectives launched on ``comm`` so far have completed (a
    device call returns at launch, its output written later); raise what cut any short
    (PeerLost for a loss: an abort leaves their outputs undefined). ``call`` names the
    caller in the error."""
    device = comm.parts.router.device
    if device is not None:
        device.settle(call)


def _is_array(value: Any) -> bool:
    """A NumPy or CuPy array (CuPy is not imported: a host-only program need not load it)."""
    return isinstance(value, np.ndarray) or type(value).__module__.split(".")[0] == "cupy"


def _arrays(value: Any) -> List[Any]:
    """The arrays a value is made of: itself, the items of a list or tuple of arrays, or none
    (a value to pickle)."""
    if _is_array(value):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(_is_array(v) for v in value):
        return list(value)
    return []


def _layout(value: Any) -> Any:
    """What must match across ranks for a value's arrays to be broadcast in place."""
    return [(a.shape, a.dtype.str, type(a).__module__.split(".")[0]) for a in _arrays(value)]


class State:
    """Named arrays (NumPy or CuPy, alone or as a list or tuple of them) and picklable values,
    as attributes, with a committed copy of each.

    ``completed`` counts the steps committed so far (:func:`cupycomm.resilient` sets it and
    runs step ``completed`` next). The committed copies stay where the arrays are (device
    arrays on their device), so a commit is a copy in the device's memory, not a transfer.

    Example::

        state = State(params=[numpy.ones(2)], lr=0.1)
        state.params[0] *= 2; state.lr = 0.2
        state.restore()
        state.params[0], state.lr        # (array([1., 1.]), 0.1)
    """

    def __init__(self, **values: Any) -> None:
        reserved = sorted(n for n in values if n.startswith("_") or hasattr(State, n)
                          or n == "completed")
        if reserved:
            raise ValueError(f"State: {', '.join(map(repr, reserved))} cannot name a value "
                             f"(an attribute of State, or a name starting with '_')")
        self._names: Tuple[str, ...] = tuple(values)
        self.__dict__.update(values)
        self.completed = 0
        self._committed: Dict[str, Any] = {}
        self.commit()

    def __iter__(self) -> Iterator[str]:
        """The values' names, in the order given."""
        return iter(self._names)

    def commit(self) -> None:
        """Copy every value (and ``completed``): what :meth:`restore` puts back."""
        self._committed = {name: self._copy(getattr(self, name)) for name in self._names}
        self._committed["completed"] = self.completed

    def restore(self) -> None:
        """Put back the values of the last commit, arrays in place where they still have the
        committed shape and dtype (else the attribute gets a copy)."""
        for name in self._names:
            saved, live = self._committed[name], getattr(self, name)
            if _layout(saved) and _layout(saved) == _layout(live):
                for into, value in zip(_arrays(live), _arrays(saved)):
                    into[...] = value
            else:
                setattr(self, name, self._copy(saved))
        self.completed = self._committed["completed"]

    def sync(self, comm: Communicator, root: int = 0) -> None:
        """Make every rank's values root's (arrays broadcast in place, other values pickled),
        then, once the broadcasts have completed (device ones too), commit them. Collective
        over ``comm``. Where an abort cut a device broadcast short (PeerLost, for a loss),
        nothing is committed: the last commit stays what :meth:`restore` puts back.

        Raises ValueError on every rank, before any array is sent, where a value's arrays
        differ from root's in number, shape, dtype or kind (host or device).
        """
        plain = {n: getattr(self, n) for n in self._names if not _arrays(getattr(self, n))}
        layouts = {n: _layout(getattr(self, n)) for n in self._names}
        ours = (plain, self.completed, layouts)
        plain, completed, theirs = comm.broadcast_object(ours if comm.rank == root else None,
                                                         root)
        differ = [n for n in self._names if layouts[n] != theirs.get(n)]
        if not comm.agree(not differ):
            raise ValueError(
                f"State.sync: the arrays of {', '.join(differ) or 'some values'} differ from "
                f"root's (rank {root}) on rank {comm.rank}" + "".join(
                    f"; {n}: {layouts[n]} here, {theirs.get(n)} on the root" for n in differ)
                + ("" if differ else " (this rank's match; another rank's do not)"))
        self.__dict__.update(plain)
        self.completed = completed
        for name in self._names:
            for array in _arrays(getattr(self, name)):
                comm.broadcast(array, root)
        settled(comm, "State.sync")
        self.commit()

    @staticmethod
    def _copy(value: Any) -> Any:
        if _is_array(value):
            return value.copy()
        arrays = _arrays(value)
        if arrays:
            return type(value)(a.copy() for a in arrays)
        return copy.deepcopy(value)

    def __repr__(self) -> str:
        return f"<cupycomm.State {', '.join(self._names)}; {self.completed} steps committed>"
