"""The flight recorder: each communicator's ring of its last calls, the block each trigger
prints (an abort after a timeout, an uncaught exception, SIGUSR1/2), the per-rank files, and
``python -m cupycomm.tools.flight`` merging them across (simulated) nodes.
"""
import json
import os
import pwd
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

import cupycomm
from cupycomm.run import launchers
from cupycomm.faults import flight
from cupycomm.testing import no_auto_cleanup, run_mpiexec

BOUND = 60   # seconds: no job here may take longer
# MPICH and Intel MPI (an MPICH) handle SIGUSR1 themselves (it is how hydra tells ranks of a
# failed peer): SIGUSR2 there
REPORT_SIGNAL = (signal.SIGUSR2 if launchers.library_kind(MPI.Get_library_version())
                 in ("mpich", "intelmpi") else signal.SIGUSR1)

MISMATCH = """
import numpy as np, cupycomm
comm = cupycomm.init()
comm.all_reduce(np.ones(2))                 # #1 on every rank
if comm.rank == 3:
    comm.broadcast(np.ones(2), root=0)      # #2: rank 3 alone (node B) broadcasts
else:
    comm.all_reduce(np.ones(2))             # #2: the others all-reduce
"""
RAISES = """
import numpy as np, cupycomm
comm = cupycomm.init()
comm.all_reduce(np.ones(2))
if comm.rank == 1:
    raise RuntimeError("deliberate")
comm.all_reduce(np.ones(2))
"""
SIGNALLED = """
import os, sys, time, numpy as np, cupycomm
comm = cupycomm.init()
comm.all_reduce(np.ones(2))
with open(f"{sys.argv[1]}-{comm.rank}", "w") as f:
    f.write(str(os.getpid()))
if comm.rank == 1:                          # rank 0 waits in the barrier meanwhile
    while not os.path.exists(sys.argv[1] + ".done"):
        time.sleep(0.05)
comm.barrier()
print("finished with", comm.rank, flush=True)
"""


def test_the_ring_keeps_the_last_calls_with_their_names_and_backends():
    with cupycomm.init(MPI.COMM_SELF) as comm:
        recorder = comm.parts.tracker.flight
        for _ in range(70):
            comm.all_reduce(np.ones(2))
        comm.broadcast(np.ones(2))
        recorder.look(comm.parts.tracker.seq, None, comm.parts.tracker.seq)
        state = recorder.state()
    assert recorder.size == 64
    assert [c["seq"] for c in state["calls"]] == list(range(8, 72))
    assert [c["call"] for c in state["calls"][-2:]] == ["all_reduce", "broadcast"]
    assert {c["backend"] for c in state["calls"]} == {"mpi"}
    assert all(c["completed"] for c in state["calls"])
    assert state["issued"] == state["completed"] == 71 and state["waiting"] is None


def test_the_ring_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUPYCOMM_FLIGHT_RECORDER_SIZE", "8")
    assert flight.Recorder("x", 0).size == 8
    monkeypatch.setenv("CUPYCOMM_FLIGHT_RECORDER_SIZE", "0")
    with pytest.raises(ValueError, match="CUPYCOMM_FLIGHT_RECORDER_SIZE='0' is not a count"):
        flight.Recorder("x", 0)


def state(rank, node, completed, call=None, seq=None, for_s=None):
    waiting = None if call is None else {"call": call, "seq": seq, "for_s": for_s}
    return {"rank": rank, "node": node, "completed": completed, "waiting": waiting,
            "communicator": "world", "calls": [{"seq": completed, "call": "all_reduce",
                                                "backend": "mpi", "completed": True}]}


def test_the_summary_groups_ranks_by_node_and_place():
    states = [state(0, "nodeA", 41, "all_reduce", 42, 12.0), state(1, "nodeA", 41,
              "all_reduce", 42, 11.0), state(2, "nodeA", 41, "all_reduce", 42),
              state(3, "nodeB", 41, "broadcast", 42, 3.0), state(4, "nodeB", 40)]
    assert flight.summarize(states) == [
        "ranks 0-2 (nodeA) completed #41, wait in all_reduce #42 (rank 0 for 12 s)",
        "rank 3 (nodeB) completed #41, waits in broadcast #42 (rank 3 for 3 s)",
        "rank 4 (nodeB) completed #40 and is in no call"]


