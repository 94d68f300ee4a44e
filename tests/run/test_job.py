"""python -m cupycomm.run: the options reach every rank, the exit status never lies, a signal
ends the job, and the job directory is gone afterwards.

Each job runs in a fresh interpreter under the launcher of this environment, so these tests
run in the single-process pass of the suite (mpiexec does not nest inside an mpiexec run).
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cupycomm.run import launchers
from cupycomm.run import job as launch
from cupycomm.faults.board import alive
from cupycomm.testing import SIMULATES_NODES, launch_environment, run_job, simulated_nodes
from cupycomm.work import poll_until

pytestmark = pytest.mark.mpi(max_size=1)

BOUND = 60   # seconds: no job here may take longer
SHORT_GRACE = 2.0   # cupycomm.run's grace after a forwarded signal, where a test waits it out

FINISHES = """
import sys, numpy as np, cupycomm
comm = cupycomm.init()
x = comm.all_reduce(np.ones(2))
print(f"rank {comm.rank}: sum {x[0]:g} timeout {comm.timeout:g} debug {comm.debug} "
      f"args {sys.argv[1:]}", flush=True)
"""
EXITS_0 = """
import os, numpy as np, cupycomm
comm = cupycomm.init()
comm.all_reduce(np.ones(2))
if comm.rank == 2:
    os._exit(0)
{after}
print("finished with", comm.rank, flush=True)
"""
# Rank 2 exits once its peers have left the all_reduce (they wait in MPI_Finalize): exiting
# at once, a peer still inside the call sees it die there, and its watchdog ends the job first
# (seen in CI), which these tests of cupycomm.run's own ending do not test.
EXITS_0_AFTER_THE_CALL = EXITS_0.replace("    os._exit(0)", "    time.sleep(1); os._exit(0)") \
    .replace("import os,", "import os, time,")
RAISES = """
import numpy as np, cupycomm
comm = cupycomm.init()
if comm.rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
comm.all_reduce(np.ones(2))
"""
WAITS = """
import os, sys, time, numpy as np, cupycomm
comm = cupycomm.init()
with open(os.path.join(sys.argv[1], f"ready-{comm.rank}"), "w") as f:
    f.write(str(os.getpid()))
if comm.rank == 0:
    time.sleep(120)
