"""Which ops of a training step a micro-batched prefix cut at a tensor holds: the forward ops
before the cut that treat each sample on their own, and the backward ops that end at the weights'
gradients (see `graph_prefix` for the rules and why)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.memory.analysis.liveness import backward_ops
from tf_ucudnn.memory.passes.node_edits import copy_node, fit_plan, sized_constant

POOLINGS = {"MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D"}


_CONVOLUTIONS = {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "UcudnnConv2D", "UcudnnConv3D",
                 "UcudnnFusedConv2D", "UcudnnFusedConv3D"}


# Ops whose first input holds the batch and whose other inputs must not.
_FIRST_OPERAND = POOLINGS | _CONVOLUTIONS | {
    "BiasAdd", "Relu", "Relu6", "LeakyRelu", "Elu", "Selu", "Sigmoid", "Tanh", "Softplus",
    "Softsign", "Identity", "Cast", "Neg", "Square", "Pad", "PadV2", "MirrorPad"}


_BROADCASTING = {"Add", "AddV2", "Mul", "Sub", "RealDiv", "Maximum", "Minimum"}


_BATCH_STATISTICS = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "UcudnnBatchNorm"}


_REDUCTIONS = {"Mean", "Sum", "Max", "Min", "Prod"}


@dataclasses.dataclass(frozen=True)
class GraphPrefix:
    """The ops of a step the pass divides at `cut` (names, in execution order)."""

    cut: str
    batch_size: int
    batch_inputs: tuple[str, ...]  # the step's inputs the prefix reads, split
    forward: tuple[str, ...]  # P
    backward: tuple[str, ...]  # B
    recomputed: tuple[str, ...]  # the ops of P that B needs made again
    dropped: tuple[str, ...]  # ops reading P or B whose results nothing uses, left out
    cut_gradient: Optional[str]  # None when B is empty (no gradient flows into the prefix)
    weight_gradients: tuple[str, ...]  # B's tensors read outside it, summed over micro-batches
    batched: frozenset  # P's and B's tensors holding the batch (along the first dimension)


class PrefixAnalysis:
    """What the prefixes of one step share: its ops and NodeDefs, which ops are backward, its
    inputs (less the captured variables) and its outputs."""

    def __init__(self, function):
        self.graph = function.graph
        self.graph_def = self.graph.as_graph_def()
        self.nodes = {node.name: node for node in self.graph_def.node}
        self.operations = self.graph.get_operations()
        self.backward = dict(zip((op.name for op in self.operations),
                                 backward_ops(self.operations)))
        captured = {t.name for t in self.graph.internal_captures}
        self.inputs = [t for t in function.inputs if t.name not in captured]
        self.outputs = {t.name for t in function.outputs}

    def batch_size(self, cut: str) -> int:
        tensor = self._tensor(cut)
        if tensor.shape.rank is None or tensor.shape.rank == 0 or tensor.shape[0] is None:
            raise PrefixError(f"{cut}: its shape {tensor.shape} has no known batch dimension")
        return int(tensor.shape[0])

    def _tensor(self, name: str) -> tf.Tensor:
        try:
            return self.graph.get_tensor_by_name(name)
        except (KeyError, ValueError) as error:
            raise PrefixError(f"{name}: no such tensor in the step") from error

    def prefix(self, cut: str, size: int) -> GraphPrefix:
        """P and B for a cut at `cut`, B's tensors classed by cloning it for a micro-batch of
        `size` samples."""
        cut_tensor, batch = self._tensor(cut), self.batch_size(cut)
        if self.backward[cut_tensor.op.name]:
            raise PrefixError(f"{cut}: made by the backward pass; cut at a forward tensor")
        before = _ancestors(cut_tensor.op)
        inputs = [t for t in self.inputs if t.op.name in before and t.shape.rank
                  and t.shape[0] == batch]
        if not inputs:
            raise PrefixError(f"{cut}: depends on none of the step's inputs of {batch} samples")
        derived = _descendants(inputs)
        forward = [op for op in self.operations if op.name in before and op.name in derived]
        batched = {t.name for t in inputs}
        for op in forward:
            reason = _not_per_sample(op, batched)
            if reason:
                raise PrefixError(f"{op.name}: {reason}, so the ops up to {cut} cannot run in "
                                  "micro-batches")
            batched.update(t.name for t in op.outputs)
        pulled: set[str] = set()  # ops made to join B: the makers of gradients not the cut's
        while True:
            backward, entering, sums, batched_b = self._backward(
                cut_tensor, batch, size, inputs, forward, derived, pulled)
            wrong = [t for t in entering if t.shape != cut_tensor.shape]
            if not wrong:
                break
            for tensor in wrong:
                maker = tensor.op
                if not self.backward[maker.name] or maker.name in pulled:
                    raise PrefixError(f"{cut}: the prefix's backward reads {tensor.name} of shape "
                                      f"{tensor.shape}, which holds the batch but is not the "
                                      f"gradient of {cut} (of shape {cut_tensor.shape})")
                pulled.add(maker.name)
        in_backward = {op.name for op in backward}
        leaving = [t for op in backward for t in op.outputs
                   if t.name in self.outputs
                   or any(reader.name not in in_backward for reader in t.consumers())]
        for tensor in leaving:
            if tensor.name in batched_b or tensor.name not in sums:
                where = ("returned by the step" if tensor.name in self.outputs else "read by " +
                         next(r.name for r in tensor.consumers() if r.name not in in_backward))
                raise PrefixError(
                    f"{cut}: {tensor.name} (shape {tensor.shape}) of the prefix's backward is "
                    f"{where}, but only sums over the batch (weights' gradients) may leave it: "
                    "a tensor with the batch, such as an input's gradient, would be made in "
                    "pieces")
        live = _ancestors_within(leaving, in_backward)
        kept = [op for op in backward if op.name in live]
        entering = [t for t in entering if any(r.name in live for r in t.consumers())]
        if kept and len(entering) != 1:
            raise PrefixError(
                f"{cut}: the prefix's backward must read exactly one tensor holding the batch "
                "from the rest of the step, the gradient of the cut; it reads "
                + (", ".join(t.name for t in entering) if entering else "none"))
        in_forward = {op.name for op in forward}
        needed = _ancestors_within([t for op in kept for t in op.inputs
                                    if t.op.name in in_forward], in_forward)
        return GraphPrefix(
            cut=cut, batch_size=batch, batch_inputs=tuple(t.name for t in inputs),
            forward=tuple(op.name for op in forward), backward=tuple(op.name for op in kept),
            recomputed=tuple(op.name for op in forward if op.name in needed),
            dropped=tuple(op.name for op in backward if op.name not in live),
            cut_gradient=entering[0].name if kept else None,
            weight_gradients=tuple(t.name for t in leaving if t.op.name in live),
            batched=frozenset(batched | batched_b))

    def _backward(self, cut_tensor, batch, size, inputs, forward, derived, pulled):
        """B (ops, in order), the tensors holding the batch it reads from outside, its outputs
        that are sums over the batch, and those holding the batch; P and B cloned into a scratch
        graph for a micro-batch of `size` samples to tell them apart."""
        probe = PrefixProbe(self.nodes, batch, size)
        for tensor in inputs:
            probe.split(tensor)
        for op in forward:
            probe.clone(op)
        cut = cut_tensor.name
        # What makes an op part of B: reading these (the cut is read by the rest of the step).
        carried = {t.name for t in inputs} | {t.name for op in forward for t in op.outputs
                                               if t.name != cut}
        in_forward = {op.name for op in forward}
        backward, entering, sums, batched = [], {}, set(), set()
        for op in self.operations:
            if op.name in in_forward or not (op.name in pulled or
                                             any(t.name in carried for t in op.inputs)):
                continue
            read = next((t.name for t in op.inputs if t.name in carried), None)
            if not self.backward[op.name]:
                raise PrefixError(f"{op.name} reads {read}, made before {cut}: the step's "
                                  f"inputs must reach the rest of it only through {cut}")
            if op.op_def.is_stateful or any(t.dtype in (tf.resource, tf.variant)
                                            for t in op.inputs):
                raise PrefixError(f"{op.name}: {op.type} is stateful or reads a resource, so it "
                                  "cannot run once per micro-batch")
            partial = [t.name for t in op.inputs if t.name in sums]
            if partial:
                raise PrefixError(f"{op.name}: reads {partial[0]}, a sum over the batch, beside "
                                  "the batch itself: the gradient does not treat each sample on "
                                  "its own")
            for tensor in op.inputs:
                if tensor.name not in probe.made and tensor.op.name in derived and \
                        tensor.dtype.is_floating and tensor.shape.rank and \
                        tensor.shape[0] == batch:
                    entering[tensor.name] = tensor
                    probe.split(tensor)
            backward.append(op)
            for tensor, shape in zip(op.outputs, probe.clone(op)):
                if shape == tensor.shape:
                    if tensor.dtype.is_integer:  # a shape or count of the batch: B reads it on
                        carried.add(tensor.name)
                    else:
                        sums.add(tensor.name)
                elif shape.rank and shape[0] == size and shape[1:] == tensor.shape[1:] and \
                        tensor.shape[0] == batch:
                    carried.add(tensor.name)
                    batched.add(tensor.name)
                else:
                    raise PrefixError(f"{op.name}: cannot tell whether {tensor.name} holds the "
                                      f"batch: its shape is {tensor.shape} for {batch} samples "
                                      f"and {shape} for {size}")
        return backward, list(entering.values()), sums, batched


class PrefixProbe:
    """A scratch graph of clones for one micro-batch, for TensorFlow's shape inference."""

    def __init__(self, nodes: dict, batch: int, size: int):
        self.nodes, self.batch, self.size = nodes, batch, size
        self.graph = tf.Graph()
        self.made: dict[str, tf.Tensor] = {}  # an original tensor's name -> its clone

    def split(self, tensor: tf.Tensor) -> None:
        with self.graph.as_default():
            self.made[tensor.name] = tf.compat.v1.placeholder(
                tensor.dtype, [self.size, *tensor.shape[1:]])

    def _outside(self, tensor: tf.Tensor) -> tf.Tensor:
        """An input from outside the clones: constants as they are (their values tell shapes),
        the rest as placeholders of their shapes."""
        with self.graph.as_default():
            value = tf.get_static_value(tensor) if tensor.op.type == "Const" else None
            return (tf.constant(value, tensor.dtype) if value is not None else
                    tf.compat.v1.placeholder(tensor.dtype, tensor.shape))

    def clone(self, op: tf.Operation) -> list[tf.TensorShape]:
        """Clones `op` and returns its outputs' static shapes."""
        node = copy_node(self.nodes[op.name])
        node.name = f"clone/{op.name}"  # apart from the placeholders' and constants' names
        del node.input[:]
        input_map = {}
        for index, tensor in enumerate(op.inputs):
            sized = sized_constant(op, index, self.batch, self.size)
            if sized is not None:
                with self.graph.as_default():
                    source = tf.constant(sized)
            else:
                source = self.made.get(tensor.name)
                if source is None:
                    source = self.made[tensor.name] = self._outside(tensor)
            key = f"input_{index}:0"
            node.input.append(key)
            input_map[key] = source
        fit_plan(node, self.size)
        try:
            with self.graph.as_default():
                clone, = tf.graph_util.import_graph_def(
                    graph_pb2.GraphDef(node=[node]), input_map=input_map,
                    return_elements=[node.name], name="")
        except ValueError as error:
            raise PrefixError(f"{op.name}: cannot run on a micro-batch of {self.size}: "
                              f"{error}") from error
        for tensor, made in zip(op.outputs, clone.outputs):
            self.made[tensor.name] = made
        return [t.shape for t in clone.outputs]


