"""Survivors go on (cupycomm.survivors): each scenario of tests/survivors/scenario.py under
Open MPI's ULFM (``mpiexec --with-ft ulfm --mca btl tcp,self``), bounded; every survivor's
record is held against a NumPy reference made from every rank's known input. Elsewhere
(MPICH, Intel MPI, Open MPI without ``--with-ft ulfm``) ``init(on_peer_loss="raise")`` must
refuse, on every rank, naming what is needed.

These tests start jobs of their own: they run in the single-process pass (mpiexec does not
nest inside an mpiexec run) and skip under mpiexec on every rank.
"""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import cupycomm
from cupycomm.run import launchers
from cupycomm.survivors import grow, policy
from cupycomm.run import job as run
from cupycomm.testing import run_job, run_mpiexec

pytestmark = pytest.mark.mpi(max_size=1)

SCENARIO = str(Path(__file__).resolve().parent / "scenario.py")
RAW_LOOP = str(Path(__file__).resolve().parent / "raw_loop.py")
LIBRARY = launchers.library_kind(MPI.Get_library_version())
ULFM = LIBRARY == "openmpi" and hasattr(MPI.Comm, "Revoke")
needs_ulfm = pytest.mark.skipif(not ULFM, reason="survivors need Open MPI 5's ULFM: the "
                                                 ".ci/run openmpi pass runs these")
BOUND = 45.0   # seconds: a job of 4 ranks that loses one and ends (seconds on a quiet machine)


def run_case(case, tmp_path, n=4):
    job = run_mpiexec(n, SCENARIO, case, str(tmp_path), timeout=BOUND,
                      mpiexec_args=list(policy.FLAGS))
    assert not job.timed_out, f"the job hung:\n{job.output}\n" + "".join(
        f"{path.name}:\n{path.read_text()}" for path in sorted(tmp_path.glob("progress-*")))
    return job


def records(tmp_path, survivors, job):
    found = {}
    for rank in survivors:
        path = tmp_path / f"rank-{rank}.json"
        assert path.exists(), f"survivor {rank} wrote nothing:\n{job.output}"
        found[rank] = json.loads(path.read_text())
    return found


def check_round(seen, victim, members, job, call="all_reduce"):
    """Every survivor's view of one round, against what the victim and the survivors
    (``members``: world ranks) imply; ``call``: the collective the loss broke."""
    expected = np.sum([np.full(4, r + 1.0) for r in members], axis=0)
    seqs = {s["seq"] for s in seen.values()}
    assert len(seqs) == 1 and seqs.pop() >= 1, job.output
    for rank, s in seen.items():
        assert s["raised"] == "PeerLost", (rank, s, job.output)
        assert s["ranks"] == [victim] and s["call"] == call, (rank, s)
        assert s["failed_ranks"] == [victim], (rank, s)
        assert s["agree_true"] is True and s["agree_mixed"] is False, (rank, s)
        assert s["size"] == len(members) and s["world_ranks"] == members, (rank, s)
        assert s["rank"] == members.index(rank), (rank, s)
        np.testing.assert_array_equal(s["result"], expected)
        for refused, refusal in s["refused"].items():
            assert refusal is not None and refusal.startswith("CommShrunkError: ") \
                and "shrunk after a peer was lost" in refusal, (rank, refused, refusal)
        assert s["fault_to_good"] < BOUND, (rank, s)


@needs_ulfm
@pytest.mark.parametrize("case", ["sigkill", "exit0", "exit3", "abort", "during"])
def test_every_survivor_raises_peer_lost_shrinks_and_goes_on(case, tmp_path):
    """World rank 1 of 4 ends (a signal, exit 0, exit 3, MPI_Abort on itself, a kill while it
    waits inside the collective): ranks 0, 2, 3 each raise PeerLost naming rank 1, agree,
    shrink to 3 and reduce correctly; the old communicator, its subgroup and bucket refuse."""
    job = run_case(case, tmp_path)
    found = records(tmp_path, (0, 2, 3), job)
    check_round({rank: rounds[0] for rank, rounds in found.items()}, 1, [0, 2, 3], job)


