"""A small CNN trained by Keras under a memory budget its training step would exceed, on the CPU:
MicroBatchCallback plans the step's swaps, recomputations and micro-batched first layers before
the first step, trains with them, prints the plan, and writes the memory timeline.

    python examples/train_beyond_memory.py [timeline.png]
"""

import sys

import keras
import numpy as np

import tf_ucudnn
from tf_ucudnn.keras import keras_training_step
from tf_ucudnn.memory import DeviceModel, analyze
from tf_ucudnn.memory.timeline import memory_timeline, write_timeline_png

BATCH = 64


def small_cnn() -> keras.Model:
    """Convolutions with batch normalization, whose statistics need the whole batch: the step
    is planned with swaps and recomputations (a model without it would train in micro-batches
    of the whole step instead, `callback.accumulation`)."""
    layers = keras.layers

    def conv_bn_relu(filters):
        return [layers.Conv2D(filters, 3, padding="same", use_bias=False),
                layers.BatchNormalization(), layers.ReLU()]
    return keras.Sequential([
        keras.Input((32, 32, 3)), *conv_bn_relu(32), *conv_bn_relu(32), layers.MaxPooling2D(),
        *conv_bn_relu(64), layers.MaxPooling2D(), *conv_bn_relu(64),
        layers.GlobalAveragePooling2D(), layers.Dense(10),
    ])


def main(png: str) -> tf_ucudnn.MicroBatchCallback:
    keras.utils.set_random_seed(0)
    model = small_cnn()
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    unplanned = analyze(keras_training_step(model, BATCH))
    needed = unplanned.peak_bytes + unplanned.persistent_bytes
    budget = int(needed * 0.75)
    print(f"the training step needs {needed / 2**20:.1f} MiB; the budget is "
          f"{budget / 2**20:.1f} MiB")

    callback = tf_ucudnn.MicroBatchCallback(
        workspace_limit=None,  # the CPU has no cuDNN workspace to plan
        memory_budget=budget,
        # A host link of 12 GB/s each way, as a PCIe 3 GPU has.
        device_model=DeviceModel("example", device_to_host=12e9, host_to_device=12e9))
    rng = np.random.default_rng(0)
    images = rng.random((4 * BATCH, 32, 32, 3), dtype=np.float32)
    labels = rng.integers(0, 10, 4 * BATCH)
    history = model.fit(images, labels, batch_size=BATCH, epochs=2, verbose=0,
                        callbacks=[callback])
    print("losses:", [round(loss, 4) for loss in history.history["loss"]])

    write_timeline_png(png, memory_timeline(callback.memory_plan.plan, unplanned),
                       title=f"small CNN, batch {BATCH}")
    print(f"wrote {png}")
    return callback


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "memory_timeline.png")
