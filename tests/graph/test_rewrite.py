"""rewrite: TensorFlow's convolution nodes replaced by tf_ucudnn's, with plans, same results."""

import numpy as np
import pytest
import tensorflow as tf
from training_steps import gradient_step

from tf_ucudnn.core.plan import BACKPROP_FILTER, BACKPROP_INPUT, FORWARD, KernelPlan, LayerPlan
from tf_ucudnn.graph.rewrite import rewrite_convolutions


def _split_plan(layer):
    """Every kernel split unevenly in two, whatever the batch."""
    batch = layer.batch_size
    halves = KernelPlan.of((batch // 2, 0), (batch - batch // 2, 1))
    return LayerPlan(halves, halves, halves)


def _vgg_style():
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((12, 12, 3)),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(16, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(4),
    ])


def _resnet_style():
    layers = tf.keras.layers
    inputs = tf.keras.Input((12, 12, 3))
    x = layers.Conv2D(8, 3, strides=2, padding="same")(inputs)  # asymmetric SAME padding
    shortcut = x
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = layers.Conv2D(8, 1)(x)
    x = layers.Add()([x, shortcut])
    x = layers.Conv2D(16, 3, strides=2, padding="valid")(x)
    x = layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, layers.Dense(4)(x))


@pytest.mark.parametrize("build", [_vgg_style, _resnet_style], ids=["vgg", "resnet"])
def test_rewritten_training_step_gives_the_same_loss_and_gradients(build):
    tf.keras.utils.set_random_seed(1)
    model = build()
    concrete = gradient_step(model, 6)
    rewritten, report = rewrite_convolutions(concrete, _split_plan)
    convs = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.Conv2D)]
    assert len(report.layers) == len(convs)
    assert report.left_alone == []
    for item in report.layers:
        # The first layer's input gradient is not needed, so TensorFlow made no node for it.
        assert FORWARD in item.nodes and BACKPROP_FILTER in item.nodes
    assert sum(BACKPROP_INPUT in item.nodes for item in report.layers) >= len(convs) - 1

    types = {op.type for op in rewritten.get_concrete_function().graph.get_operations()}
    graph_def = rewritten.get_concrete_function().graph.as_graph_def()
    library_types = {node.op for f in graph_def.library.function for node in f.node_def}
    assert not {"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"} & (types | library_types)

    x = tf.random.stateless_normal([6, 12, 12, 3], seed=[1, 2])
    y = tf.constant([0, 1, 2, 3, 0, 1])
    expected_loss, expected_grads = concrete(x, y)
    loss, grads = rewritten(x, y)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_plans_reach_the_nodes_and_refusals_are_reported():
    w1 = tf.Variable(tf.random.normal([3, 3, 3, 4]))
    w2 = tf.Variable(tf.random.normal([3, 3, 4, 5]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME")), w2, 2, "SAME")
            loss = tf.reduce_sum(y * y)
        return loss, tape.gradient(loss, [w1, w2])

    concrete = step.get_concrete_function(tf.TensorSpec([6, 8, 8, 3]))
    plan = LayerPlan(KernelPlan.of((2, 0), (4, 1)), KernelPlan.of((3, 1), (3, 1)),
                     KernelPlan.of((1, 0), (5, 1)))
    rewritten, report = rewrite_convolutions(
        concrete, lambda layer: plan if layer.filter_shape[-1] == 4 else "no gain expected")
    assert [item.layer.filter_shape for item in report.layers] == [(3, 3, 3, 4)]
    reasons = {item.node: item.reason for item in report.left_alone}
    forward_left = [name for name, reason in reasons.items() if reason == "no gain expected"]
    assert len(forward_left) == 1
    assert sum("gradient of" in reason and "no gain expected" in reason
               for reason in reasons.values()) == 2
    assert "no gain expected" in report.to_text()

    graph = rewritten.get_concrete_function().graph
    by_type = {op.type: op for op in graph.get_operations() if op.type.startswith("Ucudnn")}
    assert by_type["UcudnnConv2D"].get_attr("micro_batches") == [2, 4]
    assert by_type["UcudnnConv2D"].get_attr("backprop_filter_micro_batches") == [1, 5]
    assert by_type["UcudnnConv2DBackpropInput"].get_attr("algorithms") == [b"algo=1", b"algo=1"]
    assert by_type["UcudnnConv2DBackpropFilter"].get_attr("micro_batches") == [1, 5]

    x = tf.random.stateless_normal([6, 8, 8, 3], seed=[3, 4])
    for got, want in zip(tf.nest.flatten(rewritten(x)), tf.nest.flatten(concrete(x))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_convolutions_inside_library_functions():
    kernel = tf.constant(np.random.default_rng(0).standard_normal([3, 3, 2, 3]), tf.float32)

    @tf.function
    def inner(x):
        return tf.nn.conv2d(x, kernel, 1, "VALID")

    @tf.function
    def outer(x):
        return inner(x) * 2.0  # a call: inner's body lives in the function library

    concrete = outer.get_concrete_function(tf.TensorSpec([4, 6, 6, 2]))
    assert not any(op.type == "Conv2D" for op in concrete.graph.get_operations())
    rewritten, report = rewrite_convolutions(concrete, _split_plan)
    assert len(report.layers) == 1 and report.layers[0].scope != ""
    assert report.layers[0].scope in report.to_text()
    graph_def = rewritten.get_concrete_function().graph.as_graph_def()
    library_ops = [node.op for f in graph_def.library.function for node in f.node_def]
    assert "UcudnnConv2D" in library_ops and "Conv2D" not in library_ops
    x = tf.random.stateless_normal([4, 6, 6, 2], seed=[5, 6])
    np.testing.assert_allclose(rewritten(x), concrete(x), rtol=1e-5, atol=1e-5)


def test_unknown_shapes_and_bad_targets():
    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 3])])
    def forward(x):
        return tf.nn.conv2d(x, tf.ones([3, 3, 3, 4]), 1, "SAME")

    _, report = rewrite_convolutions(forward.get_concrete_function(), _split_plan)
    assert report.layers == []
    assert "not fully known" in report.left_alone[0].reason
    with pytest.raises(TypeError, match="get_concrete_function"):
        rewrite_convolutions(forward, _split_plan)