@needs_ulfm
def test_a_loss_in_an_object_collective_is_peer_lost_too(tmp_path):
    job = run_case("objects", tmp_path)
    found = records(tmp_path, (0, 2, 3), job)
    check_round({rank: rounds[0] for rank, rounds in found.items()}, 1, [0, 2, 3], job,
                call="all_gather_object")


@needs_ulfm
def test_two_ranks_lost_one_after_the_other(tmp_path):
    job = run_case("two", tmp_path)
    found = records(tmp_path, (0, 2), job)
    assert not (tmp_path / "rank-3.json").exists() and not (tmp_path / "rank-1.json").exists()
    check_round({0: found[0][0], 2: found[2][0]}, 3, [0, 1, 2], job)
    check_round({0: found[0][1], 2: found[2][1]}, 1, [0, 2], job)


@needs_ulfm
@pytest.mark.parametrize("options", [["--uneven"], ["--uneven", "--agree"]],
                         ids=["raw", "agreed"])
def test_a_loss_that_breaks_a_step_unevenly_is_refused_or_agreed_never_wrong(options):
    """tests/survivors/raw_loop.py: 4 ranks, each step an all_reduce checked against the sums
    of the ranks it ran on, a PeerLost redone on comm.shrink()'s communicator; world rank 2
    lost in step 2. ``--uneven`` makes the loss break step 1 on world rank 3 alone (it waits
    for the victim's message in vain), so that ranks 0 and 1 raise in step 2: redoing "the
    step that raised" would match rank 3's step 1 with their step 2 (wrong sums, then a
    hang), so shrink() refuses on every survivor alike, naming comm.agree and resilient;
    with ``--agree`` (the ranks agree whether each step counts) every survivor redoes step 1
    and all is right. (Without ``--uneven`` a loss breaks a step unevenly by a race, under
    load: 1 to 2 runs in 20; benchmarks/survivors_raw_loop.py counts them.)"""
    job = run_mpiexec(4, RAW_LOOP, "--timeout", "20", *options, timeout=BOUND,
                      mpiexec_args=list(policy.FLAGS))
    assert not job.timed_out, f"the job hung:\n{job.output}"
    assert "WRONG" not in job.output, job.output
    if "--agree" in options:
        assert job.returncode == 0, job.output
        for rank in (0, 1, 3):
            assert f"world rank {rank}: 6 steps right, sizes [4, 3, 3, 3, 3, 3]" \
                in job.stdout, job.output
    else:
        assert job.returncode == 3 and "steps right" not in job.stdout, job.output
        for rank in (0, 1, 3):
            assert f"world rank {rank} refused: shrink: the survivors stand at different " \
                f"calls of communicator world" in job.stdout, job.output
        assert job.stdout.count("(comm.agree(done), then shrink() and redo the same step), "
                                "or use cupycomm.resilient()") == 3, job.output


@needs_ulfm
def test_the_device_side_aborts_the_nccl_communicator_and_makes_one_of_the_survivors(tmp_path):
    """On the NCCL stand-in: the old NCCL communicator is aborted on every survivor, never
    destroyed (stand-in rule 21), and the shrunk communicator's is made from a new unique id,
    the same on each survivor, of ranks 0, 2, 3 only; its all_reduce is right."""
    job = run_case("device", tmp_path)
    found = records(tmp_path, (0, 2, 3), job)
    check_round({rank: rounds[0] for rank, rounds in found.items()}, 1, [0, 2, 3], job)
    devices = {rank: rounds[0]["device"] for rank, rounds in found.items()}
    for rank, d in devices.items():
        assert d["old_freed_by"] == "ncclCommAbort" and d["new_freed_by"] == "", (rank, d)
        assert d["new_size"] == 3 and d["new_members"] == [0, 2, 3], (rank, d)
        assert d["new_rank"] == [0, 2, 3].index(rank), (rank, d)
        assert d["new_id"] != d["old_id"], (rank, d)
    assert len({d["new_id"] for d in devices.values()}) == 1, devices


