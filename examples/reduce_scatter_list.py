"""reduce_scatter of a list: rank j ends up with the sum over ranks of everyone's j-th array.

    mpiexec -n 4 python examples/reduce_scatter_list.py

The pattern of sharded optimisers (ZeRO): each rank owns the reduced gradient of its shard.
"""
import cupycomm

comm = cupycomm.init()
xp = comm.xp

# Rank r's contribution to shard j is (r + 1) * (j + 1), as 3 numbers.
shards = [xp.full(3, float((comm.rank + 1) * (j + 1))) for j in range(comm.size)]
mine = comm.reduce_scatter(shards)               # a new array: this rank's reduced shard

expected = (comm.rank + 1) * sum(r + 1 for r in range(comm.size))
assert mine.shape == (3,) and all(float(v) == expected for v in mine.tolist())
print(f"rank {comm.rank}: reduced shard {mine.tolist()}")
