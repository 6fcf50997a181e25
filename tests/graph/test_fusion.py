"""The rewrite fuses planned convolutions with their BiasAdd and Relu, and says which it did not."""

import collections

import numpy as np
import pytest
import tensorflow as tf
from training_steps import gradient_step

import tf_ucudnn
from tf_ucudnn.core.plan import FORWARD, KernelPlan, LayerPlan
from tf_ucudnn.graph.rewrite import rewrite_convolutions


def _split_plan(layer):
    batch = layer.batch_size
    halves = KernelPlan.of((batch // 2, 0), (batch - batch // 2, 1))
    return LayerPlan(halves, halves, halves)


def _op_counts(function) -> collections.Counter:
    return collections.Counter(op.type for op in function.get_concrete_function().graph
                               .get_operations())


def _inference_step():
    """conv+bias+relu, conv+bias read by a pooling, conv alone, conv+bias+relu6, and a
    conv+bias+relu whose BiasAdd has a second reader, in NHWC."""
    variables = [tf.Variable(tf.random.stateless_normal(shape, seed=[i, 0]))
                 for i, shape in enumerate([[3, 3, 3, 4], [4], [3, 3, 4, 6], [6], [1, 1, 6, 5],
                                            [3, 3, 5, 4], [4], [3, 3, 4, 4], [4]])]
    w1, b1, w2, b2, w3, w4, b4, w5, b5 = variables

    @tf.function
    def step(x):
        a = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w1, 1, "SAME", name="conv1"), b1))
        b = tf.nn.max_pool2d(tf.nn.bias_add(tf.nn.conv2d(a, w2, 1, "SAME", name="conv2"), b2),
                             2, 2, "VALID")
        c = tf.nn.conv2d(b, w3, 1, "VALID", name="conv3")
        d = tf.nn.relu6(tf.nn.bias_add(tf.nn.conv2d(c, w4, 1, "SAME", name="conv4"), b4))
        pre = tf.nn.bias_add(tf.nn.conv2d(d, w5, 1, "SAME", name="conv5"), b5)
        return tf.nn.relu(pre) + pre

    return step.get_concrete_function(tf.TensorSpec([4, 8, 8, 3]))


def test_an_inference_graph_fuses_where_the_pattern_holds_and_says_why_elsewhere():
    step = _inference_step()
    rewritten, report = rewrite_convolutions(step, _split_plan)

    fused = {item.layer: item for item in report.fused}
    assert sorted(fused) == ["conv1", "conv2"]
    assert fused["conv1"].activation == "relu" and fused["conv2"].activation == "identity"
    assert fused["conv1"].node == fused["conv1"].replaced[-1] and \
        fused["conv1"].replaced[:2] == ("conv1", "BiasAdd")
    by_layer = {item.layer.name: item for item in report.layers}
    assert by_layer["conv1"].nodes[FORWARD] == fused["conv1"].node
    reasons = {item.layer: item.reason for item in report.not_fused}
    assert set(reasons) == {"conv3", "conv4", "conv5"}
    assert "not by one BiasAdd alone" in reasons["conv3"]
    assert "Relu6" in reasons["conv4"] and "Relu" in reasons["conv5"]
    assert report.to_json()["fused"][0]["activation"] in ("relu", "identity")
    assert "fused conv1 with its bias and relu" in report.to_text()

    counts = _op_counts(rewritten)
    assert counts["UcudnnFusedConv2D"] == 2 and counts["UcudnnConv2D"] == 3
    assert counts["BiasAdd"] == 2 and counts["Conv2D"] == 0

    x = tf.random.stateless_normal([4, 8, 8, 3], seed=[3, 4])
    # Five layers deep, outputs up to about 60: float32 sums in another order differ by 1e-4.
    np.testing.assert_allclose(rewritten(x), step(x), rtol=1e-4, atol=1e-3)


