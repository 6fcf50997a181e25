"""A model's first layers in micro-batches, made again for the backward pass: the same step."""

import numpy as np
import pytest
import tensorflow as tf
from training_steps import SLOW_LINK, assert_same_step, pooled_conv_model

from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.keras.micro_batched_prefix import cut, micro_batched_model_call
from tf_ucudnn.keras.planned_step import keras_training_step, plan_keras_step
from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.step_plan import plan_step_memory

layers = tf.keras.layers


def _loss_and_gradients(model, forward):
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, forward(x))
        return value, tape.gradient(value, model.trainable_variables)
    return step


def _gradient_step(model, batch, forward):
    return _loss_and_gradients(model, forward).get_concrete_function(
        tf.TensorSpec([batch, 32, 32, 3]), tf.TensorSpec([batch], tf.int32))


@pytest.mark.parametrize("layer, micro_batches", [("pool1", 3), ("pool2", 4), ("c1", 8)])
def test_the_step_in_micro_batches_gives_the_same_loss_and_gradients(layer, micro_batches):
    model = pooled_conv_model()
    plain = _gradient_step(model, 8, lambda x: model(x, training=True))
    micro = _gradient_step(model, 8, micro_batched_model_call(cut(model, layer), micro_batches))
    assert_same_step(plain, micro, rtol=1e-5, atol=1e-6)


def test_only_one_micro_batch_is_held_at_a_time():
    model = pooled_conv_model()
    prefix = cut(model, "pool2")
    step = _gradient_step(model, 16, micro_batched_model_call(prefix, 4))
    report = analyze(step)
    # The micro-batches' recomputations belong to the backward pass (they wait for the
    # output's gradient), so nothing of the prefix but its output is kept from the forward.
    assert report.kept() and not any(t.name.startswith(prefix.head.name) for t in report.kept())
    convolutions = [op for op in step.graph.get_operations()
                    if op.type == "Conv2D" and op.name.startswith(prefix.head.name)]
    assert len(convolutions) == 3 * 4 * 2  # three layers, four micro-batches, forward and again
    assert all(op.outputs[0].shape[0] == 4 for op in convolutions)
    whole = analyze(_gradient_step(model, 16, lambda x: model(x, training=True)))
    assert report.peak_bytes < whole.peak_bytes / 2


def _stem_model():
    """A ResNet-style stem (padding, strided convolution, batch normalization, ReLU, padding,
    max pooling), then a block with a batch normalization of its own and a dense head."""
    tf.keras.utils.set_random_seed(5)
    inputs = tf.keras.Input((16, 16, 3))
    h = layers.ZeroPadding2D(1)(inputs)
    h = layers.Conv2D(8, 3, strides=2, name="conv1")(h)
    h = layers.BatchNormalization(name="conv1_bn", momentum=0.5)(h)
    h = layers.ReLU(name="conv1_relu")(h)
    h = layers.ZeroPadding2D(1)(h)
    h = layers.MaxPooling2D(3, 2, name="pool1")(h)
    h = layers.Conv2D(8, 3, padding="same", name="conv2")(h)
    h = layers.BatchNormalization(name="conv2_bn")(h)
    h = layers.GlobalAveragePooling2D()(layers.ReLU()(h))
    return tf.keras.Model(inputs, layers.Dense(4)(h))


@pytest.mark.parametrize("layer, micro_batches", [("pool1", 3), ("pool1", 7), ("conv1_bn", 2)])
def test_a_stem_with_batch_normalization_runs_in_micro_batches_with_the_whole_batch_statistics(
        layer, micro_batches):
    model = _stem_model()
    prefix = cut(model, layer)
    assert prefix.normalization.name == "conv1_bn"
    assert (prefix.after_normalization is None) == (layer == "conv1_bn")
    norm = model.get_layer("conv1_bn")
    moving = [norm.moving_mean.numpy(), norm.moving_variance.numpy()]
    x = tf.random.stateless_normal([7, 16, 16, 3], seed=[1, 2]) * 3.0 + 1.0
    y = tf.range(7) % 4
    loss, gradients = _loss_and_gradients(model, lambda x: model(x, training=True))(x, y)
    expected_moving = [norm.moving_mean.numpy(), norm.moving_variance.numpy()]
    norm.moving_mean.assign(moving[0])
    norm.moving_variance.assign(moving[1])
    micro_loss, micro_gradients = _loss_and_gradients(
        model, micro_batched_model_call(prefix, micro_batches))(x, y)
    np.testing.assert_allclose(micro_loss.numpy(), loss.numpy(), rtol=1e-6)
    for variable, a, b in zip(model.trainable_variables, micro_gradients, gradients):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=variable.path)
    # Keras's own update of the moving statistics, from the same batch statistics.
    np.testing.assert_allclose(norm.moving_mean.numpy(), expected_moving[0], rtol=1e-5)
    np.testing.assert_allclose(norm.moving_variance.numpy(), expected_moving[1], rtol=1e-5)
    assert not np.allclose(expected_moving[1], moving[1])


