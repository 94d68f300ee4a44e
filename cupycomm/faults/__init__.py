"""What happens inside a rank when a rank goes wrong: no rank waits forever, and the one that
gives up says why.

:mod:`~cupycomm.faults.watchdog` (the watcher thread), :mod:`~cupycomm.faults.board` (status
boards in node-local shared memory), :mod:`~cupycomm.faults.heartbeat` (between nodes),
:mod:`~cupycomm.faults.abort` (the one ``MPI_Abort``), :mod:`~cupycomm.faults.flight` (the
flight recorder), :mod:`~cupycomm.faults.stacks` (every thread's Python stack, this
process's and its node's peers') and :mod:`~cupycomm.faults.debug` (debug mode). Their files
lie in the private directories of :mod:`cupycomm._private`. The parent-process side, the
launcher that judges how a job ended, is :mod:`cupycomm.run`.
"""
