"""The field-test report (``python -m cupycomm --report``) and the self-check's environment lines:
every line passes on the stand-in at any world size, an injected failure is a failed line and
exit status 1, a feature that cannot run says why, and without a GPU the report says so and
exits 3; the command line is run in fresh interpreters too (real CuPy, no GPU)."""
import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from cupycomm.testing import standin as sd
from arrays import STANDIN, TORCH, TORCH_SKIP_REASON
from cupycomm.tools import fieldtest, selfcheck
from cupycomm.run import launchers
from cupycomm.__main__ import main
from cupycomm.testing import launch_environment, run_mpiexec

ROOT = Path(__file__).resolve().parent.parent
FEATURES = ["async Work", "user stream", "stream= argument", "graph capture and replay",
            "split", "new_group", "batch", "all_reduce_coalesced", "bucket", "cupycomm.devices",
            "prefetch"]

# The lines that cannot pass on this machine: torch is optional (its own tests check the line).
UNAVAILABLE = [] if TORCH is not None else [
    ("torch tensors", "not run", "torch is not installed on every rank")]


def _not_passed(lines):
    return [(line["name"], line["verdict"], line["detail"]) for line in lines
            if line["verdict"] != "pass"]


@pytest.fixture(autouse=True)
def _current_device_restored():
    """The report makes this rank's device current (comm.xp): the next tests get this
    thread's current device back."""
    before = sd.Device.current_id()
    yield
    sd.Device(before).use()


@pytest.fixture
def standin_comm(request):
    communicator = STANDIN.comm()
    yield communicator
    communicator.close()


def quick_report(comm):
    return fieldtest.report(comm, device_module=sd, bench_bytes=(1024,), bench_iters=2)


def test_every_line_passes_on_the_standin_and_the_file_holds_versions_and_topology(
        monkeypatch, tmp_path):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 2)   # the local ranks spread over two "GPUs"
    with STANDIN.comm() as comm:
        path = str(tmp_path / "report.json")
        status = fieldtest.run(comm, path, device_module=sd, bench_bytes=(1024,),
                               bench_iters=2)
        found = comm.mpi_comm.bcast(json.loads(Path(path).read_text()) if comm.rank == 0
                                    else None, root=0)
        size = comm.size
    assert status == fieldtest.EXIT_PASSED == found["exit_status"]
    assert _not_passed(found["lines"]) == UNAVAILABLE
    names = {line["name"] for line in found["lines"] if line["area"] == "device"}
    assert set(FEATURES) <= names
    assert any(name.startswith("torch tensors") for name in names)
    for dtype in fieldtest.CHECKED_DTYPES:
        assert {f"all_reduce {dtype}", f"sendrecv {dtype}", f"all_to_all {dtype}"} <= names
    assert found["summary"] == {"pass": len(found["lines"]) - len(UNAVAILABLE), "fail": 0,
                                "not run": len(UNAVAILABLE)}
    bench = found["benchmark"]
    assert {row["impl"] for row in bench} == {"cupycomm (stand-in)", "nccl (stand-in)"}
    assert all(row["wrong"] == 0 and row["bytes"] == 1024 for row in bench)
    versions = found["versions"]
    assert versions["mpi_library"] == MPI.Get_library_version().splitlines()[0].strip()
    assert versions["launcher"] in launchers.KINDS and versions["cupy"].startswith("stand-in")
    topology = found["topology"]
    assert topology["ranks"] == size and topology["nodes"] == 1
    assert sum(topology["ranks_per_gpu"].values()) == size
    assert [r["device"] for r in topology["per_rank"]] == [
        r["local_rank"] % 2 for r in topology["per_rank"]]
    assert found["gpu"] == {"found": True, "why": ""}


