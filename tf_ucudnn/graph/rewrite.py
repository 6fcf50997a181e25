"""The graph pass: TensorFlow's convolution nodes become tf_ucudnn's ops, carrying their plans.

Works on a `GraphDef` (its main graph and its function library alike), a `tf.Graph`, or a
`ConcreteFunction`, whose rewritten graph is wrapped back into a callable bound to the same
variables. Each forward Conv2D/Conv3D/DepthwiseConv2dNative is grouped with the backprop nodes
that `tf.GradientTape` made from it (same input tensor, same filter tensor, same attributes), so
one `LayerPlan` serves the three kernels of a layer. Every convolution node left alone is reported
with the reason.

Grouped Conv2D/Conv3D nodes become tf_ucudnn's ops as they are (the ops take the groups from the
shapes). A depthwise node becomes the grouped convolution it is: its filter [kh, kw, C, M]
reshaped to [kh, kw, 1, C * M] on the way in, and its filter gradient reshaped back.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2
from tensorflow.python.framework import function_def_to_graph

from tf_ucudnn.core.conv_layer import UnsupportedConvolution
from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import (
    BACKPROP_FILTER,
    BACKPROP_INPUT,
    FORWARD,
    WORKSPACE_ATTR,
    KernelPlan,
    LayerPlanner,
    plan_or_reason,
)
from tf_ucudnn.graph.conv_layers import (
    DEPTHWISE,
    conv_layer_of,
    find_conv_layers,
    grouped_filter_shape,
)
from tf_ucudnn.graph.functions import (
    callable_over,
    graph_of,
    inline_function_calls,
    is_concrete_function,
)
from tf_ucudnn.graph.fusion import (
    Fusion,
    control_dependencies,
    function_results,
    fuse_nodes,
    fusion_or_reason,
    xla_compiled,
)
from tf_ucudnn.kernels import fused_conv
from tf_ucudnn.kernels.library import load_ops
from tf_ucudnn.report import FusedLayer, LeftAlone, NotFused, RewriteReport, RewrittenLayer

# TensorFlow op -> (tf_ucudnn op, kernel).
REPLACEMENTS = {
    "Conv2D": ("UcudnnConv2D", FORWARD),
    "Conv3D": ("UcudnnConv3D", FORWARD),
    "Conv2DBackpropInput": ("UcudnnConv2DBackpropInput", BACKPROP_INPUT),
    "Conv3DBackpropInputV2": ("UcudnnConv3DBackpropInput", BACKPROP_INPUT),
    "Conv2DBackpropFilter": ("UcudnnConv2DBackpropFilter", BACKPROP_FILTER),
    "Conv3DBackpropFilterV2": ("UcudnnConv3DBackpropFilter", BACKPROP_FILTER),
}
# Depthwise ops -> their grouped convolution's (tf_ucudnn op, kernel). Apart from REPLACEMENTS,
# whose nodes take the same inputs as tf_ucudnn's ops (the spatial split calls those alone).
DEPTHWISE_REPLACEMENTS = {
    DEPTHWISE: ("UcudnnConv2D", FORWARD),
    "DepthwiseConv2dNativeBackpropInput": ("UcudnnConv2DBackpropInput", BACKPROP_INPUT),
    "DepthwiseConv2dNativeBackpropFilter": ("UcudnnConv2DBackpropFilter", BACKPROP_FILTER),
}
PLANNED = {**REPLACEMENTS, **DEPTHWISE_REPLACEMENTS}
# The new name of a depthwise filter gradient's node, whose old name its reshaped result takes.
GROUPED_SUFFIX = "/ucudnn_grouped"
# Convolution-like ops tf_ucudnn has no op for, reported as left alone with why.
UNSUPPORTED = {
    "Conv3DBackpropInput": "the deprecated 3-D gradient op (V1): tf_ucudnn replaces V2 only",
    "Conv3DBackpropFilter": "the deprecated 3-D gradient op (V1): tf_ucudnn replaces V2 only",
}
_SAME_ATTRS = ("strides", "padding", "data_format", "dilations", "explicit_paddings")



def _replace(node, kernel_plan: KernelPlan, batch_size: int,
             extra: Optional[dict] = None) -> None:
    node.op = PLANNED[node.op][0]
    node.attr.pop("use_cudnn_on_gpu", None)
    # Plans are made for the traced batch; a graph that sees another (XLA compiling both branches
    # of the converter's batch check) runs it undivided.
    node.attr["plan_batch_size"].i = batch_size
    if kernel_plan.workspace_bytes is not None:
        node.attr[WORKSPACE_ATTR].i = kernel_plan.workspace_bytes
    attrs = dict(kernel_plan.attrs())
    attrs.update(extra or {})
    for key, value in attrs.items():
        if key.endswith("micro_batches"):
            node.attr[key].CopyFrom(attr_value_pb2.AttrValue(
                list=attr_value_pb2.AttrValue.ListValue(i=list(value))))
        else:
            node.attr[key].CopyFrom(attr_value_pb2.AttrValue(
                list=attr_value_pb2.AttrValue.ListValue(s=[v.encode() for v in value])))


def _output(name: str, scope: str) -> str:
    """How a node of the main graph (scope "") or of a function body reads `name`'s first output
    (every node this pass adds names it "output")."""
    return f"{name}:output:0" if scope else name


def _add_node(node_defs, name: str, op: str, inputs: list, device: str):
    added = node_defs.add()
    added.name, added.op, added.device = name, op, device
    added.input.extend(inputs)
    return added


def _add_shape(node_defs, name: str, shape: list, device: str) -> None:
    added = _add_node(node_defs, name, "Const", [], device)
    added.attr["dtype"].type = tf.int32.as_datatype_enum
    added.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(shape, tf.int32))


def _add_reshape(node_defs, name: str, tensor: str, shape: list, scope: str, node) -> None:
    _add_shape(node_defs, f"{name}/shape", shape, node.device)
    reshape = _add_node(node_defs, name, "Reshape",
                        [tensor, _output(f"{name}/shape", scope)], node.device)
    reshape.attr["T"].CopyFrom(node.attr["T"])
    reshape.attr["Tshape"].type = tf.int32.as_datatype_enum


def _group_depthwise(node_defs, node, kernel: str, depthwise_filter_shape: list,
                     scope: str) -> str:
    """Makes a depthwise node's inputs and output those of its grouped convolution: the filter
    reshaped on its way in, or for the filter's gradient, the node's name given to the gradient
    reshaped back (the node itself, renamed, computes the grouped one). Returns the name of the
    node that runs the kernel."""
    grouped = grouped_filter_shape(depthwise_filter_shape)
    if kernel != BACKPROP_FILTER:
        _add_reshape(node_defs, f"{node.name}/ucudnn_grouped_filter", node.input[1], grouped,
                     scope, node)
        node.input[1] = _output(f"{node.name}/ucudnn_grouped_filter", scope)
        return node.name
    name = node.name
    node.name = name + GROUPED_SUFFIX
    _add_shape(node_defs, f"{node.name}/filter_sizes", grouped, node.device)
    node.input[1] = _output(f"{node.name}/filter_sizes", scope)
    _add_reshape(node_defs, name, _output(node.name, scope), depthwise_filter_shape, scope, node)
    return node.name


def _attrs_match(a: tf.Operation, b: tf.Operation) -> bool:
    names = {attr.name for attr in a.op_def.attr} & {attr.name for attr in b.op_def.attr}
    return all(a.get_attr(name) == b.get_attr(name) for name in _SAME_ATTRS if name in names)


def conv_ops(graph: tf.Graph, names=None, replaced=REPLACEMENTS) -> list:
    """The graph's convolution ops of the `replaced` types (among `names`, if given)."""
    return [op for op in graph.get_operations()
            if op.type in replaced and (names is None or op.name in names)]


