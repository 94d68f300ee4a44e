"""The mean of a value across ranks: all_reduce then divide, and the same with op="avg".

    mpiexec -n 4 python examples/mean_across_ranks.py

Runs on NumPy arrays through MPI without a GPU, and unchanged on CuPy arrays through NCCL
where every rank has one (comm.xp picks the array module).
"""
import cupycomm

comm = cupycomm.init()
xp = comm.xp

loss = xp.array([float(comm.rank + 1)])          # each rank's local value: 1, 2, 3, ...
total = comm.all_reduce(loss.copy())             # in place: every rank gets the sum
mean = total / comm.size
assert float(mean[0]) == (comm.size + 1) / 2

averaged = comm.all_reduce(loss.copy(), op="avg")   # the same in one call
assert float(averaged[0]) == float(mean[0])

if comm.rank == 0:
    print(f"mean over {comm.size} ranks: {float(mean[0])} (all_reduce then divide), "
          f"{float(averaged[0])} (op='avg')")
