"""The step of a compiled Keras model measured as `MicroBatchCallback` trains it: Keras's own
compiled step (with XLA where the model is compiled so) over a batch's micro-batches, their
gradients summed, one update. The batch-size tuner's `step_ms` for steps the op-time model does
not describe, as XLA's are not.

The measurement trains the model for a few steps on the sample given; its variables and its
optimizer's are put back after each one, so measuring leaves the model as it was.
"""

from __future__ import annotations

import time

import tensorflow as tf

from tf_ucudnn.keras.accumulated_step import accumulating


class _EpochTimer(tf.keras.callbacks.Callback):
    """Appends each epoch's seconds to `seconds`."""

    def __init__(self, seconds: list):
        super().__init__()
        self.seconds = seconds

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)


def fit_two_epochs(model: tf.keras.Model, data, steps: int, epoch_seconds: list,
                   callbacks=()) -> float:
    """`model.fit` for two epochs of `steps` steps, each epoch's seconds appended to
    `epoch_seconds` as it ends (those that ended are there if `fit` fails): the first traces and
    compiles, the second is timed. Its seconds per step."""
    model.fit(data, epochs=2, steps_per_epoch=steps, verbose=0, shuffle=False,
              callbacks=[*callbacks, _EpochTimer(epoch_seconds)])
    return epoch_seconds[-1] / steps


class MeasuredStep:
    """`step_ms(batch, micro_batch_size)` for `tune_keras_batch_size`: the milliseconds of one
    step of `batch` samples in micro-batches of `micro_batch_size` (the whole batch where that is
    not smaller), measured through `model.fit` over `steps` steps after as many to compile
    (`fit_two_epochs`).

    `sample` is data as `model.fit` takes it, an `(x, y)` pair of one batch of any size; each
    batch measured repeats its rows up to the batch size. `measurements` keeps each step measured
    by "batch/micro_batch_size", in milliseconds."""

    def __init__(self, model: tf.keras.Model, sample, steps: int = 10):
        if getattr(model, "optimizer", None) is None:
            raise ValueError(f"{model.name}: the step is measured through model.fit; compile the "
                             "model first")
        if steps < 1:
            raise ValueError(f"steps must be at least 1, not {steps}")
        self.model = model
        self.sample = sample
        self.steps = steps
        self.measurements: dict[str, float] = {}

    def __call__(self, batch: int, micro_batch_size: int) -> float:
        data = tf.data.Dataset.from_tensors(tf.nest.map_structure(
            lambda t: self._rows(t, batch), self.sample)).repeat()
        saved = self._variables()
        try:
            with accumulating(self.model, min(micro_batch_size, batch)):
                milliseconds = fit_two_epochs(self.model, data, self.steps, []) * 1e3
        finally:
            for variable, value in saved:
                variable.assign(value)
            self.model.reset_metrics()
        self.measurements[f"{batch}/{micro_batch_size}"] = milliseconds
        return milliseconds

    def _variables(self) -> list:
        """The model's and its optimizer's variables with their values now, to put back; kept
        on the host, as the device may have no room for a second copy. The optimizer is built
        first, so that its slots made by the measurement are put back to their first values."""
        if not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        variables = {id(v): v for v in [*self.model.variables, *self.model.optimizer.variables]}
        return [(v, v.numpy()) for v in variables.values()]

    @staticmethod
    def _rows(t, batch: int):
        """`t` with its rows repeated to `batch` rows (None, as for a model without labels, as
        it is)."""
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        return tf.gather(t, tf.range(batch) % tf.shape(t)[0])
