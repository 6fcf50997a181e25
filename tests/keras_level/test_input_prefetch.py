"""InputPrefetch: Keras trains the batches it would have, in its order, from copies made ahead."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.keras.input_prefetch import InputPrefetch

DEVICE = "/device:CPU:0"  # the copies' device in these tests: the thread and the order are real


def _batches_seen(prefetch, iterator, calls):
    """What `calls` calls train, as lists, and whether the last one ended the data."""
    seen = []

    def train_function(batches):
        (batch,) = list(batches)
        seen.append(tf.nest.map_structure(lambda t: t.numpy().tolist(), batch))
        return len(seen)
    for _ in range(calls):
        try:
            prefetch(train_function, iterator)
        except StopIteration:
            return seen, True
    return seen, False


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_each_batch_is_trained_once_in_order_and_the_end_stays_the_end(depth):
    prefetch = InputPrefetch(DEVICE, depth)
    iterator = iter(tf.data.Dataset.range(10).batch(3))
    seen, ended = _batches_seen(prefetch, iterator, 6)
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]] and ended
    with pytest.raises(StopIteration):
        prefetch(lambda batches: None, iterator)
    prefetch.close()


def test_tensors_that_cannot_be_copied_come_through_as_they_are():
    prefetch = InputPrefetch(DEVICE)
    data = tf.data.Dataset.from_tensor_slices(([1.0, 2.0], [b"a", b"b"])).batch(1)
    seen, _ = _batches_seen(prefetch, iter(data), 2)
    assert seen == [([1.0], [b"a"]), ([2.0], [b"b"])]
    prefetch.close()


def test_an_iterator_handed_over_again_goes_on_and_a_new_one_starts_afresh():
    prefetch = InputPrefetch(DEVICE, 2)
    first = iter(tf.data.Dataset.range(100).batch(1))
    assert _batches_seen(prefetch, first, 2)[0] == [[0], [1]]
    assert _batches_seen(prefetch, first, 1)[0] == [[2]]  # the copies made ahead, not skipped
    second = iter(tf.data.Dataset.range(200, 300).batch(1))
    assert _batches_seen(prefetch, second, 2)[0] == [[200], [201]]
    prefetch.close()


def test_an_error_in_the_data_reaches_the_step_that_would_have_taken_the_batch():
    prefetch = InputPrefetch(DEVICE, 3)
    data = tf.data.Dataset.from_tensor_slices([1.0, 2.0, np.nan, 4.0]).map(
        lambda x: tf.debugging.check_numerics(x, "a sample that is not a number")).batch(1)
    iterator = iter(data)
    assert _batches_seen(prefetch, iterator, 2)[0] == [[1.0], [2.0]]
    with pytest.raises(tf.errors.InvalidArgumentError, match="not a number"):
        prefetch(lambda batches: None, iterator)


def test_batches_handed_over_are_trained_as_they_are_and_others_are_named():
    prefetch = InputPrefetch(DEVICE)
    assert prefetch(lambda batches: list(batches), [1, 2]) == [1, 2]
    assert prefetch.passed_over is None
    prefetch(lambda batches: None, (batch for batch in [1]))
    assert prefetch.passed_over == ("the train function was given a generator, not a tf.data "
                                    "iterator")


def test_close_stops_the_copying_thread():
    prefetch = InputPrefetch(DEVICE, 2)
    _batches_seen(prefetch, iter(tf.data.Dataset.range(3).repeat().batch(2)), 1)
    assert any(t.name == "tf_ucudnn_input_prefetch" for t in threading.enumerate())
    prefetch.close()
    assert not any(t.name == "tf_ucudnn_input_prefetch" for t in threading.enumerate())


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be 1 or more, got 0"):
        InputPrefetch(DEVICE, 0)


class _Prefetching(keras.callbacks.Callback):
    def __init__(self, depth):
        super().__init__()
        self.prefetch = InputPrefetch(DEVICE, depth)

    def on_train_begin(self, logs=None):
        inner = self.model.train_function
        self.model.train_function = lambda iterator: self.prefetch(inner, iterator)

    def on_train_end(self, logs=None):
        self.prefetch.close()


def _fit(callbacks, data, **fit_args):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(data, verbose=0, callbacks=callbacks, **fit_args)
    return model.get_weights(), history.history["loss"]


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("repeated", [False, True], ids=["epochs_of_the_data", "steps_per_epoch"])
def test_keras_trains_to_the_same_weights_through_the_prefetch(depth, repeated):
    rng = np.random.RandomState(0)
    x, y = rng.rand(40, 6).astype("float32"), np.arange(40) % 3
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # 16 + 16 + 8
    # Repeated, Keras hands over one iterator for all epochs, 4 steps each: epochs end mid-data.
    fit_args = {"epochs": 3, "steps_per_epoch": 4} if repeated else {"epochs": 3}
    data = data.repeat() if repeated else data
    plain_weights, plain_loss = _fit([], data, **fit_args)
    weights, loss = _fit([_Prefetching(depth)], data, **fit_args)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    for a, b in zip(weights, plain_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6)
