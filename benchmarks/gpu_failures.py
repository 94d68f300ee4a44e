"""The device path when something fails, run for real: each scenario a short job whose every
rank prints one line and exits 0 only if cupycomm did what it promises (issue 32).

    mpiexec -n 2 python benchmarks/gpu_failures.py timeout
    mpiexec -n 2 python benchmarks/gpu_failures.py graph
    mpiexec --with-ft ulfm --mca btl tcp,self --mca async_mpi_finalize 1 -n 3 \\
        python benchmarks/gpu_failures.py lost

- timeout: rank 0 starts three async device all_reduces that rank 1 never joins (timeout
  3 s): ``synchronize()`` of the last and ``wait()`` of the first raise CollectiveTimeout
  naming rank 1, within the bound; neither returns the cut-short buffer.
- graph: both ranks capture a device all_reduce in a CUDA graph and replay it once together;
  then rank 0 replays it alone with ``launch_graph``, the graph still held: within the
  timeout's bound the watchdog aborts, and the next device call raises at once, naming the
  replay (no hang: NCCL's abort must not wait for the graph the user holds).
- lost (Open MPI's ULFM, ``on_peer_loss="raise"``): world rank 2 is killed while ranks 0
  and 1 have an async device all_reduce pending: on each survivor ``Work.wait()`` and a new
  launch raise PeerLost naming rank 2; then ``shrink()`` and a device all_reduce of the
  survivors' values is right.

``--device-module cupycomm.testing.standin`` runs a scenario on the stand-in (a peer's
missing kernel is a deferred stream there: the stand-in runs NCCL's work with MPI, which
would block the host). Each rank exits 1 on a wrong outcome (the line says which).
"""
import argparse
import importlib
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, Tuple

import numpy as np

import cupycomm

TIMEOUT = 3.0   # seconds: the communicators' timeout
MARGIN = 5.0    # seconds past it within which the error must come


def stream_that_waits(xp: Any) -> Any:
    """A stream whose collective waits for a peer that never comes: on a GPU any stream
    (its kernel spins), on the stand-in a deferred one (its MPI would block the host)."""
    stream = xp.cuda.Stream(non_blocking=True)
    if hasattr(xp, "deferred"):
        stream.deferred = True
    return stream


def expect(what: str, error_type: type, call: Callable[[], Any],
           check: Callable[[Exception], bool]) -> str:
    """'' if ``call()`` raised ``error_type`` for which ``check`` holds, else what happened."""
    try:
        result = call()
    except error_type as error:
        return "" if check(error) else f"{what}: {type(error).__name__} but {error}"
    except Exception as error:   # the wrong kind of error is the finding
        return f"{what}: {type(error).__name__}, not {error_type.__name__}: {error}"
    return f"{what}: returned {type(result).__name__} instead of raising"


def timeout(comm: Any, xp: Any) -> Tuple[bool, str]:
    """Async Works pending on a peer that never comes: each raises, naming it."""
    warm = xp.asarray(np.ones(4))
    comm.all_reduce(warm)   # NCCL connects on a communicator's first call: both make it
    xp.cuda.Stream.null.synchronize()
    if comm.rank == 1:   # in no collective of the communicator until rank 0 says so
        comm.mpi_comm.recv(source=0)
        return True, "stayed out"
    stream = stream_that_waits(xp)
    with xp.cuda.Device(comm.device.id):
        works = [comm.all_reduce(xp.asarray(np.full(4, k + 1.0)), stream=stream, async_op=True)
                 for k in range(3)]
    start = time.monotonic()

    def names_rank_1(error: Exception) -> bool:
        return 1 in getattr(error, "missing", ()) and time.monotonic() - start < TIMEOUT + MARGIN
    wrong = (expect("synchronize()", cupycomm.CollectiveTimeout, works[-1].synchronize,
                    names_rank_1)
             or expect("wait()", cupycomm.CollectiveTimeout, works[0].wait, names_rank_1))
    comm.mpi_comm.send("done", dest=1)
    return not wrong, wrong or (f"both raised CollectiveTimeout naming rank 1 "
                                f"({time.monotonic() - start:.1f} s)")


