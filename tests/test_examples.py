"""The examples run as users run them (python -m cupycomm.run -n 4 on this machine: every
rank must finish) and check themselves.

They start mpiexec jobs of their own, so they run in the single-process pass of the suite.
"""
from pathlib import Path

import pytest

from cupycomm.testing import run_job

pytestmark = pytest.mark.mpi(max_size=1)

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_on_4_ranks(script):
    job = run_job(4, str(script), timeout=120)
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output
    assert job.stdout.strip(), "an example prints what it checked"


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("batches", ["1", "4"], ids=["full-batch", "4-batches"])
def test_data_parallel_training_equals_one_process(n, batches):
    """The example asserts, on rank 0, that its parameters equal single-process training."""
    script = str(EXAMPLES[0].parent / "train_data_parallel.py")
    job = run_job(n, script, "--epochs", "3", "--batches", batches, timeout=120)
    assert job.returncode == 0, job.output
    ranks = "1 rank" if n == 1 else f"{n} ranks"
    assert f"trained on {ranks} for 3 epochs" in job.stdout
    assert "parameters equal single-process training" in job.stdout
    # Not a terminal: a line per epoch, then the result, in order on one stream (no \r bar)
    lines = job.stdout.splitlines()
    assert [line.split(" loss")[0] for line in lines[:3]] == [
        f"epoch {e}/3" for e in (1, 2, 3)], job.stdout
    assert lines[3].startswith("trained on") and "\r" not in job.output, job.output