@needs_ulfm
def test_a_loss_that_only_device_collectives_see_is_ended_by_the_watchdog(tmp_path):
    """The survivors' device all_reduce waits for world rank 1, killed (no MPI error: stand-in
    rule 22); each survivor's watchdog sees the dead peer and aborts the NCCL communicator
    (never destroyed), which ends the wait; the next device call raises PeerLost naming
    rank 1, the same call and number on each; then agree, shrink, a new NCCL communicator."""
    job = device_round("device-blocked", tmp_path)
    assert job.output.count("the NCCL communicator was aborted: later device calls raise "
                            "PeerLost") == 3, job.output


@needs_ulfm
def test_a_launch_after_nccls_asynchronous_error_raises_peer_lost_on_every_survivor(tmp_path):
    """The survivors launch device all_reduces back to back after world rank 1 was killed:
    the first one's kernel meets the loss (NCCL's asynchronous error, no MPI error), the
    second launch returns that error (stand-in rule 22, NCCL's ncclCommEnsureReady); each
    survivor raises PeerLost naming rank 1, the same call and number on each, never a bare
    NcclError that ``except PeerLost`` misses; then agree, shrink, a new NCCL communicator."""
    device_round("device-launch", tmp_path)


def device_round(case, tmp_path):
    """Run ``case``, where only device calls see world rank 1's loss: every survivor's round
    is right, its old NCCL communicator aborted and its new one of ranks 0, 2, 3."""
    job = run_case(case, tmp_path)
    found = records(tmp_path, (0, 2, 3), job)
    check_round({rank: rounds[0] for rank, rounds in found.items()}, 1, [0, 2, 3], job)
    for rank, rounds in found.items():
        d = rounds[0]["device"]
        assert d["old_freed_by"] == "ncclCommAbort" and d["new_members"] == [0, 2, 3], d
    return job


@needs_ulfm
def test_a_device_collective_that_a_dead_peer_blocks_goes_the_gpus_way(tmp_path):
    """benchmarks/gpu_survivors.py on the NCCL stand-in, which models what an H200 showed
    (stand-in rule 22): in round 2, world rank 0's device all_reduce waits for world rank 1,
    killed, without an MPI error; the watchdog sees the dead peer and aborts the NCCL
    communicator, which ends the wait; PeerLost names rank 1; the shrink to one rank and
    its device all_reduce go on. Round 1 (a loss that a host call sees) comes first."""
    script = str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_survivors.py")
    job = run_mpiexec(3, script, str(tmp_path), "--device-module", "cupycomm.testing.standin",
                      timeout=BOUND, mpiexec_args=list(policy.FLAGS))
    assert not job.timed_out and job.returncode == 0, job.output
    for rank in (0, 1):
        assert f"world rank {rank}: round 1: PeerLost(ranks=(2,), call='all_reduce'" \
            in job.output, job.output
    # the watchdog names the death from the board, or from NCCL's asynchronous error where
    # that comes first (the board then names the rank it reports)
    assert re.search(r"rank 1 of communicator \S+ \(pid \d+\) has died \(its process ended: "
                     r"os\._exit, a signal or a crash\)(; NCCL reported an asynchronous error"
                     r".*| while device collectives up to #2 wait) on rank 0 of 3", job.output), \
        job.output
    assert "the NCCL communicator was aborted: later device calls raise PeerLost" \
        in job.output, job.output
    assert "world rank 0: round 2: PeerLost(ranks=(1,), call='all_reduce', seq=3); shrunk " \
        "to 1 rank(s) (0,); device all_reduce ok" in job.output, job.output


@needs_ulfm
def test_grow_gives_the_newcomer_the_gpu_no_survivor_uses(tmp_path):
    """Finding 11 of issue 32: on a node of 4 GPUs, world ranks 0-3 on GPUs 3, 2, 1, 0 (the
    program's own choice); world rank 1 (GPU 2) killed, shrink, grow(1): the newcomer takes
    GPU 2, the lost rank's, not GPU 1 by its local rank (rank 2's: NCCL refuses a duplicate
    GPU, and on a real node it is a GPU in use); the device all_reduce of all 4 is right."""
    job = run_case("grow-gpus", tmp_path)
    grown = {}
    for rank in range(4):
        path = tmp_path / f"grown-{rank}.json"
        assert path.exists(), f"world rank {rank} wrote nothing after grow:\n{job.output}"
        grown[rank] = json.loads(path.read_text())
    assert [grown[rank]["device"]["gpu"] for rank in range(4)] == [3, 2, 1, 0], grown
    assert grown[1]["joined_late"] is True, grown
    device = np.sum([np.full(3, r + 1.0) for r in range(4)], axis=0)
    for rank, g in grown.items():
        np.testing.assert_array_equal(g["device"]["result"], device)