def kernel_nodes(ops, forward: tf.Operation, claimed: set) -> dict:
    """Kernel -> name of the nodes of `forward`'s layer among `ops`: itself and the backprop
    nodes `tf.GradientTape` made from it (same input, same filter, same attributes) that no
    other layer `claimed` yet; claims them."""
    nodes = {FORWARD: forward.name}
    depthwise = forward.type in DEPTHWISE_REPLACEMENTS
    for op in ops:
        kernel = PLANNED[op.type][1]
        if op.name in claimed or kernel == FORWARD or not _attrs_match(op, forward) or \
                (op.type in DEPTHWISE_REPLACEMENTS) != depthwise:
            continue
        if kernel == BACKPROP_INPUT and op.inputs[1].name == forward.inputs[1].name:
            nodes.setdefault(BACKPROP_INPUT, op.name)
        if kernel == BACKPROP_FILTER and op.inputs[0].name == forward.inputs[0].name:
            nodes.setdefault(BACKPROP_FILTER, op.name)
    claimed.update(nodes.values())
    return nodes


def leave_layer_alone(ops, forward: tf.Operation, claimed: set, scope: str,
                      reason: str) -> list:
    """The nodes of `forward`'s layer, claimed and reported as left alone for `reason`."""
    return [LeftAlone(name, scope, reason if kernel == FORWARD else
                      f"gradient of {forward.name}, left alone: {reason}")
            for kernel, name in kernel_nodes(ops, forward, claimed).items()]


