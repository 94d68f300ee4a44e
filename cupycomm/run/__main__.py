"""``python -m cupycomm.run -n N [launcher options] script.py [args]``: start an MPI job whose
exit status never lies (the command ``cupycomm-run`` is the same).

See :mod:`cupycomm.faults.launch` for what it does, and ``python -m cupycomm.run --help``.
"""
import sys

from .faults.launch import main

if __name__ == "__main__":
    sys.exit(main())
