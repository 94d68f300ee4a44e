"""Testing support for code run under ``mpiexec``.

- ``cupycomm.testing.plugin``: the pytest plugin (loaded by its ``pytest11`` entry point) that
  makes ``mpiexec -n N python -m pytest`` one session with one report.
- :func:`run_mpiexec`: start an ``mpiexec -n N python ...`` job from a test, with a hard time
  bound; :func:`no_auto_cleanup`: the launcher's options that leave ending a failed job to
  cupycomm; :func:`simulated_nodes`: those that spread a job over simulated nodes;
  :func:`run_job`: a job through ``python -m cupycomm.run``, whose status is non-zero if any
  rank did not finish.
- :func:`release`: the end of a per-test communicator fixture (kept if the test failed).

Only the plugin and :func:`release` need pytest, which cupycomm does not depend on: the rest
(the launch helpers, ``cupycomm.testing.standin``) imports without it, and ``release`` is
imported from the plugin when first asked for.
"""
from typing import TYPE_CHECKING, Any

from .launch import (SIMULATES_NODES, Launched, launch_environment, no_auto_cleanup,
                     run_job, run_mpiexec, simulated_nodes)

if TYPE_CHECKING:
    from .plugin import release

__all__ = ["Launched", "launch_environment", "no_auto_cleanup", "run_mpiexec", "run_job",
           "release", "simulated_nodes", "SIMULATES_NODES"]


def __getattr__(name: str) -> Any:
    """``release``, from the plugin (which imports pytest) when first asked for."""
    if name == "release":
        from .plugin import release
        return release
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
