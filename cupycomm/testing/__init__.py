"""Testing support for code run under ``mpiexec``.

- ``cupycomm.testing.plugin``: the pytest plugin (loaded by its ``pytest11`` entry point) that
  makes ``mpiexec -n N python -m pytest`` one session with one report.
- :func:`run_mpiexec`: start an ``mpiexec -n N python ...`` job from a test, with a hard time
  bound.
- :func:`release`: the end of a per-test communicator fixture (kept if the test failed).
"""
from .launch import Launched, launch_environment, run_mpiexec
from .plugin import release

__all__ = ["Launched", "launch_environment", "run_mpiexec", "release"]