comm.barrier()
"""

# What --prefix-output puts before each line (the launcher's option: hydra's -prepend-rank,
# Open MPI's --tag-output, srun's --label), the rank as its group
RANK_PREFIX = {"hydra": r"\[(\d+)\] ", "intelmpi": r"\[(\d+)\] ",
               "openmpi": r"\[\d+,(\d+)\]<stdout>: ", "srun": r" *(\d+): "}


def cupycomm_run(tmp_path, script, n, *args, env=None):
    """(status, stdout, stderr) of ``python -m cupycomm.run -n n *args``, ``script`` being
    job.py (buffered output: hydra prefixes each write), ``env`` more variables."""
    (tmp_path / "job.py").write_text(script)
    job = run_job(n, *args, timeout=BOUND, cwd=str(tmp_path),
                  env={"PYTHONUNBUFFERED": "", **(env or {})})
    assert not job.timed_out, f"cupycomm.run did not end within {BOUND} s:\n{job.output}"
    # Open MPI's launcher ends each of its messages ("prterun has exited due to ...") with a
    # NUL byte, which would begin cupycomm.run's line on the shared stderr
    return job.returncode, job.stdout, job.stderr.replace("\0", "")


# Open MPI refuses root without these (CI runs as root); cupycomm.run checks them first.
ROOT_CONSENT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def no_job_directory(tmp_path):
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".cupycomm-run-")]
    assert not left, f"the job directory was left behind: {left}"


def test_a_job_that_finishes_exits_0_and_its_options_reach_every_rank(tmp_path):
    code, out, err = cupycomm_run(tmp_path, FINISHES, 3, "--timeout", "7",
                                  "--debug", "--prefix-output", "job.py", "a", "-b")
    assert code == 0, out + err
    for rank in range(3):
        assert (f"rank {rank}: sum 3 timeout 7 debug True args ['a', '-b']" in out), out
    prefix = RANK_PREFIX.get(launchers.find().kind, RANK_PREFIX["hydra"])
    ranks = [re.match(prefix + r"rank (\d+):", line) for line in out.splitlines()]
    assert all(m and m[1] == m[2] for m in ranks), out   # each line, its rank's prefix
    assert sorted(int(m[1]) for m in ranks) == [0, 1, 2], out
    assert "cupycomm.run" not in err, err
    no_job_directory(tmp_path)


def test_launcher_options_go_to_the_launcher(tmp_path):
    script = "import os, cupycomm; cupycomm.init(); print(os.environ['GIVEN'], flush=True)"
    given = (["-x", "GIVEN=by-the-launcher"] if launchers.find().kind == "openmpi"
             else ["-genv", "GIVEN", "by-the-launcher"])
    code, out, err = cupycomm_run(tmp_path, script, 2, *given, "job.py")
    assert code == 0, out + err
    assert out.split() == ["by-the-launcher"] * 2, out


@pytest.mark.parametrize("after", ["comm.all_reduce(np.ones(2))", "pass"],
                         ids=["peers-wait", "peers-finish"])
def test_a_rank_that_exits_0_fails_the_job_naming_it(tmp_path, after):
    """Whether its peers wait for it in a collective (the watchdog ends the job) or finish
    without it (the launcher may exit 0), the status is non-zero and rank 2 is named."""
    code, out, err = cupycomm_run(tmp_path, EXITS_0.format(after=after), 3,
                                  "job.py")
    assert code != 0, out + err
    line = err.strip().splitlines()[-1]
    assert line.startswith("cupycomm.run: "), err
    assert "rank 2" in line, line
    if after == "pass":
        # cupycomm.run's own verdict; or, when a peer was still inside the all_reduce as
        # rank 2 died (seen under Open MPI on a loaded machine), the watchdog's, which
        # cupycomm.run's line repeats: rank 2 named as not finishing either way
        assert ("rank 2 (host " in line and "ended without finishing" in line
                or "rank 2 of communicator world" in line and "rank 2 did not finish" in line), \
            line
    no_job_directory(tmp_path)


@pytest.mark.skipif(launchers.find().kind not in SIMULATES_NODES,
                    reason="only MPICH's hydra can simulate nodes")
def test_the_reason_names_the_node_the_launcher_gave_the_rank(tmp_path):
    """On simulated nodes every rank's host is this machine: the line names rank 2's node as
    hydra gave it (node1), as the watchdog's messages do."""
    code, out, err = cupycomm_run(tmp_path, EXITS_0_AFTER_THE_CALL.format(after="pass"), 3,
                                  *simulated_nodes(2, 1), "job.py")
    assert code != 0, out + err
    line = err.strip().splitlines()[-1]
    assert line.startswith("cupycomm.run: rank 2 (host node1, pid "), err
    assert "ended without finishing" in line, line
    no_job_directory(tmp_path)


def test_an_exception_is_the_reason_given(tmp_path):
    code, out, err = cupycomm_run(tmp_path, RAISES, 3, "job.py")
    assert code != 0
    line = err.strip().splitlines()[-1]
    assert line.startswith("cupycomm.run: rank 1 (host "), err
    assert "raised RuntimeError: deliberate failure on rank 1" in line, line
    no_job_directory(tmp_path)


def test_sigterm_ends_the_job_and_the_status_says_so(tmp_path):
    (tmp_path / "job.py").write_text(WAITS)
    job = subprocess.Popen([sys.executable, "-m", "cupycomm.run", "-n", "3", "job.py",
                            str(tmp_path)], cwd=tmp_path, env=launch_environment(), text=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    ready = [tmp_path / f"ready-{rank}" for rank in range(3)]
    deadline = time.monotonic() + BOUND
    while not all(p.exists() and p.read_text() for p in ready):
        assert time.monotonic() < deadline and job.poll() is None, "the job did not start"
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in ready]
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=BOUND)
    code = job.returncode
    assert code == 128 + signal.SIGTERM, out + err
    assert "cupycomm.run: stopped by SIGTERM, forwarded to the job" in err, err
    assert not any(alive(pid) for pid in pids), "a rank outlived the job"
    no_job_directory(tmp_path)