def graph(comm: Any, xp: Any) -> Tuple[bool, str]:
    """A watched replay whose peer never replays: a named error within the bound, no hang."""
    x = xp.asarray(np.ones(4))
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        comm.all_reduce(x)   # warm-up: NCCL connects on a communicator's first call
        stream.synchronize()
        stream.begin_capture()
        comm.all_reduce(x)
        captured = stream.end_capture()
    comm.launch_graph(captured, stream)
    stream.synchronize()
    together = np.asarray(getattr(xp, "asnumpy", np.asarray)(x))
    if not np.array_equal(together, np.full(4, float(comm.size) ** 2)):
        return False, f"the replay together gave {together}"
    comm.barrier()
    if comm.rank == 1:
        comm.mpi_comm.recv(source=0)
        return True, "stayed out"
    start = time.monotonic()
    comm.launch_graph(captured, stream_that_waits(xp))   # the graph is still held
    time.sleep(TIMEOUT + 2)                              # the watchdog's look comes meanwhile
    wrong = expect("the next device call", cupycomm.NcclError,
                   lambda: comm.all_reduce(xp.asarray(np.ones(1))),
                   lambda e: ("launch_graph" in str(e)
                              and time.monotonic() - start < TIMEOUT + MARGIN))
    comm.mpi_comm.send("done", dest=1)
    return not wrong, wrong or f"named error {time.monotonic() - start:.1f} s after the replay"


def lost(comm: Any, xp: Any) -> Tuple[bool, str]:
    """A peer killed during a device all_reduce: PeerLost from Work.wait() and a launch."""
    if comm.rank == 2:
        time.sleep(0.5)   # the survivors' all_reduce is pending by then
        os.kill(os.getpid(), signal.SIGKILL)
    x = xp.asarray(np.ones(4))
    with xp.cuda.Device(comm.device.id):
        work = comm.all_reduce(x, async_op=True)

    def names_rank_2(error: Exception) -> bool:
        return getattr(error, "ranks", ()) == (2,)
    wrong = expect("Work.wait()", cupycomm.PeerLost, lambda: work.wait(timeout=30),
                   names_rank_2)
    wrong = wrong or expect("a launch", cupycomm.PeerLost,
                            lambda: comm.all_reduce(xp.asarray(np.ones(4))), names_rank_2)
    if wrong:
        return False, wrong
    comm = comm.shrink()
    y = comm.all_reduce(xp.asarray(np.full(4, comm.rank + 1.0)))
    got = np.asarray(getattr(xp, "asnumpy", np.asarray)(y))
    expected = float(sum(r + 1 for r in range(comm.size)))
    if not np.array_equal(got, np.full(4, expected)):
        return False, f"after shrink() the device all_reduce gave {got}, expected {expected}"
    comm.close()
    return True, f"PeerLost from Work.wait() and a launch; shrunk to {comm.size}, sum right"


SCENARIOS: Dict[str, Callable[[Any, Any], Tuple[bool, str]]] = {
    "timeout": timeout, "graph": graph, "lost": lost}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--device-module", default="cupy")
    args = parser.parse_args()
    xp = importlib.import_module(args.device_module)
    options: Dict[str, Any] = {} if args.device_module == "cupy" else {"device_module": xp}
    if args.scenario == "lost":
        options["on_peer_loss"] = "raise"
    comm = cupycomm.init(timeout=TIMEOUT, **options)
    comm.init_device()
    rank = comm.rank
    comm.barrier()
    ok, outcome = SCENARIOS[args.scenario](comm, xp)
    print(f"{args.scenario}: rank {rank}: {'ok' if ok else 'WRONG'}: {outcome}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
