"""One process, many GPUs: the torch.cuda.comm family (``comm.py``) and prefetch.

- ``comm.py``: broadcast, scatter, gather and sums across this process's devices, and
  parallel_apply; ``places.py`` checks their arguments (places are GPU ids or ``"cpu"``);
  ``copies.py`` moves the data (NCCL groups go through ``cupycomm/backends/local.py``);
  ``nested.py`` walks nested tuples, lists and dicts of arrays.
- ``prefetch.py``: host-to-device copies of batches on a side stream, ahead of their use.
"""
from .comm import (BUFFER_BYTES, HOST, broadcast, broadcast_coalesced, count, gather,
                   parallel_apply, reduce_add, reduce_add_coalesced, scatter)
from .prefetch import Prefetcher, prefetch

__all__ = ["broadcast", "broadcast_coalesced", "scatter", "gather", "reduce_add",
           "reduce_add_coalesced", "parallel_apply", "count", "HOST", "BUFFER_BYTES",
           "prefetch", "Prefetcher"]