@pytest.mark.mpi(max_size=1)
def test_the_command_line_merges_the_files_of_every_rank(tmp_path):
    for s in (state(2, "nodeA", 1, "all_reduce", 2, 4.0), state(3, "nodeB", 1, "broadcast", 2)):
        (tmp_path / f"rank-{s['rank']}.json").write_text(json.dumps(s))
    done = subprocess.run([sys.executable, "-m", "cupycomm.tools.flight", str(tmp_path), "--calls"],
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "cupycomm flight recorder: 2 ranks, communicator world",
        "  rank 2 (nodeA) completed #1, waits in all_reduce #2 (rank 2 for 4 s)",
        "  rank 3 (nodeB) completed #1, waits in broadcast #2",
        "  rank 2: #1 all_reduce mpi done", "  rank 3: #1 all_reduce mpi done"]
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([sys.executable, "-m", "cupycomm.tools.flight", str(empty)],
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 2 and "no rank-<r>.json in" in done.stderr


@pytest.mark.mpi(max_size=1)
@pytest.mark.skipif(os.getuid() != 0, reason="planting another user's (nobody's) files "
                                             "needs root's chown")
def test_the_command_line_refuses_files_another_user_planted(tmp_path):
    """A directory others can write (here /tmp-like, sticky): another user's rank-1.json
    there was printed as the job's; a FIFO under a rank's name hung the command."""
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chmod(tmp_path, 0o1777)
    for s in (state(0, "nodeA", 1, "all_reduce", 2), state(1, "nodeA", 1, "broadcast", 2)):
        (tmp_path / f"rank-{s['rank']}.json").write_text(json.dumps(s))
    os.chown(tmp_path / "rank-1.json", nobody, nobody)
    done = subprocess.run([sys.executable, "-m", "cupycomm.tools.flight", str(tmp_path)],
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert (f"python -m cupycomm.tools.flight: cannot read {tmp_path}: {tmp_path}/rank-1.json is a "
            f"regular file owned by uid {nobody} with mode 0644, expected one of this user's (uid 0) "
            f"that no other user may write: refused" in done.stderr), done.stderr
    os.chown(tmp_path / "rank-1.json", 0, 0)
    os.mkfifo(tmp_path / "rank-2.json")
    os.chown(tmp_path / "rank-2.json", nobody, nobody)
    done = subprocess.run([sys.executable, "-m", "cupycomm.tools.flight", str(tmp_path)],
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 2 and "rank-2.json is neither a file nor a directory owned by " \
                                    f"uid {nobody}" in done.stderr, done.stderr


def ended(job):
    assert not job.timed_out, f"the job hung:\n{job.output}"
    return job


@pytest.mark.mpi(max_size=1)
@pytest.mark.skipif(launchers.find().kind != "hydra",
                    reason="simulated nodes need hydra's -launcher fork -hosts")
def test_a_cross_node_mismatch_is_reported_per_node_and_merged(tmp_path):
    """Ranks 0-2 on node A all-reduce while rank 3 on node B broadcasts: each node's
    timeout prints its block, and the files merge into one."""
    (tmp_path / "mismatch.py").write_text(MISMATCH)
    records = tmp_path / "flight"
    job = ended(run_mpiexec(4, "mismatch.py", timeout=BOUND, cwd=str(tmp_path),
                            mpiexec_args=[*no_auto_cleanup(), "-launcher", "fork", "-hosts",
                                          "nodeA:3,nodeB:1"],
                            env={"CUPYCOMM_TIMEOUT": "3",
                                 "CUPYCOMM_FLIGHT_RECORDER": str(records)}))
    assert job.returncode != 0
    assert "cupycomm flight recorder (abort; communicator world, seen from rank" in job.output
    assert ("ranks 0-2 (nodeA) completed #1, wait in all_reduce #2" in job.output
            or "rank 3 (nodeB) completed #1, waits in broadcast #2" in job.output), job.output
    merged = subprocess.run([sys.executable, "-m", "cupycomm.tools.flight", str(records)],
                            capture_output=True, text=True, timeout=BOUND).stdout
    lines = merged.splitlines()
    assert lines[0] == "cupycomm flight recorder: 4 ranks, communicator world", merged
    assert lines[1].startswith("  ranks 0-2 (nodeA) completed #1, wait in all_reduce #2 (rank ")
    assert lines[2].startswith("  rank 3 (nodeB) completed #1, waits in broadcast #2 (rank 3 ")


@pytest.mark.mpi(max_size=1)
def test_an_uncaught_exception_reports_where_the_ranks_are(tmp_path):
    (tmp_path / "raises.py").write_text(RAISES)
    job = ended(run_mpiexec(3, "raises.py", timeout=BOUND, cwd=str(tmp_path),
                            mpiexec_args=no_auto_cleanup()))
    assert job.returncode != 0
    assert ("cupycomm flight recorder (uncaught exception; communicator world, seen from "
            "rank 1") in job.output, job.output
    assert "rank 1 (" in job.output and "completed #1 and is in no call" in job.output


@pytest.mark.mpi(max_size=1)
def test_the_signal_reports_while_the_rank_waits_and_the_job_goes_on(tmp_path):
    (tmp_path / "signalled.py").write_text(SIGNALLED)
    pids = tmp_path / "pid"
    argv = launchers.find().command(2) + [sys.executable, "signalled.py", str(pids)]
    job = subprocess.Popen(argv, cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           env=launchers.nested_environment(os.environ),
                           start_new_session=True)
    try:
        ready = [tmp_path / f"pid-{rank}" for rank in range(2)]
        deadline = time.monotonic() + BOUND
        while not all(p.exists() and p.read_text() for p in ready):
            assert time.monotonic() < deadline and job.poll() is None, "the job did not start"
            time.sleep(0.05)
        time.sleep(0.5)   # rank 0 is in the barrier by now
        os.kill(int(ready[0].read_text()), REPORT_SIGNAL)
        time.sleep(1.0)   # the watchdog looks 10 times a second
        (tmp_path / "pid.done").write_text("")
        out, _ = job.communicate(timeout=BOUND)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out
    assert (f"cupycomm flight recorder ({REPORT_SIGNAL.name}; communicator world, seen from "
            f"rank 0") in out, out
    assert "rank 0 (" in out and "completed #1, waits in barrier #2" in out, out
    assert out.count("finished with") == 2, out