def _children(pid):
    """The pids of ``pid``'s child processes (Linux: /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:   # it has just ended
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_sigterm_ends_a_job_whose_output_nobody_reads(tmp_path):
    """Open MPI's launcher, given SIGTERM while its stdout is a full pipe that nobody reads,
    blocks for ever in a write and takes no further signal; cupycomm.run kills it (its whole
    session) after the grace period, so nothing is left behind. The grace is shortened to
    SHORT_GRACE (its length is not what is tested, and a blocked launcher waits it out)."""
    (tmp_path / "job.py").write_text(WAITS.replace(
        "if comm.rank == 0:", "sys.stdout.write(('x' * 1023 + '\\n') * 128)  # 128 KiB\n"
                              "sys.stdout.flush()\nif comm.rank == 0:"))
    run = (f"import sys; from cupycomm.run import job; job.GRACE = {SHORT_GRACE}; "
           f"sys.exit(job.main())")
    job = subprocess.Popen([sys.executable, "-c", run, "-n", "2", "job.py", str(tmp_path)],
                           cwd=tmp_path, env=launch_environment(), text=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        ready = [tmp_path / f"ready-{rank}" for rank in range(2)]
        deadline = time.monotonic() + BOUND
        while not all(p.exists() and p.read_text() for p in ready):
            assert time.monotonic() < deadline and job.poll() is None, "the job did not start"
            time.sleep(0.1)
        launcher = _children(job.pid)
        time.sleep(2)   # the ranks' output fills the pipe
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=BOUND)   # not reading: the launcher's writes stay blocked
    finally:
        out, err = job.communicate()
    assert code == 128 + signal.SIGTERM, err
    assert "cupycomm.run: stopped by SIGTERM" in err, err
    pids = [int(p.read_text()) for p in ready] + launcher
    assert poll_until(lambda: not any(alive(pid) for pid in pids), timeout=10), "left behind"
    no_job_directory(tmp_path)


def test_a_program_without_cupycomm_keeps_the_launchers_status(tmp_path):
    code, out, err = cupycomm_run(tmp_path, "import sys; sys.exit(3)", 2,
                                  "job.py")
    assert code == 3
    assert "no rank called cupycomm.init()" in err, err


def test_the_console_script_is_installed_and_its_help_names_it():
    script = os.path.join(os.path.dirname(sys.executable), "cupycomm-run")
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: cupycomm-run -n N "), done.stdout


def test_the_usage_the_reference_prints_is_the_help_of_the_console_script():
    """docs/reference/run.md prints ``USAGE`` as it is (autodoc): it showed a ``{prog}``
    placeholder where the help names the tool."""
    assert "USAGE" in (Path(__file__).parents[2] / "docs" / "reference" / "run.md").read_text()
    assert launch.USAGE.startswith("usage: cupycomm-run -n N ") and "{" not in launch.USAGE


def test_the_help_says_what_the_tool_is_for_and_its_exit_statuses():
    done = subprocess.run([sys.executable, "-m", "cupycomm.run", "--help"],
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 0 and not done.stderr, done.stderr
    text = done.stdout
    assert text.startswith("usage: python -m cupycomm.run -n N "), text
    assert "with the launcher at hand" in text and "did not finish" in text, text
    statuses = text.split("exit status:\n", 1)[1]
    for status in ("0 ", "1 ", "2 ", "128 + N"):
        assert f"  {status}" in statuses, statuses


def test_a_launcher_that_cannot_keep_survivors_is_refused_in_one_line(tmp_path):
    launcher = tmp_path / "mpiexec"
    launcher.write_text("#!/bin/sh\necho 'HYDRA build details:'; echo '    Version: 4.3.0'\n")
    launcher.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", "cupycomm.run", "-n", "2", "--survivors",
                           "--mpiexec", str(launcher), "job.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 2
    assert "usage:" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert "--survivors" in done.stderr and "Open MPI 5" in done.stderr, done.stderr


def test_open_mpi_as_root_without_the_consent_is_refused_naming_the_variables(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("runs as root only (Open MPI refuses root)")
    launcher = tmp_path / "mpirun"
    launcher.write_text("#!/bin/sh\n"
                        "if [ \"$1\" = --version ]; then echo 'mpirun (Open MPI) 5.0.11'; "
                        "exit 0; fi\nexit 1\n")
    launcher.chmod(0o755)
    env = {k: v for k, v in launch_environment().items()
           if k not in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")}
    done = subprocess.run([sys.executable, "-m", "cupycomm.run", "-n", "2",
                           "--mpiexec", str(launcher), "job.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 2, done.stderr
    assert "refuses to run as root" in done.stderr, done.stderr
    assert ("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in done.stderr), \
        done.stderr


def test_open_mpi_gets_its_prefix_option_and_is_told_to_pass_the_variables(tmp_path):
    launcher = tmp_path / "mpirun"
    launcher.write_text("#!/bin/sh\n"
                        "if [ \"$1\" = --version ]; then echo 'mpirun (Open MPI) 5.0.11'; "
                        "exit 0; fi\n"
                        f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
                        " \"$@\"\n")
    launcher.chmod(0o755)
    code, out, err = cupycomm_run(tmp_path, "", 2, "--mpiexec", str(launcher),
                                  "--timeout", "5", "--prefix-output", "--map-by",
                                  "node", "job.py", env=ROOT_CONSENT)
    assert code == 0, err
    argv = json.loads(out)
    assert argv[:9] == ["--tag-output", "-x", "CUPYCOMM_RUN_DIR", "-x", "CUPYCOMM_RUN_SIZE",
                        "-x", "CUPYCOMM_TIMEOUT", "--map-by", "node"], argv
    assert argv[9:] == ["-n", "2", sys.executable, "job.py"], argv


@pytest.mark.parametrize("argv, why", [
    (["job.py"], "-n N (the number of ranks) is required"),
    (["-n", "0", "job.py"], "-n must be a number of ranks >= 1, got '0'"),
    (["-n", "2", "--timeout", "-1", "job.py"], "--timeout must be a positive number"),
    (["-n", "2", "-hosts", "a:1"], "no program"),
    (["-n"], "-n needs a value"),
])
def test_a_bad_command_line_says_what_is_wrong(argv, why):
    with pytest.raises(launch.UsageError, match=re.escape(why)):
        launch.parse(argv)


def test_the_program_starts_at_a_script_a_module_or_after_a_double_dash():
    assert launch.parse(["-n", "2", "-hosts", "a:1,b:1", "x.py", "-n", "5"]).program == \
        [sys.executable, "x.py", "-n", "5"]
    options = launch.parse(["-np", "2", "-m", "pytest", "-x"])
    assert options.program == [sys.executable, "-m", "pytest", "-x"] and options.n == 2
    assert launch.parse(["-n", "1", "--", "env", "a.py"]).program == ["env", "a.py"]


def record(rank, state, detail=""):
    return {"rank": rank, "node": "h", "host": "vm", "pid": 10 + rank, "state": state,
            "detail": detail}


@pytest.mark.parametrize("records, code, expected", [
    ([record(0, "ended"), record(1, "ended")], 0, (0, "")),
    ([record(0, "ended"), record(1, "running")], 0,
     (1, "cupycomm.run: rank 1 (host h, pid 11) ended without finishing (it recorded no "
         "end: os._exit, a signal or a crash); mpiexec exited 0")),
    ([record(0, "running"), record(1, "raised", "ValueError: bad"), None], 1,
     (1, "cupycomm.run: rank 1 (host h, pid 11) raised ValueError: bad; rank 0 did not "
         "finish; rank 2 never called cupycomm.init(); mpiexec exited 1")),
    ([record(0, "aborted", "rank 1 has died"), record(1, "running")], -9,
     (137, "cupycomm.run: rank 0 (host h, pid 10) ended the job: rank 1 has died; rank 1 "
           "did not finish; mpiexec was killed by signal 9")),
    ([record(0, "ended"), record(1, "ended")], 4,
     (4, "cupycomm.run: every rank reached its end, but mpiexec exited 4 (a rank called "
         "sys.exit with a non-zero code?)")),
    ([None, None], 0, (0, "")),
])
def test_the_verdict_names_the_first_cause(records, code, expected):
    assert launch.verdict(records, code) == expected


def test_hydras_own_failure_after_every_rank_finished_is_not_the_jobs():
    ended = [record(0, "ended"), record(1, "ended")]
    assert launch.verdict(ended, 255, launcher_failed=True) == (
        0, "cupycomm.run: every rank reached its end; mpiexec exited 255 after failing on its "
           "own as the job ended (hydra's race with its exiting proxies)")
    assert launch.verdict(ended, 255)[0] == 255
    assert launch.verdict([record(0, "ended"), record(1, "running")], 255,
                          launcher_failed=True)[0] == 255


def _hydra_then(tmp_path, after):
    """A stand-in for hydra: the real one runs the job, then the shell runs ``after``."""
    fake, real = tmp_path / "mpiexec", launchers.find().executable
    fake.write_text(f"#!/bin/sh\n"
                    f"if [ \"$1\" = --version ]; then exec {real} \"$@\"; fi\n"
                    f"{real} \"$@\"\n"
                    f"{after}\n")
    fake.chmod(0o755)
    return fake


@pytest.mark.skipif(launchers.find().kind != "hydra", reason="hydra's own failure")
def test_a_job_that_finished_ends_0_though_hydra_then_failed_on_its_own(tmp_path):
    """A stand-in for hydra runs the job with the real one, then fails as hydra does when
    it races its exiting proxies: cupycomm.run passes its words on and ends 0."""
    fake = _hydra_then(tmp_path, "echo '[mpiexec@vm] control_cb: unable to send SIGUSR1 "
                                 "downstream' >&2; exit 255")
    code, out, err = cupycomm_run(tmp_path, FINISHES, 2, "--mpiexec", str(fake), "job.py")
    assert code == 0, out + err
    assert "unable to send SIGUSR1 downstream" in err, err
    assert err.strip().splitlines()[-1].startswith(
        "cupycomm.run: every rank reached its end; mpiexec exited 255 after failing"), err
    code, out, err = cupycomm_run(tmp_path, RAISES, 2, "--mpiexec", str(fake), "job.py")
    assert code != 0 and "raised RuntimeError: deliberate failure on rank 1" in err, err


@pytest.mark.skipif(launchers.find().kind != "hydra", reason="hydra's own failure")
def test_hydra_writing_to_a_proxy_already_gone_is_not_killed_by_sigpipe(tmp_path):
    """Seen in CI: hydra with simulated nodes killed by SIGPIPE (status -13) after every rank
    had finished, writing to a proxy that had just exited. The kernel sends SIGPIPE to a
    process writing to a pipe or socket with no reader (pipe(7)); a stand-in for hydra
    sends it to itself after the job: cupycomm.run must start the launcher with SIGPIPE
    ignored, as Python itself runs, so that such a write fails with EPIPE instead."""
    fake = _hydra_then(tmp_path, "kill -PIPE $$; exit 0")
    code, out, err = cupycomm_run(tmp_path, FINISHES, 2, "--mpiexec", str(fake), "job.py")
    assert code == 0, out + err


def test_a_rank_seen_dead_is_named_before_those_killed_after_it():
    records = [record(0, "running"), record(1, "running"), record(2, "running")]
    assert launch.verdict(records, -9, died=[2]) == (
        137, "cupycomm.run: rank 2 (host h, pid 12) ended without finishing (it recorded no "
             "end: os._exit, a signal or a crash); ranks 0, 1 did not finish; mpiexec was "
             "killed by signal 9")


def test_a_program_a_rank_starts_does_not_record_over_the_ranks(tmp_path):
    """A rank of a cupycomm.run job starts a program that initialises cupycomm (a benchmark
    run by a script, a singleton MPI world) and is killed: the job's own records stay those
    of its ranks, and the job ends 0."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        import cupycomm
        from cupycomm.run import launchers
        comm = cupycomm.init()
        if comm.rank == 0:   # a job of its own, given cupycomm.run's variables all the same
            env = dict(launchers.nested_environment(os.environ),
                       CUPYCOMM_RUN_DIR=os.environ["CUPYCOMM_RUN_DIR"],
                       CUPYCOMM_RUN_SIZE=os.environ["CUPYCOMM_RUN_SIZE"])
            subprocess.run([sys.executable, "-c",
                            "import cupycomm, os; cupycomm.init(); os._exit(0)"], env=env)
            time.sleep(5)   # longer than cupycomm.run waits before ending a job for a lost rank
        comm.barrier()
    """))
    job = run_job(2, str(script), timeout=120)
    assert job.returncode == 0, job.output


def stray(state, detail=""):
    return {"rank": 0, "size": 1, "node": "node1", "host": "vm", "pid": 40, "state": state,
            "detail": detail}


def test_singletons_fail_the_job_whatever_the_launcher_says():
    raised = stray("raised", "RuntimeError: init: MPI formed a world of 1 rank, but the "
                             "launcher started 3 (SLURM_STEP_NUM_TASKS=3 (srun)). Advice.")
    assert launch.verdict([None] * 3, 0, "srun", strays=[stray("running"), raised]) == (
        1, "cupycomm.run: 2 processes called cupycomm.init() in a world of 1 rank, none in "
           "the job's world of 3; pid 40 on node1 raised: RuntimeError: init: MPI formed a "
           "world of 1 rank, but the launcher started 3 (SLURM_STEP_NUM_TASKS=3 (srun)); "
           "srun exited 0")
    assert launch.verdict([None] * 3, 5, strays=[stray("ended")])[0] == 5


def test_a_stray_beside_ranks_that_all_ended_changes_nothing():
    ended = [record(0, "ended"), record(1, "ended")]
    assert launch.verdict(ended, 0, strays=[stray("raised", "ValueError: x")]) == (0, "")


def test_singletons_under_a_launcher_that_exits_0_end_the_job_non_zero(tmp_path):
    """A launcher that starts its processes as srun --mpi=none does (each one an MPI world of
    its own, told SLURM_STEP_NUM_TASKS) and exits 0 whatever they did: cupycomm.run ends
    non-zero, naming the singletons, and each process said why at init()."""
    fake = tmp_path / "srun"
    fake.write_text(textwrap.dedent("""\
        #!/bin/sh
        if [ "$1" = --version ]; then echo 'slurm-wlm 22.05.8'; exit 0; fi
        while [ "$1" != -n ]; do shift; done
        n=$2; shift 2
        for i in $(seq $n); do SLURM_STEP_NUM_TASKS=$n SLURM_PROCID=$((i - 1)) "$@" & done
        wait
        exit 0
        """))
    fake.chmod(0o755)
    code, out, err = cupycomm_run(tmp_path, FINISHES, 3, "--mpiexec", str(fake), "job.py")
    assert code == 1, out + err
    assert err.count("RuntimeError: init: MPI formed a world of 1 rank, but the launcher "
                     "started 3 (SLURM_STEP_NUM_TASKS=3 (srun))") >= 3, err
    assert err.strip().splitlines()[-1].startswith(
        "cupycomm.run: 3 processes called cupycomm.init() in a world of 1 rank, none in the "
        "job's world of 3; pid "), err
    assert err.strip().endswith("; srun exited 0"), err
    no_job_directory(tmp_path)


@pytest.mark.skipif(launchers.find().kind != "hydra", reason="runs its ranks with hydra")
def test_srun_is_ended_with_sigterm_which_gives_its_allocation_back(tmp_path):
    """srun killed leaves its allocation held (the job RUNNING with no task): a stand-in for
    srun runs the job with hydra, rank 2 exits without finishing while its peers wait in
    MPI_Finalize, and cupycomm.run ends the stand-in's session with SIGTERM."""
    fake, real, stopped = tmp_path / "srun", launchers.find().executable, tmp_path / "stopped"
    fake.write_text(f"#!/bin/sh\n"
                    f"if [ \"$1\" = --version ]; then echo 'slurm-wlm 22.05.8'; exit 0; fi\n"
                    f"trap 'echo TERM > {stopped}; exit 143' TERM\n"
                    f"shift   # --kill-on-bad-exit=0\n"
                    f"{real} -disable-auto-cleanup \"$@\" &\n"
                    f"wait\n")
    fake.chmod(0o755)
    code, out, err = cupycomm_run(tmp_path, EXITS_0_AFTER_THE_CALL.format(after="pass"), 3,
                                  "--mpiexec", str(fake), "job.py")
    assert code == 143, out + err
    assert stopped.read_text().strip() == "TERM"
    assert err.strip().splitlines()[-1].startswith("cupycomm.run: rank 2 (host "), err
    assert err.strip().endswith("srun exited 143"), err


