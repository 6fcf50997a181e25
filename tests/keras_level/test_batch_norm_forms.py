"""Fused batch normalization against Keras's own: same outputs, gradients and moving statistics,
one kernel each way, and the layers it leaves alone named with the reason."""

import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.keras.batch_norm_forms import (KERNELS, MIN_EPSILON, fused_batch_norm,
                                              unfusable_because)
from tf_ucudnn.keras.planned_step import keras_training_step
from tf_ucudnn.memory import analyze

keras = tf.keras


def _model(shape=(6, 6, 3), conv=keras.layers.Conv2D, **batch_norm):
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input(shape), conv(4, 3, padding="same"),
        keras.layers.BatchNormalization(**batch_norm), keras.layers.ReLU(),
        keras.layers.Flatten(), keras.layers.Dense(2)])


def _train_step(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    gradients = tape.gradient(loss, model.trainable_variables)
    return loss, gradients


@pytest.mark.parametrize("shape,conv", [((6, 6, 3), keras.layers.Conv2D),
                                        ((4, 4, 4, 2), keras.layers.Conv3D)])
@pytest.mark.parametrize("options", [{}, {"center": False, "scale": False, "momentum": 0.5}])
@pytest.mark.parametrize("kernel", ["cudnn", "xla", "ucudnn"])
def test_fused_training_matches_keras(shape, conv, options, kernel):
    x = tf.random.stateless_normal([5, *shape], seed=[1, 2])
    y = tf.random.stateless_normal([5, 2], seed=[3, 4])
    reference, fused = _model(shape, conv, **options), _model(shape, conv, **options)
    expected_loss, expected_gradients = tf.function(_train_step)(reference, x, y)
    with fused_batch_norm(fused, kernel) as left_alone:
        step = tf.function(_train_step)
        loss, gradients = step(fused, x, y)
        ops = step.get_concrete_function(fused, x, y).graph.get_operations()
    assert left_alone == []
    types = {op.type for op in ops}
    if kernel == "cudnn":
        assert {"FusedBatchNormV3", "FusedBatchNormGradV3"} <= types
    elif kernel == "ucudnn":
        assert {"UcudnnBatchNorm", "UcudnnBatchNormGrad"} <= types
    else:  # one XLA computation each way, and no moment ops
        compiled = [op for op in ops if op.type == "PartitionedCall"
                    and op.node_def.attr["_XlaMustCompile"].b]
        in_layer = {op.type for op in ops if "batch_normalization" in op.name}
        assert len(compiled) == 2 and not {"FusedBatchNormV3", "Mean"} & in_layer
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for got, want in zip(gradients, expected_gradients):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    normalization = [next(layer for layer in model.layers
                          if isinstance(layer, keras.layers.BatchNormalization))
                     for model in (reference, fused)]
    for want, got in zip(normalization[0].non_trainable_weights,
                         normalization[1].non_trainable_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The step did update them (from zeros and ones).
    assert not np.allclose(normalization[1].moving_mean, 0.0)
    assert not np.allclose(normalization[1].moving_variance, 1.0)


def test_xla_statistics_stay_accurate_far_from_zero():
    """The "xla" kernel sums x and x^2 in one read, about one sample per channel: a mean 2000
    spreads larger than its deviation loses nothing a float64 reference sees (unshifted, float32's
    E[x^2] - E[x]^2 would lose all of the variance 1e-2 here)."""
    rng = np.random.default_rng(5)
    x = 2000.0 + 0.1 * rng.standard_normal((8, 5, 5, 3))
    y, mean, variance = KERNELS["xla"](tf.constant(x, tf.float32), tf.ones([3]), tf.zeros([3]),
                                       MIN_EPSILON)
    x32 = x.astype(np.float32).astype(np.float64)  # what the kernel was given
    np.testing.assert_allclose(mean, x32.mean(axis=(0, 1, 2)), rtol=1e-7)
    np.testing.assert_allclose(variance, x32.var(axis=(0, 1, 2)), rtol=2e-3)
    expected = (x32 - x32.mean(axis=(0, 1, 2))) / np.sqrt(x32.var(axis=(0, 1, 2)) + MIN_EPSILON)
    np.testing.assert_allclose(y, expected, atol=2e-3)


def test_inference_and_restoring_leave_keras_behaviour():
    model = _model()
    x = tf.random.stateless_normal([3, 6, 6, 3], seed=[5, 6])
    expected = model(x, training=False)
    with fused_batch_norm(model):
        np.testing.assert_array_equal(model(x, training=False), expected)
    assert "call" not in vars(model.layers[1])


def test_one_kernel_each_way_instead_of_the_moment_ops():
    def batch_norm_ops(step):
        return [op.type for op in analyze(step).ops if "batch_normalization" in op.name
                and op.type not in ("Const", "ReadVariableOp", "AssignVariableOp")]

    unfused = batch_norm_ops(keras_training_step(_model((32, 32, 3)), 64))
    fused = batch_norm_ops(keras_training_step(_model((32, 32, 3)), 64, fuse_batch_norm=True))
    assert "Mean" in unfused and "FusedBatchNormV3" not in unfused
    assert fused.count("FusedBatchNormV3") == 1 and fused.count("FusedBatchNormGradV3") == 1
    assert "Mean" not in fused and len(fused) < len(unfused) / 2


def test_layers_it_cannot_fuse_are_named_with_the_reason():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5, 4)), keras.layers.BatchNormalization(axis=1),
                              keras.layers.BatchNormalization(epsilon=1e-6),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    with pytest.warns(UserWarning, match="left unfused: inputs of rank 3"):
        keras_training_step(model, 2, loss=keras.losses.MeanSquaredError(), fuse_batch_norm=True)
    with pytest.raises(ValueError, match="fuse_batch_norm='fast': the kernels are cudnn, xla, "):
        keras_training_step(model, 2, fuse_batch_norm="fast")
    with fused_batch_norm(model) as left_alone:
        pass
    assert [(u.layer, u.reason.split(":")[0]) for u in left_alone] == [
        (model.layers[0].path, "inputs of rank 3"), (model.layers[1].path, "inputs of rank 3")]
    layer = keras.layers.BatchNormalization(axis=1, epsilon=1e-6)
    assert unfusable_because(layer, 4).startswith("normalizes axis")
    layer.axis = [-1]
    assert unfusable_because(layer, 4).startswith("epsilon 1e-06 is below")
