"""What the pytest plugin costs a test under ``mpiexec -n N python -m pytest``: ms per trivial
test with the plugin on and off (``-p no:cupycomm``), at 2, 4, 8 and 16 ranks, in one run.

    python benchmarks/plugin_cost.py [--ranks 2 4 8 16] [--tests 100] [--rounds 3]

Each job runs a scratch module of ``--tests`` trivial tests; each rank times its tests from
the start of the first to the end of the last (the job's start, the collection and the end
left out), and the job's cost per test is the slowest rank's time over the tests between.
More ranks than cores is the point: the plugin's rounds between the ranks must not grow with
the sleeping and waking of oversubscribed ranks. On a shared machine the figures grow with
the load: compare on with off within one run (they alternate). Prints the median over
rounds.
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from cupycomm.testing import run_mpiexec

TRIVIAL = """import os, time
import pytest

COUNT = {count}


@pytest.mark.parametrize("i", range(COUNT))
def test_trivial(i):
    if i == 0:
        test_trivial.start = time.monotonic()
    elif i == COUNT - 1:
        with open(f"span.{{os.getpid()}}", "w") as f:
            f.write(repr(time.monotonic() - test_trivial.start))
"""


def per_test(n: int, count: int, plugin: bool, scratch: Path) -> float:
    """ms per test of one ``mpiexec -n n python -m pytest`` job over ``count`` trivial
    tests: the slowest rank's time from its first test to its last, over ``count - 1``."""
    for old in scratch.glob("span.*"):
        old.unlink()
    (scratch / "test_trivial.py").write_text(TRIVIAL.format(count=count))
    off = [] if plugin else ["-p", "no:cupycomm"]
    job = run_mpiexec(n, "-m", "pytest", "-q", "-p", "no:cacheprovider", *off,
                      "test_trivial.py", timeout=600, cwd=str(scratch))
    spans = [float(path.read_text()) for path in scratch.glob("span.*")]
    if job.returncode != 0 or len(spans) != n:
        raise SystemExit(f"plugin_cost: the job of {n} ranks failed:\n{job.output}")
    return max(spans) / (count - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--tests", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.tests < 2 or args.rounds < 1:
        parser.error(f"--tests must be >= 2 and --rounds >= 1, got {args.tests} and "
                     f"{args.rounds}")
    print(f"ms per trivial test ({args.tests} tests), median of {args.rounds} round(s)")
    print(f"{'ranks':>5}  {'plugin on':>9}  {'plugin off':>10}")
    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        for n in args.ranks:
            costs: dict = {True: [], False: []}
            for _ in range(args.rounds):
                for plugin in (True, False):
                    costs[plugin].append(per_test(n, args.tests, plugin, scratch))
            print(f"{n:>5}  {statistics.median(costs[True]):>9.1f}  "
                  f"{statistics.median(costs[False]):>10.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
