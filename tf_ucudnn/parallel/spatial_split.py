"""The spatial pass: each convolution layer of a graph split over devices along its first spatial
dimension (`tf_ucudnn.parallel.spatial`), the graph-level twin of `SpatialCosmoFlow`.

Every channels-last Conv2D/Conv3D of the main graph, and the backprop nodes `tf.GradientTape`
made from it, become calls (PartitionedCall) to functions that cut the input into slabs, one per
device, convolve each slab with its halo and concatenate the outputs (or the gradients) again:
the convolution work and its activations are spread over the devices while the rest of the graph
is left as it was. The backward functions differentiate the forward one with each gradient op
colocated with its forward op, so the backward convolutions run on the slabs' devices too. Each
device's part can carry a micro-batch plan. A layer the split cannot serve (depthwise,
channels-first, explicit padding, slabs thinner than its halo, a convolution inside a library
function) is reported with the reason, as is every other convolution-like node.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2

from tf_ucudnn.core.conv_layer import ConvLayer, UnsupportedConvolution
from tf_ucudnn.core.plan import BACKPROP_FILTER, BACKPROP_INPUT, FORWARD, LayerPlanner
from tf_ucudnn.graph.conv_layers import DEPTHWISE, conv_layer_of
from tf_ucudnn.graph.functions import graph_of
from tf_ucudnn.graph.rewrite import (
    PLANNED,
    UNSUPPORTED,
    conv_ops,
    kernel_nodes,
    leave_layer_alone,
    left_unsupported,
    orphan_backprops,
)
from tf_ucudnn.parallel import spatial
from tf_ucudnn.report import LeftAlone, RewriteReport


# The op each node of a split layer becomes: a call of the function that splits it.
SPLIT_CALL = "PartitionedCall"


@dataclasses.dataclass(frozen=True)
class SplitLayer:
    layer: str  # the forward node
    nodes: dict  # kernel -> node name
    devices: tuple[str, ...]
    slab_rows: tuple[int, ...]  # input rows of the split dimension on each device

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _unsplittable(layer: ConvLayer) -> Optional[str]:
    if layer.op_type == DEPTHWISE:
        return "a depthwise convolution; the spatial split takes Conv2D and Conv3D"
    if not layer.channels_last:
        return (f"{layer.data_format} is channels-first; the spatial split cuts channels-last "
                "tensors along their first spatial dimension")
    if layer.padding not in ("SAME", "VALID"):
        return f"{layer.padding} padding; the spatial split takes SAME or VALID"
    return None


def _layer_functions(layer: ConvLayer, devices: Sequence[str], planner: Optional[LayerPlanner]):
    """ConcreteFunctions (x, w) -> y, (x, w, dy) -> dx and (x, w, dy) -> dw of the split layer."""
    dtype = tf.as_dtype(layer.dtype)
    x_spec = tf.TensorSpec(layer.input_shape, dtype)
    w_spec = tf.TensorSpec(layer.filter_shape, dtype)

    def forward(x, w):
        slabs = spatial.conv(spatial.split(x, devices), w, strides=layer.strides[1:-1],
                             padding=layer.padding, dilations=layer.dilations[1:-1],
                             name=layer.name.replace("/", "_"), planner=planner)
        return spatial.gather(slabs)

    forward_function = tf.function(forward, autograph=False).get_concrete_function(x_spec, w_spec)
    y_spec = tf.TensorSpec(forward_function.outputs[0].shape, dtype)

    def gradient(of_filter: bool):
        def backward(x, w, dy):
            # Colocated, each slab's backward convolution runs where its forward one did.
            return tf.compat.v1.gradients(forward(x, w), w if of_filter else x, dy,
                                          colocate_gradients_with_ops=True)[0]
        return tf.function(backward, autograph=False).get_concrete_function(x_spec, w_spec,
                                                                            y_spec)

    return {FORWARD: forward_function, BACKPROP_INPUT: gradient(False),
            BACKPROP_FILTER: gradient(True)}


def _call(node, function, inputs: list, dtype) -> None:
    """`node` becomes a PartitionedCall of `function` on `inputs`, keeping its control inputs."""
    control = [name for name in node.input if name.startswith("^")]
    name, device = node.name, node.device
    node.Clear()
    node.name = name
    node.op = SPLIT_CALL
    node.input.extend(inputs + control)
    node.device = device
    node.attr["Tin"].CopyFrom(attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(type=[dtype.as_datatype_enum] * len(inputs))))
    node.attr["Tout"].CopyFrom(attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(type=[dtype.as_datatype_enum])))
    node.attr["f"].func.name = function.name


def _add_functions(library, function) -> None:
    present = {f.signature.name for f in library.function}
    for definition in [*function.graph.as_graph_def().library.function, function.function_def]:
        if definition.signature.name not in present:
            library.function.add().CopyFrom(definition)
            present.add(definition.signature.name)


def split_graph_def(graph_def: graph_pb2.GraphDef, devices: Sequence[str],
                    planner: Optional[LayerPlanner] = None,
                    graph: Optional[tf.Graph] = None) -> tuple[graph_pb2.GraphDef, RewriteReport]:
    """A copy of `graph_def` whose main-graph convolution layers are split over `devices`, and
    the report of each convolution node split or left alone with why."""
    devices = tuple(devices)
    rewritten = graph_pb2.GraphDef()
    rewritten.CopyFrom(graph_def)
    report = RewriteReport()
    graph = graph_of(graph_def, graph)
    by_name = {node.name: node for node in rewritten.node}
    ops = conv_ops(graph, by_name, PLANNED)
    claimed = set()
    for forward in (op for op in ops if PLANNED[op.type][1] == FORWARD):
        try:
            layer = conv_layer_of(forward)
            reason = _unsplittable(layer)
            functions = None if reason else _layer_functions(layer, devices, planner)
        except (UnsupportedConvolution, spatial.SpatialSplitError) as error:
            reason = str(error)
        if reason:
            report.left_alone.extend(leave_layer_alone(ops, forward, claimed, "",
                                                       f"not split: {reason}"))
            continue
        nodes = kernel_nodes(ops, forward, claimed)
        x, w = forward.inputs[0].name, forward.inputs[1].name
        dtype = forward.inputs[0].dtype
        for kernel, name in nodes.items():
            op = graph.get_operation_by_name(name)
            inputs = [x, w] if kernel == FORWARD else [x, w, op.inputs[2].name]
            _call(by_name[name], functions[kernel], inputs, dtype)
            _add_functions(rewritten.library, functions[kernel])
        report.spatial.append(SplitLayer(forward.name, nodes, devices, tuple(
            spatial.even_sizes(layer.input_shape[spatial.SPLIT_AXIS], len(devices)))))
    report.left_alone.extend(orphan_backprops(ops, claimed, ""))
    report.left_alone.extend(left_unsupported(graph, by_name, ""))
    for function in graph_def.library.function:
        for node in function.node_def:
            if node.op in PLANNED or node.op in UNSUPPORTED:
                report.left_alone.append(LeftAlone(
                    node.name, function.signature.name, "not split: inside a library function; "
                    "rewrite with inline_functions=True to split it in its caller"))
    return rewritten, report