SWAPS = """
import json, os, socket, sys, cupycomm
comm = cupycomm.init()
job = os.environ["CUPYCOMM_RUN_DIR"]   # another user who can write its parent does this:
os.rename(job, job + ".away")          # the job's directory away, a forged one in its place
os.mkdir(job, 0o700)
with open(os.path.join(job, "rank-0.json"), "w") as f:
    json.dump({"rank": 0, "size": 1, "node": socket.gethostname(), "pid": os.getpid(),
               "host": socket.gethostname(), "state": "ended", "detail": "", "survived": []},
              f)
if os.getuid() == 0:
    for path in (job, os.path.join(job, "rank-0.json")):
        os.chown(path, 65534, 65534)
os._exit(0)                            # the rank ends without finishing
"""


def test_a_job_directory_swapped_under_its_name_is_not_read(tmp_path):
    """The directory is held by its descriptor from its making, and read there: a forged
    directory under its name (its parent is the current directory, which others may be able
    to write) said that rank 0 had ended, and the job that lost it exited 0."""
    code, out, err = cupycomm_run(tmp_path, SWAPS, 1, "job.py")
    assert code != 0, out + err
    line = err.strip().splitlines()[-1]
    assert line.startswith("cupycomm.run: rank 0 (host ") and "ended without finishing" in line
    forged = [p for p in tmp_path.iterdir() if p.name.startswith(".cupycomm-run-")
              and not p.name.endswith(".away")]
    assert [p.name for p in forged[0].iterdir()] == ["rank-0.json"], "not ours to remove"


