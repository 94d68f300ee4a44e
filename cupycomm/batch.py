"""One ``with comm.batch():`` block: the calls in it are issued together and complete when
the block ends (as torch.distributed's batch_isend_irecv).

On the host each call inside starts as a nonblocking MPI request and the end of the block
waits for all of them; on the device the calls form one NCCL group (groupStart/groupEnd),
launched at the end of the block, after which the caller's stream waits for it. So a halo
exchange that posts its sends and receives in any order cannot deadlock. A block holds host
calls or device calls, not both. Each call inside returns a Work that completes with the
block.
"""
from __future__ import annotations

from typing import Any, List, Optional

__all__ = ["Batch"]


class Batch:
    """The state of one open block, shared by the backends while it is open."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.kind: Optional[str] = None   # "host" or "device", set by the first call
        self.works: List[Any] = []
        self.caller: Any = None           # device: the stream the block's calls order after
        self.unpack: List[tuple] = []     # device: (dst, src) copies to make after the group

    def claim(self, kind: str, label: str) -> None:
        """Record that ``label``, a call of ``kind``, joins the block (before it is issued)."""
        if self.kind is None:
            self.kind = kind
        elif self.kind != kind:
            raise TypeError(f"batch: {label} on {kind} arrays cannot join a block of "
                            f"{self.kind} calls (one block is one set of MPI requests or one "
                            f"NCCL group) on rank {self.rank}")
