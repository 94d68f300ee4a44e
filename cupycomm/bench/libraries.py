"""The implementations a run times, cupycomm first, and where their buffers live.

Host backend: cupycomm on NumPy arrays, and with ``--compare`` raw mpi4py on the very MPI
communicator cupycomm uses (``comm.mpi_comm``), given the arrays as a user gives them (a
bfloat16 array viewed as uint16; see :mod:`cupycomm.bench.collectives`). Device backend:
cupycomm on device arrays, and with ``--compare`` a raw ``NcclCommunicator`` of the same device
module, then ``cupyx.distributed`` and ``torch.distributed`` where installed (real CuPy only). A
device module loaded from a file is a stand-in: its implementations are labelled so.
"""
from __future__ import annotations

import importlib
import importlib.util
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
from mpi4py import MPI

from .._bootstrap import broadcast_unique_id
from ..backends.nccl import library_version, nccl_module
from ..tools.selfcheck import gpu_name
from .collectives import Call, Case, Collective, Runner
from .timing import CudaEvents, HostClock

__all__ = ["Arrays", "Impl", "Setup", "load_device_module", "host_setup", "device_setup"]


@dataclass(frozen=True)
class Arrays:
    """Allocation, loading and reading back of buffers: NumPy, or a device array module."""

    module: Any
    on_device: bool

    def empty(self, elements: int, dtype: np.dtype) -> Any:
        return self.module.empty(elements, dtype)

    def load(self, dst: Any, data: np.ndarray) -> None:
        dst[...] = self.module.asarray(data) if self.on_device else data

    def host(self, a: Any) -> np.ndarray:
        """A NumPy view or copy of ``a``, after the work queued on the current stream."""
        return self.module.asnumpy(a) if self.on_device else a

    def settle(self) -> None:
        """Wait until the current stream's work is done (nothing to wait for on the host)."""
        if self.on_device:
            self.module.cuda.get_current_stream().synchronize()


def _nothing_refused(row: Collective, case: Case) -> str:
    return ""


@dataclass
class Impl:
    """One implementation: its library handle, the table field it calls, how an async call
    completes (cupycomm's Work, MPI's Request), and what it cannot run (a reason, or "")."""

    name: str
    handle: Any
    entry: Callable[[Collective], Call]
    finish: Optional[Callable[[Runner], Runner]] = None
    refuse: Callable[[Collective, Case], str] = _nothing_refused
    stand_in: bool = False

    @property
    def label(self) -> str:
        return f"{self.name} (stand-in)" if self.stand_in else self.name

    def runner(self, row: Collective, case: Case) -> Union[Runner, str]:
        """The zero-argument call to time, or why this implementation has none for ``case``."""
        why = self.refuse(row, case)
        if why:
            return why
        run = self.entry(row)(self.handle, case)
        if isinstance(run, str) or not case.async_op or self.finish is None:
            return run
        return self.finish(run)