XFAIL_LAST = """
import pytest

def test_a(cupycomm_comm):
    cupycomm_comm.barrier()

@pytest.mark.xfail(reason="the session's last test fails, as expected")
def test_x():
    assert 1 == 2
"""


def test_a_passing_session_whose_last_test_was_an_xfail_ends_0(tmp_path):
    """pytest sets sys.last_value for an exception it handled (an xfail): the exit record
    says "raised" only for an exception that ended the program."""
    (tmp_path / "test_x.py").write_text(XFAIL_LAST)
    job = run_job(2, "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider", "test_x.py",
                  timeout=BOUND, cwd=str(tmp_path))
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output
    assert "1 passed, 1 xfailed" in job.stdout, job.output


def test_an_exception_is_the_reason_given_without_the_abort_handler(tmp_path):
    (tmp_path / "job.py").write_text(RAISES)
    job = run_job(2, "job.py", timeout=BOUND, cwd=str(tmp_path),
                  env={"CUPYCOMM_ABORT_ON_EXCEPTION": "0"})
    assert job.returncode != 0, job.output
    assert "rank 1 (host" in job.stderr and "raised RuntimeError: deliberate failure on rank 1" \
        in job.stderr.strip().splitlines()[-1], job.output


FORKS = """
import atexit, json, os, sys, time, numpy as np, cupycomm
comm = cupycomm.init(); comm.all_reduce(np.ones(2))
if comm.rank == 1:
    time.sleep(0.35)
    child = os.fork()
    if child == 0:       # a helper process whose exception escapes, then ends normally:
        try:
            raise RuntimeError("a helper's own failure")
        except RuntimeError:
            sys.excepthook(*sys.exc_info())
        atexit._run_exitfuncs()   # as sys.exit does; but not mpi4py's MPI_Finalize, which
        os._exit(0)               # waits forever in a child (MPICH), with cupycomm or not
    os.waitpid(child, 0)
    with open(os.path.join(os.environ["CUPYCOMM_RUN_DIR"], "rank-1.json")) as f:
        record = json.load(f)
    print("record of", record["pid"], record["state"], "rank pid", os.getpid(), flush=True)
    time.sleep(4)            # rank 1 alive and busy
comm.barrier()
"""


