"""Peer-loss scenarios, one per command line, run by tests/survivors/test_survivors.py under
Open MPI's ``mpiexec --with-ft ulfm --mca btl tcp,self``:

    mpiexec --with-ft ulfm --mca btl tcp,self -n 4 python tests/survivors/scenario.py sigkill DIR

Every rank runs ``init(on_peer_loss="raise")`` and a first all_reduce; then the victim
(world rank 1; in ``two``, rank 3 and then rank 1) ends as the case says, once every
survivor has told it that the calls before are done (``settle``), just after writing the
time in ``DIR/fault-<rank>``. Each survivor catches PeerLost, agrees, shrinks, runs an
all_reduce on the shrunk communicator and checks what the old one (and its subgroup, its
bucket) does then; it writes what it saw, one JSON object per round, to
``DIR/rank-<world rank>.json``, which the test compares with a NumPy reference. Cases:

- ``sigkill``, ``exit0``, ``exit3``, ``abort`` (``MPI_Abort`` on ``COMM_SELF``): before the
  second collective;
- ``during``: SIGKILL while the victim waits inside the second collective (rank 0 comes late);
- ``two``: rank 3 lost, shrink to 3, then world rank 1, shrink to 2;
- ``objects``: as ``sigkill``, the survivors in all_gather_object (pickled objects);
- ``no-shrink``: as ``sigkill``, but the survivors end after PeerLost without going on;
- ``device``: as ``sigkill``, with device arrays on the NCCL stand-in
  (cupycomm.testing.standin): the NCCL communicator is aborted, not destroyed, and the
  shrunk one is made from a new unique id, of the survivors only;
- ``device-blocked``: as ``device``, but only device calls see the loss: the survivors'
  device all_reduce waits for the dead peer (stand-in rule 22), the watchdog aborts the
  NCCL communicator, which ends the wait, and their next device call raises PeerLost;
- ``device-launch``: as ``device-blocked``, but the survivors launch device all_reduces
  back to back, without waiting: NCCL hands the launch after its asynchronous error that
  error (stand-in rule 22), which must be PeerLost, not a bare NcclError;
- ``grow``, ``grow-device`` (device arrays on the stand-in): as ``sigkill``, then the
  survivors try grow() with bad arguments, a grow() whose new process refuses to join
  (``init(on_peer_loss="abort")``), and ``grow(1)``: a new process, started as this
  program again (its ``init()`` joins), takes world rank 1; every rank of the grown
  communicator, the newcomer too, runs an all_reduce of host and stand-in device arrays
  and writes ``DIR/grown-<world rank>.json``;
- ``grow-gpus``: as ``grow-device`` without the refusals, on a node whose 4 stand-in GPUs
  every rank sees; the program picks its own GPU (3 - its world rank), a newcomer leaves
  it to cupycomm.

A victim never ends by raising: under ULFM its MPI_Finalize would wait for ever (mpi4py's
own ULFM tests kill instead).
"""
import json
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import cupycomm


def progress(directory: str, what: str) -> None:
    """Append ``what`` to ``DIR/progress-<world rank>`` (``progress-new`` in a process that
    grow() started): where a hung job's ranks got to."""
    who = "new" if "CUPYCOMM_JOIN" in os.environ else MPI.COMM_WORLD.Get_rank()
    with open(os.path.join(directory, f"progress-{who}"), "a") as f:
        f.write(f"{time.time():.3f} {what}\n")


def fault(case: str, directory: str) -> None:
    """End this rank as ``case`` says, after writing the time in ``DIR/fault-<rank>``."""
    with open(os.path.join(directory, f"fault-{MPI.COMM_WORLD.Get_rank()}"), "w") as f:
        f.write(repr(time.time()))
    if case == "exit0":
        os._exit(0)
    elif case == "exit3":
        os._exit(3)
    elif case == "abort":
        MPI.COMM_SELF.Abort(3)
    os.kill(os.getpid(), signal.SIGKILL)


def settle(comm, victim):
    """Every survivor tells the victim that it has finished the calls before the loss, which
    the victim waits for: a collective that it left first could otherwise still be broken
    by its end on a slower survivor (ULFM), which would raise PeerLost there and not in the
    collective the case is about."""
    me, done = comm.world_ranks[comm.rank], np.ones(1)
    at = comm.world_ranks.index(victim)
    if me != victim:
        comm.send(done, at)
        return
    for rank in range(comm.size):
        if rank != at:
            comm.recv(done, rank)