def test_an_injected_failure_is_a_failed_line_and_exit_status_1(monkeypatch, standin_comm):
    def broken(self, *args):
        raise sd.NcclError("injected by the test")
    monkeypatch.setattr(sd.NcclCommunicator, "reduceScatter", broken)
    found = quick_report(standin_comm)
    failed = [line for line in found["lines"] if line["verdict"] == "fail"]
    assert [line["name"] for line in failed] == [
        f"reduce_scatter {dtype}" for dtype in fieldtest.CHECKED_DTYPES]
    assert all(line["area"] == "device" and "injected by the test" in line["detail"]
               and line["failed_on"] == list(range(standin_comm.size)) for line in failed)
    assert found["exit_status"] == fieldtest.EXIT_FAILED and found["summary"]["fail"] == 4


def test_a_wrong_result_on_one_rank_fails_the_line_naming_that_rank(monkeypatch, standin_comm):
    last = standin_comm.size - 1
    real = sd.NcclCommunicator.bcast

    def wrong_on_the_last_rank(self, buff, count, datatype, root, stream):
        real(self, buff, count, datatype, root, stream)
        if standin_comm.rank == last:   # after the broadcast, in its stream's order
            result = sd._view(buff, count, datatype, "test")
            sd.launch(sd.Stream.from_ptr(stream), lambda: result.__setitem__(Ellipsis, 7))
    monkeypatch.setattr(sd.NcclCommunicator, "bcast", wrong_on_the_last_rank)
    found = quick_report(standin_comm)
    line = next(line for line in found["lines"] if line["name"] == "broadcast float32"
                and line["area"] == "device")
    assert line["verdict"] == "fail" and line["failed_on"] == [last]
    assert line["detail"] == f"rank {last}: a result differs from NumPy's"
    assert found["exit_status"] == fieldtest.EXIT_FAILED


@pytest.mark.skipif(TORCH is None, reason=TORCH_SKIP_REASON)
def test_the_torch_line_runs_cpu_tensors_through_mpi_where_torch_is(standin_comm):
    found = quick_report(standin_comm)
    line = next(line for line in found["lines"] if line["name"].startswith("torch tensors"))
    assert line["name"] == "torch tensors (CPU, through MPI: torch has no CUDA here)"
    assert line["verdict"] == "pass" and found["exit_status"] == fieldtest.EXIT_PASSED
    assert found["versions"]["torch"].startswith(TORCH.module.__version__)


def test_a_feature_that_cannot_run_says_why_and_is_no_failure(monkeypatch, standin_comm):
    monkeypatch.setitem(sys.modules, "torch", None)   # import torch raises ImportError
    found = quick_report(standin_comm)
    not_run = [line for line in found["lines"] if line["verdict"] == "not run"]
    assert [(line["name"], line["detail"]) for line in not_run] == [
        ("torch tensors", "torch is not installed on every rank")]
    assert found["exit_status"] == fieldtest.EXIT_PASSED
    assert found["versions"]["torch"] == "not installed"


def test_without_a_gpu_the_report_says_so_keeps_the_host_part_and_exits_3(monkeypatch,
                                                                           standin_comm):
    monkeypatch.setattr(sd, "DEVICE_COUNT", 0)
    found = quick_report(standin_comm)
    assert found["gpu"]["found"] is False
    assert found["gpu"]["why"].startswith("rank 0: CUDA sees no device")
    assert {line["area"] for line in found["lines"]} == {"host"}
    assert all(line["verdict"] == "pass" for line in found["lines"])
    assert found["benchmark"] == [] and found["topology"]["ranks_per_gpu"] == {}
    assert found["exit_status"] == fieldtest.EXIT_NO_GPU == 3
    assert found["versions"]["mpi_kind"] == launchers.library_kind(MPI.Get_library_version())


