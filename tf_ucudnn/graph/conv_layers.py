"""The convolutions of a TensorFlow graph, as plain data: what the profiler measures and the
optimizer plans for.

A `ConvLayer` is one Conv2D/Conv3D op with its shapes and attributes in TensorFlow's terms,
grouped where its filter has fewer input channels than its input; a DepthwiseConv2dNative op is
the grouped convolution it is (groups = input channels, filter [kh, kw, C, M] as
[kh, kw, 1, C * M], whose output channel c * M + m is TensorFlow's depthwise output). Its
`cudnn_geometry()` is what cuDNN actually runs: TensorFlow's padding may be asymmetric (SAME with
an odd total, or explicit pairs) while cuDNN pads symmetrically, so tf_ucudnn's kernels pad the
input by the difference first, and the geometry cuDNN sees has that larger input.
"""

from __future__ import annotations

from typing import Iterable, Optional

import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer, UnsupportedConvolution, conv_groups
from tf_ucudnn.core.geometry import ConvGeometry

# TensorFlow's forward convolution ops this package can replace, by number of spatial dims.
CONV_OP_TYPES = {"Conv2D": 2, "Conv3D": 3, "DepthwiseConv2dNative": 2}
DEPTHWISE = "DepthwiseConv2dNative"
# Ops that read a variable: where none is upstream of a tensor, nothing trains through it.
VARIABLE_READS = frozenset({"ReadVariableOp", "ResourceGather", "VarHandleOp", "VariableV2"})


def fed_by_variables(tensor) -> bool:
    """Whether a variable feeds `tensor` in its graph, through any ops; True for an eager tensor
    (no graph says otherwise)."""
    if not tf.is_symbolic_tensor(tensor):
        return True
    pending, seen = [tensor.op], set()
    while pending:
        op = pending.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in VARIABLE_READS:
            return True
        pending.extend(t.op for t in op.inputs)
    return False


def grouped_filter_shape(depthwise_filter_shape) -> list[int]:
    """A depthwise filter's shape [kh, kw, C, M] as its grouped convolution's,
    [kh, kw, 1, C * M]."""
    kh, kw, channels, multiplier = depthwise_filter_shape
    return [kh, kw, 1, channels * multiplier]


def conv_layer_of(op: tf.Operation) -> ConvLayer:
    """The ConvLayer of a Conv2D/Conv3D/DepthwiseConv2dNative op whose input and filter shapes are
    fully known."""
    if op.type not in CONV_OP_TYPES:
        raise UnsupportedConvolution(f"{op.name}: {op.type} is not one of {sorted(CONV_OP_TYPES)}")
    input_shape, filter_shape = op.inputs[0].shape, op.inputs[1].shape
    if not input_shape.is_fully_defined() or not filter_shape.is_fully_defined():
        raise UnsupportedConvolution(
            f"{op.name}: input shape {input_shape} or filter shape {filter_shape} is not fully "
            "known; give the batch size and input shape when tracing the model")
    data_format = op.get_attr("data_format").decode()
    filter_shape = filter_shape.as_list()
    if op.type == DEPTHWISE:
        filter_shape = grouped_filter_shape(filter_shape)
    groups = conv_groups(op.name, input_shape[-1 if data_format.endswith("C") else 1],
                         filter_shape[-2], filter_shape[-1])
    attr = {a.name for a in op.op_def.attr}
    return ConvLayer(
        name=op.name, op_type=op.type,
        input_shape=tuple(input_shape.as_list()), filter_shape=tuple(filter_shape),
        strides=tuple(op.get_attr("strides")),
        dilations=tuple(op.get_attr("dilations")),
        padding=op.get_attr("padding").decode(),
        explicit_paddings=tuple(op.get_attr("explicit_paddings")) if "explicit_paddings" in attr
        else (),
        data_format=data_format, dtype=op.get_attr("T").name, groups=groups,
        input_gradient=fed_by_variables(op.inputs[0]))


def find_conv_layers(graph: tf.Graph) -> tuple[list[ConvLayer], list[tuple[str, str]]]:
    """The convolutions of a graph, and (op name, reason) for each one left out."""
    layers, skipped = [], []
    for op in graph.get_operations():
        if op.type not in CONV_OP_TYPES:
            continue
        try:
            layers.append(conv_layer_of(op))
        except UnsupportedConvolution as error:
            skipped.append((op.name, str(error)))
    return layers, skipped


def trace_model(model: tf.keras.Model, batch_size: int,
                dtype: Optional[tf.DType] = None) -> tf.Graph:
    """The inference graph of a Keras model for one batch size (its forward pass, traced)."""
    inputs = model.inputs if isinstance(model.inputs, (list, tuple)) else [model.inputs]
    specs = [tf.TensorSpec([batch_size, *x.shape[1:]], dtype or x.dtype) for x in inputs]
    function = tf.function(lambda *args: model(list(args) if len(args) > 1 else args[0],
                                               training=False))
    return function.get_concrete_function(*specs).graph


def unique_geometries(layers: Iterable[ConvLayer]) -> dict[ConvGeometry, list[str]]:
    """Distinct cuDNN geometries, each with the layers that share it (profiled once)."""
    result: dict[ConvGeometry, list[str]] = {}
    for layer in layers:
        result.setdefault(layer.cudnn_geometry(), []).append(layer.name)
    return result
