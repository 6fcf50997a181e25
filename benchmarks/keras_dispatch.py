"""Keras's training step dispatched as Keras does by default, against the same step with a callback
that reads each step's logs (any callback with an `on_train_batch_end` that is not `async_safe`):
Keras then waits for each step before it starts the next. One process, one compiled step, fits
taking turns, images per second from the epochs after the first of each fit.

    python benchmarks/keras_dispatch.py --model resnet50 --batch 128 --out $OUT/dispatch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import keras
import tensorflow as tf
from gpu_names import device_name

from tf_ucudnn.keras import models


class EpochSeconds(keras.callbacks.Callback):
    """Each epoch's seconds; no batch hook, so Keras's dispatch stays as it is."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


class ReadsEachStep(keras.callbacks.Callback):
    """A batch hook that is not async-safe: Keras hands it each step's logs as numbers."""

    def on_train_batch_end(self, batch, logs=None):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="per fit, the first not timed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    model = models.load_model(args.model)
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images = tf.random.stateless_uniform([args.batch, *model.input_shape[1:]], seed=[1, 2])
    labels = tf.random.stateless_uniform([args.batch], [3, 4], maxval=model.output_shape[-1],
                                         dtype=tf.int32)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)  # compiles the step once
    result = {"model": args.model, "batch": args.batch, "jit_compile": bool(model.jit_compile),
              "device": device_name(),
              "img_per_s": {"keras_default": [], "reading_each_step": []}}
    for _ in range(args.rounds):
        for label, extra in (("keras_default", []), ("reading_each_step", [ReadsEachStep()])):
            timer = EpochSeconds()
            model.fit(data, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0,
                      callbacks=[timer, *extra])
            seconds = statistics.median(timer.seconds[1:])
            result["img_per_s"][label].append(round(args.batch * args.steps / seconds, 1))
            print(label, result["img_per_s"][label][-1], "img/s", flush=True)
            with open(args.out, "w") as out:
                json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
