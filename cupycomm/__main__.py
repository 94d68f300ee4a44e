"""``python -m cupycomm``: the self-check (:mod:`cupycomm.tools.selfcheck`), or with
``--report`` the field-test report (:mod:`cupycomm.tools.fieldtest`). Run it under
``mpiexec -n N`` or alone.

Exit status: 0 passed; 1 a check failed on some rank; 2 a bad command line, or a report
file that cannot be written; 3 (``--report``) nothing failed but some rank has no GPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from mpi4py import MPI

import cupycomm
from . import _bootstrap
from .tools import fieldtest, selfcheck
from . import _private as private
from .errors import SharedFileRefused
from .bench.libraries import load_device_module

EXIT_USAGE = 2


def _writable(path: str, comm: MPI.Comm) -> str:
    """'' where rank 0 can write ``path`` (as :func:`cupycomm._private.replacing` will, at
    the end), else why not (the same answer on every rank)."""
    why = ""
    if comm.Get_rank() == 0:
        try:
            private.check_writable(path)
        except (OSError, SharedFileRefused) as error:
            why = f"cannot write the report to {path}: {error}"
    return comm.bcast(why, root=0)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cupycomm",
        description="The self-check: every collective end to end on NumPy (MPI) and, where "
                    "every rank has a GPU, CuPy (NCCL). With --report: the field-test report "
                    "of every device feature, with versions and topology, as JSON.",
        epilog="Exit status: 0 passed, 1 a check failed, 2 a bad command line or an "
               "unwritable report, 3 (--report) no GPU on some rank, so no device line ran.")
    parser.add_argument("--report", nargs="?", const="cupycomm-report.json", metavar="FILE",
                        help="write the field-test report to FILE (default "
                             "cupycomm-report.json); attach it to bug reports")
    parser.add_argument("--device-module", metavar="MODULE",
                        help="the device module instead of CuPy: a module name such as "
                             "cupycomm.testing.standin (the host-memory stand-in) or a .py file")
    args = parser.parse_args(argv)
    world = _bootstrap.world()
    try:
        module = load_device_module(args.device_module) if args.device_module else None
    except (FileNotFoundError, ImportError) as error:
        if world.Get_rank() == 0:
            print(f"python -m cupycomm: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.report:
        why = _writable(args.report, world)
        if why:
            if world.Get_rank() == 0:
                print(f"python -m cupycomm: error: {why}", file=sys.stderr)
            return EXIT_USAGE
    comm = cupycomm.init(device_module=module)
    try:
        if args.report is None:
            return selfcheck.main(comm)
        return fieldtest.run(comm, args.report, device_module=module)
    finally:
        comm.close()


if __name__ == "__main__":
    sys.exit(main())