def orphan_backprops(ops, claimed: set, scope: str) -> list:
    """Backprop nodes no layer claimed, reported as left alone."""
    return [LeftAlone(op.name, scope, "a backprop node with no forward convolution of the same "
                      "input, filter and attributes in this graph, so no layer plan to give it")
            for op in ops if op.name not in claimed and PLANNED[op.type][1] != FORWARD]


def _rewrite_nodes(graph: tf.Graph, node_defs, scope: str, planner: LayerPlanner,
                   report: RewriteReport, kept: set, unfused_because: Optional[str],
                   returns=None) -> None:
    """Rewrites `node_defs` (the NodeDefs `graph` was built from) in place, fusing each planned
    layer with its bias and activation where it can (`kept`: names that must stay; `returns`: a
    function body's ret map) unless `unfused_because` says why none is."""
    by_name = {node.name: node for node in node_defs}
    kept = kept | control_dependencies(node_defs)
    ops = conv_ops(graph, by_name, PLANNED)
    forwards = [op for op in ops if PLANNED[op.type][1] == FORWARD]
    claimed = set()
    for forward in forwards:
        try:
            layer = conv_layer_of(forward)
        except UnsupportedConvolution as error:
            report.left_alone.extend(leave_layer_alone(ops, forward, claimed, scope, str(error)))
            continue
        plan = plan_or_reason(planner, layer)
        if isinstance(plan, str):
            report.left_alone.extend(leave_layer_alone(ops, forward, claimed, scope, plan))
            continue
        nodes = kernel_nodes(ops, forward, claimed)
        gradient_plans = {f"backprop_input_{k}": v for k, v in plan.backprop_input.attrs().items()}
        gradient_plans.update({f"backprop_filter_{k}": v
                               for k, v in plan.backprop_filter.attrs().items()})
        _replace(by_name[forward.name], plan.forward, layer.batch_size, gradient_plans)
        for kernel in (BACKPROP_INPUT, BACKPROP_FILTER):
            if kernel in nodes:
                _replace(by_name[nodes[kernel]], plan.kernel(kernel), layer.batch_size)
        if forward.type == DEPTHWISE:
            nodes = {kernel: _group_depthwise(node_defs, by_name[name], kernel,
                                              forward.inputs[1].shape.as_list(), scope)
                     for kernel, name in nodes.items()}
        fusion = fused_conv.plan_refusal(plan) or fusion_or_reason(forward, kept)
        if isinstance(fusion, Fusion) and unfused_because is None:
            fuse_nodes(node_defs, fusion, returns)
            by_name = {node.name: node for node in node_defs}  # the replaced nodes are gone
            nodes[FORWARD] = fusion.name
            report.fused.append(FusedLayer(forward.name, scope, fusion.activation, fusion.name,
                                           fusion.nodes))
        else:
            reason = fusion if isinstance(fusion, str) else unfused_because
            report.not_fused.append(NotFused(forward.name, scope, reason))
        report.layers.append(RewrittenLayer(layer, scope, nodes, plan))
    report.left_alone.extend(orphan_backprops(ops, claimed, scope))
    report.left_alone.extend(left_unsupported(graph, by_name, scope))


def rewrite_graph_def(graph_def: graph_pb2.GraphDef, planner: LayerPlanner,
                      graph: Optional[tf.Graph] = None, unfused_because: Optional[str] = None,
                      ) -> tuple[graph_pb2.GraphDef, RewriteReport]:
    """A copy of `graph_def` with its convolutions (main graph and library) replaced, and the
    report of each convolution node rewritten or left alone with why (`unreported_convolutions`
    lists any it missed).

    `graph`, the graph `graph_def` came from, gives shapes a bare GraphDef may not hold (a
    variable's, for one); without it the GraphDef is imported to infer them. Each planned layer
    followed by its bias (and a ReLU) runs them in one fused op (`graph/fusion.py`), unless
    `unfused_because` gives why no layer may (the report's `not_fused` says it for each layer).
    The fused node keeps the last replaced node's name; the convolution's and the BiasAdd's
    names are gone, so a caller fetching those from a bare GraphDef or tf.Graph should pass
    `unfused_because`.
    """
    load_ops()  # the rewritten graph is imported, with tf_ucudnn's ops in it
    rewritten = graph_pb2.GraphDef()
    rewritten.CopyFrom(graph_def)
    report = RewriteReport()
    graph = graph_of(graph_def, graph)
    scopes = [("", graph, rewritten.node, set(), unfused_because, None)]
    for function in rewritten.library.function:
        try:
            body = function_def_to_graph.function_def_to_graph(function)
        except Exception as error:  # a body TensorFlow itself cannot rebuild: say so, keep it
            for node in function.node_def:
                if node.op in PLANNED:
                    report.left_alone.append(LeftAlone(
                        node.name, function.signature.name,
                        f"its function could not be rebuilt to read shapes: {error}"))
            continue
        scopes.append((function.signature.name, body, function.node_def,
                       function_results(function), unfused_because or xla_compiled(function),
                       function.ret))
    prepare = getattr(planner, "prepare", None)
    if prepare is not None:  # a planner for the whole network sees every layer first
        prepare([layer for _, body, *_ in scopes for layer in find_conv_layers(body)[0]])
    for scope, body, node_defs, kept, unfused, returns in scopes:
        _rewrite_nodes(body, node_defs, scope, planner, report, kept, unfused, returns)
    return rewritten, report