def test_a_forked_child_that_ends_is_not_the_rank(tmp_path):
    """A child forked from rank 1 raises, then runs its exit hooks: they do nothing to the
    job (no abort, no board row left, no record overwritten, no lock of the watchdog
    waited for)."""
    code, out, err = cupycomm_run(tmp_path, FORKS, 2, "job.py")
    assert code == 0, out + err
    pid = re.search(r"rank pid (\d+)", out)
    assert pid and f"record of {pid[1]} running" in out, out + err


def test_a_rank_a_signal_ended_after_its_end_is_reported_as_a_kill():
    ended = [record(0, "ended"), record(1, "ended")]
    assert launch.verdict(ended, 9, killed="Killed (signal 9)") == (
        9, "cupycomm.run: every rank reached its end, but then a rank was ended by a signal "
           "(mpiexec said: Killed (signal 9)); mpiexec exited 9")


KILLED_AFTER_ITS_END = """
import atexit, os, signal, numpy as np
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 1:   # runs after cupycomm's exit hooks, which come later
    atexit.register(os.kill, os.getpid(), signal.SIGKILL)
import cupycomm
cupycomm.init().all_reduce(np.ones(2))
"""


@pytest.mark.skipif(launchers.find().kind != "hydra", reason="hydra's words for a signal")
def test_hydras_killed_rank_is_named_a_kill(tmp_path):
    code, out, err = cupycomm_run(tmp_path, KILLED_AFTER_ITS_END, 2, "job.py")
    assert code != 0, out + err
    line = err.strip().splitlines()[-1]
    assert "a rank was ended by a signal (mpiexec said: Killed (signal 9))" in line, err
    assert "sys.exit" not in line, err


