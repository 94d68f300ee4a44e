"""What happens inside a rank when a rank goes wrong: no rank waits forever, and the one that
gives up says why.

- :mod:`~cupycomm.faults.watchdog`: the thread that watches every call's progress and ends a
  call past its timeout, or one whose peer has died;
- :mod:`~cupycomm.faults.board`: status boards in node-local shared memory, where each process
  of a node says what it is doing, readable while the others are blocked;
- :mod:`~cupycomm.faults.heartbeat`: heartbeats between nodes, naming a rank or node gone
  silent;
- :mod:`~cupycomm.faults.abort`: ending the whole job, the one place that calls ``MPI_Abort``;
- :mod:`~cupycomm.faults.flight`: the flight recorder, each communicator's last calls and
  one block saying where every rank is (its files merge with ``python -m cupycomm.tools.flight``);
- :mod:`~cupycomm.faults.stacks`: every thread's Python stack, this process's and its
  node's peers';
- :mod:`~cupycomm.faults.debug`: debug mode, the ranks comparing each call before it runs.

The files these parts make in ``/dev/shm`` or the temporary directory lie in the private
directories of :mod:`cupycomm._private`, which ``cupycomm.run`` uses too. The parent-process
side, the launcher that judges how a job ended, is :mod:`cupycomm.run`.
"""
