"""The step measured as the callback trains it: in its micro-batches, the model left as it was."""

import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.keras.step_timing import MeasuredStep


class _BatchesSeen(tf.keras.layers.Layer):
    """Records the batch dimension of each trace of its call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x):
        self.seen.append(x.shape[0])
        return x


def _model(optimizer):
    tf.keras.utils.set_random_seed(3)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 3)), _BatchesSeen(),
        layers.Conv2D(4, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
        layers.GlobalAveragePooling2D(), layers.Dropout(0.5), layers.Dense(3),
    ])
    model.compile(optimizer, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _sample(rows=3):
    return (tf.random.stateless_normal([rows, 8, 8, 3], seed=[1, 2]), tf.range(rows) % 3)


def test_the_step_runs_in_its_micro_batches_and_leaves_the_model_as_it_was():
    model = _model(tf.keras.optimizers.Adam(0.1))
    before = [v.numpy() for v in model.variables]
    measure = MeasuredStep(model, _sample(), steps=2)

    milliseconds = measure(16, 4)

    assert milliseconds > 0 and measure.measurements == {"16/4": milliseconds}
    # Keras's own step traced at the micro-batch, not at the batch.
    assert 4 in model.layers[0].seen and 16 not in model.layers[0].seen
    assert "train_step" not in model.__dict__ and model.train_function is None
    for value, variable in zip(before, model.variables):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
    # The optimizer's slots and iteration count, made by the measurement, are back at zero.
    assert model.optimizer.iterations.numpy() == 0
    assert all(not np.any(v.numpy()) for v in model.optimizer.variables
               if "momentum" in v.path or "velocity" in v.path)


def test_a_micro_batch_no_smaller_than_the_batch_runs_the_whole_step():
    model = _model(tf.keras.optimizers.SGD(0.1))
    measure = MeasuredStep(model, (*_sample(5), None), steps=1)  # (x, y, no sample weights)
    measure(6, 6)
    measure(2, 8)
    assert 6 in model.layers[0].seen and 2 in model.layers[0].seen
    assert set(measure.measurements) == {"6/6", "2/8"}


def test_the_tuner_takes_the_measured_step():
    from training_steps import SLOW_LINK

    from tf_ucudnn.keras.batch_size_tuner import tune_keras_batch_size

    model = _model(tf.keras.optimizers.SGD(0.1))
    measure = MeasuredStep(model, _sample(), steps=1)
    report = tune_keras_batch_size(model, (4, 8), 1 << 40, SLOW_LINK, step_ms=measure,
                                   batch_norm_statistics="micro_batch")
    assert [t.step_ms for t in report.trials] == [
        measure.measurements[f"{t.batch_size}/{t.accumulated_micro_batch}"]
        for t in report.trials]
    assert report.best is not None


def test_a_model_not_compiled_is_refused_by_name():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)], name="plain")
    with pytest.raises(ValueError, match="plain: .*compile the model first"):
        MeasuredStep(model, (tf.zeros([1, 4]), tf.zeros([1])))
