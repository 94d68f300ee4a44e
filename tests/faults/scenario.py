"""Fault scenarios, one per command line, run under mpiexec by tests/test_faults.py.

    mpiexec -n 3 python tests/faults/scenario.py raise-before-collective

The last rank misbehaves; the others enter a collective that cannot complete. Every
scenario must end the whole job quickly, non-zero, saying which rank and why.
"""
import ctypes
import os
import signal
import sys
import time

import numpy as np

import cupycomm


def main(name: str) -> None:
    debug = name.startswith("debug-")
    comm = cupycomm.init(timeout=3.0, debug=debug)
    culprit = comm.rank == comm.size - 1
    x = np.ones(4)
    comm.all_reduce(x)                       # everyone is up: the fault comes after this
    if name == "raise-before-collective" and culprit:
        raise RuntimeError("deliberate failure before the collective")
    if name == "sys-exit-0" and culprit:
        sys.exit(0)
    if name == "os-exit-0" and culprit:
        os._exit(0)
    if name == "sigkill" and culprit:
        os.kill(os.getpid(), signal.SIGKILL)
    if name == "never-arrives" and culprit:
        time.sleep(60)
    if name == "hold-gil":
        if culprit:   # a C call that keeps the GIL: no Python thread of this rank can run
            ctypes.PyDLL(None).sleep(60)
        time.sleep(60)
    if name.endswith("mismatch-count"):
        x = np.ones(4 + 2 * culprit)
    if name.endswith("mismatch-dtype"):   # the same number of bytes: MPI cannot tell
        x = np.ones(8 if culprit else 4, np.float32 if culprit else np.float64)
    try:
        if name.endswith("mismatch-op"):
            comm.all_reduce(x, op="max" if culprit else "sum")
        elif name.endswith("mismatch-root"):
            comm.broadcast(x, root=1 if culprit else 0)
        else:
            comm.all_reduce(x)
    except cupycomm.CollectiveMismatch as error:   # debug mode: raised on every rank
        print(f"rank {comm.rank}: CollectiveMismatch: {error}", flush=True)
        comm.barrier()
        sys.exit(3)
    print(f"rank {comm.rank} finished with {x[:2]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
