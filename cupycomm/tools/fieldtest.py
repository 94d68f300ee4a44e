"""The field-test report (``mpiexec -n N python -m cupycomm --report report.json``): every
device feature run end to end on this machine, with the versions and the topology, in one
JSON file to attach to a bug report.

Each line (**host**: every collective on NumPy arrays in each dtype of
:data:`CHECKED_DTYPES`; **device**: the same on CuPy arrays and every device feature;
**benchmark**: ``all_reduce`` against a raw ``NcclCommunicator`` at :data:`BENCH_BYTES`, the
smallest size only on a stand-in device module) has a verdict agreed by every rank:
``pass``, ``fail`` or ``not run``, and why. The file also holds the versions, the
``NCCL_*``/``CUDA_*``/``CUPYCOMM_*`` variables, the topology, and notes (ranks sharing a GPU
without what NCCL needs for that). :func:`run` exits :data:`EXIT_PASSED`,
:data:`EXIT_FAILED` or :data:`EXIT_NO_GPU`; ``python -m cupycomm`` exits 2 on a bad command
line or a file it cannot write. What each line runs, and the statuses:
docs/guide/reporting-a-problem.md.
"""
from __future__ import annotations

import ctypes.util
import datetime
import importlib
import json
import os
import platform
import sys
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
from mpi4py import MPI

import cupycomm
from .. import _private as private, devices
from .._bootstrap import node_name
from ..backends.nccl import library_version
from ..bench.cli import Options
from ..bench.collectives import ROWS
from ..bench.libraries import device_setup
from ..bench.run import Progress, measure_collective
from .selfcheck import (NotRun, Verdict, collective_checks, gpu_name, mpi_environment,
                        verdicts)

__all__ = ["run", "report", "CHECKED_DTYPES", "BENCH_BYTES", "EXIT_PASSED", "EXIT_FAILED",
           "EXIT_NO_GPU"]

EXIT_PASSED = 0
"""The exit status when every line passed, or was not run for the reason it gives."""
EXIT_FAILED = 1
"""The exit status when a line failed on some rank."""
EXIT_NO_GPU = 3
"""The exit status when nothing failed but some rank has no GPU, so no device line ran."""

CHECKED_DTYPES: Tuple[str, ...] = ("float32", "float16", "int32", "complex64")
"""The dtypes every collective is checked in (host and device)."""

BENCH_BYTES: Tuple[int, ...] = (8 * 2 ** 10, 2 ** 20, 16 * 2 ** 20)
"""The message sizes of the benchmark, in bytes."""

_VARIABLES = ("NCCL_", "CUDA_", "CUPYCOMM_")   # the environment variables the report keeps
Check = Callable[[], bool]


def _everywhere(comm: cupycomm.Communicator, flag: bool) -> bool:
    return bool(comm.mpi_comm.allreduce(bool(flag), op=MPI.LAND))


# -- versions and topology -------------------------------------------------------------------------
def _cupy(device_module: Any) -> Tuple[Any, str]:
    """The device module and ``""``, or None and why CuPy is not there."""
    if device_module is not None:
        return device_module, ""
    try:
        return importlib.import_module("cupy"), ""
    except Exception as error:   # not installed, or a CUDA library that fails to load
        return None, f"CuPy cannot be imported ({type(error).__name__}: {error})"


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}" if code else "none"