def survive(comm, case, directory, victim, xp):
    """One round: the victim ends (else this rank waits in all_reduce #2 until PeerLost),
    and the survivors shrink; returns the shrunk communicator and what this rank saw."""
    me = comm.world_ranks[comm.rank]
    sub = comm.split(comm.rank % 2)     # made before the loss: refused after the shrink
    bucket = comm.bucket([np.ones(3)])
    comm.all_gather_object(me)          # the object collectives' duplicate exists: retired too
    settle(comm, victim)
    x = np.full(4, me + 1.0)   # host arrays: the device case's loss is seen by MPI
    if me == victim and case != "during":
        fault("sigkill" if case == "objects" else case, directory)
    elif me == victim:
        threading.Timer(0.3, fault, (case, directory)).start()   # inside the collective
    elif case == "during" and comm.rank == 0:
        time.sleep(0.6)   # the victim waits inside all_reduce #2 when it is killed
    seen = {}
    progress(directory, f"all_reduce, victim {victim}")
    try:
        if case == "objects":
            comm.all_gather_object(me)
        elif case == "device-blocked":
            xp.asnumpy(comm.all_reduce(xp.asarray(x)))   # returns once the watchdog aborted
            comm.all_reduce(xp.asarray(x))
        elif case == "device-launch":   # the second launch meets NCCL's asynchronous error
            for _ in range(2):
                comm.all_reduce(xp.asarray(x))
        else:
            comm.all_reduce(x)
        seen["raised"] = None
    except cupycomm.PeerLost as lost:
        seen.update(raised="PeerLost", ranks=list(lost.ranks), call=lost.call, seq=lost.seq)
    progress(directory, f"raised {seen['raised']}")
    seen["failed_ranks"] = comm.failed_ranks()
    seen["agree_true"] = comm.agree(True)
    seen["agree_mixed"] = comm.agree(me != min(r for r in comm.world_ranks if r != victim))
    old_device = comm.parts.router.device
    progress(directory, "agreed")
    shrunk = comm.shrink()
    y = np.asarray(getattr(xp, "asnumpy", np.asarray)(
        shrunk.all_reduce(xp.asarray(np.full(4, me + 1.0)))))
    good = time.time()
    progress(directory, "shrunk and reduced")
    with open(os.path.join(directory, f"fault-{victim}")) as f:
        seen["fault_to_good"] = good - float(f.read())
    seen.update(size=shrunk.size, rank=shrunk.rank, world_ranks=list(shrunk.world_ranks),
                result=y.tolist())
    refusals = {"all_reduce": lambda: comm.all_reduce(np.ones(2)),
                "all_reduce avg": lambda: comm.all_reduce(np.ones(2), op="avg"),
                "barrier": comm.barrier, "agree": lambda: comm.agree(True),
                "subgroup": lambda: sub.all_reduce(np.ones(2)),
                "bucket": bucket.all_reduce, "shrink": comm.shrink}
    seen["refused"] = {}
    for name, call in refusals.items():
        try:
            call()
            seen["refused"][name] = None
        except cupycomm.CommClosedError as error:
            seen["refused"][name] = f"{type(error).__name__}: {error}"
    if old_device is not None:
        old, new = old_device._comm, shrunk.parts.router.device._comm
        seen["device"] = {"old_freed_by": old.freed_by, "new_freed_by": new.freed_by,
                          "new_size": new.size(), "new_rank": new.rank_id(),
                          "new_members": _world_ranks(new._comm),
                          "new_id": new.unique_id.hex(), "old_id": old.unique_id.hex()}
    return shrunk, seen