@needs_ulfm
def test_grow_puts_a_new_process_in_the_lost_rank_s_place(tmp_path):
    """World rank 1 of 4 killed, shrink to (0, 2, 3), then grow(1): a new process (the same
    program, whose init() joins) takes world rank 1; on every rank of the grown
    communicator, the newcomer too, world_ranks (0, 1, 2, 3) and the all_reduce of host and
    stand-in device arrays are right, the NCCL communicator one of all 4 from a new unique
    id; bad arguments, and a new process that refused to join (init(on_peer_loss="abort")),
    were refused first on every survivor, and the shrunk communicator refuses every call
    after the grow."""
    job = run_case("grow-device", tmp_path)
    found = records(tmp_path, (0, 2, 3), job)
    check_round({rank: rounds[0] for rank, rounds in found.items()}, 1, [0, 2, 3], job)
    grown = {}
    for rank in range(4):
        path = tmp_path / f"grown-{rank}.json"
        assert path.exists(), f"world rank {rank} wrote nothing after grow:\n{job.output}"
        grown[rank] = json.loads(path.read_text())
    host = np.sum([np.full(4, r + 1.0) for r in range(4)], axis=0)
    device = np.sum([np.full(3, r + 1.0) for r in range(4)], axis=0)
    for rank, g in grown.items():
        assert g["world_ranks"] == [0, 1, 2, 3] and g["rank"] == rank and g["size"] == 4, g
        assert g["joined_late"] is (rank == 1), (rank, g)
        assert g["failed_ranks"] == [] and g["agree"] is True, (rank, g)
        np.testing.assert_array_equal(g["result"], host)
        np.testing.assert_array_equal(g["device"]["result"], device)
        assert g["device"]["size"] == 4 and g["device"]["rank"] == rank, (rank, g)
        assert g["fault_to_good"] < BOUND, (rank, g)
    assert len({g["device"]["id"] for g in grown.values()}) == 1, grown
    assert grown[0]["device"]["id"] != found[0][0]["device"]["new_id"], (grown, found)
    assert len({g["name"] for g in grown.values()}) == 1, grown
    for rank in (0, 2, 3):
        me = [0, 2, 3].index(rank)
        assert grown[rank]["refused"] == {
            "n=0": f"ValueError: grow: n must be >= 1, got 0 on rank {me}",
            "n=-1": f"ValueError: grow: n must be >= 1, got -1 on rank {me}",
            "n=1.0": f"TypeError: grow: n must be an int (how many processes to start), got "
                     f"1.0 on rank {me}",
            "n=True": f"TypeError: grow: n must be an int (how many processes to start), got "
                      f"True on rank {me}",
            "command=str": f"TypeError: grow: command must be a non-empty list of str (the "
                           f"program and its arguments), got {sys.executable!r} on rank {me}",
            "newcomer": f"RuntimeError: grow: the new process(es) running "
                        f"\"{sys.executable} -c import cupycomm; cupycomm.init(on_peer_loss="
                        f"'abort')\" did not join: this process was started by comm.grow() to "
                        f"join ranks that go on after a lost peer; on_peer_loss='abort' cannot "
                        f"be its mode (leave it out, or pass 'raise') (rank {me})"}
        for call, refusal in grown[rank]["after"].items():
            assert refusal == (f"CommShrunkError: {call}: the communicator was grown by new "
                               f"processes (rank {me}); use the communicator grow() "
                               f"returned"), (rank, call, refusal)