def _versions(cupy: Any, why: str) -> Dict[str, str]:
    found = {"cupycomm": cupycomm.__version__, "python": platform.python_version(),
             "numpy": np.__version__, **mpi_environment()}
    if cupy is None:
        found["cupy"] = why
    else:
        runtime = cupy.cuda.runtime
        found["cupy"] = getattr(cupy, "__version__", f"stand-in {cupy.__name__}")
        for name, ask in (("cuda_driver", "driverGetVersion"),
                          ("cuda_runtime", "runtimeGetVersion")):
            try:
                found[name] = _cuda_version(getattr(runtime, ask)())
            except Exception as error:   # no driver; a stand-in without the call
                found[name] = f"unknown ({type(error).__name__}: {error})"
        found["nccl"] = (library_version(cupy) or "cannot load" if hasattr(cupy, "__version__")
                         else "stand-in")
    try:
        import torch
        found["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"
    except Exception:   # not installed, or fails to load
        found["torch"] = "not installed"
    return found


def _gpu_of(comm: cupycomm.Communicator, cupy: Any, why: str) -> Dict[str, Any]:
    """This rank's GPU: whether one was found (and why not), which, and how many it sees."""
    if cupy is None:
        return {"found": False, "why": why, "visible": 0}
    try:
        visible = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:   # no driver, no device
        # CUDA's runtime says "driver version is insufficient" where there is no driver at all
        said = (f"{type(error).__name__}: {error}" if ctypes.util.find_library("cuda")
                else "no CUDA driver on this machine (no libcuda)")
        return {"found": False, "why": f"CUDA: {said}", "visible": 0}
    device = comm.device
    if device is None:
        return {"found": False, "visible": visible, "why": "CUDA sees no device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"}
    mine = {"found": True, "visible": visible, "device": device.id,
            "name": gpu_name(cupy, device.id)}
    if hasattr(cupy.cuda.runtime, "deviceGetPCIBusId"):   # (a stand-in has none)
        mine["pci_bus_id"] = cupy.cuda.runtime.deviceGetPCIBusId(device.id)
    return mine


def _topology(comm: cupycomm.Communicator, gpu: Dict[str, Any]) -> Dict[str, Any]:
    ranks = comm.mpi_comm.allgather({
        "host": node_name(), "local_rank": comm.local_rank, **gpu,
        "nccl_hostid": os.environ.get("NCCL_HOSTID", ""),
        "nccl_multi_rank_gpu": os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"})
    gpus_per_node: Dict[str, int] = {}
    ranks_per_gpu: Dict[str, int] = {}
    for j, rank in enumerate(ranks):
        rank["rank"] = j
        gpus_per_node[rank["host"]] = max(gpus_per_node.get(rank["host"], 0), rank["visible"])
        # one physical GPU: its node and PCI bus id (device numbers depend on CUDA_VISIBLE_DEVICES)
        rank["gpu"] = (f"{rank['host']}:{rank.get('pci_bus_id', rank['device'])}"
                       if rank["found"] else "")
        if rank["found"]:
            ranks_per_gpu[rank["gpu"]] = ranks_per_gpu.get(rank["gpu"], 0) + 1
    return {"ranks": comm.size, "nodes": len(gpus_per_node), "gpus_per_node": gpus_per_node,
            "ranks_per_gpu": ranks_per_gpu, "per_rank": ranks}


def _counted(count: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _sharing_notes(topology: Dict[str, Any]) -> List[str]:
    """Why NCCL may refuse the ranks that share a GPU: "Duplicate GPU detected" unless every
    one of them allows it (NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL 2.30+) or has a host id of its
    own (NCCL_HOSTID)."""
    notes = []
    for gpu, count in topology["ranks_per_gpu"].items():
        ranks = [r for r in topology["per_rank"] if r["gpu"] == gpu]
        allowed = all(r["nccl_multi_rank_gpu"] for r in ranks)
        distinct = len({r["nccl_hostid"] for r in ranks if r["nccl_hostid"]}) == count
        if count > 1 and not allowed and not distinct:
            notes.append(f"ranks {[r['rank'] for r in ranks]} share GPU {gpu}: NCCL refuses "
                         f"that (Duplicate GPU detected) unless each sets "
                         f"NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL 2.30 or newer) or its own "
                         f"NCCL_HOSTID (benchmarks/with_hostid)")
    return notes


# -- the device features ---------------------------------------------------------------------------
def _feature_checks(comm: cupycomm.Communicator, xp: Any, module: Any,
                    real_cupy: bool) -> List[Tuple[str, Check]]:
    """(name, check) of each device feature beyond the plain collectives."""
    n, r = comm.size, comm.rank
    mine = np.arange(8, dtype=np.float32) + r
    total = sum((np.arange(8, dtype=np.float32) + j for j in range(n)), np.zeros(8, np.float32))

    def equal(got: Any, expected: np.ndarray) -> bool:
        return np.array_equal(xp.asnumpy(got), expected)

    def async_work():
        work = comm.all_reduce(xp.asarray(mine), async_op=True)
        result = work.wait(timeout=60)
        work.synchronize()
        return work.is_completed() and equal(result, total)

    def user_stream():
        with xp.cuda.Stream(non_blocking=True) as stream:
            x = xp.asarray(mine)
            comm.all_reduce(x)
            comm.all_reduce(x, op="max")
            stream.synchronize()
            return equal(x, total)

    def stream_argument():
        stream = xp.cuda.Stream(non_blocking=True)
        x = xp.asarray(mine)
        xp.cuda.get_current_stream().synchronize()
        comm.all_reduce(x, stream=stream)
        stream.synchronize()
        return equal(x, total)

    def graph():
        stream = xp.cuda.Stream(non_blocking=True)
        with stream:
            x = xp.asarray(mine)
            comm.all_reduce(x)   # warm-up: NCCL's first call on this stream is not captured
            stream.begin_capture()
            comm.all_reduce(x)
            captured = stream.end_capture()
            results = []
            for k in range(1, 4):   # replayed three times, on new values each time
                x[...] = xp.asarray(mine * k)
                captured.launch(stream)
                stream.synchronize()
                results.append(equal(x, total * k))
        return all(results)

    def split():
        half = comm.split(r % 2)
        try:
            same_parity = sum(np.arange(8, dtype=np.float32) + j for j in range(r % 2, n, 2))
            return equal(half.all_reduce(xp.asarray(mine)), same_parity)
        finally:
            half.close()

    def new_group():
        members = list(range(0, n, 2))
        group = comm.new_group(members)
        if group is None:
            return r not in members
        try:
            return equal(group.broadcast(xp.asarray(mine), 0), np.arange(8, dtype=np.float32))
        finally:
            group.close()

    def batch():
        right, left = (r + 1) % n, (r - 1) % n
        received = xp.empty(8, np.float32)
        with comm.batch():
            comm.irecv(received, left)
            comm.isend(xp.asarray(mine), right)
        return equal(received, np.arange(8, dtype=np.float32) + left)

    def coalesced():
        arrays = [xp.asarray(mine), xp.asarray(mine[:3].astype(np.int32)),
                  xp.asarray(np.ones((2, 2), np.float16))]
        comm.all_reduce_coalesced(arrays, bucket_bytes=16)
        return (equal(arrays[0], total) and equal(arrays[1], total[:3].astype(np.int32))
                and equal(arrays[2], np.full((2, 2), n, np.float16)))

    def bucket():
        held = comm.bucket([xp.asarray(mine), xp.asarray(mine[:5])])
        held.all_reduce()
        held.all_reduce(op="avg")
        return equal(held.arrays[0], total) and equal(held.arrays[1], total[:5])

    return [("async Work", async_work), ("user stream", user_stream),
              ("stream= argument", stream_argument), ("graph capture and replay", graph),
              ("split", split), ("new_group", new_group), ("batch", batch),
              ("all_reduce_coalesced", coalesced), ("bucket", bucket),
              _torch_check(comm, real_cupy, mine, total),
              ("cupycomm.devices", _devices_check(module, mine)),
              ("prefetch", _prefetch_check(comm, xp, module))]


def _torch_check(comm: cupycomm.Communicator, real_cupy: bool, mine: np.ndarray,
                 total: np.ndarray) -> Tuple[str, Check]:
    """CUDA tensors where torch has CUDA on every rank, else CPU tensors (through MPI)."""
    try:
        import torch
        on_gpu = real_cupy and torch.cuda.is_available()
    except Exception:   # not installed, or fails to load
        torch, on_gpu = None, False
    present = _everywhere(comm, torch is not None)
    on_gpu = _everywhere(comm, on_gpu)

    def check():
        if not present:
            raise NotRun("torch is not installed on every rank")
        x = torch.from_numpy(mine.copy())
        if on_gpu:
            x = x.to(f"cuda:{comm.device.id}")
        y = comm.all_reduce(x)
        return (isinstance(y, torch.Tensor) and y.device == x.device
                and np.array_equal(y.cpu().numpy(), total))
    return ("torch tensors" + (" (CUDA)" if on_gpu else " (CPU, through MPI: torch has no "
                                                         "CUDA here)" if present else "")), check


def _devices_check(module: Any, mine: np.ndarray) -> Check:
    def check():
        gpus = list(range(devices.count(device_module=module)))
        copies = devices.broadcast(mine, gpus, device_module=module)
        total = devices.reduce_add(copies, "cpu", device_module=module)
        parts = devices.scatter(np.arange(4 * len(gpus), dtype=np.float32), gpus,
                                device_module=module)
        joined = devices.gather(parts, 0, "cpu", device_module=module)
        return (np.array_equal(total, mine * len(gpus))
                and np.array_equal(joined, np.arange(4 * len(gpus), dtype=np.float32)))
    return check


def _prefetch_check(comm: cupycomm.Communicator, xp: Any, module: Any) -> Check:
    def check():
        batches = [np.full(1000, k, np.float64) for k in range(5)]
        got = [xp.asnumpy(b) for b in cupycomm.prefetch(batches, comm.device, depth=2,
                                                         device_module=module)]
        return all(np.array_equal(a, b) for a, b in zip(got, batches)) and len(got) == 5
    return check


def _benchmark(comm: cupycomm.Communicator, stand_in: bool, sizes: Sequence[int],
               iters: int) -> Tuple[List[Dict[str, Any]], Check]:
    """The rows of ``all_reduce`` cupycomm against a raw NcclCommunicator, and the check that
    runs it (passes when no result was wrong)."""
    rows: List[Dict[str, Any]] = []

    def check():
        setup = device_setup(comm, compare=True, stand_in=stand_in, raw_only=True)
        try:
            opts = Options(collectives=["all_reduce"], sizes=list(sizes),
                           dtype=np.dtype(np.float32), op="sum", root=0, iters=iters,
                           warmup=max(1, iters // 4), backend="device", async_op=False,
                           check=True, compare=True, device_module=None, no_work=False,
                           csv=None, json=None, plot=None, progress=False)
            measured = measure_collective(ROWS["all_reduce"], opts, comm, setup,
                                          Progress(sys.stderr, False, 0), lambda *line: None)
        finally:
            setup.close()
        rows.extend({"collective": m.collective, "impl": m.impl, "mode": m.mode,
                     "bytes": m.size, "time_us": m.time_us, "busbw_GBps": m.busbw,
                     "wrong": m.wrong, "ratio_vs_cupycomm": m.ratio} for m in measured)
        return all(m.wrong == 0 for m in measured)
    return rows, check


# -- the report -----------------------------------------------------------------------------------
def _line(area: str, v: Verdict) -> Dict[str, Any]:
    return {"area": area, "name": v.name, "verdict": v.verdict, "detail": v.detail,
            "failed_on": list(v.failed_on), "ms": round(v.seconds * 1e3, 3)}


def report(comm: cupycomm.Communicator, *, device_module: Any = None,
           bench_bytes: Sequence[int] = BENCH_BYTES, bench_iters: int = 20,
           say: Callable[[str], None] = lambda line: None) -> Dict[str, Any]:
    """Run every check on ``comm`` and return the report (the same dict on every rank).
    ``device_module`` is what ``comm`` was made with (None: CuPy); ``say`` gets a line per
    check as it ends. Collective.

    Example::

        found = report(cupycomm.init())
        failed = [line for line in found["lines"] if line["verdict"] == "fail"]
    """
    cupy, why = _cupy(device_module)
    gpu = _gpu_of(comm, cupy, why)
    with_gpu = _everywhere(comm, gpu["found"])
    found: Dict[str, Any] = {
        "report": "cupycomm field test", "format": 1,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(getattr(sys, "orig_argv", sys.argv)),
        # rank 0's (sent below; what differs per rank is in the topology)
        "versions": _versions(cupy, why) if comm.rank == 0 else {},
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_VARIABLES)},
        "topology": _topology(comm, gpu),
        "gpu": {"found": with_gpu, "why": "" if with_gpu else next(
            f"rank {j}: {g['why']}" for j, g in enumerate(comm.mpi_comm.allgather(gpu))
            if not g["found"])},
        "lines": [], "benchmark": []}
    found["notes"] = _sharing_notes(found["topology"])
    for note in found["notes"]:
        say(f"  note: {note}")
    found["versions"], found["environment"] = comm.mpi_comm.bcast(
        (found["versions"], found["environment"]), root=0)

    def section(area: str, checks: List[Tuple[str, Check]], synchronize=lambda: None) -> None:
        for v in verdicts(comm, checks, synchronize):
            found["lines"].append(_line(area, v))
            say(f"  {area:9s} {v.name:34s} {v.seconds * 1e3:9.2f} ms  {v.verdict.upper()}"
                + (f": {v.detail}" if v.detail else ""))

    for dtype in CHECKED_DTYPES:
        section("host", [(f"{name} {dtype}", check)
                         for name, check in collective_checks(comm, np, dtype)])
    if not with_gpu:
        say(f"  no GPU found: {found['gpu']['why']}; the device lines did not run")
    else:
        xp = comm.xp
        stand_in = not hasattr(xp, "__version__")
        synchronize = lambda: xp.cuda.get_current_stream().synchronize()
        for dtype in CHECKED_DTYPES:
            section("device", [(f"{name} {dtype}", check)
                               for name, check in collective_checks(comm, xp, dtype)],
                    synchronize)
        features = _feature_checks(comm, xp, cupy, real_cupy=not stand_in)
        section("device", features, synchronize)
        # a stand-in's times are not GPU numbers: its benchmark only shows that the run works
        rows, bench = _benchmark(comm, stand_in, bench_bytes[:1] if stand_in else bench_bytes,
                                 bench_iters)
        section("benchmark", [("all_reduce: cupycomm vs raw NcclCommunicator", bench)])
        found["benchmark"] = rows
    verdict_counts = {k: sum(line["verdict"] == k for line in found["lines"])
                      for k in ("pass", "fail", "not run")}
    status = (EXIT_FAILED if verdict_counts["fail"] else EXIT_PASSED if with_gpu
              else EXIT_NO_GPU)
    found.update(summary=verdict_counts, exit_status=status)
    return found


def run(comm: cupycomm.Communicator, path: str, *, device_module: Any = None,
        bench_bytes: Sequence[int] = BENCH_BYTES, bench_iters: int = 20) -> int:
    """Run the report on ``comm``, print a line per check on rank 0, write the JSON file
    ``path`` there, and return the exit status (see the module docstring). Collective.

    Example::

        status = run(cupycomm.init(), "report.json")
    """
    say = (lambda line: print(line, flush=True)) if comm.rank == 0 else (lambda line: None)
    say(f"cupycomm {cupycomm.__version__} field-test report on {_counted(comm.size, 'rank')}")
    found = report(comm, device_module=device_module, bench_bytes=bench_bytes,
                   bench_iters=bench_iters, say=say)
    versions = found["versions"]
    say("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    topology = found["topology"]
    say(f"topology: {_counted(topology['nodes'], 'node')}, GPUs per node "
        f"{topology['gpus_per_node']}, "
        f"ranks per GPU {topology['ranks_per_gpu'] or 'none'}")
    if not found["gpu"]["found"]:
        say(f"NO GPU FOUND ({found['gpu']['why']}): only the host lines ran")
    counts = found["summary"]
    if comm.rank == 0:
        with private.replacing(path, permissions=0o666) as out:   # reports: the umask's mode
            json.dump(found, out, indent=1)
            out.write("\n")
    say(f"{counts['pass']} passed, {counts['fail']} failed, {counts['not run']} not run; "
        f"report written to {path}; exit status {found['exit_status']}")
    return found["exit_status"]
