"""One ``with comm.batch():`` block: the calls in it are issued together and complete when
the block ends (as torch.distributed's batch_isend_irecv).

The calls inside are checked as they are made and queued; the end of the block issues them
together. On the host each starts as a nonblocking MPI request and the end of the block waits
for all of them; on the device they form one NCCL group (groupStart/groupEnd), after which
the caller's stream waits for it. So a halo exchange that posts its sends and receives in
any order cannot deadlock, and a block that raises (a bad argument, an error in between)
issues nothing: no peer is left matching half of it. A block holds host calls or device
calls, not both. Each call inside returns a Work that completes with the block.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

__all__ = ["Batch"]


class Batch:
    """The state of one open block (``comm.batch()`` opens and ends it), shared by the
    backends while it is open.

    Example::

        with comm.batch() as group:
            comm.isend(x, 1)   # checked and queued; group.works holds its Work
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.kind: Optional[str] = None   # "host" or "device", set by the first call
        self.works: List[Any] = []        # the Work of each call, in the order of the calls
        self.calls: List[Tuple[Any, ...]] = []   # what the backend issues for each call at the end
        self.caller: Any = None           # device: the stream the block's calls order after

    def claim(self, kind: str, label: str) -> None:
        """Record that ``label``, a call of ``kind``, joins the block (before it is issued)."""
        if self.kind is None:
            self.kind = kind
        elif self.kind != kind:
            raise TypeError(f"batch: {label} on {kind} arrays cannot join a block of "
                            f"{self.kind} calls (one block is one set of MPI requests or one "
                            f"NCCL group) on rank {self.rank}")
