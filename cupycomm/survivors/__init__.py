"""Survivors go on: after a peer is lost, raise on every survivor, shrink and continue.

With ``cupycomm.init(on_peer_loss="raise")`` (MPI's ULFM: Open MPI 5 under ``mpiexec
--with-ft ulfm``; elsewhere ``init`` refuses), a collective that a lost rank would block
raises :class:`~cupycomm.errors.PeerLost` on every survivor; ``comm.agree(flag)``,
``comm.failed_ranks()``, ``comm.shrink()`` and ``comm.grow(n)`` let the program go on
(docs/guide/survivors.md).

- :mod:`.policy`: the process's mode; :mod:`.lost`: MPI's errors turned into PeerLost;
- :mod:`.state`: one communicator's lost peers, the agreement, its shrunk MPI successor;
- :mod:`.grow`: the MPI side of ``comm.grow(n)``; :mod:`.numbering`: the job's world ranks;
- ``committed``, ``resilient``: :class:`cupycomm.State` and :func:`cupycomm.resilient`.

Nothing is imported here: :mod:`.policy` is read by tools that must not start MPI.
"""
