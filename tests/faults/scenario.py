"""Fault scenarios, one per command line, run under mpiexec by tests/faults/test_abort.py,
test_timeouts.py, test_mismatches.py and test_heartbeat.py (through fault_jobs.py).

    mpiexec -n 3 python tests/faults/scenario.py raise-before-collective

The last rank misbehaves; the others enter a collective that cannot complete. Every
scenario must end the whole job quickly, non-zero, saying which rank and why, except
hold-gil-idle, long-compute and long-sleep: correct programs whose slow rank must not be
taken for a hung or dead one.

Run on simulated nodes (cupycomm.testing.simulated_nodes) with a long CUPYCOMM_TIMEOUT, the
last rank is on the last node, and the heartbeats between nodes must end the job: the
node-* scenarios SIGKILL or SIGSTOP every rank of that node.

The hold-gil scenarios shrink the watchdog's GIL margin (10 s at least otherwise) to 1 s, so
that they take seconds: the mechanism is the same.
"""
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import cupycomm
from cupycomm import _bootstrap, _env
from cupycomm.faults import watchdog as _watchdog


def hold_the_gil(seconds: int) -> None:
    """A C call that keeps the GIL: no other Python thread of this process can run."""
    ctypes.PyDLL(None).sleep(seconds)


def compute_in_python(seconds: float) -> None:
    """Pure Python work: it holds the GIL, but only for the interpreter's switch interval at
    a time, so the watchdog thread still runs."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(1000))


def hold_the_gil_inside_a_collective(comm: cupycomm.Communicator, culprit: bool) -> None:
    """The culprit blocks in a barrier that the others never enter (they wait in one of
    another communicator, with a long timeout) and a thread of it takes the GIL once the
    watchdog has seen the barrier start (it has then armed its backstop)."""
    elsewhere = cupycomm.init(MPI.COMM_WORLD, timeout=60.0)
    if not culprit:
        elsewhere.barrier()
        return

    def take_the_gil() -> None:
        while not _watchdog._watchdog.armed:
            time.sleep(0.01)
        hold_the_gil(60)

    threading.Thread(target=take_the_gil, daemon=True).start()
    comm.barrier()


def signal_the_culprits_node(comm: cupycomm.Communicator, signum: int) -> None:
    """Every rank on the last rank's node gets ``signum`` at once: SIGKILL, as when a node
    fails; SIGSTOP, as when it hangs or loses the network. The node is the launcher's
    (hydra's PMI_HOSTNAME on simulated nodes, srun's SLURMD_NODENAME). The launcher's own
    process there (hydra's proxy, slurmstepd) is spared: on a real node that fails its
    connection to the launcher is not closed cleanly either."""
    node = _bootstrap.node_name()
    ranks = comm.all_gather_object((node, os.getpid()))
    doomed = [pid for host, pid in ranks if host == ranks[-1][0]]
    if node == ranks[-1][0] and os.getpid() == doomed[-1]:
        for pid in doomed:
            os.kill(pid, signum)
    time.sleep(0.5)


def device_peer_dies() -> None:
    """The others wait for a device receive from the culprit (NCCL on the stand-in), which
    dies: their watchdog aborts the NCCL communicator and the wait raises PeerLost."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cupycomm.testing import standin
    world = cupycomm.init(timeout=60.0, device_module=standin)
    # reversed, so that PeerLost's world numbering differs from this communicator's
    comm = world.split(0, key=world.size - world.rank)
    comm.all_reduce(standin.zeros(1))   # connected (stand-in rule 24): a launch never waits
    culprit = comm.size - 1   # world rank 0
    if comm.rank == culprit:
        time.sleep(1.0)   # the others' receives are posted by then
        os._exit(0)
    work = comm.irecv(standin.empty(4), culprit)
    seq = comm.parts.tracker.seq   # the irecv's number (a "recv")
    try:
        work.synchronize()
    except cupycomm.PeerLost as lost:
        print(f"rank {comm.rank}: PeerLost ranks={lost.ranks} call={lost.call} "
              f"seq={lost.seq} (recv #{seq}, world rank {comm.world_ranks[culprit]} killed)",
              flush=True)
        raise
    print(f"rank {comm.rank} finished with a message from a dead rank", flush=True)


def device_first_call(name: str) -> None:
    """Rank 1's first device call comes 20 s late (the timeout: 1 s): in making the NCCL
    communicator ("device-init-late": the unique-id exchange, ncclCommInitRank), or in its
    first collective, which connects the peers ("device-connect-late": NCCL's runtime
    connect, stand-in rule 24); or it is a host call ("device-host-mismatch")."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cupycomm.testing import standin
    comm = cupycomm.init(timeout=1.0, device_module=standin)
    if name == "device-connect-late":
        comm.init_device()
    x = standin.asarray(np.ones(4))
    if comm.rank == 1:
        if name == "device-host-mismatch":
            x = np.ones(4)
        else:
            time.sleep(20)
    comm.all_reduce(x)
    print(f"rank {comm.rank} finished with {standin.asnumpy(x)[:2]}", flush=True)


def main(name: str) -> None:
    if name == "device-peer-dies":
        return device_peer_dies()
    if name in ("device-init-late", "device-connect-late", "device-host-mismatch"):
        return device_first_call(name)
    debug = name.startswith("debug-")
    if name.startswith("hold-gil"):
        _watchdog.HOLD_MARGIN = (1.0, 1.0)
    # A multi-node run sets CUPYCOMM_TIMEOUT long: only the heartbeats can end it in time.
    comm = cupycomm.init(timeout=None if os.environ.get("CUPYCOMM_TIMEOUT") else 3.0,
                         debug=debug)
    culprit = comm.rank == comm.size - 1
    x = np.ones(4)
    comm.all_reduce(x)                       # everyone is up: the fault comes after this
    if name == "raise-before-collective" and culprit:
        raise RuntimeError("deliberate failure before the collective")
    if name == "raise-with-receive-pending" and culprit:
        comm.irecv(np.empty(4), 0)   # dropped at once; rank 0 will never send
        raise RuntimeError("deliberate failure with a receive in flight")
    if name == "sys-exit-0" and culprit:
        sys.exit(0)
    if name == "exit-3" and culprit:
        sys.exit(3)
    if name == "os-exit-0" and culprit:
        os._exit(0)
    if name == "sigkill" and culprit:
        os.kill(os.getpid(), signal.SIGKILL)
    if name == "os-exit-0-beside-a-busy-leader":   # on 1 + 2 or 2 + 2 ranks: the rank
        # before the culprit leads their node
        if culprit:
            os._exit(0)
        if comm.rank == comm.size - 2:
            time.sleep(30)   # not in a collective: its watchdog relays, it does not judge
    if name in ("long-compute", "long-sleep") and culprit:   # longer than the heartbeat bound
        seconds = _env.read("CUPYCOMM_HEARTBEAT_TIMEOUT") + 1
        compute_in_python(seconds) if name == "long-compute" else time.sleep(seconds)
    if name == "node-sigkill":
        signal_the_culprits_node(comm, signal.SIGKILL)
    if name == "node-sigstop":
        signal_the_culprits_node(comm, signal.SIGSTOP)
    if name == "never-arrives" and culprit:
        time.sleep(60)
    if name == "hold-gil":
        hold_the_gil_inside_a_collective(comm, culprit)
    if name == "hold-gil-idle":   # longer than the timeout + margin, outside any collective
        time.sleep(0.5)   # the watchdog has looked since the last collective ended
        if culprit:
            hold_the_gil(5)
        else:
            time.sleep(5)
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