def grow(comm, directory, xp):
    """After the shrink: the refusals of bad arguments, then grow(1) (this program again,
    whose main() joins) and an all_reduce on the grown communicator, host and device."""
    refused = {}
    for name, call in {"n=0": lambda: comm.grow(0), "n=-1": lambda: comm.grow(-1),
                       "n=1.0": lambda: comm.grow(1.0), "n=True": lambda: comm.grow(True),
                       "command=str": lambda: comm.grow(1, command=sys.executable)}.items():
        try:
            call()
            refused[name] = None
        except (TypeError, ValueError) as error:
            refused[name] = f"{type(error).__name__}: {error}"
    abort_mode = [sys.executable, "-c", "import cupycomm; cupycomm.init(on_peer_loss='abort')"]
    try:   # a new process that refuses to join: every survivor raises, comm stays usable
        comm.grow(1, command=abort_mode)
        refused["newcomer"] = None
    except RuntimeError as error:
        refused["newcomer"] = f"{type(error).__name__}: {error}"
    comm.all_reduce(np.ones(2))   # still usable after the refusals
    progress(directory, "growing")
    grown = comm.grow(1)
    progress(directory, "grown")
    after = {}
    for name, call in {"all_reduce": lambda: comm.all_reduce(np.ones(2)),
                       "grow": lambda: comm.grow(1)}.items():
        try:
            call()
            after[name] = None
        except cupycomm.CommShrunkError as error:
            after[name] = f"{type(error).__name__}: {error}"
    return grown, {"refused": refused, "after": after}


def grown_round(comm, directory, xp, seen):
    """Every rank of the grown communicator, the newcomer too: the all_reduce (host, then
    device on the stand-in), what it sees; written to DIR/grown-<world rank>.json."""
    me = comm.world_ranks[comm.rank]
    y = comm.all_reduce(np.full(4, me + 1.0))
    good = time.time()
    if xp is not np:
        from cupycomm.testing import standin
        standin.join_world(comm.mpi_comm)   # real NCCL meets over sockets, not MPI's world
        comm.device.use()
        device = comm.all_reduce(xp.asarray(np.full(3, me + 1.0)))
        nccl = comm.parts.router.device._comm
        seen["device"] = {"result": xp.asnumpy(device).tolist(), "size": nccl.size(),
                          "rank": nccl.rank_id(), "id": nccl.unique_id.hex(),
                          "gpu": comm.parts.router.device_id}
    with open(os.path.join(directory, "fault-1")) as f:
        seen["fault_to_good"] = good - float(f.read())
    seen.update(world_ranks=list(comm.world_ranks), rank=comm.rank, size=comm.size,
                joined_late=cupycomm.joined_late(), result=y.tolist(), name=comm.name,
                failed_ranks=comm.failed_ranks(), agree=comm.agree(True))
    with open(os.path.join(directory, f"grown-{me}.json"), "w") as f:
        json.dump(seen, f)
    progress(directory, "grown round written")


def _world_ranks(mpi_comm):
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))


def main(case: str, directory: str) -> None:
    options = {}
    xp = np
    if case.startswith("device") or case in ("grow-device", "grow-gpus"):
        from cupycomm.testing import standin
        options["device_module"] = xp = standin
    if case == "grow-gpus":   # one node's GPUs, as NCCL sees them: a duplicate is refused
        standin.SHARED_GPUS, standin.DEVICE_COUNT = True, 4
        if "CUPYCOMM_JOIN" not in os.environ:
            options["device"] = 3 - MPI.COMM_WORLD.Get_rank()
    progress(directory, "started")
    comm = cupycomm.init(on_peer_loss="raise", timeout=60, **options)
    if cupycomm.joined_late():   # started by the survivors' grow(1): world rank 1 again
        progress(directory, f"joined as world rank {comm.world_ranks[comm.rank]}")
        grown_round(comm, directory, xp, {})
        comm.close()
        return
    if xp is not np:
        comm.device.use()
    comm.all_reduce(xp.asarray(np.ones(2)))   # on the device too: the NCCL communicator
    if case == "no-shrink":   # the survivors end after PeerLost, without going on
        if comm.rank == 1:
            fault("sigkill", directory)
        try:
            comm.all_reduce(np.ones(2))
        except cupycomm.PeerLost:
            progress(directory, "raised PeerLost; ending without shrink()")
        return
    rounds = []
    for victim in ((3, 1) if case == "two" else (1,)):
        comm, seen = survive(comm, case, directory, victim, xp)
        rounds.append(seen)
    if case == "grow-gpus":
        progress(directory, "growing")
        grown_round(comm.grow(1), directory, xp, {})
    elif case.startswith("grow"):
        comm, seen = grow(comm, directory, xp)
        grown_round(comm, directory, xp, seen)
    with open(os.path.join(directory, f"rank-{MPI.COMM_WORLD.Get_rank()}.json"), "w") as f:
        json.dump(rounds, f)
    comm.close()
    progress(directory, "closed")


if __name__ == "__main__":
    main(*sys.argv[1:])