def _not_per_sample(op: tf.Operation, batched: set) -> Optional[str]:
    """Why `op` may mix samples, or None if it treats each on its own; `batched` names the
    tensors holding the batch."""
    holds = [t.name in batched for t in op.inputs]
    if op.type in _BATCH_STATISTICS:
        return (f"{op.type} normalizes each sample with statistics of the whole batch"
                if op.type == "UcudnnBatchNorm" or op.get_attr("is_training") else
                f"{op.type} is not among the ops known to treat each sample on its own")
    if op.type in _FIRST_OPERAND:
        if not holds[0] or any(holds[1:]):
            other = next(t.name for t, held in zip(op.inputs[1:], holds[1:]) if held)
            return f"its operand {other} depends on the batch (only its first may)"
        if op.type in POOLINGS and (op.get_attr("ksize")[0] != 1 or
                                    op.get_attr("strides")[0] != 1):
            return "it pools across the batch"
        if op.type in ("Pad", "PadV2", "MirrorPad"):
            paddings = tf.get_static_value(op.inputs[1])
            if paddings is None or list(paddings[0]) != [0, 0]:
                return "it pads along the batch, or by amounts not known while building"
        return None
    if op.type in _REDUCTIONS:
        axes = tf.get_static_value(op.inputs[1])
        rank = op.inputs[0].shape.rank
        if any(holds[1:]) or axes is None or rank is None or \
                0 in {int(axis) % rank for axis in np.ravel(axes)}:
            return "it reduces over the batch, mixing the samples"
        return None
    if op.type in _BROADCASTING:
        shape = op.outputs[0].shape
        for tensor, held in zip(op.inputs, holds):
            if held and (tensor.shape.rank != shape.rank or tensor.shape[0] != shape[0]):
                return f"it broadcasts {tensor.name}, which holds the batch"
            if not held and tensor.shape.rank == shape.rank and tensor.shape[0] != 1:
                return (f"its operand {tensor.name} does not depend on the batch but has "
                        f"{tensor.shape[0]} rows along it, one for each sample")
        return None
    return f"{op.type} is not among the ops known to treat each sample on its own"


def _ancestors(op: tf.Operation) -> set:
    """The names of `op` and of the ops it depends on through data."""
    seen, frontier = {op.name}, [op]
    while frontier:
        for tensor in frontier.pop().inputs:
            if tensor.op.name not in seen:
                seen.add(tensor.op.name)
                frontier.append(tensor.op)
    return seen


def _descendants(tensors) -> set:
    """The names of the ops that depend on `tensors` through data."""
    seen, frontier = set(), [op for t in tensors for op in t.consumers()]
    while frontier:
        op = frontier.pop()
        if op.name not in seen:
            seen.add(op.name)
            frontier += [reader for t in op.outputs for reader in t.consumers()]
    return seen


def _ancestors_within(tensors, names: set) -> set:
    """The ops among `names` that `tensors` depend on through data."""
    seen, frontier = set(), [t.op for t in tensors if t.op.name in names]
    while frontier:
        op = frontier.pop()
        if op.name not in seen:
            seen.add(op.name)
            frontier += [t.op for t in op.inputs if t.op.name in names]
    return seen

