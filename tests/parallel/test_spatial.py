"""Spatially partitioned layers over logical CPU devices equal the unpartitioned ones."""

import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.parallel import SpatialSplitError, batch_norm, conv, gather, pool, split

DEVICES = [f"/CPU:{i}" for i in range(4)]


def _random(shape, seed):
    return tf.constant(np.random.RandomState(seed).randn(*shape))


@pytest.mark.parametrize("spatial", [2, 3], ids=["2d", "3d"])
@pytest.mark.parametrize("devices, sizes", [(2, None), (3, [5, 3, 4]), (4, None)])
@pytest.mark.parametrize("kernel, stride, dilation, padding", [
    (3, 1, 1, "SAME"), (3, 2, 1, "SAME"), (5, 1, 1, "VALID"), (3, 1, 2, "SAME"),
    (2, 2, 1, "VALID"), (4, 1, 1, "SAME")])
def test_conv_equals_the_unpartitioned_layer_with_gradients(spatial, devices, sizes, kernel,
                                                            stride, dilation, padding):
    shape = [2, 12, 7, 3] if spatial == 2 else [2, 12, 6, 5, 2]
    x = _random(shape, 1)
    w = _random([kernel] * spatial + [shape[-1], 4], 2)

    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, w])
        y = gather(conv(split(x, DEVICES[:devices], sizes), w, stride, padding, dilation))
        # tf.nn.convolution: dilated convolutions as TensorFlow's CPU kernels allow them.
        reference = tf.nn.convolution(x, w, strides=stride, padding=padding,
                                      dilations=dilation,
                                      data_format="NHWC" if spatial == 2 else "NDHWC")
        weights = tf.reshape(tf.cast(tf.range(tf.size(y)), y.dtype), y.shape)
        loss, reference_loss = tf.reduce_sum(y * weights), tf.reduce_sum(reference * weights)
    np.testing.assert_allclose(y.numpy(), reference.numpy(), rtol=1e-10, atol=1e-10)
    for got, expected in zip(tape.gradient(loss, [x, w]), tape.gradient(reference_loss, [x, w])):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-9, atol=1e-9)


def test_each_device_computes_its_own_slab():
    x, w = _random([1, 16, 6, 2], 3), _random([3, 3, 2, 2], 4)

    @tf.function
    def f(x, w):
        return conv(split(x, DEVICES), w).parts

    graph = f.get_concrete_function(tf.TensorSpec(x.shape, x.dtype),
                                    tf.TensorSpec(w.shape, w.dtype)).graph
    convs = [op for op in graph.get_operations() if op.type == "UcudnnConv2D"]
    by_device = {}
    for op in convs:
        by_device.setdefault(op.device.split("device:")[-1], []).append(op)
    assert sorted(by_device) == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    # The middle devices compute their interior apart from the two halo rows.
    assert len(by_device["CPU:1"]) == 3 and len(by_device["CPU:0"]) == 2


