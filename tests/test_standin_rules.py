"""Each rule of the stand-in (see the list in ``nccl_standin``'s docstring), broken on purpose:
the stand-in must refuse what CUDA or NCCL would refuse, or the suite proves nothing."""
import pytest
from mpi4py import MPI

import nccl_standin as sd
from cupycomm.backends.nccl import NcclBackend, nccl_module


class Tracker:
    seq = 0


# -- the nccl submodule exists once imported --------------------------------------------------------
def test_cuda_has_no_nccl_until_it_is_imported():
    sd.forget_nccl_import()
    with pytest.raises(AttributeError):
        sd.cuda.nccl
    backend = NcclBackend(MPI.COMM_SELF, 0, sd, Tracker())   # imports it, as it must
    assert sd.cuda.nccl is sd.nccl
    backend.close()


def test_nccl_that_cannot_load_is_named(monkeypatch):
    monkeypatch.setattr(sd.nccl, "available", False)
    with pytest.raises(RuntimeError, match="libnccl could not load"):
        nccl_module(sd)
    with pytest.raises(RuntimeError, match="libnccl could not load"):
        NcclBackend(MPI.COMM_SELF, 0, sd, Tracker())
