"""init(): idempotence, reuse of an mpi4py communicator, local ranks, devices, arguments."""
import re
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import cupycomm
from cupycomm import _bootstrap
from cupycomm.faults import abort


def test_init_is_idempotent_until_closed():
    first = cupycomm.init()
    assert cupycomm.init() is first
    assert (first.rank, first.size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    first.close()
    second = cupycomm.init()
    assert second is not first and not second.closed
    assert second.all_reduce(np.ones(1))[0] == second.size
    second.close()


def test_init_on_an_existing_mpi_communicator():
    world = MPI.COMM_WORLD
    half = world.Split(world.Get_rank() % 2, key=-world.Get_rank())
    with cupycomm.init(mpi_comm=half) as comm:
        assert (comm.rank, comm.size) == (half.Get_rank(), half.Get_size())
        assert comm.mpi_comm != half, "cupycomm must work on its own duplicate"
        total = comm.all_reduce(np.array([world.Get_rank()]))
        assert total[0] == sum(r for r in range(world.Get_size()) if r % 2 == world.Get_rank() % 2)
    half.Free()


def test_local_rank_comes_from_the_shared_memory_split():
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    with cupycomm.init(MPI.COMM_WORLD) as comm:
        assert comm.local_rank == node.Get_rank()
    node.Free()


def test_no_gpu_means_no_device_and_numpy():
    if _bootstrap.choose_device(0, _bootstrap.import_cupy() or None) is not None:
        pytest.skip("this machine has a GPU; the no-GPU path is for machines without one")
    with cupycomm.init(MPI.COMM_WORLD) as comm:
        assert comm.device is None
        assert comm.xp is np


@pytest.mark.parametrize("kwargs,kind,pattern", [
    ({"device": -1}, ValueError, "device must be a CUDA device number >= 0, got -1"),
    ({"device": "0"}, ValueError, "device must be a CUDA device number"),
    ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds, got 0"),
    ({"timeout": True}, TypeError, "init: timeout must be a number of seconds, got True"),
    ({"timeout": "10"}, TypeError, "init: timeout must be a number of seconds, got '10'"),
    ({"mpi_comm": "world"}, TypeError, "mpi_comm must be an mpi4py communicator, got 'world'"),
])
def test_init_rejects_bad_arguments(kwargs, kind, pattern):
    with pytest.raises(kind, match=pattern):
        cupycomm.init(**kwargs)


def test_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUPYCOMM_TIMEOUT", "12.5")
    with cupycomm.init(MPI.COMM_WORLD) as comm:
        assert comm.timeout == 12.5
    monkeypatch.setenv("CUPYCOMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CUPYCOMM_TIMEOUT='soon' is not a number of seconds"):
        cupycomm.init(MPI.COMM_WORLD)


@pytest.mark.parametrize("name,value,why", [
    ("CUPYCOMM_HEARTBEAT_TIMEOUT", "0.05", "must be at least 1 s"),
    ("CUPYCOMM_HEARTBEAT_TIMEOUT", "soon", "is not a number of seconds"),
    ("CUPYCOMM_FLIGHT_RECORDER_SIZE", "1000000000000", "is not a count from 1 to 100000"),
    ("CUPYCOMM_FLIGHT_RECORDER_SIZE", "1e8", "is not a count from 1 to 100000"),
])
def test_init_refuses_a_setting_out_of_range_before_any_communication(monkeypatch, name,
                                                                       value, why):
    """On every rank, whether the communicator spans nodes (the heartbeats) or not."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} {why}")):
        cupycomm.init(MPI.COMM_WORLD)
    monkeypatch.undo()
    with cupycomm.init(MPI.COMM_WORLD) as comm:   # nothing was left half made
        assert comm.all_reduce(np.ones(1))[0] == comm.size


def test_no_timeout_is_inf():
    with cupycomm.init(MPI.COMM_WORLD, timeout=float("inf")) as comm:
        assert comm.timeout == float("inf")
        assert comm.all_reduce(np.ones(1))[0] == comm.size


def test_default_init_refuses_different_settings():
    cupycomm.init().close()
    comm = cupycomm.init(device=0, timeout=30.0)
    try:
        assert cupycomm.init() is comm and cupycomm.init(timeout=30.0, device=0) is comm
        for asked, said in [({"device": 1}, "device=0, now asked for device=1"),
                            ({"timeout": 5.0}, "timeout=30.0, now asked for timeout=5.0"),
                            ({"debug": True}, "debug=False, now asked for debug=True")]:
            with pytest.raises(ValueError, match=f"already initialized with {said}"):
                cupycomm.init(**asked)
    finally:
        comm.close()


def test_abort_switch(monkeypatch):
    assert abort.abort_enabled(True) and not abort.abort_enabled(False)
    monkeypatch.setenv("CUPYCOMM_ABORT_ON_EXCEPTION", "0")
    assert not abort.abort_enabled(None)
    monkeypatch.setenv("CUPYCOMM_ABORT_ON_EXCEPTION", "1")
    assert abort.abort_enabled(None)


def test_repr_names_rank_and_state():
    comm = cupycomm.init(MPI.COMM_WORLD)
    assert f"rank {comm.rank} of {comm.size}" in repr(comm)
    comm.close()
    assert "closed" in repr(comm)


# -- does the world MPI formed match the job the launcher started? (init's check_launch) --------

@pytest.fixture
def local_rank_unchecked(monkeypatch):
    monkeypatch.setattr(_bootstrap, "_local_rank_checked", False)


def library_line():
    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())


@pytest.mark.parametrize("variable", ["SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
def test_a_world_that_is_not_the_launchers_job_is_an_error(variable):
    size = MPI.COMM_WORLD.Get_size()
    environ = {variable: str(size + 2)}
    with pytest.raises(RuntimeError) as raised:
        _bootstrap.check_launch(MPI.COMM_WORLD, environ)
    said = str(raised.value)
    assert said.startswith(f"init: MPI formed a world of {size} rank"), said
    assert f"the launcher started {size + 2} ({variable}={size + 2} " in said, said
    assert "--mpi=pmi2" in said and library_line() in said, said
    assert ("(a singleton)" in said) == (size == 1), said


def test_init_refuses_singletons_before_any_communication(monkeypatch):
    size = MPI.COMM_WORLD.Get_size()
    said = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
    for name in said:   # every launcher this rank may have been started by
        monkeypatch.setenv(name, str(3 * size))
    with pytest.raises(RuntimeError, match=rf"world of {size} rank.*started {3 * size} "):
        cupycomm.init(MPI.COMM_WORLD)
    monkeypatch.undo()
    with cupycomm.init(MPI.COMM_WORLD) as comm:   # nothing was left half made
        assert comm.all_reduce(np.ones(1))[0] == size


@pytest.mark.parametrize("said", [
    {},                                                  # no launcher: plain python
    {"PMI_SIZE": "{size}", "SLURM_STEP_NUM_TASKS": "1"},  # hydra's proxies, one per node
    {"OMPI_COMM_WORLD_SIZE": "{size}", "PMI_SIZE": "7"},  # mpirun inside a PMI rank
    {"PMI_SIZE": "", "SLURM_STEP_NUM_TASKS": "many"},     # not numbers: nothing said
])
def test_a_world_that_agrees_with_one_launcher_passes(said, local_rank_unchecked):
    size = MPI.COMM_WORLD.Get_size()
    _bootstrap.check_launch(MPI.COMM_WORLD, {k: v.format(size=size) for k, v in said.items()})


def node_size():
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    rank, size = node.Get_rank(), node.Get_size()
    node.Free()
    return rank, size


@pytest.mark.parametrize("variable", ["SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK",
                                      "MPI_LOCALRANKID"])
def test_a_node_the_launcher_numbers_otherwise_is_said_plainly(variable,
                                                               local_rank_unchecked):
    mine, size = node_size()
    with pytest.warns(cupycomm.LocalRankWarning) as warned:
        _bootstrap.check_launch(MPI.COMM_WORLD, {variable: str(mine + 1)})
    said = str(warned[0].message)
    assert f"split of node {_bootstrap.node_name()} holds {size} rank" in said, said
    assert f"local ranks of those are {variable} {list(range(1, size + 1))}" in said, said
    assert "same GPU" in said and "init(device=" in said, said
    with warnings.catch_warnings():   # once per process: the next init says nothing
        warnings.simplefilter("error")
        _bootstrap.check_launch(MPI.COMM_WORLD, {variable: str(mine + 1)})


@pytest.mark.parametrize("said", [
    {"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "{mine}"},   # agrees with one launcher
    {"OMPI_COMM_WORLD_LOCAL_RANK": "{reversed}"},   # another order (Open MPI's mpiexec)
    {"SLURM_LOCALID": "not a number"},
])
def test_a_node_the_launcher_numbers_alike_is_not_warned_about(said, local_rank_unchecked):
    mine, size = node_size()
    environ = {k: v.format(mine=mine, reversed=size - 1 - mine) for k, v in said.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _bootstrap.check_launch(MPI.COMM_WORLD, environ)


def test_the_local_rank_is_checked_on_the_world_only(local_rank_unchecked):
    """init(mpi_comm) may run on some ranks only: no collective on the world then."""
    world = MPI.COMM_WORLD
    alone = world.Split(world.Get_rank())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _bootstrap.check_launch(alone, {"SLURM_LOCALID": str(node_size()[0] + 1)})
    alone.Free()
    assert not _bootstrap._local_rank_checked
