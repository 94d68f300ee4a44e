"""What the heartbeats between nodes cost a collective: all_reduce at 2 ranks, 8 B and 1 MiB,
before and after them, in one run.

    python benchmarks/heartbeat_cost.py [--before REV] [--rounds 3] [--iters 300]

Each round runs ``python -m cupycomm.bench all_reduce --compare`` (cupycomm and raw mpi4py,
interleaved call for call) four times, one after the other: with this checkout's cupycomm
and with the one of commit REV (default: the commit before heartbeats came), each on one
node and on two simulated nodes (1 + 1 ranks, where the heartbeats run; on one node there
are none). It prints, per layout and size, the median over rounds of the time per call of
each version and of raw mpi4py in the same runs. Run it alone on the machine (the lock).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cupycomm.testing import run_mpiexec, simulated_nodes

ROOT = Path(__file__).resolve().parent.parent
SIZES = ["-b", "8", "-e", "1M", "-f", str(1 << 17)]   # 8 B and 1 MiB
LAYOUTS = {"one node": [], "two simulated nodes": simulated_nodes(1, 1)}


def before_heartbeats() -> str:
    """The commit before the one that added cupycomm/faults/heartbeat.py."""
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--",
                            "cupycomm/faults/heartbeat.py"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    if not added:
        raise SystemExit("heartbeat_cost: no commit adds cupycomm/faults/heartbeat.py; "
                         "give --before")
    return f"{added[-1]}^"


def checkout(rev: str, into: Path) -> None:
    """The cupycomm package of commit ``rev`` under ``into``."""
    archive = subprocess.run(["git", "archive", rev, "cupycomm"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def one_run(tree: str, layout: list, iters: int, scratch: Path) -> dict:
    """{(size, mode): (cupycomm µs, mpi4py µs)} of one bench job with ``tree``'s cupycomm."""
    out = scratch / "rows.json"
    job = run_mpiexec(2, "-m", "cupycomm.bench", "all_reduce", *SIZES, "--backend", "host",
                      "--compare", "--no-progress", "-n", str(iters), "--json", str(out),
                      timeout=300, cwd=str(scratch), mpiexec_args=layout,
                      env={"PYTHONPATH": tree})
    if job.returncode != 0:
        raise SystemExit(f"heartbeat_cost: the bench failed:\n{job.output}")
    rows = json.loads(out.read_text())
    times = {(row["size"], row["mode"], row["impl"]): row["time_us"] for row in rows}
    return {(size, mode): (us, times[size, mode, "mpi4py"])
            for (size, mode, impl), us in times.items() if impl == "cupycomm"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the commit to compare with (default: the one "
                                         "before heartbeats)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    before = args.before or before_heartbeats()
    with tempfile.TemporaryDirectory(prefix="cupycomm-heartbeat-cost-") as scratch:
        old = Path(scratch, "before")
        old.mkdir()
        checkout(before, old)
        trees = {"before": str(old), "after": str(ROOT)}
        runs: dict = {}
        for _ in range(args.rounds):
            for layout, options in LAYOUTS.items():
                for version, tree in trees.items():
                    for key, pair in one_run(tree, options, args.iters, Path(scratch)).items():
                        runs.setdefault((layout, *key), {}).setdefault(version, []).append(pair)
    print(f"before = {before}; after = {ROOT} (working tree); medians of {args.rounds} "
          f"rounds of {args.iters} calls; µs per call (raw mpi4py in the same job)")
    print(f"{'layout':20s} {'size':>8s} {'mode':13s} {'before':>16s} {'after':>16s} "
          f"{'after/before':>12s}")
    for (layout, size, mode), versions in sorted(runs.items()):
        cells = {}
        for version, pairs in versions.items():
            cells[version] = (statistics.median(p[0] for p in pairs),
                              statistics.median(p[1] for p in pairs))
        b, a = cells["before"], cells["after"]
        print(f"{layout:20s} {size:8d} {mode:13s} {b[0]:7.1f} ({b[1]:6.1f}) "
              f"{a[0]:7.1f} ({a[1]:6.1f}) {a[0] / b[0]:12.2f}", flush=True)
    print(f"({os.uname().nodename}, {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
