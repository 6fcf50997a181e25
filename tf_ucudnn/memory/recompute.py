"""The recomputation pass: a kept activation made by a cheap op is made again for the backward pass.

For each chosen tensor, its producer is cloned, reading the same inputs, and the backward
consumers read the clone instead; the original is then freed after its last forward use. The
clone waits, through a control edge, for the op named as its trigger, so that it runs just before
it is needed rather than as soon as its inputs exist (which would keep it alive all along, as
SuperNeurons' cost-aware recomputation avoids).

Only ops that give the same result when run again may be cloned: stateful ops (random numbers,
variable updates) are refused. The clone's inputs must stay alive until it runs; the planner only
proposes tensors whose producers read kept tensors or variables.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tf_ucudnn.graph.functions import callable_over
from tf_ucudnn.memory.graph_edits import KeptTensor, graph_of, protect, rewire

_NEVER = {"Placeholder", "VarHandleOp", "ReadVariableOp", "Const", "Identity"}


@dataclasses.dataclass(frozen=True)
class Recompute(KeptTensor):
    """Make `tensor` again for `backward_consumers`, after `trigger` ran (or as soon as its
    inputs exist if None)."""

    trigger: Optional[str] = None


class RecomputeError(ValueError):
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
                      graph: Optional[tf.Graph] = None) -> graph_pb2.GraphDef:
    """A copy of `graph_def` (its main graph) with the recomputations made. `graph`, the graph
    `graph_def` came from, tells which ops are stateful (else the GraphDef is imported)."""
    graph = graph_of(graph_def, graph)
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {node.name: node for node in result.node}
    for recompute in recomputes:
        producer = nodes.get(recompute.producer)
        if producer is None:
            raise RecomputeError(f"{recompute.tensor}: no node {recompute.producer!r}")
        reason = recomputable(graph.get_operation_by_name(recompute.producer))
        if reason:
            raise RecomputeError(f"{recompute.tensor}: {reason}")
        if recompute.trigger is not None and recompute.trigger not in nodes:
            raise RecomputeError(f"{recompute.tensor}: the trigger names no node "
                                 f"({recompute.trigger!r})")
        clone = result.node.add()
        clone.CopyFrom(producer)
        clone.name = f"{producer.name}/ucudnn_recompute"
        if recompute.trigger is not None:
            clone.input.append(f"^{recompute.trigger}")
            protect(nodes[recompute.trigger])
        protect(clone)
        index = recompute.output_index
        rewire(nodes, recompute, clone.name if index == 0 else f"{clone.name}:{index}",
               RecomputeError)
    return result


def recompute_function(function, recomputes: Sequence[Recompute]):
    """A ConcreteFunction with the recomputations made, as a tf.function over the same inputs."""
    graph_def = insert_recomputes(function.graph.as_graph_def(), recomputes, function.graph)
    return callable_over(graph_def, function)
