"""all_gather into a preallocated (size, ...) buffer, asynchronously, with work in between.

    mpiexec -n 4 python examples/all_gather_async.py
"""
import cupycomm

comm = cupycomm.init()
xp = comm.xp

features = xp.arange(5, dtype=xp.float32) + 100 * comm.rank
gathered = xp.empty((comm.size, 5), dtype=xp.float32)        # allocated once, reused

work = comm.all_gather(features, out=gathered, async_op=True)
local = float((features * 2).sum())                            # overlaps the communication
result = work.wait()                                           # the buffer, now filled

assert result is gathered
for rank in range(comm.size):
    assert gathered[rank].tolist() == [100.0 * rank + i for i in range(5)]
if comm.rank == 0:
    print(f"gathered {tuple(gathered.shape)} from {comm.size} ranks; local work {local}")
