"""How much of the host-to-device copies ``cupycomm.prefetch`` hides behind compute, on a GPU.

Times, per batch of host memory (NumPy, pageable): the parts one at a time (CuPy's own copy
from pageable memory, the host copy into pinned memory by one thread and by prefetch's
threads, the DMA from pinned memory, the compute step), then three loops over the same
batches with a step of ``factor`` x the copy's time: copy, wait, compute (serial); a plain
CuPy loop (``step(cupy.asarray(b))``), whose pageable copies CUDA already stages on the host
while the GPU computes; and the prefetching loop. Every figure is the better of two runs.

    python benchmarks/prefetch_overlap.py                       # 12 batches of 64 MiB
    python benchmarks/prefetch_overlap.py --mib 16 --device-module cupycomm.testing.standin
"""
import argparse
import importlib
import time
from typing import Any, Callable, List

import numpy as np

import cupycomm
from cupycomm.devices.prefetch import _stage


def per_batch(stream: Any, loop: Callable[[], Any], batches: int) -> float:
    """Seconds per batch of ``loop()`` over ``batches`` batches on ``stream``: the better of
    two runs after an untimed one (the memory pool's first allocations, the kernels'
    compilation at their first launch)."""
    loop()
    times = []
    for _ in range(2):
        stream.synchronize()
        start = time.perf_counter()
        loop()
        stream.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) / batches


def step(x: Any, reps: int) -> Any:
    """The compute step: ``reps`` repetitions of two elementwise kernels over ``x``."""
    for _ in range(reps):
        x = x * np.float32(0.999) + np.float32(0.5)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB per batch (64)")
    parser.add_argument("--batches", type=int, default=12, help="batches per loop (12)")
    parser.add_argument("--device-module", default="cupy", help="cupy, or the stand-in")
    args = parser.parse_args()
    xp = importlib.import_module(args.device_module)
    cuda = xp.cuda
    count = args.mib * 2 ** 20 // 4
    rng = np.random.default_rng(0)
    batches = [rng.random(count, dtype=np.float32) for _ in range(args.batches)]
    module = None if args.device_module == "cupy" else xp

    with cuda.Device(0):
        stream = cuda.Stream(non_blocking=True)
        with stream:
            def best(loop: Callable[[], Any]) -> float:
                return per_batch(stream, loop, len(batches))

            memory = cuda.alloc_pinned_memory(count * 4)
            pinned = np.ndarray((count,), np.float32, buffer=memory)
            target = xp.empty(count, np.float32)
            runtime = cuda.runtime

            def dma() -> None:
                for _ in batches:
                    runtime.memcpyAsync(target.data.ptr, memory.ptr, count * 4,
                                        runtime.memcpyHostToDevice, stream.ptr)

            parts = {
                "cupy.asarray (pageable)": best(lambda: [xp.asarray(b) for b in batches]),
                "host copy to pinned, 1 thread":
                    best(lambda: [np.copyto(pinned, b) for b in batches]),
                "host copy to pinned, prefetch's threads":
                    best(lambda: [_stage(pinned, b) for b in batches]),
                "DMA from pinned": best(dma),
            }
            x = xp.asarray(batches[0])
            per_rep = best(lambda: step(x, 10)) * len(batches) / 10
            copy = parts["cupy.asarray (pageable)"]
            for name, seconds in parts.items():
                print(f"{name:42s} {seconds * 1e3:8.2f} ms  {count * 4 / seconds / 1e9:6.1f} GB/s")
            print(f"{'one step repetition':42s} {per_rep * 1e3:8.3f} ms")

            for factor in (0.5, 1, 2):
                reps = max(1, round(factor * copy / per_rep))

                def serial() -> List[Any]:
                    out = []
                    for b in batches:
                        y = xp.asarray(b)
                        stream.synchronize()
                        out.append(step(y, reps))
                    return out
                loops = {
                    "compute only": best(lambda: [step(x, reps) for _ in batches]),
                    "serial (copy, wait, compute)": best(serial),
                    "plain CuPy loop": best(lambda: [step(xp.asarray(b), reps) for b in batches]),
                    "prefetch depth 2": best(lambda: [
                        step(b, reps) for b in cupycomm.prefetch(batches, 0, depth=2,
                                                                 device_module=module)]),
                }
                base = loops["serial (copy, wait, compute)"]
                plain = loops["plain CuPy loop"]
                print(f"\nstep = {factor} x the copy ({reps} repetitions)")
                for name, seconds in loops.items():
                    print(f"{name:42s} {seconds * 1e3:8.2f} ms/batch  {seconds / base:5.2f} of "
                          f"serial  {seconds / plain:5.2f} of plain")


if __name__ == "__main__":
    main()
