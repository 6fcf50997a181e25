"""The spatial pass: graphs whose convolution layers are split over logical CPUs compute and
differentiate as the originals; layers the split cannot serve are reported with the reason."""

import numpy as np
import pytest
import tensorflow as tf
from training_steps import SLOW_LINK, assert_same_step, conv_training_step, gradient_step

import tf_ucudnn
from tf_ucudnn.core.plan import BACKPROP_FILTER, BACKPROP_INPUT, FORWARD, KernelPlan, LayerPlan

DEVICES = ["/CPU:0", "/CPU:1"]

# Compared with the original at float32 precision, on the GPU too.
pytestmark = pytest.mark.usefixtures("no_tf32")


def _conv3d_training_step():
    tf.keras.utils.set_random_seed(12)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 8, 2)),
        layers.Conv3D(4, 3, padding="same", activation="relu"),
        layers.Conv3D(4, 3, strides=2, padding="valid"), layers.LeakyReLU(0.3),
        layers.GlobalAveragePooling3D(), layers.Dense(3),
    ])
    return gradient_step(model, 2)


def _devices_of_split_functions(graph_def) -> set:
    return {node.device.split("device:")[-1].upper() for function in graph_def.library.function
            for node in function.node_def if node.op.startswith("Ucudnn")}


@pytest.mark.parametrize("make_step", [_conv3d_training_step, conv_training_step])
def test_split_training_steps_give_the_same_loss_and_gradients(make_step):
    step = make_step()
    split, report = tf_ucudnn.rewrite(step, spatial_split=2)
    assert len(report.spatial) == len({item.layer for item in report.spatial}) >= 2
    assert all({FORWARD, BACKPROP_FILTER} <= set(item.nodes) for item in report.spatial)
    backprop_inputs = [op for op in step.graph.get_operations()
                       if op.type.startswith("Conv") and "BackpropInput" in op.type]
    assert len([item for item in report.spatial if BACKPROP_INPUT in item.nodes]) == \
        len(backprop_inputs)
    assert not report.left_alone
    assert_same_step(step, split.get_concrete_function(), rtol=1e-4, atol=1e-5)
    graph_def = split.get_concrete_function().graph.as_graph_def()
    assert {"CPU:0", "CPU:1"} <= _devices_of_split_functions(graph_def)
    assert "split over /device:CPU:0, /device:CPU:1 (slabs of [" in report.to_text()


def test_a_graph_def_is_split_and_runs_as_the_original():
    @tf.function
    def forward(x, w):
        return tf.nn.relu(tf.nn.conv3d(x, w, [1, 1, 1, 1, 1], "SAME"))

    x = tf.random.stateless_normal([1, 9, 6, 6, 2], seed=[3, 4])
    w = tf.random.stateless_normal([3, 3, 3, 2, 5], seed=[5, 6])
    graph_def = forward.get_concrete_function(x, w).graph.as_graph_def()
    expected = forward(x, w).numpy()
    split, report = tf_ucudnn.rewrite(graph_def, devices=["/CPU:0", "/CPU:1", "/CPU:2"])
    assert [list(item.slab_rows) for item in report.spatial] == [[3, 3, 3]]
    with tf.Graph().as_default():
        y, = tf.graph_util.import_graph_def(split, input_map={"x:0": tf.constant(x.numpy()),
                                                              "w:0": tf.constant(w.numpy())},
                                            return_elements=["Relu:0"])
        with tf.compat.v1.Session() as session:
            np.testing.assert_allclose(session.run(y), expected, rtol=1e-5, atol=1e-5)


def test_each_devices_part_gets_its_own_plan():
    seen = []

    def halves(layer):
        seen.append(layer.input_shape)
        batch = layer.batch_size
        plan = KernelPlan.of((batch // 2, 0), (batch - batch // 2, 0))
        return LayerPlan(plan, plan, plan)

    step = conv_training_step()
    split, _ = tf_ucudnn.rewrite(step, halves, spatial_split=2)
    # Each device convolves its part of the 16 rows (a few rows with the halo apart), the
    # layer after the pooling its part of 8.
    assert {shape[-1] for shape in seen} == {3, 16}
    assert max(shape[1] for shape in seen if shape[-1] == 3) <= 16 // 2 + 1
    assert max(shape[1] for shape in seen if shape[2] == 8) <= 8 // 2 + 1
    assert_same_step(step, split.get_concrete_function(), rtol=1e-4, atol=1e-5)


def test_layers_the_split_cannot_serve_are_left_alone_with_the_reason():
    @tf.function
    def forward(x, w, v):
        thin = tf.nn.conv2d(x, w, 1, "SAME")  # 5x5 kernel on slabs of 1 row: halo too wide
        return tf.nn.conv2d(thin, v, 1, [[0, 0], [1, 1], [0, 0], [0, 0]])  # explicit padding

    function = forward.get_concrete_function(tf.TensorSpec([1, 4, 4, 1]),
                                             tf.TensorSpec([5, 5, 1, 1]),
                                             tf.TensorSpec([3, 3, 1, 1]))
    _, report = tf_ucudnn.rewrite(function, spatial_split=4)
    reasons = {item.node: item.reason for item in report.left_alone}
    assert not report.spatial and len(reasons) == 2
    assert any("thinner than the layer's halo" in reason for reason in reasons.values())
    assert any("EXPLICIT padding" in reason for reason in reasons.values())


def test_a_memory_budget_plans_the_tensors_between_the_split_layers():
    step = conv_training_step()
    _, unplanned = tf_ucudnn.rewrite(step, spatial_split=2, memory_budget=1 << 40,
                                     device_model=SLOW_LINK)
    # The slabs are inside the split layers' calls; what the plan sees lies between them.
    assert unplanned.memory.liveness.function_calls
    peak = unplanned.memory.decisions.prediction.peak_bytes
    planned, report = tf_ucudnn.rewrite(step, spatial_split=2, memory_budget=int(peak * 0.85),
                                        device_model=SLOW_LINK)
    assert report.memory.swaps or report.memory.recomputes
    assert report.memory.decisions.prediction.peak_bytes <= peak * 0.85
    assert_same_step(step, planned.get_concrete_function(), rtol=1e-4, atol=1e-5)


def test_bad_split_requests_are_refused():
    step = conv_training_step()
    with pytest.raises(ValueError, match="spatial_split=2 but 3 devices"):
        tf_ucudnn.rewrite(step, spatial_split=2, devices=DEVICES + ["/CPU:2"])
    with pytest.raises(tf_ucudnn.parallel.SpatialSplitError, match="needs 9 GPUs or logical"):
        tf_ucudnn.rewrite(step, spatial_split=9)
