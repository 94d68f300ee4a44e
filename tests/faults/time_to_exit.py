"""How long each fault scenario takes to end the job: the worst of several runs.

    python tests/faults/time_to_exit.py --runs 5 [--n 3]
    python tests/faults/time_to_exit.py --runs 5 --nodes

Prints one line per scenario with the exit statuses seen and the worst and median time:
the user-program faults of scenario.py, then the plugin's cases (pytest under mpiexec on the
scratch suites of tests/plugin_cases). Every job runs as the README recommends (MPICH's
``-disable-auto-cleanup``), then os-exit-0 and sigkill once more with MPICH's own cleanup.
The fault suite (tests/faults/test_abort.py, test_timeouts.py, test_mismatches.py,
test_heartbeat.py, tests/testing/test_plugin.py) asserts the bounds; this records the figures. With ``--nodes``: the faults of a rank or a whole node on another
(simulated) node while the others wait in all_reduce, under hydra's default cleanup and
with ``-disable-auto-cleanup``, with the default collective timeout (600 s: only the
heartbeats, at their default bound, can end these jobs in time), and through
``python -m cupycomm.run`` (which adds ``-disable-auto-cleanup`` itself).
"""
import argparse
import statistics
from pathlib import Path

from cupycomm.testing import no_auto_cleanup, run_job, run_mpiexec, simulated_nodes

SCENARIOS = ["raise-before-collective", "raise-with-receive-pending", "sys-exit-0", "os-exit-0",
             "sigkill", "never-arrives", "hold-gil", "hold-gil-idle", "debug-mismatch-count",
             "debug-mismatch-dtype", "debug-mismatch-op", "debug-mismatch-root", "mismatch-count",
             "mismatch-dtype", "mismatch-op", "mismatch-root"]
SCRIPT = str(Path(__file__).resolve().parent / "scenario.py")
CASES = Path(__file__).resolve().parent.parent / "plugin_cases"
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-q"]
NODE_SCENARIOS = {   # name: ranks per node; the last node's ranks fail
    "os-exit-0": (3, 1), "sys-exit-0": (3, 1), "exit-3": (3, 1), "sigkill": (3, 1),
    "raise-before-collective": (3, 1), "os-exit-0-beside-a-busy-leader": (2, 2),
    "node-sigkill": (2, 2), "node-sigstop": (2, 2), "long-compute": (3, 1),
    "long-sleep": (3, 1)}
PLUGIN_CASES = {   # name: the pytest arguments, run in CASES
    "plugin: a test fails on one rank": ["case_outcomes.py", "-k", "fails_on_the_last_rank"],
    "plugin: ranks disagree on a skip": ["case_outcomes.py", "-k", "skip"],
    "plugin: a test hangs (3 s timeout)": ["case_hang.py", "-o", "mpi_timeout=3"],
    "plugin: a failure leaves others waiting": ["case_stuck.py", "-k", "fails_while"],
    "plugin: a rank exits inside a test": ["case_stuck.py", "-k", "exits_while"],
    "plugin: a fixture skips on one rank": ["case_fixture_skip.py"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--n", type=int, default=3,
                        help="ranks (the hold-gil scenarios always run on 2)")
    parser.add_argument("--nodes", action="store_true",
                        help="the faults on another simulated node instead")
    parser.add_argument("--only", default="",
                        help="with --nodes: these scenarios only (comma-separated)")
    args = parser.parse_args()
    options = no_auto_cleanup()
    if args.nodes:
        only = [name for name in args.only.split(",") if name]
        unknown = sorted(set(only) - set(NODE_SCENARIOS))
        if unknown:
            parser.error(f"--only: no such scenario {unknown}; choose from {list(NODE_SCENARIOS)}")
        return across_nodes(args.runs, options, only or list(NODE_SCENARIOS))
    print(f"{'scenario':40s} {'exit statuses':14s} {'worst s':>8s} {'median s':>9s}")
    for name in SCENARIOS:
        n = 2 if name.startswith("hold-gil") else args.n
        report(name, [run_mpiexec(n, SCRIPT, name, timeout=60, mpiexec_args=options)
                      for _ in range(args.runs)])
    for name in ("os-exit-0", "sigkill"):
        report(f"{name}, the launcher's own cleanup",
               [run_mpiexec(args.n, SCRIPT, name, timeout=60) for _ in range(args.runs)])
    for name, pytest_args in PLUGIN_CASES.items():
        report(name, [run_mpiexec(args.n, *PYTEST, *pytest_args, timeout=90, cwd=str(CASES),
                                  mpiexec_args=options) for _ in range(args.runs)])


def across_nodes(runs: int, options: list, names: list) -> None:
    print(f"{'scenario (ranks per node), launcher cleanup':62s} {'exit statuses':14s} "
          f"{'worst s':>8s} {'median s':>9s}")
    for name in names:
        ranks_per_node = NODE_SCENARIOS[name]
        n, nodes = sum(ranks_per_node), simulated_nodes(*ranks_per_node)
        env = {"CUPYCOMM_TIMEOUT": "600"}
        failed = ("node1", tuple(f"rank {r} " for r in range(ranks_per_node[0], n)))
        for cleanup, extra in (("hydra's", []), ("-disable-auto-cleanup", options)):
            report(f"{name} {ranks_per_node}, {cleanup}",
                   [run_mpiexec(n, SCRIPT, name, timeout=60, mpiexec_args=extra + nodes,
                                env=env) for _ in range(runs)], width=62, names=failed)
        report(f"{name} {ranks_per_node}, cupycomm.run",
               [run_job(n, SCRIPT, name, timeout=60, options=nodes, env=env)
                for _ in range(runs)], width=62, names=failed)


def report(name: str, jobs: list, width: int = 40, names: tuple = ()) -> None:
    """One line: the statuses, worst and median times, hangs, and, given ``names`` (the failed
    node's name, in cupycomm's message or hydra's; the failed ranks, 'rank 3 '), how many runs
    printed either, and how many the node's and a rank's."""
    codes = sorted({job.returncode for job in jobs})
    times = [job.elapsed for job in jobs]
    hung = " (HUNG)" if any(job.timed_out for job in jobs) else ""
    named = ""
    if names:
        node, ranks = names
        by_node = [node in job.output for job in jobs]
        by_rank = [any(rank in job.output for rank in ranks) for job in jobs]
        named = (f" named {sum(map(max, by_node, by_rank))}/{len(jobs)} (node {sum(by_node)}, "
                 f"rank {sum(by_rank)})")
    print(f"{name:{width}s} {str(codes):14s} {max(times):8.2f} "
          f"{statistics.median(times):9.2f}{named}{hung}", flush=True)


if __name__ == "__main__":
    main()