def test_each_devices_backward_runs_on_it_and_only_halos_cross_between_neighbours():
    # GradientTape would put every gradient op where tape.gradient runs (the first device),
    # and add up each slab's gradients there.
    x, w = _random([1, 16, 6, 2], 3), _random([3, 3, 2, 2], 4)

    @tf.function
    def gradients(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            loss = tf.reduce_sum(gather(conv(conv(split(x, DEVICES), w), w)) ** 2)
        return tape.gradient(loss, [x, w])

    graph = gradients.get_concrete_function(tf.TensorSpec(x.shape, x.dtype),
                                            tf.TensorSpec(w.shape, w.dtype)).graph

    def device(op):
        return tf.DeviceSpec.from_string(op.device or "/CPU:0").device_index

    kernels = {}
    for op in graph.get_operations():
        if op.type.startswith("UcudnnConv2D"):
            kernels.setdefault(op.type, []).append(device(op))
    assert sorted(kernels["UcudnnConv2D"]) == sorted([0, 0, 1, 1, 1, 2, 2, 2, 3, 3] * 2)
    assert sorted(kernels["UcudnnConv2DBackpropInput"]) == sorted(kernels["UcudnnConv2D"])
    assert sorted(kernels["UcudnnConv2DBackpropFilter"]) == sorted(kernels["UcudnnConv2D"])
    # Tensors read on another device than their own. Between the other devices only the
    # one-row halos, both ways, of two layers, and their gradients back. To or from the first
    # (where x and the loss are) the 4-row slabs: x's, the output's, and their gradients.
    crossing = {(value.name, device(op)): (device(value.op), device(op), value.shape)
                for op in graph.get_operations() for value in op.inputs
                if device(op) != device(value.op)}.values()
    assert sorted(shape[1] for source, to, shape in crossing if 0 not in (source, to)) == \
        [1] * 16
    slabs = [(source, to) for source, to, shape in crossing
             if shape.rank == 4 and shape[1] == 4]
    assert sorted(slabs) == sorted([(0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (3, 0)] * 2)
    assert max(shape[1] for _, _, shape in crossing if shape.rank == 4) == 4


def test_a_split_finer_than_the_halo_is_refused():
    x, w = _random([1, 8, 4, 1], 5), _random([7, 1, 1, 1], 6)
    with pytest.raises(SpatialSplitError, match="device 0 .* needs rows .* of device 2, beyond "
                                                "its neighbours"):
        conv(split(x, DEVICES, [2, 2, 2, 2]), w)


def test_uneven_and_bad_splits_are_named():
    x = _random([1, 6, 4, 1], 7)
    with pytest.raises(SpatialSplitError, match="do not cover 6 rows"):
        split(x, DEVICES[:2], [3, 4])
    with pytest.raises(SpatialSplitError, match="cannot split 6 rows over 8 devices"):
        split(x, DEVICES * 2)


def test_pooling_and_batch_norm_equal_the_unpartitioned_layers():
    x = tf.cast(_random([2, 8, 6, 4, 3], 8), tf.float32)  # MaxPool3D has no float64 kernel
    gamma, beta = tf.cast(_random([3], 9), tf.float32), tf.cast(_random([3], 10), tf.float32)
    slabs = split(x, DEVICES[:2], [4, 4])
    pooled = gather(pool(slabs, 2))
    np.testing.assert_allclose(pooled.numpy(), tf.nn.max_pool3d(x, 2, 2, "VALID").numpy())
    normalized = gather(batch_norm(slabs, gamma, beta))
    mean, variance = tf.nn.moments(x, [0, 1, 2, 3])
    expected = tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3)
    np.testing.assert_allclose(normalized.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(SpatialSplitError, match="do not hold whole 2-row pooling windows"):
        pool(split(x, DEVICES[:2], [3, 5]), 2)


def test_each_devices_part_runs_its_plan():
    from tf_ucudnn.core.plan import KernelPlan, LayerPlan

    layers = []

    def planner(layer):
        layers.append(layer)
        batch = layer.batch_size
        halves = KernelPlan.of((batch // 2, 0), (batch - batch // 2, 1))
        return LayerPlan(halves, halves, halves)

    x, w = _random([4, 10, 6, 5, 2], 11), _random([3, 3, 3, 2, 3], 12)
    y = gather(conv(split(x, DEVICES[:2]), w, planner=planner))
    np.testing.assert_allclose(y.numpy(), tf.nn.conv3d(x, w, [1] * 5, "SAME").numpy(),
                               rtol=1e-10, atol=1e-10)
    # Each device's interior and halo parts were planned with their own input rows.
    assert len(layers) == 4 and {layer.op_type for layer in layers} == {"Conv3D"}
    assert {layer.padding for layer in layers} == {"EXPLICIT"}
    assert sorted(layer.input_shape[1] for layer in layers) == [3, 3, 6, 6]


def test_rows_too_many_for_one_call_are_convolved_in_chunks():
    x, w = _random([2, 12, 5, 5, 2], 11), _random([3, 3, 3, 2, 3], 12)

    def convolve(x, w, **options):
        return gather(conv(split(x, DEVICES[:2]), w, 1, "SAME", **options))

    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, w])
        # A row is 2 x 5 x 5 x 3 = 150 output values: 320 allow 2 rows a call.
        chunked = convolve(x, w, max_call_elements=320)
        whole = convolve(x, w)
    np.testing.assert_allclose(chunked.numpy(), whole.numpy(), rtol=1e-10, atol=1e-10)
    for got, expected in zip(tape.gradient(chunked, [x, w]), tape.gradient(whole, [x, w])):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-9, atol=1e-9)

    @tf.function
    def calls(x, w):
        return convolve(x, w, max_call_elements=320)

    graph = calls.get_concrete_function(tf.TensorSpec(x.shape, x.dtype),
                                        tf.TensorSpec(w.shape, w.dtype)).graph
    # 6 output rows per device, at most 2 per call: 3 calls each (the halo rows are their own).
    assert len([op for op in graph.get_operations() if op.type == "UcudnnConv3D"]) >= 6


def test_rows_too_many_for_one_call_are_pooled_in_chunks():
    x = tf.cast(_random([2, 12, 6, 4, 3], 13), tf.float32)
    for kind, expected in (("MAX", tf.nn.max_pool3d), ("AVG", tf.nn.avg_pool3d)):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            # A row is 2 x 6 x 4 x 3 = 144 values: 600 allow two 2-row windows a call.
            chunked = gather(pool(split(x, DEVICES[:2]), 2, kind, max_call_elements=600))
            whole = expected(x, 2, 2, "VALID")
        np.testing.assert_allclose(chunked.numpy(), whole.numpy(), rtol=1e-6)
        np.testing.assert_allclose(tape.gradient(chunked, x).numpy(),
                                   tape.gradient(whole, x).numpy(), rtol=1e-6)

    @tf.function
    def calls(x):
        return gather(pool(split(x, DEVICES[:2]), 2, "AVG", max_call_elements=600))

    graph = calls.get_concrete_function(tf.TensorSpec(x.shape, x.dtype)).graph
    # 6 rows per device, 4 rows a call: two calls each.
    assert len([op for op in graph.get_operations() if op.type == "AvgPool3D"]) == 4


def test_a_grouped_convolution_is_planned_with_its_groups():
    layers = []

    def planner(layer):
        layers.append(layer)
        return "left to cuDNN's choice"  # the planner saw it; nothing to plan here

    x, w = _random([2, 8, 6, 4], 13), _random([3, 3, 2, 6], 14)  # 4 channels in 2 groups
    y = gather(conv(split(x, DEVICES[:2]), w, planner=planner))
    # Each group by itself, as TensorFlow's grouped Conv2D means it.
    expected = tf.concat([tf.nn.conv2d(x[..., 2 * g:2 * g + 2], w[..., 3 * g:3 * g + 3], 1,
                                       "SAME") for g in range(2)], axis=-1)
    np.testing.assert_allclose(y.numpy(), expected.numpy(), rtol=1e-10, atol=1e-10)
    assert layers and {layer.groups for layer in layers} == {2}
