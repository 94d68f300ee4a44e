"""One process, several GPUs (the torch.cuda.comm / DataParallel pattern): scatter a batch to
the devices, copy a small layer to each, apply it everywhere at once, gather the outputs, and
sum the per-device gradients. Without a GPU the same code runs on three host ("cpu") places.

    python examples/multi_gpu_one_process.py
"""
import numpy as np

from cupycomm import devices

places = list(range(devices.count())) or ["cpu"] * 3    # every GPU here, else 3 host parts
batch = np.arange(12 * 4, dtype=np.float64).reshape(12, 4) / 10
weights = np.linspace(-1.0, 1.0, 4 * 2).reshape(4, 2)  # a tiny linear layer with a ReLU

parts = devices.scatter(batch, places)                  # rows 0..3 to the first place, ...
layers = devices.broadcast(weights, places)             # the layer on every place
outputs = devices.parallel_apply(lambda x, w: (x @ w).clip(0), list(zip(parts, layers)))
result = devices.gather(outputs, destination="cpu")     # the rows back in order, on the host
assert np.allclose(result, (batch @ weights).clip(0))

grads = devices.parallel_apply(lambda x, y: x.T @ y, list(zip(parts, outputs)))
total = devices.reduce_add(grads, destination="cpu")    # summed over the places
assert np.allclose(total, batch.T @ result)

print(f"scattered {len(batch)} rows to {len(places)} places {places}, applied the layer, "
      f"gathered them back: ok; summed {len(grads)} gradients: ok")
