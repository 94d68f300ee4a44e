"""CUDA graph capture: a collective issued while the current stream is capturing is captured
(the comm stream forks from and joins back into the capture by events, with no host
synchronisation and no allocation), so replaying the graph replays the collective."""
import numpy as np
import pytest

import nccl_standin as sd
from arrays import GPU, GPU_SKIP_REASON, STANDIN, assert_equal



def test_captured_all_reduce_replays(dcomm):
    x = sd.asarray(np.ones(4))
    out = sd.empty(4)
    stream = sd.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dcomm.all_reduce(x, out=out)             # captured, not run
        dcomm.all_reduce(out)                    # in place on the result
        graph = stream.end_capture()
    assert_equal(STANDIN, x, np.ones(4))         # nothing ran during the capture
    n = dcomm.size
    for replay in range(2):
        x[...] = replay + 1
        graph.launch(stream)
        stream.synchronize()
        assert_equal(STANDIN, out, np.full(4, float((replay + 1) * n * n)))


def test_capture_of_every_preallocated_collective(dcomm):
    n, r = dcomm.size, dcomm.rank
    x = sd.asarray(np.full(2 * n, r + 1.0))
    gathered, part, exchanged = sd.empty(2 * n * n), sd.empty(2), sd.empty(2 * n)
    stream = sd.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dcomm.all_gather(x, out=gathered)
        dcomm.reduce_scatter(x, out=part)
        dcomm.all_to_all(x, out=exchanged)
        dcomm.broadcast(x, 0)
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    everyone = np.repeat(np.arange(1.0, n + 1), 2 * n)
    assert_equal(STANDIN, gathered, everyone)
    assert_equal(STANDIN, part, np.full(2, n * (n + 1) / 2))
    assert_equal(STANDIN, exchanged, np.repeat(np.arange(1.0, n + 1), 2))
    assert_equal(STANDIN, x, np.full(2 * n, 1.0))


def test_async_collective_in_a_capture_must_be_waited_in_it(dcomm):
    stream = sd.Stream(non_blocking=True)
    x = sd.asarray(np.ones(3))
    with stream:
        stream.begin_capture()
        dcomm.all_reduce(x, async_op=True).wait()     # joins the comm stream back
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    assert_equal(STANDIN, x, np.full(3, float(dcomm.size)))
    with stream:
        stream.begin_capture()
        dcomm.all_reduce(x, async_op=True)            # never joined: CUDA refuses the capture
        with pytest.raises(sd.NcclError, match="not joined back"):
            stream.end_capture()


@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason=GPU_SKIP_REASON)
def test_gpu_graph_replays_the_collective():
    cupy = GPU.module
    with GPU.comm() as comm:
        comm.device.use()
        comm.init_device()
        x = cupy.ones(1024, cupy.float32)
        out = cupy.empty_like(x)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            comm.all_reduce(x, out=out)
            graph = stream.end_capture()
            for replay in range(3):
                x.fill(replay + 1)
                graph.launch(stream)
            stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), np.full(1024, 3.0 * comm.size))
