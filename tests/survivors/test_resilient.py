"""cupycomm.resilient losing ranks for real: jobs under Open MPI 5's ULFM (``python -m
cupycomm.run --survivors``: ``mpiexec --with-ft ulfm --mca btl tcp,self ...``), each bounded,
in which ranks kill themselves (SIGKILL) at given steps. The survivors must finish with the
result of the ranks that were left at each step, or all stop alike with TooFewSurvivors, and
the job exit 0 naming the lost ranks; the training example must end with the final loss of
an uninterrupted 3-rank run from the state of the step of the kill.

These start jobs of their own, so they run in the single-process pass (under mpiexec they
skip on every rank); elsewhere than Open MPI 5 they skip, saying so (the refusals there are
tests/survivors/test_committed.py's).
"""
import re
from pathlib import Path

import pytest

from cupycomm.run import launchers
from cupycomm.testing import run_job

pytestmark = pytest.mark.mpi(max_size=1)

HERE = Path(__file__).resolve().parent
LOOP = str(HERE / "loop.py")
EXAMPLE = str(HERE.parent.parent / "examples" / "survivors" / "train_through_a_loss.py")
TIMEOUT = 90
LAUNCHER = launchers.find()
ULFM = LAUNCHER.kind == "openmpi" and re.search(r"\b([5-9]|\d\d+)\.\d+", LAUNCHER.version)
needs_ulfm = pytest.mark.skipif(not ULFM, reason=f"needs Open MPI 5's mpiexec (ULFM); this "
                                                 f"environment's is {LAUNCHER.kind}'s "
                                                 f"({LAUNCHER.executable})")


def ulfm_job(n, *args):
    job = run_job(n, *args, timeout=TIMEOUT, options=["--survivors"])
    assert not job.timed_out, f"the job hung:\n{job.output}"
    assert job.returncode == 0, job.output
    return job


def went_on_without(job, lost):
    """cupycomm.run's verdict: the ranks ``lost`` named, the others went on and finished."""
    assert re.search(r"cupycomm\.run: .*lost: ranks [\d, ]+ went on without", job.stderr), \
        job.output
    for rank in lost:
        assert f"rank {rank} (host" in job.stderr, job.output


@needs_ulfm
def test_with_grow_a_new_process_takes_the_lost_rank_s_place_and_the_loop_goes_on():
    """World rank 1 killed at step 3 of 8: the survivors shrink, restore, grow back to 4 (a
    new process, loop.py again, takes world rank 1) and sync; the newcomer enters the loop
    at step 3 with the survivors' state, and every step counted on 4 ranks."""
    job = ulfm_job(4, LOOP, "--steps", "8", "--kill", "1@3", "--grow")
    found = re.search(r"finished on (\d) ranks \((.*)\): total (\d+), expected (\d+); "
                      r"shrinks \[\(\(1,\), 3, 3\)\]", job.stdout)
    assert found, job.output
    assert found[1] == "4" and found[2] == "0, 1, 2, 3", job.output
    assert found[3] == found[4] == "32", job.output
    assert "world rank 1 joined late and finished: total 32, expected 32" in job.stdout, \
        job.output


@needs_ulfm
@pytest.mark.parametrize("kills, size_left, options", [
    (["3@2"], 3, []), (["0@0"], 3, []), (["3@2", "1@5"], 2, []), (["1@3", "2@3"], 2, []),
    (["3@2", "1@5"], 2, ["--device"]), (["2@5"], 3, ["--commit-every", "3"])],
    ids=["one", "rank-0-first", "two-one-after-the-other", "two-at-once", "device",
         "commit-every-3"])
def test_the_survivors_finish_with_the_ranks_left_at_each_step(kills, size_left, options):
    """With ``--device``, the state also holds an array on the NCCL stand-in, synced over the
    NCCL communicator that each shrink makes anew (loop.py asserts its total on every rank);
    with ``--commit-every 3``, a loss at step 5 redoes steps 3 and 4 on the survivors."""
    job = ulfm_job(4, LOOP, "--steps", "8", *[a for k in kills for a in ("--kill", k)],
                   *options)
    found = re.search(r"finished on (\d) ranks .*: total (\d+), expected (\d+)", job.stdout)
    assert found, job.output
    assert int(found[1]) == size_left, job.output
    assert found[2] == found[3], job.output
    went_on_without(job, [int(k.split("@")[0]) for k in kills])


@needs_ulfm
def test_a_step_whose_device_collective_was_still_running_at_the_vote_counts_rightly():
    """Each step's device all_reduce returns at launch and runs later (a busy GPU); world
    rank 1 is killed right after the vote on step 3. The vote must wait for the step's
    device collectives (every rank's, rank 1's too, completed before it died), so step 3
    counts with its full result; the loss is seen in step 4 and the device value ends as the
    product of the sizes each counted step had, not a cut-short step's garbage."""
    job = ulfm_job(4, LOOP, "--steps", "6", "--device", "--busy", "--kill-after-vote", "1@3")
    found = re.search(r"finished on (\d) ranks .*: total (\d+), expected (\d+)", job.stdout)
    assert found and found[1] == "3" and found[2] == found[3], job.output
    went_on_without(job, [1])


@needs_ulfm
@pytest.mark.parametrize("options, survivors, why", [
    (["--kill", "2@2", "--min-size", "3"], [0, 1], "1 of 3 ranks lost .*fewer than min_size=3"),
    (["--kill", "3@2", "--kill", "1@5", "--max-failures", "1"], [0, 2],
     r"2 of 4 ranks lost \(world ranks 1, 3\).*more than max_failures=1"),
], ids=["below-min-size", "past-max-failures"])
def test_every_survivor_stops_alike_with_too_few(options, survivors, why):
    n = 3 if "--min-size" in options else 4
    job = ulfm_job(n, LOOP, "--steps", "8", *options)
    for rank in survivors:
        assert re.search(f"world rank {rank} stopped: .*resilient: {why}", job.stdout), \
            job.output
    assert "finished on" not in job.stdout, job.output
    went_on_without(job, [int(k.split("@")[0]) for k in options[1::2] if "@" in k])


FINAL = re.compile(r"final loss ([\d.]+); parameters equal one-process training")


@pytest.fixture(scope="module")
def uninterrupted():
    """The example on 3 ranks from the 4-rank state after 5 steps, no rank lost."""
    job = ulfm_job(3, EXAMPLE, "--resume-at", "5")
    assert FINAL.search(job.stdout), job.output
    return job


@needs_ulfm
@pytest.mark.parametrize("kill_rank", [1, 0])
def test_the_example_ends_with_the_loss_of_an_uninterrupted_3_rank_run(kill_rank,
                                                                       uninterrupted):
    killed = ulfm_job(4, EXAMPLE, "--kill-rank", str(kill_rank), "--kill-at", "5")
    went_on_without(killed, [kill_rank])
    assert f"world rank(s) {kill_rank} lost; 3 ranks go on from step 5" in killed.stdout, \
        killed.output
    assert re.search(r"time from the kill to the next completed step: [\d.]+ ms",
                     killed.stdout), killed.output
    loss = FINAL.search(killed.stdout)
    assert loss, killed.output
    assert abs(float(loss[1]) - float(FINAL.search(uninterrupted.stdout)[1])) < 1e-9, \
        killed.stdout + uninterrupted.stdout
