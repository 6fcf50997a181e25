"""NodeDef edits the memory passes make: copies of nodes, inputs read and written as text, shape
constants and plans resized to a micro-batch, a kernel's plan replaced."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_ucudnn.core.plan import WORKSPACE_ATTR, KernelPlan

# The operand of these that is a shape whose first dimension is the output's.
SHAPE_OPERANDS = {"AvgPoolGrad": 0, "AvgPool3DGrad": 0, "Conv2DBackpropInput": 0,
                   "Conv3DBackpropInputV2": 0, "UcudnnConv2DBackpropInput": 0,
                   "UcudnnConv3DBackpropInput": 0, "Reshape": 1, "Fill": 0, "BroadcastTo": 1}


def copy_node(node):
    copy = type(node)()
    copy.CopyFrom(node)
    copy.attr.pop("_class", None)  # colocation with an original: the clones go where they may
    return copy


def sized_constant(op: tf.Operation, index: int, batch: int, size: int):
    """For a shape operand that is a constant with the batch first (where the op's output has
    the batch first), that shape for a micro-batch of `size`; else None."""
    if SHAPE_OPERANDS.get(op.type) != index or op.inputs[index].op.type != "Const" or \
            not op.outputs[0].shape.rank or op.outputs[0].shape[0] != batch:
        return None
    value = tf.get_static_value(op.inputs[index])
    if value is None or value.ndim != 1 or not len(value) or value[0] != batch:
        return None
    sized = np.array(value)
    sized[0] = size
    return sized


def fit_plan(node, size: int) -> None:
    """A tf_ucudnn convolution's plans (whose micro-batches sum to the batch) cut down to their
    first `size` samples: the same algorithms on micro-batches no larger, so no more workspace."""
    for key in list(node.attr):
        sizes = list(node.attr[key].list.i) if key.endswith("micro_batches") else []
        if not sizes:
            continue
        algorithms = node.attr[key.replace("micro_batches", "algorithms")].list.s
        kept, left = [], size
        for planned in sizes:
            if left == 0:
                break
            kept.append(min(planned, left))
            left -= kept[-1]
        node.attr[key].list.i[:] = kept
        del algorithms[len(kept):]
    if "plan_batch_size" in node.attr and node.attr["plan_batch_size"].i >= 0:
        node.attr["plan_batch_size"].i = size  # the plans are for micro-batches of `size` now


def set_kernel_plan(node, plan: KernelPlan, workspace_bytes: int) -> None:
    """A planned convolution node's own kernel runs `plan`, whose workspace the node then
    carries for the liveness analysis."""
    attrs = plan.attrs()
    node.attr["micro_batches"].list.i[:] = attrs["micro_batches"]
    node.attr["algorithms"].list.s[:] = [a.encode() for a in attrs["algorithms"]]
    node.attr[WORKSPACE_ATTR].i = workspace_bytes


def parse_input(text: str) -> tuple[bool, str, int]:
    """A NodeDef input: whether it is a control input, the node, the output index."""
    control = text.startswith("^")
    name, _, index = text.lstrip("^").partition(":")
    return control, name, int(index or 0)


def tensor_ref(name: str, index: int) -> str:
    return name if index == 0 else f"{name}:{index}"

