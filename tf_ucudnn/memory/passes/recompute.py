"""The recomputation pass: a kept activation made by a cheap op is made again for the backward pass.

For each chosen tensor, its producer is cloned, reading the same inputs, and the backward
consumers read the clone instead; the original is then freed after its last forward use. The
clone waits, through a control edge, for the op named as its trigger, so that it runs just before
it is needed rather than as soon as its inputs exist (which would keep it alive all along, as
SuperNeurons' cost-aware recomputation avoids).

A producer whose own inputs were not kept is recomputed with the chain of ops back to kept tensors
(SuperNeurons' segments, e.g. a batch normalization and ReLU from the kept convolution output).
Only ops that give the same result when run again may be cloned: stateful ops (random numbers,
variable updates) are refused. The chain's inputs must stay alive until it runs; the planner only
proposes chains that start from kept tensors or variables.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.graph.functions import callable_over, graph_of
from tf_ucudnn.memory.passes.graph_edits import KeptTensor, protect, rewire

_NEVER = {"Placeholder", "VarHandleOp", "ReadVariableOp", "Const", "Identity"}
CLONE = "/ucudnn_recompute"  # in the names of the clones


@dataclasses.dataclass(frozen=True)
class Recompute(KeptTensor):
    """Make `tensor` again for `backward_consumers`, after `trigger` ran (or as soon as its
    inputs exist if None). `chain` names the ops before its producer that must run again too
    (their outputs were not kept either), in execution order."""

    trigger: Optional[str] = None
    chain: tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "chain", tuple(self.chain))


class RecomputeError(TfUcudnnError, ValueError):
    """A recomputation that cannot be made; names the tensor and the reason."""


def recomputable(op: tf.Operation) -> Optional[str]:
    """None if `op` may be cloned for recomputation, else why not."""
    if op.type in _NEVER:
        return f"{op.type} is cheaper to keep than to clone"
    if op.op_def.is_stateful:
        return f"{op.type} is stateful: running it again could give another result"
    if any(t.dtype == tf.resource or t.dtype == tf.variant for t in op.inputs):
        return f"{op.type} reads a resource or variant"
    return None


def insert_recomputes(graph_def: graph_pb2.GraphDef, recomputes: Sequence[Recompute],
                      graph: Optional[tf.Graph] = None,
                      barriers: bool = False) -> graph_pb2.GraphDef:
    """A copy of `graph_def` (its main graph) with the recomputations made. `graph`, the graph
    `graph_def` came from, tells which ops are stateful (else the GraphDef is imported).

    With `barriers`, for a step XLA compiles, which keeps no control edges and merges an op
    with its clone of the same inputs: each chain reads its inputs through one
    XlaOptimizationBarrier together with the trigger's first output, so that XLA can neither
    run the chain before the trigger nor see that its inputs are the original's.

    They are made in the order given, which must be the order they run in: a recomputed tensor
    whose producer an earlier chain made again on its way is not made again, and a later chain
    reads the recomputed tensors made before it rather than the originals (which would then stay
    alive for it)."""
    graph = graph_of(graph_def, graph)
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {node.name: node for node in result.node}
    taken = set(nodes)
    producers = {recompute.producer for recompute in recomputes}
    recomputed = {f"{r.producer}:{r.output_index}" for r in recomputes}
    made: dict[str, str] = {}  # the producer of a recomputed tensor -> its first clone
    for recompute in recomputes:
        if recompute.trigger is not None and recompute.trigger not in nodes:
            raise RecomputeError(f"{recompute.tensor}: the trigger names no node "
                                 f"({recompute.trigger!r})")
        # Each recomputation clones its own chain: a clone shared with another one would wait
        # for that one's trigger, which may come after this one's readers, closing a cycle.
        # Only recomputed tensors are shared, with the recomputations after them in order.
        clones: dict[str, str] = {}  # original op -> its clone
        outside: list = []  # with barriers: the clones, whose inputs from outside it routes
        for name in (*recompute.chain, recompute.producer):
            if name == recompute.producer and name in made:
                clones[name] = made[name]  # made on an earlier recomputation's way
                continue
            original = nodes.get(name)
            if original is None:
                raise RecomputeError(f"{recompute.tensor}: no node {name!r}")
            reason = recomputable(graph.get_operation_by_name(name))
            if reason:
                raise RecomputeError(f"{recompute.tensor}: {name}: {reason}")
            clone = result.node.add()
            clone.CopyFrom(original)
            clone.name = unique_name(f"{name}{CLONE}", taken)
            reads_a_clone = False
            for i, text in enumerate(clone.input):
                source, _, index = text.lstrip("^").partition(":")
                remade = (made.get(source) if not text.startswith("^")
                          and f"{source}:{index or 0}" in recomputed else None)
                if source in clones or remade:
                    clone.input[i] = ("^" if text.startswith("^") else "") + \
                        clones.get(source, remade) + (f":{index}" if index else "")
                    reads_a_clone |= source in clones
            if recompute.trigger is not None and not reads_a_clone and not barriers:
                clone.input.append(f"^{recompute.trigger}")  # the chain starts no earlier
                protect(nodes[recompute.trigger])
            protect(clone)
            clones[name] = clone.name
            if barriers:
                outside.append(clone)
            if name in producers:
                made.setdefault(name, clone.name)
        if outside and recompute.trigger is not None:
            _route_through_barrier(result, outside, set(clones.values()), recompute, graph,
                                   taken, nodes)
        index = recompute.output_index
        producer_clone = clones[recompute.producer]
        rewire(nodes, recompute, producer_clone if index == 0 else f"{producer_clone}:{index}",
               RecomputeError)
    return result


def _route_through_barrier(result: graph_pb2.GraphDef, clones: list, made: set,
                           recompute: Recompute, graph: tf.Graph, taken: set, nodes: dict) -> None:
    """Has the chain's clones read their inputs from outside the chain through one
    XlaOptimizationBarrier that also takes the trigger's first output."""
    importlib.import_module("tensorflow.compiler.tf2xla.ops.gen_xla_ops")  # registers the op
    trigger = graph.get_operation_by_name(recompute.trigger)
    if not trigger.outputs:
        raise RecomputeError(f"{recompute.tensor}: the trigger {recompute.trigger} has no output "
                             "for XLA to order the recomputation after")
    def tensor(text):
        return graph.get_tensor_by_name(text if ":" in text else f"{text}:0")

    # The inputs from outside, once each; not integers (shapes, paddings, axes), which XLA
    # must see as constants, and which the original could not share anyway.
    reads: list[str] = []
    for clone in clones:
        for text in clone.input:
            source = text.partition(":")[0]
            if not text.startswith("^") and source not in made and text not in reads and \
                    not tensor(text).dtype.is_integer:
                reads.append(text)
    barrier = result.node.add()
    barrier.name = unique_name(f"{recompute.producer}{CLONE}_barrier", taken)
    barrier.op = "XlaOptimizationBarrier"
    barrier.input.extend([*reads, recompute.trigger])
    types = [tensor(text).dtype.as_datatype_enum for text in reads] + \
        [trigger.outputs[0].dtype.as_datatype_enum]
    barrier.attr["T"].list.type.extend(types)
    if nodes[recompute.trigger].device:
        barrier.device = nodes[recompute.trigger].device
    protect(barrier)
    for clone in clones:
        for i, text in enumerate(clone.input):
            if text in reads:
                clone.input[i] = f"{barrier.name}:{reads.index(text)}"


def unique_name(name: str, taken: set) -> str:
    """`name`, or the first of `name_2`, `name_3`, ... not in `taken`; added to it."""
    candidate, count = name, 1
    while candidate in taken:
        count += 1
        candidate = f"{name}_{count}"
    taken.add(candidate)
    return candidate


def recompute_function(function, recomputes: Sequence[Recompute], jit_compile: bool = False):
    """A ConcreteFunction with the recomputations made, as a tf.function over the same inputs;
    with `jit_compile`, compiled by XLA with the recomputations behind barriers."""
    graph_def = insert_recomputes(function.graph.as_graph_def(), recomputes, function.graph,
                                  barriers=jit_compile)
    return callable_over(graph_def, function, jit_compile=jit_compile)