def test_grow_is_refused_where_a_loss_ends_the_job():
    """The default mode (on_peer_loss="abort"), on any MPI: refused before any
    communication, naming what is needed; the communicator stays usable."""
    with cupycomm.init(MPI.COMM_WORLD) as comm:
        with pytest.raises(RuntimeError, match=r"^grow: this communicator ends the job when a "
                                               r"peer is lost; grow\(\) needs cupycomm.init\("
                                               r"on_peer_loss='raise'\) \(rank 0\)$"):
            comm.grow(1)
        np.testing.assert_array_equal(comm.all_reduce(np.ones(2)), np.ones(2))


@pytest.mark.parametrize("n, command, error, says", [
    (0, None, ValueError, "grow: n must be >= 1, got 0 on rank 2"),
    (1.0, None, TypeError, "grow: n must be an int (how many processes to start), got 1.0 "
                           "on rank 2"),
    (True, None, TypeError, "grow: n must be an int (how many processes to start), got True "
                            "on rank 2"),
    ("1", None, TypeError, "grow: n must be an int (how many processes to start), got '1' "
                           "on rank 2"),
    (1, "python", TypeError, "grow: command must be a non-empty list of str (the program and "
                             "its arguments), got 'python' on rank 2"),
    (1, [], TypeError, "grow: command must be a non-empty list of str (the program and its "
                       "arguments), got [] on rank 2"),
    (1, ["python", 3], TypeError, "grow: command must be a non-empty list of str (the "
                                  "program and its arguments), got ['python', 3] on rank 2"),
], ids=["n=0", "n=1.0", "n=True", "n=str", "command=str", "command=[]", "command-not-str"])
def test_a_bad_grow_is_named(n, command, error, says):
    with pytest.raises(error, match="^" + re.escape(says) + "$"):
        grow._command(2, n, command)


