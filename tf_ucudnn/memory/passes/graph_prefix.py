"""The micro-batched prefix on a graph: a training step's first ops run one micro-batch at a time.

`microbatched_prefix` does this for a Keras model, whose layers it can call again; a graph (a
ConcreteFunction of a training step, as `tf_ucudnn.rewrite` and the SavedModel converter get) has
only its ops. Cut after a forward tensor (typically a pooling's output):

- the prefix P is the forward ops before the cut that depend on the step's batch inputs (not the
  weights' reads and reshapes). Each of them must treat each sample on its own (an allow-list of
  op types, with checks of their operands), and the batch inputs must reach the rest of the step
  only through the cut;
- the prefix's backward B is the backward ops that read a tensor of P or a batch input, or one
  of B's that holds the batch (or an integer made from them, such as a shape), and pass
  something on to the rest of the step: B ends at the weights' gradients, the first tensors
  without the batch, which are sums over the samples. The only tensor holding the batch that B
  reads from outside is the gradient of the cut; where B's first op reads another (an average
  pooling's gradient reads the cut's gradient and gives its input's), that op's maker joins B.
  Which tensors hold the batch is TensorFlow's own shape inference's answer: B is cloned for a
  micro-batch op by op, and a tensor holds the batch when its clone's first dimension is the
  micro-batch's rather than the batch's.

The batch inputs are split into micro-batches; P is cloned for each, one after another (control
edges), and the cut's readers read the clones' outputs concatenated. After the cut's gradient is
made, each micro-batch's P is cloned again (recomputed) and B cloned over it, reading its piece
of the cut's gradient; the weights' gradients are summed as the micro-batches go (each waits for
the sums of the one before), so that one micro-batch's activations and one set of partial sums
are held at a time. Shape constants that fix the batch (a gradient's input sizes) are given the
micro-batch's, and every clone's static shape is checked before the step is handed back.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Iterator, Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.core.plan import even_sizes
from tf_ucudnn.graph.functions import callable_over
from tf_ucudnn.memory.analysis.liveness import backward_ops
from tf_ucudnn.memory.passes.graph_edits import protect
from tf_ucudnn.memory.passes.recompute import unique_name

SCOPE = "ucudnn_micro_batch"  # in the names of the clones and of the nodes the pass adds

POOLINGS = {"MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D"}
_CONVOLUTIONS = {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "UcudnnConv2D", "UcudnnConv3D"}
# Ops whose first input holds the batch and whose other inputs must not.
_FIRST_OPERAND = POOLINGS | _CONVOLUTIONS | {
    "BiasAdd", "Relu", "Relu6", "LeakyRelu", "Elu", "Selu", "Sigmoid", "Tanh", "Softplus",
    "Softsign", "Identity", "Cast", "Neg", "Square", "Pad", "PadV2", "MirrorPad"}
_BROADCASTING = {"Add", "AddV2", "Mul", "Sub", "RealDiv", "Maximum", "Minimum"}
_BATCH_STATISTICS = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "UcudnnBatchNorm"}
_REDUCTIONS = {"Mean", "Sum", "Max", "Min", "Prod"}
# The operand of these that is a shape whose first dimension is the output's.
_SHAPE_OPERANDS = {"AvgPoolGrad": 0, "AvgPool3DGrad": 0, "Conv2DBackpropInput": 0,
                   "Conv3DBackpropInputV2": 0, "UcudnnConv2DBackpropInput": 0,
                   "UcudnnConv3DBackpropInput": 0, "Reshape": 1, "Fill": 0, "BroadcastTo": 1}


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


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """The sizes `run_in_micro_batches` uses: as even as can be, the larger ones first."""
    if not 2 <= micro_batches <= batch:
        raise PrefixError(f"cannot divide a batch of {batch} into {micro_batches} micro-batches "
                          f"(from 2 to {batch})")
    return even_sizes(batch, micro_batches)


def micro_batch_prefix(function, cut: str, micro_batches: int):
    """`function` (a ConcreteFunction of a training step) with the ops up to the tensor `cut`
    ("op:0") run in `micro_batches` micro-batches and made again for the backward pass, as a
    tf.function over the same inputs and variables. PrefixError names the op and the reason
    where the step does not allow it."""
    analysis = _Analysis(function)
    batch = analysis.batch_size(cut)
    sizes = micro_batch_sizes(batch, micro_batches)
    prefix = analysis.prefix(cut, sizes[0])
    return callable_over(_build(analysis.graph_def, prefix, sizes, analysis.graph), function)


def prefix_cuts(function) -> tuple[list[str], list[tuple[str, str]]]:
    """The forward poolings' outputs at which `micro_batch_prefix` can cut the step, in execution
    order, and (tensor, reason) for those at which it cannot."""
    possible, refused = [], []
    for cut, reason in cut_candidates(function):
        if reason is None:
            possible.append(cut)
        else:
            refused.append((cut, reason))
    return possible, refused


def cut_candidates(function, cuts=None) -> Iterator[tuple[str, Optional[str]]]:
    """Each of `cuts` (default: the forward poolings' outputs, in execution order) with None
    where the pass can cut there, else the reason; worked out as they are asked for."""
    analysis = _Analysis(function)
    if cuts is None:
        cuts = [op.outputs[0].name for op in analysis.operations
                if op.type in POOLINGS and not analysis.backward[op.name]]
    for cut in cuts:
        try:
            analysis.prefix(cut, micro_batch_sizes(analysis.batch_size(cut), 2)[0])
        except PrefixError as error:
            yield cut, str(error)
            continue
        yield cut, None


class _Analysis:
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
        probe = _Probe(self.nodes, batch, size)
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


class _Probe:
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
        node = _copy(self.nodes[op.name])
        node.name = f"clone/{op.name}"  # apart from the placeholders' and constants' names
        del node.input[:]
        input_map = {}
        for index, tensor in enumerate(op.inputs):
            sized = _sized_constant(op, index, self.batch, self.size)
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
        _fit_plan(node, self.size)
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


def _copy(node):
    copy = type(node)()
    copy.CopyFrom(node)
    copy.attr.pop("_class", None)  # colocation with an original: the clones go where they may
    return copy


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


def _sized_constant(op: tf.Operation, index: int, batch: int, size: int):
    """For a shape operand that is a constant with the batch first (where the op's output has
    the batch first), that shape for a micro-batch of `size`; else None."""
    if _SHAPE_OPERANDS.get(op.type) != index or op.inputs[index].op.type != "Const" or \
            not op.outputs[0].shape.rank or op.outputs[0].shape[0] != batch:
        return None
    value = tf.get_static_value(op.inputs[index])
    if value is None or value.ndim != 1 or not len(value) or value[0] != batch:
        return None
    sized = np.array(value)
    sized[0] = size
    return sized


def _fit_plan(node, size: int) -> None:
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


def _parse(text: str) -> tuple[bool, str, int]:
    """A NodeDef input: whether it is a control input, the node, the output index."""
    control = text.startswith("^")
    name, _, index = text.lstrip("^").partition(":")
    return control, name, int(index or 0)


def _ref(name: str, index: int) -> str:
    return name if index == 0 else f"{name}:{index}"


def _build(graph_def: graph_pb2.GraphDef, prefix: GraphPrefix, sizes: list[int],
           graph: tf.Graph) -> graph_pb2.GraphDef:
    """A copy of `graph_def` (the main graph of `graph`) with `prefix` run in micro-batches of
    `sizes`."""
    builder = _Builder(graph_def, prefix, sizes, graph)
    position = builder.position
    cut_op, cut_index = _parse(prefix.cut)[1:]
    first = min(position[name] for name in prefix.forward)
    for tensor in prefix.batch_inputs:
        builder.split(tensor, (first, -1, 0, 0))
    cut_clones, trigger = [], []
    for i in range(len(sizes)):
        made: dict[str, str] = {}
        builder.clone(prefix.forward, i, "", (position[cut_op], 1), trigger, made)
        cut_clones.append(_ref(made[cut_op], cut_index))
        trigger = [made[cut_op]]  # the next micro-batch starts once this one's cut is made
    builder.rewire(prefix.cut, builder.concat(cut_clones, (position[cut_op], 2, 0, 0)))
    if not prefix.backward:
        return builder.finish()
    start = min(position[name] for name in prefix.backward)
    # The first micro-batch waits for the cut's gradient: made any sooner, its activations would
    # be held through the rest of the backward pass.
    trigger, sums = [builder.split(prefix.cut_gradient, (start, -1, 0, 0))], {}
    for i in range(len(sizes)):
        made = {}
        builder.clone(prefix.recomputed, i, "/recomputed", (start, 1), trigger, made)
        builder.clone(prefix.backward, i, "", (start, 1), trigger, made)
        for tensor in prefix.weight_gradients:
            producer, index = _parse(tensor)[1:]
            part = _ref(made[producer], index)
            sums[tensor] = part if i == 0 else builder.add_n(
                tensor, f"{producer}/{SCOPE}_{i}/sum" + (f"_{index}" if index else ""),
                [sums[tensor], part], (start, 1, i, len(position)))
        # The next micro-batch waits for these sums: one set of partial sums is held at a time.
        trigger = sorted({_parse(name)[1] for name in sums.values()})
    for tensor, total in sums.items():
        builder.rewire(tensor, total)
    return builder.finish()


class _Builder:
    """The micro-batched GraphDef being made: the original's nodes less the prefix's, and the
    clones and nodes the pass adds, each with a key for its place in the execution order (among
    the nodes whose inputs are made, the smallest key goes first)."""

    def __init__(self, graph_def: graph_pb2.GraphDef, prefix: GraphPrefix, sizes: list[int],
                 graph: tf.Graph):
        self.graph_def, self.prefix, self.sizes, self.graph = graph_def, prefix, sizes, graph
        self.original = {node.name: node for node in graph_def.node}
        self.position = {name: i for i, name in enumerate(self.original)}
        removed = set(prefix.forward) | set(prefix.backward) | set(prefix.dropped)
        self.nodes = {name: _copy(node) for name, node in self.original.items()
                      if name not in removed}
        self.keys = {name: (self.position[name], 0, 0, 0) for name in self.nodes}
        self.taken = set(self.original)
        self.clones: dict[str, tuple[str, int]] = {}  # clone -> (original, micro-batch)
        self.first_clones: dict[str, str] = {}  # original -> its first micro-batch's clone
        self.pieces: dict[str, str] = {}  # a tensor split in micro-batches -> the split
        self.sized: dict[tuple, str] = {}  # (constant, size) -> the constant for that size
        first = (min(self.position[name] for name in prefix.forward), -1, 0, 0)
        cut_op = _parse(prefix.cut)[1]
        self.sizes_const = self.constant(f"{cut_op}/{SCOPE}/sizes", np.array(sizes, np.int32),
                                         first)
        self.axis = self.constant(f"{cut_op}/{SCOPE}/axis", np.array(0, np.int32), first)

    def add(self, node, key: tuple) -> str:
        node.name = unique_name(node.name, self.taken)
        protect(node)
        self.nodes[node.name], self.keys[node.name] = node, key
        return node.name

    def constant(self, name: str, value, key: tuple) -> str:
        tensor = tf.make_tensor_proto(value)
        node = node_def_pb2.NodeDef(name=name, op="Const")
        node.attr["value"].tensor.CopyFrom(tensor)
        node.attr["dtype"].type = tensor.dtype
        return self.add(node, key)

    def _dtype(self, tensor: str):
        return self.graph.get_tensor_by_name(tensor).dtype.as_datatype_enum

    def split(self, tensor: str, key: tuple) -> str:
        """Splits `tensor` along its first dimension into the micro-batches."""
        producer, index = _parse(tensor)[1:]
        node = node_def_pb2.NodeDef(name=f"{producer}/{SCOPE}/split", op="SplitV",
                                    input=[_ref(producer, index), self.sizes_const, self.axis])
        node.attr["T"].type = self._dtype(tensor)
        node.attr["Tlen"].type = tf.int32.as_datatype_enum
        node.attr["num_split"].i = len(self.sizes)
        self.pieces[tensor] = self.add(node, key)
        return self.pieces[tensor]

    def concat(self, tensors: list[str], key: tuple) -> str:
        node = node_def_pb2.NodeDef(name=f"{_parse(self.prefix.cut)[1]}/{SCOPE}/concat",
                                    op="ConcatV2", input=[*tensors, self.axis])
        node.attr["N"].i = len(tensors)
        node.attr["T"].type = self._dtype(self.prefix.cut)
        node.attr["Tidx"].type = tf.int32.as_datatype_enum
        return self.add(node, key)

    def add_n(self, tensor: str, name: str, parts: list[str], key: tuple) -> str:
        """The sum of `parts`, pieces of `tensor`."""
        node = node_def_pb2.NodeDef(name=name, op="AddN", input=parts)
        node.attr["N"].i = len(parts)
        node.attr["T"].type = self._dtype(tensor)
        return self.add(node, key)

    def clone(self, names, i: int, suffix: str, key: tuple, trigger: list[str],
              made: dict) -> None:
        """Clones the ops `names` for micro-batch `i`, recording them in `made` (original ->
        clone); a clone reading no other clone waits for the ops `trigger`."""
        size = self.sizes[i]
        for name in names:
            op = self.graph.get_operation_by_name(name)
            node = _copy(self.original[name])
            node.name = f"{name}/{SCOPE}_{i}{suffix}"
            reads_a_clone = False
            for slot, text in enumerate(node.input):
                control, source, index = _parse(text)
                if control:
                    if source in made:
                        node.input[slot] = f"^{made[source]}"
                        reads_a_clone = True
                    continue
                sized = _sized_constant(op, slot, self.prefix.batch_size, size)
                if sized is not None:
                    if (source, size) not in self.sized:
                        self.sized[source, size] = self.constant(
                            f"{source}/{SCOPE}_size_{size}", sized, (*key, i, -1))
                    node.input[slot] = self.sized[source, size]
                elif source in made:
                    node.input[slot] = _ref(made[source], index)
                    reads_a_clone = True
                elif f"{source}:{index}" in self.pieces:
                    node.input[slot] = _ref(self.pieces[f"{source}:{index}"], i)
            if not reads_a_clone:
                node.input.extend(f"^{op_name}" for op_name in trigger)
            _fit_plan(node, size)
            made[name] = self.add(node, (*key, i, self.position[name]))
            self.clones[made[name]] = (name, i)
            self.first_clones.setdefault(name, made[name])

    def rewire(self, tensor: str, replacement: str) -> None:
        """Has every node reading `tensor` read `replacement` instead."""
        producer, index = _parse(tensor)[1:]
        for node in self.nodes.values():
            for slot, text in enumerate(node.input):
                if _parse(text) == (False, producer, index):
                    node.input[slot] = replacement

    def finish(self) -> graph_pb2.GraphDef:
        # A node waiting for an op of the prefix waits for its first clone: an inlined call's
        # control node waits so for the call's inputs, and the weight reads behind it must not
        # wait for a later micro-batch, which waits for them in turn.
        for name, node in self.nodes.items():
            for slot, text in enumerate(node.input):
                waited = text[1:] if text.startswith("^") else None
                if waited in self.prefix.dropped:
                    raise PrefixError(f"{name} waits for {waited}, which reads the prefix but "
                                      "whose result nothing uses, so the pass leaves it out")
                if waited in self.first_clones and name not in self.clones:
                    node.input[slot] = f"^{self.first_clones[waited]}"
        result = graph_pb2.GraphDef()
        result.versions.CopyFrom(self.graph_def.versions)
        result.library.CopyFrom(self.graph_def.library)
        result.node.extend(self._ordered())
        self._check(result)
        return result

    def _ordered(self) -> list:
        """The nodes, each after its inputs, by key where that leaves a choice: the order the
        liveness analysis, and so the memory plan, sees them run in."""
        waiting = {name: {_parse(text)[1] for text in node.input}
                   for name, node in self.nodes.items()}
        readers: dict[str, list[str]] = {}
        for name, inputs in waiting.items():
            for source in inputs:
                readers.setdefault(source, []).append(name)
        ready = [(self.keys[name], name) for name, inputs in waiting.items() if not inputs]
        heapq.heapify(ready)
        order = []
        while ready:
            name = heapq.heappop(ready)[1]
            order.append(self.nodes[name])
            for reader in readers.get(name, ()):
                waiting[reader].discard(name)
                if not waiting[reader]:
                    heapq.heappush(ready, (self.keys[reader], reader))
        if len(order) != len(self.nodes):
            stuck = sorted(set(self.nodes) - {node.name for node in order})
            raise PrefixError(f"{self.prefix.cut}: the micro-batched step would wait in a "
                              f"cycle, or for nodes it does not have, at {', '.join(stuck[:3])}")
        return order

    def _check(self, graph_def: graph_pb2.GraphDef) -> None:
        """Each clone's static shapes: the micro-batch's size first where the original held the
        batch, the original's elsewhere (a constant or attribute fixing the batch size would break
        this). Imported alone, the graph's variables have no shapes, nor what is made from them:
        those dimensions are let be."""
        checked = tf.Graph()
        try:
            with checked.as_default():
                tf.graph_util.import_graph_def(graph_def, name="")
        except ValueError as error:
            raise PrefixError(f"{self.prefix.cut}: the micro-batched step does not build: "
                              f"{error}") from error
        for name, (original, i) in self.clones.items():
            clone = checked.get_operation_by_name(name)
            for made, tensor in zip(clone.outputs,
                                    self.graph.get_operation_by_name(original).outputs):
                batched = tensor.name in self.prefix.batched
                expected = (tf.TensorShape([self.sizes[i], *tensor.shape[1:]]) if batched
                            else tensor.shape)
                if not made.shape.is_compatible_with(expected) or \
                        batched and made.shape[0] != self.sizes[i]:
                    raise PrefixError(
                        f"{original}: its copy for micro-batch {i} ({self.sizes[i]} samples) "
                        f"makes {made.shape} where {expected} was due: a constant or attribute "
                        "of the step fixes the batch size")
