"""conv_layers: a graph's convolutions as plain data, and the geometry cuDNN runs for each."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer, UnsupportedConvolution, conv_groups
from tf_ucudnn.graph.conv_layers import (
    fed_by_variables,
    find_conv_layers,
    trace_model,
    unique_geometries,
)
from tf_ucudnn.keras import models


def _graph_of(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs).graph


def _only_conv(graph):
    layers, skipped = find_conv_layers(graph)
    assert skipped == []
    assert len(layers) == 1
    return layers[0]


CASES_2D = [
    # input (NHWC), filter, strides, padding, dilations
    ((2, 9, 10, 3), (3, 3, 3, 4), (1, 1), "SAME", (1, 1)),
    ((2, 9, 10, 3), (3, 3, 3, 4), (2, 2), "SAME", (1, 1)),  # odd total padding: asymmetric
    ((2, 8, 8, 3), (4, 2, 3, 4), (2, 3), "SAME", (1, 1)),
    ((2, 9, 10, 3), (3, 3, 3, 4), (1, 1), "VALID", (1, 1)),
    ((2, 11, 12, 3), (3, 3, 3, 4), (1, 1), "SAME", (2, 3)),
    ((2, 9, 10, 3), (3, 3, 3, 4), (2, 1), [[0, 0], [1, 2], [0, 3], [0, 0]], (1, 1)),
]


@pytest.mark.parametrize("input_shape,filter_shape,strides,padding,dilations", CASES_2D)
def test_output_and_cudnn_geometry_agree_with_tensorflow(input_shape, filter_shape, strides,
                                                         padding, dilations):
    w = tf.zeros(filter_shape)
    graph = _graph_of(lambda x: tf.nn.conv2d(x, w, strides, padding, dilations=dilations),
                      tf.TensorSpec(input_shape))
    layer = _only_conv(graph)
    conv_op = next(op for op in graph.get_operations() if op.type == "Conv2D")
    assert layer.output_spatial() == tuple(conv_op.outputs[0].shape[1:3])

    # The geometry cuDNN runs: input padded by the asymmetric part, symmetric pads: same output.
    g = layer.cudnn_geometry()
    x = np.random.default_rng(0).standard_normal(input_shape)
    wv = np.random.default_rng(1).standard_normal(filter_shape)
    pads = layer.pads()
    extra = [[b - s, a - s] for (b, a), s in zip(pads, g.pads)]
    padded = np.pad(x, [[0, 0], *extra, [0, 0]])
    assert padded.shape[1:3] == g.input_dims
    ours = tf.nn.conv2d(padded, wv, strides, [[0, 0], *[[p, p] for p in g.pads], [0, 0]],
                        dilations=dilations)
    theirs = tf.nn.conv2d(x, wv, strides, padding, dilations=dilations)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


def test_nchw_and_3d_layers():
    graph = _graph_of(
        lambda x, v: (tf.nn.conv2d(x, tf.zeros([3, 3, 4, 8]), 1, "SAME", data_format="NCHW"),
                      tf.nn.conv3d(v, tf.zeros([3, 3, 3, 2, 5]), [1, 2, 2, 2, 1], "SAME")),
        tf.TensorSpec([2, 4, 7, 7]), tf.TensorSpec([2, 6, 6, 6, 2]))
    layers, skipped = find_conv_layers(graph)
    assert skipped == []
    by_type = {layer.op_type: layer for layer in layers}
    nchw, conv3d = by_type["Conv2D"], by_type["Conv3D"]
    assert nchw.data_format == "NCHW" and nchw.input_spatial == (7, 7)
    assert nchw.cudnn_geometry().layout == "NCHW"
    assert nchw.cudnn_geometry().in_channels == 4 and nchw.cudnn_geometry().out_channels == 8
    assert conv3d.cudnn_geometry().input_dims == (7, 7, 7)  # 6 + 1 extra (SAME pads 0/1)
    assert conv3d.cudnn_geometry().pads == (0, 0, 0)
    assert conv3d.output_spatial() == (3, 3, 3)


def test_unknown_shapes_are_reported_not_dropped():
    graph = _graph_of(lambda x: tf.nn.conv2d(x, tf.zeros([3, 3, 3, 4]), 1, "SAME"),
                      tf.TensorSpec([None, 8, 8, 3]))
    layers, skipped = find_conv_layers(graph)
    assert layers == []
    assert len(skipped) == 1
    name, reason = skipped[0]
    assert "Conv2D" in name and "not fully known" in reason


def test_grouped_and_depthwise_convolutions_are_grouped_layers():
    graph = _graph_of(
        lambda x, v: (tf.nn.conv2d(x, tf.zeros([3, 3, 2, 6]), 1, "SAME"),
                      tf.nn.depthwise_conv2d(x, tf.zeros([3, 3, 4, 2]), [1, 2, 2, 1], "SAME",
                                             dilations=[1, 1]),
                      tf.nn.conv3d(v, tf.zeros([1, 1, 1, 3, 4]), [1] * 5, "VALID",
                                   data_format="NCDHW")),
        tf.TensorSpec([1, 8, 8, 4]), tf.TensorSpec([2, 6, 5, 5, 5]))
    layers, skipped = find_conv_layers(graph)
    assert skipped == []
    by_type = {layer.op_type: layer for layer in layers}
    grouped, depthwise, conv3d = (by_type[t] for t in ("Conv2D", "DepthwiseConv2dNative",
                                                       "Conv3D"))
    assert grouped.groups == 2 and grouped.filter_shape == (3, 3, 2, 6)
    # A depthwise filter [3, 3, 4, 2] is the grouped convolution's [3, 3, 1, 8], 4 groups.
    assert depthwise.groups == 4 and depthwise.filter_shape == (3, 3, 1, 8)
    assert depthwise.output_spatial() == (4, 4)
    assert conv3d.groups == 2
    geometry = depthwise.cudnn_geometry()
    assert (geometry.in_channels, geometry.out_channels, geometry.groups) == (4, 8, 4)
    assert geometry.filter_in_channels == 1
    assert grouped.cudnn_geometry().in_channels == 4
    # The profile key tells a grouped geometry from the ungrouped one of the same shapes.
    assert len({grouped.cudnn_geometry(), dataclasses.replace(grouped.cudnn_geometry(),
                                                              groups=1)}) == 2
    assert "groups 4" in str(geometry)


def test_a_layer_whose_channels_are_not_its_groups_is_refused():
    with pytest.raises(UnsupportedConvolution, match="conv: an input of 4 channels and a filter "
                                                     "for 2 are not 1 group"):
        ConvLayer("conv", "Conv2D", (1, 8, 8, 4), (3, 3, 2, 6), (1, 1, 1, 1), (1, 1, 1, 1),
                  "SAME", (), "NHWC", "float32")
    with pytest.raises(UnsupportedConvolution, match="not a multiple of the filter's 3 input"):
        conv_groups("conv", 4, 3, 6)
    with pytest.raises(UnsupportedConvolution, match="6 output channels are not a multiple of "
                                                     "its 4 groups"):
        conv_groups("conv", 4, 1, 6)
    assert conv_groups("conv", None, 1, 6) is None


def test_keras_model_layers_and_shared_geometries():
    model = models.alexnet("channels_first")
    layers, skipped = find_conv_layers(trace_model(model, 16))
    assert skipped == []
    assert [layer.filter_shape[:2] for layer in layers] == [(11, 11), (5, 5), (3, 3), (3, 3),
                                                            (3, 3)]
    assert all(layer.batch_size == 16 for layer in layers)
    assert [layer.input_spatial for layer in layers] == [(227, 227), (27, 27), (13, 13),
                                                         (13, 13), (13, 13)]
    geometries = unique_geometries(layers)
    assert len(geometries) == 5  # conv4 (384->384) differs from conv3 (256->384) and conv5
    assert sum(len(names) for names in geometries.values()) == 5


def test_shared_geometry_is_counted_once():
    w = tf.zeros([3, 3, 4, 4])
    graph = _graph_of(lambda x: tf.nn.conv2d(tf.nn.conv2d(x, w, 1, "SAME"), w, 1, "SAME"),
                      tf.TensorSpec([2, 8, 8, 4]))
    layers, _ = find_conv_layers(graph)
    geometries = unique_geometries(layers)
    assert len(layers) == 2 and len(geometries) == 1
    assert sorted(next(iter(geometries.values()))) == sorted(layer.name for layer in layers)


def test_a_layer_the_images_feed_computes_no_input_gradient():
    """No variable upstream of the first convolution's input (padding and scaling have none):
    training never runs its input gradient. Every later convolution reads some weights."""
    layers, _ = find_conv_layers(trace_model(models.load_model("resnet50"), 2))
    assert [layer.name for layer in layers if not layer.input_gradient] == [
        layers[0].name]
    assert "conv1" in layers[0].name
    scale = tf.Variable(2.0)

    def step(x, w):
        return (tf.nn.conv2d(x, w, 1, "SAME"), tf.nn.conv2d(x * scale, w, 1, "SAME"),
                tf.nn.conv2d(tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]]) + 1.0, w, 1, "VALID"))

    traced, _ = find_conv_layers(_graph_of(step, tf.TensorSpec([2, 5, 5, 3]),
                                           tf.TensorSpec([3, 3, 3, 4])))
    assert [layer.input_gradient for layer in traced] == [False, True, False]
    assert fed_by_variables(tf.constant(1.0))  # an eager tensor: no graph says otherwise