def test_grow_starts_this_program_again_unless_told(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--epochs", "3"])
    assert grow._command(0, 1, None) == [sys.executable, "train.py", "--epochs", "3"]
    assert grow._command(0, 1, ("worker", "-x")) == ["worker", "-x"]
    monkeypatch.setattr(sys, "argv", ["-c"])
    with pytest.raises(ValueError, match=r"grow: this program was not started from a file "
                                         r"\(sys.argv \['-c'\]\): pass command=\[...\]"):
        grow._command(0, 1, None)


@needs_ulfm
@pytest.mark.parametrize("case, recovered", [("exit3", True), ("no-shrink", False)])
def test_cupycomm_run_says_whether_the_program_recovered(case, recovered, tmp_path):
    """``python -m cupycomm.run --survivors``: the lost rank is named; the status is 0 only
    where every survivor went on without it (shrink()), whatever mpiexec said (3 here, for
    the victim's exit 3; 0 after a SIGKILL)."""
    job = run_job(4, SCENARIO, case, str(tmp_path), timeout=BOUND, options=["--survivors"])
    assert not job.timed_out, job.output
    if recovered:
        assert job.returncode == 0, job.output
        assert "rank 1 (host" in job.output and ") lost: ranks 0, 2, 3 went on without it " \
            "(comm.shrink()) and finished; mpiexec exited 3" in job.output, job.output
    else:
        assert job.returncode != 0, job.output
        assert "rank 1 (host" in job.output and "ended without finishing" in job.output, \
            job.output


def record(rank, state, survived=()):
    return {"rank": rank, "state": state, "node": "a", "pid": 100 + rank, "detail": "",
            "survived": list(survived)}


@pytest.mark.parametrize("records, status, says", [
    ([record(0, "ended", [1]), record(1, "running"), record(2, "ended", [1])], 0,
     "rank 1 (host a, pid 101) lost: ranks 0, 2 went on without it (comm.shrink()) and "
     "finished; mpiexec exited 3"),
    ([record(0, "ended", [1]), record(1, "running"), record(2, "ended")], 3,
     "rank 1 (host a, pid 101) ended without finishing"),
    ([record(0, "ended", [1, 2]), record(1, "running"), record(2, "running")], 0,
     "went on without them"),
    ([record(0, "ended", [1]), record(1, "running"), None], 3, "rank 2 never called"),
    ([record(0, "raised", [1]), record(1, "running"), record(2, "ended", [1])], 3,
     "rank 0 (host a, pid 100) raised"),
], ids=["recovered", "one-survivor-did-not-go-on", "two-lost", "one-never-started", "raised"])
def test_the_verdict_is_zero_only_where_every_survivor_went_on(records, status, says):
    got, line = run.verdict(records, 3)
    assert got == status and says in line, (got, line)


@pytest.mark.skipif(ULFM and policy.unsupported(MPI.Get_library_version()) == "",
                    reason="this process runs under ULFM, where the raise mode is allowed")
def test_the_raise_mode_is_refused_where_the_mpi_cannot_survive_a_loss(tmp_path):
    """MPICH, Intel MPI, Open MPI without --with-ft ulfm: init refuses on every rank, naming
    the MPI and what is needed, and no rank is left waiting."""
    program = tmp_path / "refused.py"
    program.write_text(
        "import sys, cupycomm\n"   # one write a line: the two ranks' lines never interleave
        "try:\n"
        "    cupycomm.init(on_peer_loss='raise')\n"
        "except RuntimeError as error:\n"
        "    sys.stdout.write(f'refused: {error}\\n')\n"
        "comm = cupycomm.init()\n"
        "sys.stdout.write(f'rank {comm.rank} abort mode {comm.agree(True)} "
        "{comm.failed_ranks()}\\n')\n")
    job = run_mpiexec(2, str(program), timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.output
    assert job.output.count("refused: init: on_peer_loss='raise' needs MPI's fault "
                            "tolerance (ULFM)") == 2, job.output
    assert "--with-ft ulfm --mca btl tcp,self" in job.output
    named = {"mpich": "MPICH has none", "intelmpi": "Intel MPI has none",
             "openmpi": "started without it"}.get(LIBRARY, "this MPI has none")
    assert named in job.output, job.output
    assert job.output.count("abort mode True []") == 2, job.output


@pytest.mark.parametrize("version, environ, says", [
    ("MPICH Version:      4.2.0\nMPICH Release date: ...", {}, "MPICH has none"),
    ("Intel(R) MPI Library 2021.13 for Linux* OS\n", {}, "Intel MPI has none"),
    ("Open MPI v4.1.6, package: Open MPI ...", {"OMPI_MCA_mpi_ft_enable": "1"},
     "this is 'Open MPI v4.1.6"),
    ("Open MPI v5.0.11, package: Open MPI ...", {}, "started without it"),
    ("Open MPI v5.0.11, package: Open MPI ...", {"OMPI_MCA_mpi_ft_enable": "0"},
     "started without it"),
    ("Open MPI v5.0.11, package: Open MPI ...", {"OMPI_MCA_mpi_ft_enable": "1"}, ""),
])
def test_which_mpi_can_survive_a_loss(monkeypatch, version, environ, says):
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    reason = policy.unsupported(version)
    if says:
        assert says in reason and "--with-ft ulfm --mca btl tcp,self" in reason, reason
    else:
        assert reason == ""


@pytest.mark.parametrize("bad", ["ignore", "", None, 1])
def test_a_mode_that_is_not_one_is_named(bad):
    with pytest.raises(ValueError, match=r"init: on_peer_loss must be one of 'abort', "
                                         r"'raise', got " + repr(bad).replace("'", "'")):
        policy.check_mode(bad)


def test_the_launcher_knows_the_survivors_options():
    launcher = launchers.find()
    if launchers.KINDS[launcher.kind].survivors:
        argv = launcher.command(3, survivors=True)
        assert argv[1:9] == list(policy.FLAGS) and argv[9:11] == ["-n", "3"], argv
        assert list(policy.NEEDED) == ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]
    else:
        with pytest.raises(ValueError, match=r"cannot let ranks go on past a lost one; "
                                             r"Open MPI 5's mpiexec can"):
            launcher.command(3, survivors=True)
        job = run_job(2, "--", "true", timeout=60, options=["--survivors"])
        assert job.returncode == 2 and "--survivors: " in job.output, job.output