BEFORE_INIT = """
import os, sys
if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
    open("/nonexistent/shard-1.npy")   # a missing file, before anything of MPI
import numpy as np, cupycomm
cupycomm.init().all_reduce(np.ones(2))
"""


def test_a_rank_that_fails_before_init_ends_the_job_within_seconds(tmp_path):
    """Its peers wait for it in MPI_Init (hydra, with -disable-auto-cleanup, waits too): the
    parent sees its process gone, ends the job and names it. Open MPI's launcher ends such a
    job itself, naming the rank and its exit code."""
    start = time.monotonic()
    code, out, err = cupycomm_run(tmp_path, BEFORE_INIT, 3, "job.py")
    assert time.monotonic() - start < 20, out + err
    assert code != 0, out + err
    if launchers.find().kind == "openmpi":   # it ends the job itself, naming the rank
        assert re.search(r"exited with non-zero status.*Process name: *\[\S+,1\]"
                         r".*Exit code: *1", err, re.DOTALL), err
    else:
        line = err.strip().splitlines()[-1]
        assert line.startswith("cupycomm.run: rank 1 (host "), err
        assert "ended before calling cupycomm.init()" in line, line
    no_job_directory(tmp_path)


AFTER_MPI_BEFORE_INIT = """
import numpy as np, cupycomm
from mpi4py import MPI   # MPI_Init: at exit, this rank waits in MPI_Finalize for the others
if MPI.COMM_WORLD.Get_rank() == 1:
    open("/nonexistent/shard-1.npy")
cupycomm.init().all_reduce(np.ones(2))
"""


