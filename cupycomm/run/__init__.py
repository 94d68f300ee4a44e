"""Starting a job and judging how it ended: the parent-process side of ``python -m cupycomm.run``.

- :mod:`cupycomm.run.job`: the command (``python -m cupycomm.run``, ``cupycomm-run``): start
  the launcher, forward Ctrl-C and SIGTERM, and exit with a status that never lies;
- :mod:`cupycomm.run.exit_records`: each rank's record of how it ended, written by the rank
  (from ``init()``) and read back here after the job;
- :mod:`cupycomm.run.launchers`: what cupycomm knows of ``mpiexec``, ``mpirun`` and ``srun``
  (``python -m cupycomm.run.launchers -n 3`` prints a job's argv).

Nothing here runs a collective: the in-rank side of faults is ``cupycomm.faults``.
"""
