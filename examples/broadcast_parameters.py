"""Broadcast of model parameters from rank 0, so every rank starts from the same weights.

    mpiexec -n 4 python examples/broadcast_parameters.py
"""
import numpy

import cupycomm

comm = cupycomm.init()
xp = comm.xp

# Every rank initialises its own weights (differently); rank 0's are the ones to keep.
rng = numpy.random.default_rng(seed=comm.rank)
params = {"w": xp.asarray(rng.normal(size=(4, 3))), "b": xp.asarray(rng.normal(size=3))}
for value in params.values():
    comm.broadcast(value, root=0)                 # in place on every rank

reference = numpy.random.default_rng(seed=0)
expected_w, expected_b = reference.normal(size=(4, 3)), reference.normal(size=3)
assert numpy.allclose(numpy.asarray(params["w"].tolist()), expected_w)
assert numpy.allclose(numpy.asarray(params["b"].tolist()), expected_b)
checksum = comm.all_reduce(xp.array([float(params["w"].sum())]), op="max")
if comm.rank == 0:
    print(f"parameters broadcast to {comm.size} ranks; checksum {float(checksum[0]):.6f}")