def test_a_rank_that_raises_after_mpi_init_but_before_cupycomms_is_named_within_seconds(
        tmp_path):
    """Issue 33: with MPI started (mpi4py imported), a rank that raises before
    ``cupycomm.init()`` stays alive in MPICH's MPI_Finalize, so no process is seen gone and
    the others waited in init() until the timeout. A rank that imported cupycomm records
    the exception that escaped; the parent ends the job at once, naming it."""
    start = time.monotonic()
    code, out, err = cupycomm_run(tmp_path, AFTER_MPI_BEFORE_INIT, 3, "--timeout", "60",
                                  "job.py")
    assert time.monotonic() - start < 20, out + err
    assert code != 0, out + err
    if launchers.find().kind != "openmpi":   # Open MPI's launcher ends such a job itself
        line = err.strip().splitlines()[-1]
        assert line.startswith("cupycomm.run: rank 1 (host "), err
        assert "raised FileNotFoundError" in line and "before calling cupycomm.init()" in line, \
            line
    no_job_directory(tmp_path)


def test_a_rank_gone_before_init_is_the_first_cause():
    assert launch.verdict([None, None, None], -9, before_init=[(1, None), (2, 42)])[1] \
        .startswith(f"cupycomm.run: rank 1 (host {socket.gethostname()}) ended before calling "
                    "cupycomm.init() (its output says why), while the other ranks waited for "
                    "it (in MPI_Init or init()); rank 2 too; mpiexec was killed by signal 9")
