"""Survivors go on: after a peer is lost, raise on every survivor, shrink and continue.

With ``cupycomm.init(on_peer_loss="raise")`` (the default "abort" ends the job, as always),
a collective that a lost rank would block raises :class:`~cupycomm.errors.PeerLost` on every
survivor (its ``ranks`` in world numbering, the ``call`` and its ``seq``), not always from
the same call: one that the loss broke may complete on some survivors first. Then
``comm.agree(flag)`` (a fault-tolerant AND over the survivors), ``comm.failed_ranks()`` and
``comm.shrink()`` (the survivors' communicator, host and device; refused on every survivor
where they stand at different calls) let the program go on. It
needs MPI's ULFM: Open MPI 5 started with ``mpiexec --with-ft ulfm --mca btl tcp,self``;
elsewhere ``init`` refuses (:mod:`.policy`).

- :mod:`.policy`: the process's mode, and the refusal where the MPI cannot;
- :mod:`.lost`: MPI's errors turned into PeerLost, where the host calls fail;
- :mod:`.state`: one communicator's lost peers, the agreement, its shrunk MPI successor;
- :mod:`.shrink`: ``comm.shrink()``, the old communicator (and its NCCL one) retired;
- :mod:`.grow`: ``comm.grow(n)``, new processes in the lost ranks' places, and their
  ``init()`` joining;
- :mod:`.numbering`: the job's world ranks, kept across grow() (a newcomer's MPI world is
  only the processes started with it).

Example (4 ranks under ``mpiexec --with-ft ulfm --mca btl tcp,self``, one killed)::

    comm = cupycomm.init(on_peer_loss="raise")
    try:
        comm.all_reduce(x)
        done = True
    except cupycomm.PeerLost as lost:
        done = False
    if not comm.agree(done):    # the same answer on every survivor
        comm = comm.shrink()    # the 3 survivors; comm.world_ranks keeps the job's numbers
        comm = comm.grow(1)     # optional: a new process takes world rank 1 again

Nothing is imported here: :mod:`.policy` is read by tools that must not start MPI
(``python -m cupycomm.run``).
"""