def test_nchw_and_3d_layers_fuse_with_the_same_results():
    w2, b2 = tf.Variable(tf.random.normal([3, 3, 3, 4])), tf.Variable(tf.random.normal([4]))
    w3, b3 = tf.Variable(tf.random.normal([3, 3, 3, 3, 2])), tf.Variable(tf.random.normal([2]))

    @tf.function
    def step(x, v):
        # NCHW convolutions run on the CPU through tf_ucudnn only: compare with NHWC.
        y = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w2, 1, "SAME", data_format="NCHW"), b2,
                                      data_format="NCHW"))
        z = tf.nn.relu(tf.nn.bias_add(tf.nn.conv3d(v, w3, [1] * 5, "SAME"), b3))
        return y, z

    step = step.get_concrete_function(tf.TensorSpec([2, 3, 6, 6]), tf.TensorSpec([2, 4, 4, 4, 3]))
    rewritten, report = rewrite_convolutions(step, _split_plan)
    assert [item.activation for item in report.fused] == ["relu", "relu"]
    counts = _op_counts(rewritten)
    assert counts["UcudnnFusedConv2D"] == 1 and counts["UcudnnFusedConv3D"] == 1

    x, v = tf.random.normal([2, 3, 6, 6]), tf.random.normal([2, 4, 4, 4, 3])
    y, z = rewritten(x, v)
    nhwc = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(tf.transpose(x, [0, 2, 3, 1]), w2, 1, "SAME"),
                                     b2))
    np.testing.assert_allclose(y, tf.transpose(nhwc, [0, 3, 1, 2]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(z, tf.nn.relu(tf.nn.bias_add(tf.nn.conv3d(v, w3, [1] * 5, "SAME"),
                                                            b3)), rtol=1e-5, atol=1e-5)


def _keras_model():
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((10, 10, 3)),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.Conv2D(8, 3, strides=2, padding="same"),  # bias, no activation
        layers.Conv2D(8, 3, padding="same", use_bias=False, activation="relu"),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(4),
    ])


def test_a_training_step_fuses_and_its_gradients_run_around_the_fused_nodes():
    """TensorFlow's gradients of these layers read the input, the filter, the output and the
    incoming gradient only, so they run unchanged around the fused nodes."""
    tf.keras.utils.set_random_seed(2)
    step = gradient_step(_keras_model(), 6)
    rewritten, report = rewrite_convolutions(step, _split_plan)

    assert [item.activation for item in report.fused] == ["relu", "identity", "relu"]
    (not_fused,) = report.not_fused
    assert "not by one BiasAdd alone" in not_fused.reason  # use_bias=False: its Relu reads it
    assert report.left_alone == []
    counts = _op_counts(rewritten)
    assert counts["UcudnnFusedConv2D"] == 3 and counts["UcudnnConv2D"] == 1
    assert counts["UcudnnConv2DBackpropFilter"] == 4 and counts["Conv2DBackpropFilter"] == 0
    assert counts["ReluGrad"] == 3 and counts["BiasAddGrad"] == 4  # the Dense's and 3 convs'

    x = tf.random.stateless_normal([6, 10, 10, 3], seed=[1, 2])
    y = tf.constant([0, 1, 2, 3, 0, 1])
    expected_loss, expected_grads = step(x, y)
    loss, grads = rewritten(x, y)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_nothing_is_fused_where_xla_compiles_the_step_or_a_name_must_stay():
    tf.keras.utils.set_random_seed(2)
    step = gradient_step(_keras_model(), 6)
    compiled, report = tf_ucudnn.rewrite(step, _split_plan, jit_compile=True)
    assert report.fused == [] and len(report.not_fused) == 4
    assert any("XLA" in item.reason for item in report.not_fused)
    x = tf.random.stateless_normal([6, 10, 10, 3], seed=[1, 2])
    y = tf.constant([0, 1, 2, 3, 0, 1])
    np.testing.assert_allclose(compiled(x, y)[0], step(x, y)[0], rtol=1e-5)

    w, b = tf.Variable(tf.random.normal([3, 3, 3, 4])), tf.Variable(tf.random.normal([4]))

    @tf.function
    def waits_for_the_convolution(x):
        conv = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
        with tf.control_dependencies([conv.op]):
            done = tf.identity(x)
        return tf.nn.relu(tf.nn.bias_add(conv, b)), done

    _, report = rewrite_convolutions(
        waits_for_the_convolution.get_concrete_function(tf.TensorSpec([2, 6, 6, 3])), _split_plan)
    (not_fused,) = report.not_fused
    assert report.fused == [] and "control dependency" in not_fused.reason


@pytest.mark.parametrize("jit_compile", [True, False])
def test_a_library_function_fuses_unless_xla_compiles_it(jit_compile):
    # Constants, not variables, so that the function's body knows the filter's shape.
    w, b = tf.random.stateless_normal([3, 3, 3, 4], seed=[1, 1]), tf.constant([0.1, -0.2, 0.3, 0.])

    @tf.function(jit_compile=jit_compile)
    def layer(x):
        return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b))

    @tf.function
    def step(x):
        return layer(x) * 2.0

    step = step.get_concrete_function(tf.TensorSpec([2, 6, 6, 3]))
    rewritten, report = rewrite_convolutions(step, _split_plan)
    assert report.layers and report.layers[0].scope
    if jit_compile:
        assert report.fused == [] and "XLA" in report.not_fused[0].reason
    else:
        assert [item.activation for item in report.fused] == ["relu"]
    x = tf.random.normal([2, 6, 6, 3])
    np.testing.assert_allclose(rewritten(x), step(x), rtol=1e-5, atol=1e-5)
