"""``python -m cupycomm.run -n N [launcher options] script.py [args]``: start an MPI job whose
exit status never lies (the command ``cupycomm-run`` is the same).

See :mod:`cupycomm.run.job` for what it does, and ``python -m cupycomm.run --help``.
"""
import sys

from .job import main

if __name__ == "__main__":
    sys.exit(main())