@dataclass
class Setup:
    """Everything a run needs besides the options: the backend's name, buffers, implementations
    (cupycomm first), the timer and its description, notes for the output, versions for the
    metadata, and what to close at the end."""

    backend: str
    arrays: Arrays
    impls: List[Impl]
    timer: Callable[[Runner], float]
    timing: str
    notes: List[str] = field(default_factory=list)
    versions: Dict[str, str] = field(default_factory=dict)
    closers: List[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()


def _wait_work(start: Runner) -> Runner:
    return lambda: start().wait()


def _wait_request(start: Runner) -> Runner:
    return lambda: start().Wait()


def _mpi_refuses(row: Collective, case: Case) -> str:
    if row.reduces and case.mpi_view is not None:
        return (f"MPI has no {case.dtype} type, so raw mpi4py cannot reduce {case.dtype} (it "
                f"moves it as {case.mpi_view} bits); only cupycomm runs the reductions")
    if row.reduces and case.mpi_op is None:
        return f"MPI has no {case.op} on {case.dtype} (only cupycomm runs it)"
    return ""


def _cupyx_refuses(row: Collective, case: Case) -> str:
    from cupyx.distributed import _nccl_comm
    if case.dtype.char not in _nccl_comm._nccl_dtypes:
        return f"cupyx.distributed has no {case.dtype}"
    if row.reduces and case.op not in _nccl_comm._nccl_ops:
        return f"cupyx.distributed has no op {case.op}"
    return ""


def _cupycomm(comm: Any, stand_in: bool = False) -> Impl:
    return Impl("cupycomm", comm, lambda row: row.cupycomm, _wait_work, stand_in=stand_in)


# -- host -----------------------------------------------------------------------------------------
def host_setup(comm: Any, compare: bool) -> Setup:
    """cupycomm on NumPy arrays; with ``compare``, raw mpi4py on ``comm.mpi_comm`` too."""
    impls = [_cupycomm(comm)]
    if compare:
        impls.append(Impl("mpi4py", comm.mpi_comm, lambda row: row.mpi, _wait_request,
                          _mpi_refuses))
    return Setup("host (MPI)", Arrays(np, on_device=False), impls,
                 HostClock(comm.mpi_comm.Barrier), "barrier, then a monotonic host clock")


# -- device ---------------------------------------------------------------------------------------
def load_device_module(spec: str) -> Any:
    """The device module named by ``--device-module``: a ``.py`` file (reused if that file is
    already imported, as the test suite imports the stand-in) or an importable module name.

    Example::

        standin = load_device_module("cupycomm.testing.standin")
    """
    path = Path(spec)
    if path.suffix != ".py":
        return importlib.import_module(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--device-module: no file {spec}")
    resolved = path.resolve()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == resolved:
            return module
    module_spec = importlib.util.spec_from_file_location(path.stem, resolved)
    if module_spec is None or module_spec.loader is None:   # a .py file always has both
        raise ImportError(f"--device-module: cannot load {spec}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    return module


@dataclass
class RawNccl:
    """The raw baseline's handle: an NcclCommunicator, its module (group calls), the streams."""

    comm: Any
    nccl: Any
    cuda: Any

    @property
    def stream(self) -> int:
        """The current stream's pointer, where raw calls launch."""
        return self.cuda.get_current_stream().ptr


def _raw_nccl(comm: Any, xp: Any) -> RawNccl:
    nccl = nccl_module(xp)
    unique_id = broadcast_unique_id(comm.mpi_comm, nccl.get_unique_id)
    with xp.cuda.Device(comm.device.id):
        raw = nccl.NcclCommunicator(comm.size, unique_id, comm.rank)
    return RawNccl(raw, nccl, xp.cuda)


class TorchPeer:
    """torch.distributed (NCCL) on this rank's device, tensors viewing the CuPy buffers."""

    def __init__(self, comm: Any, device_id: int) -> None:
        import torch
        import torch.distributed as dist
        torch.cuda.set_device(device_id)
        address = None
        if comm.rank == 0:
            with socket.socket() as probe:   # a free port on rank 0's host, for the rendezvous
                probe.bind(("", 0))
                address = f"tcp://{socket.gethostbyname(socket.gethostname())}:" \
                          f"{probe.getsockname()[1]}"
        address = comm.mpi_comm.bcast(address, root=0)
        dist.init_process_group("nccl", init_method=address, rank=comm.rank,
                                world_size=comm.size)
        self.dist = dist
        self._torch = torch
        self._ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                     "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
                     "avg": dist.ReduceOp.AVG}

    def tensor(self, a: Any) -> Any:
        """A torch tensor on the same device memory (``__cuda_array_interface__``, no copy)."""
        return self._torch.as_tensor(a, device="cuda")

    def op(self, name: str) -> Any:
        return self._ops[name]

    def parts(self, a: Any, case: Case) -> list:
        """The per-rank parts of ``a`` as tensors (gather and scatter lists)."""
        return list(self.tensor(a).view(case.ranks, case.unit).unbind(0))

    def sendrecv(self, x: Any, dst: int, y: Any, src: int) -> Runner:
        dist = self.dist
        ops = [dist.P2POp(dist.isend, self.tensor(x), dst),
               dist.P2POp(dist.irecv, self.tensor(y), src)]
        batch = dist.batch_isend_irecv

        def run() -> None:
            for work in batch(ops):
                work.wait()
        return run

    def close(self) -> None:
        self.dist.destroy_process_group()


def everywhere(comm: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (one allreduce)."""
    return bool(comm.mpi_comm.allreduce(bool(flag), op=MPI.LAND))


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def device_setup(comm: Any, compare: bool, stand_in: bool, raw_only: bool = False) -> Setup:
    """cupycomm on device arrays; with ``compare``, a raw NcclCommunicator, and (on real CuPy,
    unless ``raw_only``) cupyx.distributed and torch.distributed where installed on every
    rank."""
    xp = comm.xp   # makes this rank's device current
    comm.init_device()
    arrays = Arrays(xp, on_device=True)
    barrier = comm.mpi_comm.Barrier
    if stand_in:
        setup = Setup("device (NCCL stand-in)", arrays, [_cupycomm(comm, stand_in)],
                      HostClock(barrier, arrays.settle),
                      "barrier, then a monotonic host clock (stand-in: no GPU)",
                      versions={"device_module": getattr(xp, "__file__", xp.__name__),
                                "nccl": "stand-in"})
    else:
        setup = Setup("device (NCCL)", arrays, [_cupycomm(comm)], CudaEvents(xp.cuda, barrier),
                      "barrier, then CUDA events on the current stream",
                      versions={"cupy": xp.__version__,
                                "nccl": library_version(xp),
                                "gpu": gpu_name(xp, comm.device.id)})
    if not compare:
        return setup
    raw = _raw_nccl(comm, xp)
    setup.closers.append(raw.comm.destroy)
    setup.impls.append(Impl("nccl", raw, lambda row: row.nccl, stand_in=stand_in))
    if stand_in or raw_only:
        setup.notes.append("cupyx.distributed and torch.distributed: not run "
                           + ("on a stand-in (they need real CUDA)" if stand_in else
                              "(raw NcclCommunicator only)"))
        return setup
    if everywhere(comm, _installed("cupyx.distributed")):
        import cupyx.distributed
        peer = cupyx.distributed.init_process_group(comm.size, comm.rank, backend="nccl",
                                                    use_mpi=True)
        setup.impls.append(Impl("cupyx", peer, lambda row: row.cupyx, refuse=_cupyx_refuses))
    else:
        setup.notes.append("cupyx.distributed: not installed on every rank, not run")
    if everywhere(comm, _installed("torch") and _torch_has_cuda()):
        torch_peer = TorchPeer(comm, comm.device.id)
        setup.closers.append(torch_peer.close)
        setup.impls.append(Impl("torch", torch_peer, lambda row: row.torch))
        setup.versions["torch"] = torch_peer._torch.__version__
    else:
        setup.notes.append("torch.distributed: torch with CUDA not installed on every rank, "
                           "not run")
    return setup


def _torch_has_cuda() -> bool:
    import torch
    return bool(torch.cuda.is_available())
