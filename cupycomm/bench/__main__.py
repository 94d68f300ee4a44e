"""Entry point: ``mpiexec -n N python -m cupycomm.bench [collective ...] [options]``.

Ctrl-C ends every rank: the rank that sees the interrupt aborts the MPI job, so that no rank
is left waiting in a collective for a peer that has gone.
"""
import sys

from .. import _bootstrap
from ..faults.abort import abort_world
from .run import main


def _main() -> int:
    try:
        return main()
    except KeyboardInterrupt:
        sys.stderr.write(f"\ncupycomm.bench: interrupted on rank {_bootstrap.world().Get_rank()}"
                         f"; aborting every rank\n")
        abort_world(130)
        return 130


if __name__ == "__main__":
    sys.exit(_main())