class UnreportedConvolution(TfUcudnnError, RuntimeError):
    """The pass's guarantee broke: a convolution node neither rewritten nor reported left alone."""


def left_unsupported(graph: tf.Graph, names, scope: str) -> list:
    """The ops among `names` tf_ucudnn has no op for (`UNSUPPORTED`), reported as left alone."""
    return [LeftAlone(op.name, scope, UNSUPPORTED[op.type]) for op in graph.get_operations()
            if op.type in UNSUPPORTED and op.name in names]


def unreported_convolutions(graph_def: graph_pb2.GraphDef, report: RewriteReport) -> list[str]:
    """The convolution-like nodes of `graph_def` (main graph and library) that `report`, a
    convolution pass's report on it, neither rewrote, split nor left alone with why: none, by
    the pass's guarantee."""
    reported = {(item.scope, item.node) for item in report.left_alone}
    reported |= {(item.scope, name.removesuffix(GROUPED_SUFFIX)) for item in report.layers
                 for name in item.nodes.values()}
    reported |= {(item.scope, item.layer) for item in report.fused}
    reported |= {("", name) for item in report.spatial for name in item.nodes.values()}
    scopes = [("", graph_def.node)] + [(function.signature.name, function.node_def)
                                       for function in graph_def.library.function]
    return [f"{scope + ': ' if scope else ''}{node.name} ({node.op})"
            for scope, nodes in scopes for node in nodes
            if (node.op in PLANNED or node.op in UNSUPPORTED)
            and (scope, node.name) not in reported]


def rewrite_convolutions(target, planner: LayerPlanner, *, inline_functions: bool = False,
                         unfused_because: Optional[str] = None):
    """Rewrites a GraphDef, a tf.Graph or a ConcreteFunction; returns (rewritten, report).

    A GraphDef or tf.Graph gives a GraphDef. A ConcreteFunction gives a tf.function over the same
    inputs, outputs and captured variables, running the rewritten graph. With `inline_functions`,
    a ConcreteFunction's calls to other functions (a restored SavedModel's signatures are such
    calls) are inlined first, so that their convolutions get the caller's fully known shapes.
    Layers are fused with their bias and ReLU unless `unfused_because` says why not (see
    `rewrite_graph_def`). UnreportedConvolution, naming them, if the pass neither rewrote nor
    reported some convolution nodes.
    """
    def rewrite_and_check(graph_def, graph):
        rewritten, report = rewrite_graph_def(graph_def, planner, graph, unfused_because)
        missing = unreported_convolutions(graph_def, report)
        if missing:
            raise UnreportedConvolution(f"the convolution pass neither rewrote nor reported "
                                        f"{len(missing)} node(s): {', '.join(missing[:5])}")
        return rewritten, report

    return apply_graph_pass(target, rewrite_and_check, inline_functions=inline_functions)


def graph_def_of(target) -> tuple[graph_pb2.GraphDef, Optional[tf.Graph], Optional[object]]:
    """A GraphDef, a tf.Graph or a ConcreteFunction as a GraphDef, with the tf.Graph it was built
    from (None for a GraphDef) and the ConcreteFunction whose inputs, outputs and variables its
    placeholders are (None but for a ConcreteFunction)."""
    if isinstance(target, graph_pb2.GraphDef):
        return target, None, None
    if isinstance(target, tf.Graph):
        return target.as_graph_def(), target, None
    if is_concrete_function(target):
        return target.graph.as_graph_def(), target.graph, target
    raise TypeError(f"rewrite takes a GraphDef, a tf.Graph or a ConcreteFunction, got "
                    f"{type(target).__name__} (for a tf.function, pass "
                    "fn.get_concrete_function(...))")


def apply_graph_pass(target, graph_pass, *, inline_functions: bool = False):
    """Runs `graph_pass(graph_def, graph or None) -> (graph_def, report)` over a GraphDef, a
    tf.Graph or a ConcreteFunction, returning what `rewrite_convolutions` does."""
    if inline_functions and is_concrete_function(target):
        target = inline_function_calls(target).get_concrete_function()
    graph_def, graph, function = graph_def_of(target)
    rewritten, report = graph_pass(graph_def, graph)
    return (rewritten if function is None else callable_over(rewritten, function)), report
