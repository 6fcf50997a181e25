"""A planned convolution, its BiasAdd and its Relu as one `UcudnnFusedConv2D/3D` node.

Where a convolution's only reader is a BiasAdd of a channel bias in the convolution's data format,
and that BiasAdd's only reader is a Relu, the three nodes become one fused node with activation
"relu"; where the BiasAdd is read by no activation at all, the two become one with "identity".
The fused node takes the name of the last node it replaces, so every reader, fetch and control
dependency of that node finds it; the nodes before it must have no reader but the next one, no
control dependents, and not be a function's result, since their names are gone afterwards.

Training graphs fuse as well: TensorFlow's gradients of these ops read the layer's input, filter
and output and the incoming gradient, never the convolution's or the BiasAdd's result (ReluGrad
takes the Relu's output), so they run unchanged around the fused node. A gradient that did read
one of those results is a reader like any other, and the layer is then not fused, saying so.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import tensorflow as tf

# The ops tf_ucudnn's convolution nodes become when fused with their bias and activation.
FUSED_OPS = {"UcudnnConv2D": "UcudnnFusedConv2D", "UcudnnConv3D": "UcudnnFusedConv3D"}
# Activations after a BiasAdd that the fused op does not take (it takes a Relu, or nothing).
OTHER_ACTIVATIONS = {"Relu6", "LeakyRelu", "Elu", "Selu", "Softplus", "Softsign", "Sigmoid",
                     "Tanh", "Gelu"}


@dataclasses.dataclass(frozen=True)
class Fusion:
    """The nodes one fused node replaces, in order (convolution, BiasAdd[, Relu])."""

    nodes: tuple
    activation: str  # "relu" or "identity"

    @property
    def name(self) -> str:
        return self.nodes[-1]


def _readers(op: tf.Operation) -> list:
    return [reader for output in op.outputs for reader in output.consumers()]


def _describe(ops) -> str:
    return ", ".join(f"{op.type} {op.name}" for op in ops) or "nothing"


def fusion_or_reason(forward: tf.Operation, kept: set) -> Union[Fusion, str]:
    """The fusion of `forward` (a Conv2D/Conv3D/DepthwiseConv2dNative op) with its BiasAdd and
    Relu, or why there is none. `kept` holds the names that must stay (control dependencies,
    function results)."""
    readers = _readers(forward)
    if len(readers) != 1 or readers[0].type != "BiasAdd" or \
            readers[0].inputs[0] is not forward.outputs[0]:
        return f"its output is read by {_describe(readers)}, not by one BiasAdd alone"
    bias_add = readers[0]
    channels_last = forward.get_attr("data_format").decode().endswith("C")
    if bias_add.get_attr("data_format").decode() != ("NHWC" if channels_last else "NCHW"):
        return (f"its BiasAdd {bias_add.name} adds along another dimension than the "
                "convolution's channels")
    nodes, activation = (forward.name, bias_add.name), "identity"
    after_bias = _readers(bias_add)
    if len(after_bias) == 1 and after_bias[0].type == "Relu":
        nodes, activation = (*nodes, after_bias[0].name), "relu"
    elif any(op.type in OTHER_ACTIVATIONS or op.type == "Relu" for op in after_bias):
        return (f"its BiasAdd {bias_add.name} is read by {_describe(after_bias)}: the fused op "
                "takes one Relu alone after the bias, or no activation")
    gone = [name for name in nodes[:-1] if name in kept]
    if gone:
        return (f"{', '.join(gone)} must keep its name (a control dependency or a function's "
                "result), and the fused node would replace it")
    return Fusion(nodes, activation)


def fuse_nodes(node_defs, fusion: Fusion, returns=None) -> None:
    """Replaces `fusion`'s NodeDefs among `node_defs` (the convolution's already tf_ucudnn's,
    carrying its plans) by one fused node with the last one's name. In a function body
    (`returns`: its FunctionDef's ret map), readers name an output by its argument, "output" for
    the fused op, so the readers of the last node and the function's results are renamed too."""
    by_name = {node.name: node for node in node_defs}
    conv, bias_add = by_name[fusion.nodes[0]], by_name[fusion.nodes[1]]
    replaced = [by_name[name] for name in fusion.nodes]
    controls = list(dict.fromkeys(name for node in replaced for name in node.input
                                  if name.startswith("^")))
    fused = node_defs.add()
    fused.CopyFrom(conv)
    fused.name, fused.op = fusion.name, FUSED_OPS[conv.op]
    del fused.input[:]
    fused.input.extend([conv.input[0], conv.input[1], bias_add.input[1], *controls])
    fused.attr["activation"].s = b"Relu" if fusion.activation == "relu" else b"Identity"
    for node in replaced:
        node_defs.remove(node)
    if returns is None:
        return
    prefix = fusion.name + ":"
    for node in node_defs:
        for index, name in enumerate(node.input):
            if name.startswith(prefix):
                node.input[index] = _fused_output(name)
    for key, name in returns.items():
        if name.startswith(prefix):
            returns[key] = _fused_output(name)


def _fused_output(name: str) -> str:
    """A function body's "node:argument:index" for the same output of the fused node."""
    node, _, index = name.rsplit(":", 2)
    return f"{node}:output:{index}"


def control_dependencies(node_defs) -> set:
    """The names of the nodes some node of `node_defs` has a control dependency on."""
    return {name[1:] for node in node_defs for name in node.input if name.startswith("^")}


def function_results(function) -> set:
    """The names of the nodes whose outputs or completion a FunctionDef returns."""
    return {value.partition(":")[0] for value in function.ret.values()} | \
        set(function.control_ret.values())


def xla_compiled(function) -> Optional[str]:
    """Why a FunctionDef's layers are not fused, if XLA compiles it."""
    if "_XlaMustCompile" in function.attr and function.attr["_XlaMustCompile"].b:
        return "its function is compiled by XLA (jit_compile), which has no kernel for the fused op"
    return None
