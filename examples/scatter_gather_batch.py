"""Scatter a batch from rank 0, process each part where it lands, gather the results back.

    mpiexec -n 4 python examples/scatter_gather_batch.py
"""
import cupycomm

comm = cupycomm.init()
xp = comm.xp
per_rank = 2

batch = None
if comm.rank == 0:                                   # only the root holds the whole batch
    batch = xp.arange(comm.size * per_rank * 3, dtype=xp.float64).reshape(-1, 3)
part = comm.scatter(batch, root=0, out=xp.empty((per_rank, 3)))

processed = part ** 2                                # each rank works on its rows

results = comm.gather(processed, root=0)             # (size, per_rank, 3) on rank 0, None elsewhere
if comm.rank == 0:
    assert results.reshape(-1, 3).tolist() == (batch ** 2).tolist()
    print(f"scattered {batch.shape[0]} rows to {comm.size} ranks and gathered them back squared")
else:
    assert results is None
