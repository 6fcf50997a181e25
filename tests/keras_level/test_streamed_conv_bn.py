"""A convolution and its batch normalization trained as one op with the backward in micro-batches:
the same outputs, gradients, training step and moving statistics as the two layers, a lower
liveness peak, and the pairs found in a Keras model (or the reason a layer is left alone)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.keras import models
from tf_ucudnn.keras.batch_norm_forms import xla_normalization
from tf_ucudnn.keras.planned_step import keras_training_step
from tf_ucudnn.keras.streamed_conv_bn import (
    conv_batch_norm,
    conv_batch_norm_pairs,
    micro_batch_sizes,
    streamed_conv_batch_norm,
)
from tf_ucudnn.memory import analyze

keras = tf.keras


def _normal(shape, seed):
    return tf.random.stateless_normal(shape, seed=[7, seed])


def _reference(x, kernel, bias, scale, offset, strides, padding):
    z = tf.nn.conv2d(x, kernel, strides, padding.upper())
    return xla_normalization(tf.nn.bias_add(z, bias), scale, offset, 1e-3)


def _value_and_gradients(normalize, x, kernel, bias, scale, offset, weights):
    @tf.function
    def run(*inputs):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y, mean, variance = normalize(*inputs)
            loss = tf.reduce_sum(y * weights)
        return y, mean, variance, tape.gradient(loss, inputs)
    return run(x, kernel, bias, scale, offset)


def test_micro_batch_sizes_cover_the_batch():
    assert micro_batch_sizes(6, 4) == [2, 2, 1, 1]
    assert micro_batch_sizes(8, 4) == [2, 2, 2, 2]
    assert micro_batch_sizes(3, 8) == [1, 1, 1]


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("strides", [1, 2])
@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("batch,micro_batches", [(8, 4), (6, 4), (5, 1)])
def test_outputs_and_gradients_match_the_two_ops(window, strides, padding, batch, micro_batches):
    x, kernel = _normal([batch, 9, 9, 3], 1), _normal([window, window, 3, 5], 2)
    bias, scale, offset = _normal([5], 3), _normal([5], 4) + 1.0, _normal([5], 5)
    y_shape = _reference(x, kernel, bias, scale, offset, strides, padding)[0].shape
    weights = _normal(y_shape, 6)
    expected = _value_and_gradients(
        lambda *a: _reference(*a, strides, padding), x, kernel, bias, scale, offset, weights)
    got = _value_and_gradients(
        lambda *a: conv_batch_norm(*a, strides=strides, padding=padding, epsilon=1e-3,
                                   micro_batches=micro_batches),
        x, kernel, bias, scale, offset, weights)
    for name, want, have in zip(["y", "mean", "variance", "dx", "dkernel", "dbias", "dscale",
                                 "doffset"], tf.nest.flatten(expected), tf.nest.flatten(got)):
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_backward_makes_one_micro_batch_of_the_normalization_gradient_at_a_time():
    x, kernel = _normal([8, 6, 6, 3], 1), _normal([1, 1, 3, 4], 2)
    step = tf.function(lambda x: tf.gradients(conv_batch_norm(
        x, kernel, None, tf.ones([4]), tf.zeros([4]), micro_batches=4)[0], x)).get_concrete_function(
        tf.TensorSpec(x.shape))
    ops = step.graph.get_operations()
    inputs_gradients = [op for op in ops if op.type == "Conv2DBackpropInput"]
    assert [op.outputs[0].shape[0] for op in inputs_gradients] == [2, 2, 2, 2]
    # Each micro-batch's normalization gradient waits for the one before's convolution gradients.
    compiled = [op for op in ops if op.type == "PartitionedCall" and
                op.outputs[0].shape == [2, 6, 6, 4]]
    assert len(compiled) == 4
    for before, after in zip(inputs_gradients, compiled[1:]):
        slices = [t.op for t in after.inputs if t.op.type == "Slice"]
        assert len(slices) == 2 and all(before in op.control_inputs for op in slices)


def _residual_model(extra_reader=False):
    """conv-bn-relu, a bottleneck residual block with a projection shortcut, then a convolution
    widening 8 channels to 64 and its batch normalization (as ResNet-50's widen 64 to 256),
    an average pooling and a dense layer; with `extra_reader`, the stem convolution's output is
    also read by a pooling."""
    keras.utils.set_random_seed(5)
    layers = keras.layers
    inputs = keras.Input((10, 10, 3))
    stem = layers.Conv2D(4, 3, padding="same", name="stem_conv")(inputs)
    h = layers.ReLU()(layers.BatchNormalization(name="stem_bn")(stem))
    shortcut = layers.BatchNormalization(name="short_bn")(
        layers.Conv2D(8, 1, name="short_conv")(h))
    r = layers.Conv2D(4, 1, name="a_conv")(h)
    r = layers.ReLU()(layers.BatchNormalization(name="a_bn")(r))
    r = layers.Conv2D(4, 3, padding="same", use_bias=False, name="b_conv")(r)
    r = layers.ReLU()(layers.BatchNormalization(name="b_bn", momentum=0.5)(r))
    r = layers.BatchNormalization(name="c_bn", center=False)(
        layers.Conv2D(8, 1, name="c_conv")(r))
    h = layers.ReLU()(layers.Add()([shortcut, r]))
    h = layers.BatchNormalization(name="top_bn")(layers.Conv2D(64, 1, name="top_conv")(h))
    # An average pooling's gradient keeps nothing of the forward: the widening pair's backward
    # is the step's peak, as ResNet-50's first stage is at batch 768.
    h = layers.AveragePooling2D(10)(h)
    if extra_reader:
        h = layers.Concatenate()([layers.AveragePooling2D(10)(stem), h])
    return keras.Model(inputs, layers.Dense(3)(layers.Flatten()(h)))


def test_keras_step_trains_as_the_fused_layers():
    x = _normal([6, 10, 10, 3], 8)
    y = tf.range(6) % 3
    models_ = {}
    losses = {}
    for streamed in (0, 4):
        model = _residual_model()
        step = keras_training_step(model, 6, fuse_batch_norm="xla",
                                   stream_conv_batch_norm=streamed)
        losses[streamed] = step(x, y).numpy()
        models_[streamed] = model
        if streamed:
            # The four widening pairs' (stem, short, c, top) in 4 micro-batches each, and one
            # each for a_conv and b_conv, which keep the channels and are left unpaired.
            assert sum(op.type == "Conv2DBackpropInput"
                       for op in step.graph.get_operations()) == 4 * 4 + 2
    np.testing.assert_allclose(losses[4], losses[0], rtol=1e-5)
    for want, got in zip(models_[0].weights, models_[4].weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=want.path)
    # The step did train the convolutions and update the moving statistics.
    fresh = _residual_model()
    assert not np.allclose(models_[4].get_layer("b_conv").kernel,
                           fresh.get_layer("b_conv").kernel)
    assert not np.allclose(models_[4].get_layer("b_bn").moving_mean, 0.0)
    assert "call" not in vars(models_[4].get_layer("b_bn"))
    assert "call" not in vars(models_[4].get_layer("b_conv"))


def test_streaming_lowers_the_liveness_peak():
    batch, micro_batches = 64, 8
    reports = {streamed: analyze(keras_training_step(
        _residual_model(), batch, fuse_batch_norm="xla", stream_conv_batch_norm=streamed))
        for streamed in (0, micro_batches)}
    peaks = {streamed: report.peak_bytes for streamed, report in reports.items()}
    # The streamed gradient's ops, outside the tape's name scope, are the backward pass's.
    streamed_ops = [op for op in reports[micro_batches].ops
                    if op.type in ("Slice", "Conv2DBackpropInput", "ConcatV2")]
    # The four widening pairs: three slices and an input gradient per micro-batch each.
    assert len(streamed_ops) > 4 * 8 * 4 and all(op.backward for op in streamed_ops)
    # Unstreamed, top_bn's backward holds its gradient whole (batch x 10 x 10 x 64 float32)
    # besides its input and its output's gradient; streamed, an eighth of it, the slices of its
    # input and its output's gradient (copies to the liveness analysis, which is pessimistic:
    # TensorFlow slices the first dimension in place) and the input gradients made so far (an
    # eighth of its size in all): at least a third of it is saved.
    top_gradient = batch * 10 * 10 * 64 * 4
    assert peaks[micro_batches] <= peaks[0] - top_gradient / 3


def test_resnet50_pairs_every_widening_convolution_with_its_normalization():
    model = models.load_model("resnet50")
    pairs, unpaired = conv_batch_norm_pairs(model)
    # The stem, each block's last convolution (16) and each stage's projection shortcut (4).
    paired = {conv.name for conv, _ in pairs}
    assert len(pairs) == 21 and "conv1_conv" in paired
    assert all(name == "conv1_conv" or name.endswith(("_0_conv", "_3_conv")) for name in paired)
    assert ("conv2_block1_3_conv", "conv2_block1_3_bn") in [
        (conv.name, norm.name) for conv, norm in pairs]
    # The other 32 convolutions keep or narrow the channels; their normalizations go with them.
    reasons = {layer.layer: layer.reason for layer in unpaired}
    assert len(reasons) == 64
    assert reasons["conv2_block1_1_conv"].startswith("it does not widen the channels (64 to 64)")
    assert reasons["conv2_block1_1_bn"] == "its input is not a paired convolution's output"


def test_a_convolution_read_elsewhere_is_left_unpaired_and_the_step_still_matches():
    model = _residual_model(extra_reader=True)
    pairs, unpaired = conv_batch_norm_pairs(model)
    assert len(pairs) == 3  # short, c and top: a and b keep the channels
    reasons = {layer.layer: layer.reason for layer in unpaired}
    assert reasons["stem_conv"].startswith("its output is read by 2 layers")
    assert set(reasons) == {"stem_conv", "stem_bn", "a_conv", "a_bn", "b_conv", "b_bn"}
    x, y = _normal([4, 10, 10, 3], 10), tf.range(4) % 3
    with pytest.warns(UserWarning, match="6 layer.s. not streamed with a convolution: .*"
                      "stem_conv: its output is read by 2 layers"):
        loss = keras_training_step(model, 4, fuse_batch_norm="xla",
                                   stream_conv_batch_norm=2)(x, y)
    expected = keras_training_step(_residual_model(extra_reader=True), 4,
                                   fuse_batch_norm="xla")(x, y)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_inference_calls_the_layers_as_before():
    model = _residual_model()
    x = _normal([2, 10, 10, 3], 9)
    expected = model(x, training=False)
    with streamed_conv_batch_norm(model, 2) as unpaired:
        np.testing.assert_array_equal(model(x, training=False), expected)
    assert {layer.layer for layer in unpaired} == {"a_conv", "a_bn", "b_conv", "b_bn"}


def test_convolutions_the_op_cannot_take_are_left_unpaired_with_the_reason():
    layers = keras.layers
    model = keras.Sequential([
        keras.Input((9, 9, 3)), layers.Conv2D(4, 3, activation="relu", name="relu_conv"),
        layers.BatchNormalization(name="bn1"),
        layers.Conv2D(4, 3, dilation_rate=2, name="dilated"), layers.BatchNormalization(name="bn2"),
        layers.Conv2D(8, 1, name="plain"), layers.BatchNormalization(name="bn3"),
        layers.Conv2D(16, 1, name="last")])
    pairs, unpaired = conv_batch_norm_pairs(model)
    assert [(conv.name, norm.name) for conv, norm in pairs] == [("plain", "bn3")]
    reasons = {layer.layer.split("/")[-1]: layer.reason for layer in unpaired}
    assert reasons.keys() == {"relu_conv", "dilated", "last", "bn1", "bn2"}
    assert reasons["relu_conv"].startswith("activation relu")
    assert reasons["dilated"].startswith("dilation rate (2, 2)")
    assert reasons["last"] == "its output is the model's output"
