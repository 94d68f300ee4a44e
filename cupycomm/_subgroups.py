"""Subgroups: the communicators that ``Communicator.split`` and ``Communicator.new_group``
make, each a full communicator over an MPI split of its parent (and an NCCL split where the
parent has an NCCL communicator). It reads the parent's public attributes and ``parts``.

Example (4 ranks)::

    from cupycomm import _subgroups
    half = _subgroups.split(comm, comm.rank % 2, None)   # as comm.split(comm.rank % 2)
    assert (half.rank, half.size) == (comm.rank // 2, 2)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from mpi4py import MPI

if TYPE_CHECKING:   # the type only: the Communicator imports this module
    from .communicator import Communicator

__all__ = ["split", "new_group"]


def split(comm: Communicator, color: Optional[int], key: Optional[int]) -> Optional[Communicator]:
    """``comm.split(color, key)``: checked on every rank alike, then made (collective)."""
    checks = comm.parts.checks
    checks.check_open("split")
    checks.check_split(color, key)
    return _subgroup(comm, None if color is None else int(color),
                     comm.rank if key is None else int(key), f"split({color})")


def new_group(comm: Communicator, ranks: Sequence[int]) -> Optional[Communicator]:
    """``comm.new_group(ranks)``: checked on every rank alike, then made (collective)."""
    checks = comm.parts.checks
    checks.check_open("new_group")
    ordered = checks.check_members(ranks)
    mine = comm.rank in ordered
    return _subgroup(comm, 0 if mine else None, ordered.index(comm.rank) if mine else 0,
                     f"group{ordered}")


def _subgroup(comm: Communicator, color: Optional[int], key: int,
              label: str) -> Optional[Communicator]:
    router = comm.parts.router
    sub = comm.mpi_comm.Split(MPI.UNDEFINED if color is None else color, key)
    raw = router.device.split(color, key) if router.device is not None else None
    if color is None:
        return None
    child = type(comm).create(sub, name=f"{comm.name}/{label}", timeout=comm.timeout,
                              device=router.device_choice, device_module=router.cupy,
                              debug=comm.debug, device_rank=router.device_rank, nccl_comm=raw)
    if comm.parts.survival is not None:   # shrink() retires it with its parent
        comm.parts.survival.adopt(child)
    return child