def _depthwise_and_grouped():
    """A depthwise convolution with dilations, a grouped one and a plain one, TensorFlow's ops
    (channels-last: its CPU kernels have no NCHW depthwise convolution), as a step of batch 6
    with its loss and gradients."""
    rng = np.random.default_rng(3)
    depthwise = tf.Variable(rng.standard_normal([3, 3, 4, 2]), dtype=tf.float32)
    grouped = tf.Variable(rng.standard_normal([3, 3, 4, 6]), dtype=tf.float32)
    pointwise = tf.Variable(rng.standard_normal([1, 1, 6, 5]), dtype=tf.float32)
    shape = [6, 9, 9, 4]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.depthwise_conv2d(x, depthwise, [1, 1, 1, 1], "SAME", dilations=[2, 2])
            y = tf.nn.relu(tf.nn.conv2d(y, grouped, 2, "VALID"))
            loss = tf.reduce_sum(tf.nn.conv2d(y, pointwise, 1, "SAME") ** 2)
        return loss, tape.gradient(loss, [x, depthwise, grouped, pointwise])

    return step.get_concrete_function(tf.TensorSpec(shape)), shape


def test_depthwise_and_grouped_layers_are_planned_with_the_same_results():
    concrete, shape = _depthwise_and_grouped()
    rewritten, report = rewrite_convolutions(concrete, _split_plan)
    assert report.left_alone == []
    layers = {layer.layer.op_type: layer for layer in report.layers}
    assert set(layers) == {"DepthwiseConv2dNative", "Conv2D"} and len(report.layers) == 3
    depthwise = layers["DepthwiseConv2dNative"]
    assert depthwise.layer.groups == 4 and depthwise.layer.filter_shape == (3, 3, 1, 8)
    assert set(depthwise.nodes) == {FORWARD, BACKPROP_INPUT, BACKPROP_FILTER}
    assert sorted(layer.layer.groups for layer in report.layers) == [1, 2, 4]
    ops = {node.op for node in rewritten.get_concrete_function().graph.as_graph_def().node}
    assert not ops & {"Conv2D", "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                      "DepthwiseConv2dNativeBackpropFilter", "Conv2DBackpropInput",
                      "Conv2DBackpropFilter"}
    x = tf.random.stateless_normal(shape, seed=[3, 4])
    loss, grads = concrete(x)
    new_loss, new_grads = rewritten(x)
    np.testing.assert_allclose(new_loss, loss, rtol=1e-5)
    for a, b in zip(new_grads, grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


def test_depthwise_layers_inside_library_functions():
    """Inside a function body, nodes read each other's outputs by argument name: the reshapes
    the pass adds around a depthwise layer's nodes are read so too."""
    depthwise = tf.constant(np.random.default_rng(4).standard_normal([3, 3, 3, 2]), tf.float32)

    @tf.function
    def inner(x):
        with tf.GradientTape() as tape:
            tape.watch([x, depthwise])
            y = tf.nn.depthwise_conv2d(x, depthwise, [1, 2, 2, 1], "SAME")
        return (y, *tape.gradient(y, [x, depthwise], output_gradients=tf.sin(y)))

    @tf.function
    def outer(x):
        return [t * 2.0 for t in inner(x)]  # a call: inner's body lives in the function library

    concrete = outer.get_concrete_function(tf.TensorSpec([4, 7, 7, 3]))
    rewritten, report = rewrite_convolutions(concrete, _split_plan)
    assert report.left_alone == [] and len(report.layers) == 1
    assert report.layers[0].scope != "" and len(report.layers[0].nodes) == 3
    graph_def = rewritten.get_concrete_function().graph.as_graph_def()
    library_ops = {node.op for f in graph_def.library.function for node in f.node_def}
    assert "UcudnnConv2DBackpropFilter" in library_ops
    assert not any(op.startswith("Depthwise") for op in library_ops)
    x = tf.random.stateless_normal([4, 7, 7, 3], seed=[7, 8])
    for got, want in zip(rewritten(x), concrete(x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_a_planner_that_answers_nothing_is_an_error_naming_the_layer():
    from tf_ucudnn.core.plan import PlannerAnswerError

    with pytest.raises(PlannerAnswerError, match="conv2d.*the planner returned None"):
        rewrite_convolutions(gradient_step(_vgg_style(), 4), lambda layer: None)


def test_the_pass_guarantees_every_convolution_is_in_the_report(monkeypatch):
    """Were a node skipped silently, the pass would fail naming it, not hand back the graph."""
    from tf_ucudnn.graph import rewrite

    monkeypatch.setattr(rewrite, "_rewrite_nodes", lambda *args: None)  # a pass that forgets
    with pytest.raises(rewrite.UnreportedConvolution,
                       match=r"neither rewrote nor reported 9 node\(s\): .*\(Conv2D\)"):
        rewrite_convolutions(gradient_step(_vgg_style(), 4), _split_plan)