def test_a_stem_holds_one_micro_batch_of_its_activations_at_a_time():
    model = _stem_model()
    prefix = cut(model, "pool1")

    def step(forward):
        return _loss_and_gradients(model, forward).get_concrete_function(
            tf.TensorSpec([16, 16, 16, 3]), tf.TensorSpec([16], tf.int32))
    micro = step(micro_batched_model_call(prefix, 4))
    whole = step(lambda x: model(x, training=True))
    convolutions = [op for op in micro.graph.get_operations()
                    if op.type == "Conv2D" and "conv1" in op.name]
    # Statistics, output, and twice again for the backward pass, in four micro-batches.
    assert len(convolutions) == 4 * 4
    assert all(op.outputs[0].shape[0] == 4 for op in convolutions)
    report = analyze(micro)
    assert not any(t.name.startswith(prefix.before_normalization.name) for t in report.kept())
    assert report.peak_bytes < analyze(whole).peak_bytes


def test_cuts_the_model_does_not_allow_are_refused_with_the_reason():
    model = pooled_conv_model()
    with pytest.raises(PrefixError, match="has no layer 'pool9'"):
        cut(model, "pool9")
    inputs = tf.keras.Input((8, 8, 3))
    h = layers.Conv2D(4, 3, padding="same", name="a")(inputs)
    h = layers.BatchNormalization(name="bn")(h)
    h = layers.Conv2D(4, 3, padding="same", name="b")(h)
    h = layers.BatchNormalization(name="bn2")(h)
    two_normalizations = tf.keras.Model(inputs, layers.Conv2D(4, 3, name="c")(h))
    with pytest.raises(PrefixError, match="bn: BatchNormalization depends on the whole batch, "
                       "and so do bn2: only one normalization's statistics"):
        cut(two_normalizations, "bn2")
    h = layers.BatchNormalization(name="bn3")(inputs)
    skip = tf.keras.Model(inputs, layers.Add(name="add")([h, layers.Conv2D(
        3, 3, padding="same", name="d")(inputs)]))
    with pytest.raises(PrefixError, match="bn3: BatchNormalization depends on the whole batch, "
                       "and the layers after it read more than its output"):
        cut(skip, "add")
    no_batch_norm = tf.keras.Model(inputs, layers.Add()([inputs, layers.Conv2D(
        3, 3, padding="same", name="c")(inputs)]))
    with pytest.raises(PrefixError, match="c: the layers after it read more than its output"):
        cut(no_batch_norm, "c")


def test_plan_keras_step_runs_the_first_layers_in_micro_batches_when_it_must():
    model = pooled_conv_model()
    peak = plan_step_memory(keras_training_step(model, 16), 1 << 40,
                            SLOW_LINK).decisions.prediction.peak_bytes
    step, plan = plan_keras_step(model, 16, int(peak * 0.4), SLOW_LINK)
    assert plan.prefix_end == "pool1" and plan.micro_batches in (4, 8)
    assert plan.passed_over[0].startswith("whole batches:") and "MiB over" in plan.passed_over[0]
    assert plan.plan.decisions.prediction.peak_bytes <= int(peak * 0.4)
    x = tf.random.stateless_normal([16, 32, 32, 3], seed=[1, 2])
    y = tf.range(16) % 4
    expected = keras_training_step(model, 16)
    weights = [w.numpy() for w in model.trainable_variables]
    expected_loss = expected(x, y).numpy()
    after_plain = [w.numpy() for w in model.trainable_variables]
    for w, value in zip(model.trainable_variables, weights):
        w.assign(value)
    assert step(x, y).numpy() == pytest.approx(expected_loss, rel=1e-5)
    for w, value in zip(model.trainable_variables, after_plain):
        assert w.numpy() == pytest.approx(value, rel=1e-4, abs=1e-6)
    # Enough room without micro-batches: none.
    _, roomy = plan_keras_step(model, 16, peak, SLOW_LINK)
    assert roomy.prefix_end is None and not roomy.passed_over
    with pytest.raises(BudgetError, match="tried: whole batches: .*; up to pool1 in 4"):
        plan_keras_step(model, 16, 1 << 10, SLOW_LINK)


def test_plan_keras_step_runs_a_stem_with_batch_normalization_in_micro_batches():
    model = _stem_model()
    peak = plan_step_memory(keras_training_step(model, 16), 1 << 40,
                            SLOW_LINK).decisions.prediction.peak_bytes
    step, plan = plan_keras_step(model, 16, int(peak * 0.5), SLOW_LINK)
    assert plan.prefix_end == "pool1"
    assert plan.plan.decisions.prediction.peak_bytes <= int(peak * 0.5)
    x = tf.random.stateless_normal([16, 16, 16, 3], seed=[3, 4])
    y = tf.range(16) % 4
    before = [w.numpy() for w in model.weights]
    expected_loss = keras_training_step(model, 16)(x, y).numpy()
    expected = [w.numpy() for w in model.weights]  # the moving statistics too
    for w, value in zip(model.weights, before):
        w.assign(value)
    assert step(x, y).numpy() == pytest.approx(expected_loss, rel=1e-5)
    for w, value in zip(model.weights, expected):
        np.testing.assert_allclose(w.numpy(), value, rtol=1e-4, atol=1e-6, err_msg=w.path)
    # Asked not to try whole batches: the stem in micro-batches though whole batches fit.
    _, asked = plan_keras_step(model, 16, peak, SLOW_LINK, whole_batches=False)
    assert asked.prefix_end == "pool1"
    assert asked.passed_over == ["whole batches: not tried, as asked"]
