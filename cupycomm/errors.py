"""The exceptions cupycomm raises beyond Python's own TypeError and ValueError.

Bad arguments raise ``TypeError`` (wrong kind of object) or ``ValueError`` (wrong value or
shape), before any communication starts. The classes here are for state and for faults:
a closed communicator, a collective that did not finish in time, ranks that disagree about
a collective (debug mode), a failed NCCL call, a peer process that is gone (and a
communicator replaced by ``shrink()`` after it), a node's shared file that is not the one
cupycomm made; and one warning, for a launch that MPI sees otherwise than the launcher.
"""
from __future__ import annotations

from typing import Any, Tuple

__all__ = ["CommClosedError", "CommShrunkError", "CollectiveTimeout", "CollectiveMismatch",
           "NcclError", "PeerLost", "TooFewSurvivors", "SharedFileRefused",
           "LocalRankWarning"]


class CommClosedError(RuntimeError):
    """The communicator was closed; create a new one with ``cupycomm.init()``."""


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within its timeout.

    ``collective`` names it, ``seq`` is its sequence number on the communicator and
    ``missing`` lists the ranks of this node known not to have arrived (empty when
    unknown); the message lists the ranks on other nodes as not known here.
    """

    def __init__(self, message: str, *, collective: str = "", seq: int = -1,
                 missing: Tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.missing = tuple(missing)


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives, or the same one with different arguments (debug mode)."""


class NcclError(RuntimeError):
    """An NCCL call failed, synchronously or asynchronously; the NCCL communicator is unusable."""


class PeerLost(NcclError):
    """A peer process of the communicator is gone.

    On the device: a peer died while this rank's device collectives waited for it, and the
    NCCL communicator was aborted. With ``init(on_peer_loss="raise")`` (see
    :mod:`cupycomm.survivors`), also on the host: every survivor raises it, from the call
    on the communicator that the loss broke on it or from a later one, and may then
    ``comm.shrink()`` and go on; in the default mode host collectives end the job instead.

    What is the same on every survivor: that it raises PeerLost from some call, and what
    ``comm.shrink()`` agrees (the survivors' communicator, hence the lost ranks). What is
    not: the call. A collective that the loss broke may complete on some survivors and
    raise on others, which then raise from their next call; a program that redoes "the step
    that raised" would redo different steps, so ``shrink()`` refuses on every survivor
    (RuntimeError) where they stand at different calls. Agree first whether the step counts
    (``comm.agree``), or use :func:`cupycomm.resilient`, which does.

    ``ranks`` are the lost ranks in the numbering of the job's world (a sorted tuple; empty
    where unknown), those this rank knew of when it raised; ``call`` the collective's name
    and ``seq`` its sequence number on the communicator (-1 where unknown), on the host and
    on the device alike (there: the ranks the watchdog saw die; for a refused call, the
    number it would have had). It subclasses NcclError, which the device side raised
    first.
    """

    def __init__(self, message: str, *, ranks: Tuple[int, ...] = (), call: str = "",
                 seq: int = -1) -> None:
        super().__init__(message)
        self.ranks = tuple(sorted(ranks))
        self.call = call
        self.seq = seq


class CommShrunkError(CommClosedError):
    """The communicator was replaced by ``comm.shrink()`` or ``comm.grow()`` (it, its
    subgroups and its buckets refuse every call): use the communicator that call returned."""


class TooFewSurvivors(RuntimeError):
    """:func:`cupycomm.resilient` stops: fewer ranks are left than its ``min_size``, or more
    were lost than its ``max_failures``. Raised on every survivor alike, after the shrink and
    the restore: ``comm`` is the survivors' communicator, ``state`` the last committed state
    (the same on each; write a checkpoint from it), ``lost`` the lost world ranks (sorted)."""

    def __init__(self, message: str, *, comm: Any, state: Any, lost: Tuple[int, ...]) -> None:
        super().__init__(message)
        self.comm = comm
        self.state = state
        self.lost = tuple(sorted(lost))


class SharedFileRefused(RuntimeError):
    """A file that cupycomm shares between the processes of a node (the node board) is not
    the one it made: a link, another user's, or open to other users; the message names the
    path, what was found and what was expected. Raised on every rank of the communicator
    being made. See the security guide (docs/guide/security.md)."""


class LocalRankWarning(RuntimeWarning):
    """The MPI library and the launcher disagree about the ranks that share a node.

    ``init()`` warns, once per process, when MPI's shared-memory split of a node holds other
    ranks than the launcher's local ranks say (``SLURM_LOCALID``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``): Open MPI under srun's pmix, for one,
    makes every rank local rank 0. The default device choice follows MPI's split, so ranks of
    one node may pick the same GPU; pass ``init(device=...)`` from the launcher's local rank.
    Host collectives are right all the same.

    Example::

        import warnings
        warnings.simplefilter("error", cupycomm.LocalRankWarning)   # make it fatal
    """
