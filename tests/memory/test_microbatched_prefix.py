"""A model's first layers in micro-batches, made again for the backward pass: the same step."""

import pytest
import tensorflow as tf

from tf_ucudnn.memory.liveness import analyze
from tf_ucudnn.memory.microbatched_prefix import PrefixError, cut, microbatched_model_call
from tf_ucudnn.memory.performance_model import BudgetError
from tf_ucudnn.memory.planner import plan_step_memory
from tf_ucudnn.memory.tuner import keras_training_step, plan_keras_step
from training_steps import SLOW_LINK, assert_same_step, pooled_conv_model

layers = tf.keras.layers


def _gradient_step(model, batch, forward):
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, forward(x))
        return value, tape.gradient(value, model.trainable_variables)

    return step.get_concrete_function(tf.TensorSpec([batch, 32, 32, 3]),
                                      tf.TensorSpec([batch], tf.int32))


@pytest.mark.parametrize("layer, micro_batches", [("pool1", 3), ("pool2", 4), ("c1", 8)])
def test_the_step_in_micro_batches_gives_the_same_loss_and_gradients(layer, micro_batches):
    model = pooled_conv_model()
    plain = _gradient_step(model, 8, lambda x: model(x, training=True))
    micro = _gradient_step(model, 8, microbatched_model_call(cut(model, layer), micro_batches))
    assert_same_step(plain, micro, rtol=1e-5, atol=1e-6)


def test_only_one_micro_batch_is_held_at_a_time():
    model = pooled_conv_model()
    prefix = cut(model, "pool2")
    step = _gradient_step(model, 16, microbatched_model_call(prefix, 4))
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


def test_cuts_the_model_does_not_allow_are_refused_with_the_reason():
    model = pooled_conv_model()
    with pytest.raises(PrefixError, match="has no layer 'pool9'"):
        cut(model, "pool9")
    inputs = tf.keras.Input((8, 8, 3))
    h = layers.Conv2D(4, 3, padding="same", name="a")(inputs)
    h = layers.BatchNormalization(name="bn")(h)
    skip = layers.Conv2D(4, 3, padding="same", name="b")(h)
    residual = tf.keras.Model(inputs, layers.Add(name="add")([h, skip]))
    with pytest.raises(PrefixError, match="bn: BatchNormalization depends on the whole batch"):
        cut(residual, "b")
    no_batch_norm = tf.keras.Model(inputs, layers.Add()([inputs, layers.Conv2D(
        3, 3, padding="same", name="c")(inputs)]))
    with pytest.raises(PrefixError, match="c: the layers after it read more than its output"):
        cut(no_batch_norm, "c")


def test_plan_keras_step_runs_the_first_layers_in_micro_batches_when_it_must():
    model = pooled_conv_model()
    peak = plan_step_memory(keras_training_step(model, 16), 1 << 40,
                            SLOW_LINK).decisions.prediction.peak_bytes
    step, plan = plan_keras_step(model, 16, int(peak * 0.4), SLOW_LINK)
    assert plan.micro_batched_until == "pool1" and plan.micro_batches in (4, 8)
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
    assert roomy.micro_batched_until is None and not roomy.passed_over
    with pytest.raises(BudgetError, match="tried: whole batches: .*; up to pool1 in 4"):
        plan_keras_step(model, 16, 1 << 10, SLOW_LINK)
