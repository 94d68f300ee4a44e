"""``python -m cupycomm.flight DIR``: merge the flight recorder's files of every rank
(``CUPYCOMM_FLIGHT_RECORDER=DIR``) into one block saying where each rank was.

See :mod:`cupycomm.faults.flight`.
"""
import sys

from .faults.flight import main

if __name__ == "__main__":
    sys.exit(main())
