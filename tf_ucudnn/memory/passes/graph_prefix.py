"""The micro-batched prefix on a graph: a training step's first ops run one micro-batch at a time.

`micro_batched_prefix` does this for a Keras model, whose layers it can call again; a graph (a
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

import heapq
from typing import Iterator, Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.core.plan import even_sizes
from tf_ucudnn.graph.functions import callable_over
from tf_ucudnn.memory.passes.graph_edits import protect
from tf_ucudnn.memory.passes.node_edits import (
    copy_node,
    fit_plan,
    parse_input,
    sized_constant,
    tensor_ref,
)
from tf_ucudnn.memory.passes.prefix_analysis import POOLINGS, GraphPrefix, PrefixAnalysis
from tf_ucudnn.memory.passes.recompute import unique_name

SCOPE = "ucudnn_micro_batch"  # in the names of the clones and of the nodes the pass adds


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """The sizes `run_in_micro_batches` uses: as even as can be, the larger ones first."""
    if not 2 <= micro_batches <= batch:
        raise PrefixError(f"cannot divide a batch of {batch} into {micro_batches} micro-batches "
                          f"(from 2 to {batch})")
    return even_sizes(batch, micro_batches)


def micro_batched_prefix(function, cut: str, micro_batches: int):
    """`function` (a ConcreteFunction of a training step) with the ops up to the tensor `cut`
    ("op:0") run in `micro_batches` micro-batches and made again for the backward pass, as a
    tf.function over the same inputs and variables. PrefixError names the op and the reason
    where the step does not allow it."""
    analysis = PrefixAnalysis(function)
    batch = analysis.batch_size(cut)
    sizes = micro_batch_sizes(batch, micro_batches)
    prefix = analysis.prefix(cut, sizes[0])
    return callable_over(_build(analysis.graph_def, prefix, sizes, analysis.graph), function)


def prefix_cuts(function) -> tuple[list[str], list[tuple[str, str]]]:
    """The forward poolings' outputs at which `micro_batched_prefix` can cut the step, in execution
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
    analysis = PrefixAnalysis(function)
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


def _build(graph_def: graph_pb2.GraphDef, prefix: GraphPrefix, sizes: list[int],
           graph: tf.Graph) -> graph_pb2.GraphDef:
    """A copy of `graph_def` (the main graph of `graph`) with `prefix` run in micro-batches of
    `sizes`."""
    builder = _Builder(graph_def, prefix, sizes, graph)
    position = builder.position
    cut_op, cut_index = parse_input(prefix.cut)[1:]
    first = min(position[name] for name in prefix.forward)
    for tensor in prefix.batch_inputs:
        builder.split(tensor, (first, -1, 0, 0))
    cut_clones, trigger = [], []
    for i in range(len(sizes)):
        made: dict[str, str] = {}
        builder.clone(prefix.forward, i, "", (position[cut_op], 1), trigger, made)
        cut_clones.append(tensor_ref(made[cut_op], cut_index))
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
            producer, index = parse_input(tensor)[1:]
            part = tensor_ref(made[producer], index)
            sums[tensor] = part if i == 0 else builder.add_n(
                tensor, f"{producer}/{SCOPE}_{i}/sum" + (f"_{index}" if index else ""),
                [sums[tensor], part], (start, 1, i, len(position)))
        # The next micro-batch waits for these sums: one set of partial sums is held at a time.
        trigger = sorted({parse_input(name)[1] for name in sums.values()})
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
        self.nodes = {name: copy_node(node) for name, node in self.original.items()
                      if name not in removed}
        self.keys = {name: (self.position[name], 0, 0, 0) for name in self.nodes}
        self.taken = set(self.original)
        self.clones: dict[str, tuple[str, int]] = {}  # clone -> (original, micro-batch)
        self.first_clones: dict[str, str] = {}  # original -> its first micro-batch's clone
        self.pieces: dict[str, str] = {}  # a tensor split in micro-batches -> the split
        self.sized: dict[tuple, str] = {}  # (constant, size) -> the constant for that size
        first = (min(self.position[name] for name in prefix.forward), -1, 0, 0)
        cut_op = parse_input(prefix.cut)[1]
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
        producer, index = parse_input(tensor)[1:]
        node = node_def_pb2.NodeDef(
            name=f"{producer}/{SCOPE}/split", op="SplitV",
            input=[tensor_ref(producer, index), self.sizes_const, self.axis])
        node.attr["T"].type = self._dtype(tensor)
        node.attr["Tlen"].type = tf.int32.as_datatype_enum
        node.attr["num_split"].i = len(self.sizes)
        self.pieces[tensor] = self.add(node, key)
        return self.pieces[tensor]

    def concat(self, tensors: list[str], key: tuple) -> str:
        node = node_def_pb2.NodeDef(name=f"{parse_input(self.prefix.cut)[1]}/{SCOPE}/concat",
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
            node = copy_node(self.original[name])
            node.name = f"{name}/{SCOPE}_{i}{suffix}"
            reads_a_clone = False
            for slot, text in enumerate(node.input):
                control, source, index = parse_input(text)
                if control:
                    if source in made:
                        node.input[slot] = f"^{made[source]}"
                        reads_a_clone = True
                    continue
                sized = sized_constant(op, slot, self.prefix.batch_size, size)
                if sized is not None:
                    if (source, size) not in self.sized:
                        self.sized[source, size] = self.constant(
                            f"{source}/{SCOPE}_size_{size}", sized, (*key, i, -1))
                    node.input[slot] = self.sized[source, size]
                elif source in made:
                    node.input[slot] = tensor_ref(made[source], index)
                    reads_a_clone = True
                elif f"{source}:{index}" in self.pieces:
                    node.input[slot] = tensor_ref(self.pieces[f"{source}:{index}"], i)
            if not reads_a_clone:
                node.input.extend(f"^{op_name}" for op_name in trigger)
            fit_plan(node, size)
            made[name] = self.add(node, (*key, i, self.position[name]))
            self.clones[made[name]] = (name, i)
            self.first_clones.setdefault(name, made[name])

    def rewire(self, tensor: str, replacement: str) -> None:
        """Has every node reading `tensor` read `replacement` instead."""
        producer, index = parse_input(tensor)[1:]
        for node in self.nodes.values():
            for slot, text in enumerate(node.input):
                if parse_input(text) == (False, producer, index):
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
        waiting = {name: {parse_input(text)[1] for text in node.input}
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