def test_ranks_sharing_a_gpu_without_nccls_leave_fail_and_the_report_says_why(
        monkeypatch, standin_comm):
    """As NCCL, the stand-in refuses ranks of one host on one GPU unless each allows it."""
    monkeypatch.setattr(sd, "SHARED_GPUS", True)
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    found = quick_report(standin_comm)
    size = standin_comm.size
    device = [line for line in found["lines"] if line["area"] == "device"]
    if size == 1:
        assert found["notes"] == [] and _not_passed(device) == UNAVAILABLE
        return
    assert found["notes"] == [
        f"ranks {list(range(size))} share GPU {found['topology']['per_rank'][0]['gpu']}: NCCL "
        f"refuses that (Duplicate GPU detected) unless each sets NCCL_MULTI_RANK_GPU_ENABLE=1 "
        f"(NCCL 2.30 or newer) or its own NCCL_HOSTID (benchmarks/with_hostid)"]
    assert device[0]["verdict"] == "fail" and "Duplicate GPU" in device[0]["detail"]
    assert found["exit_status"] == fieldtest.EXIT_FAILED


def test_ranks_sharing_a_gpu_with_nccls_leave_pass(monkeypatch, standin_comm):
    monkeypatch.setattr(sd, "SHARED_GPUS", True)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    found = quick_report(standin_comm)
    assert found["notes"] == [] and found["exit_status"] == fieldtest.EXIT_PASSED
    assert found["topology"]["ranks_per_gpu"] == {
        found["topology"]["per_rank"][0]["gpu"]: standin_comm.size}


def test_an_unwritable_report_file_is_exit_status_2_before_anything_runs(tmp_path, capsys):
    assert main(["--report", str(tmp_path / "no" / "such" / "dir.json")]) == 2
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "cannot write the report to" in capsys.readouterr().err


def test_the_self_check_names_the_mpi_library_and_the_launcher(capsys):
    with STANDIN.comm() as comm:
        status = selfcheck.main(comm)
        rank = comm.rank
    out = capsys.readouterr().out
    assert status == 0
    if rank == 0:
        mpi = MPI.Get_library_version().splitlines()[0].strip()
        assert f"MPI: {mpi}; world size" in out
        launcher = launchers.find()
        assert f"launcher: {launcher.kind} {launcher.executable}: {launcher.version}" in out
        assert out.rstrip().endswith("self-check passed")


# -- fresh interpreters ---------------------------------------------------------------------------
@pytest.mark.mpi(max_size=1)   # starts jobs of its own
def test_with_the_real_cupy_and_no_gpu_the_command_says_so_and_exits_3(tmp_path):
    """CUDA_VISIBLE_DEVICES hides any GPU, so this holds on a GPU machine too."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: no real CuPy to load")
    path = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "cupycomm", "--report", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=launch_environment({"CUDA_VISIBLE_DEVICES": ""}))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "NO GPU FOUND" in done.stdout and "exit status 3" in done.stdout
    assert "report on 1 rank\n" in done.stdout and "topology: 1 node," in done.stdout
    found = json.loads(path.read_text())
    assert found["gpu"]["found"] is False and found["gpu"]["why"].startswith("rank 0: CUDA")
    if ctypes.util.find_library("cuda") is None:   # no driver here: said so, not "insufficient"
        assert "no CUDA driver" in found["gpu"]["why"], found["gpu"]["why"]
    assert found["versions"]["cupy"] == cupy.__version__
    assert found["versions"]["mpi_library"] and found["versions"]["nccl"]
    assert found["summary"]["fail"] == 0 and found["summary"]["pass"] > 0


@pytest.mark.mpi(max_size=1)   # starts jobs of its own
def test_the_command_under_mpiexec_on_the_standin_passes_every_line(tmp_path):
    path = tmp_path / "report.json"
    job = run_mpiexec(2, "-m", "cupycomm", "--report", str(path), "--device-module",
                      "cupycomm.testing.standin", timeout=180, cwd=str(tmp_path))
    assert job.returncode == 0, job.output
    found = json.loads(path.read_text())
    assert found["topology"]["ranks"] == 2 and found["exit_status"] == 0
    assert found["summary"]["fail"] == 0 and found["summary"]["not run"] == len(UNAVAILABLE)
    assert f"0 failed, {len(UNAVAILABLE)} not run" in job.stdout
