"""The swap pass: activations kept from the forward to the backward pass wait in host memory.

For each chosen tensor, a swap-out node (an Identity placed on the host) copies it out after it is
produced, and a swap-in node (an Identity on the tensor's own device) copies it back for its
backward consumers, which are rewired to read the copy. Once its forward consumers and the
swap-out have run, TensorFlow frees the device buffer; the swap-in allocates a new one. A host
Identity between the two waits, through a control edge, for the op the performance model names,
so that the transfer starts early enough to hide behind the computation in between, but not so
early that the tensor is back on the device long before it is needed.

Why explicit Identity nodes rather than Grappler's own swapping (the `_swap_to_host` hint of its
memory optimizer): Grappler swaps only on GPU graphs and schedules the swap-in by its own cost
model, so the decision could not be tested on the CPU nor follow our performance model. The nodes
and the prefetch ops are marked `_grappler_do_not_remove`, so Grappler's optimizers keep them as
they are (constant folding, for one, would otherwise turn a prefetch op reading a shape into a
constant and hand its control edges on).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.graph.functions import callable_over, graph_of
from tf_ucudnn.memory.passes.graph_edits import KeptTensor, protect, rewire

HOST = "/device:CPU:0"
SWAP = "/ucudnn_swap_"  # in the names of the swap nodes


@dataclasses.dataclass(frozen=True)
class Swap(KeptTensor):
    """Swap `tensor` out after its producer and back in for `backward_consumers`, starting once
    `prefetch_after` (a node name, or None: as soon as possible) ran. `copied_out_before`
    (a node name, or None) waits for the copy out to end: TensorFlow's executor queues GPU
    kernels well ahead of the device, while a copy frees its source only once it ran, so
    without the wait the executor allocates for later ops while the buffer is still held.
    `held_back` (node names) wait until the copy back has been queued: TensorFlow queues a copy
    to a GPU behind all the work already queued on the GPU's compute stream (the buffer it
    copies into may still be read there), and its executor queues work as far ahead as it can,
    so without them the copy would start only once the GPU had nothing left to do but wait for
    it. Held back until then, the ops after the prefetch op run while the copy does."""

    prefetch_after: Optional[str] = None
    copied_out_before: Optional[str] = None
    held_back: tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "held_back", tuple(self.held_back))


class SwapError(TfUcudnnError, ValueError):
    """A swap that cannot be made; names the tensor and the reason."""


def insert_swaps(graph_def: graph_pb2.GraphDef, swaps: Sequence[Swap],
                 device: Optional[str] = None,
                 graph: Optional[tf.Graph] = None) -> graph_pb2.GraphDef:
    """A copy of `graph_def` (its main graph) with the swaps made.

    `device` is where swapped-in tensors go; by default the producer's device, else the first GPU
    when there is one, else left to TensorFlow's placer. `graph`, the graph `graph_def` came from,
    gives the tensors' types (else the GraphDef is imported to read them).
    """
    graph = graph_of(graph_def, graph)
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {node.name: node for node in result.node}
    if device is None:
        device = "/device:GPU:0" if tf.config.list_logical_devices("GPU") else ""
    for swap in swaps:
        producer = nodes.get(swap.producer)
        if producer is None:
            raise SwapError(f"{swap.tensor}: no node {swap.producer!r} in the graph")
        try:
            dtype = graph.get_tensor_by_name(f"{swap.producer}:{swap.output_index}").dtype
        except (KeyError, ValueError) as error:
            raise SwapError(f"{swap.tensor}: {error}") from error
        if not swap.backward_consumers:
            raise SwapError(f"{swap.tensor}: no backward consumers to swap it in for")
        for role in ("prefetch_after", "copied_out_before"):
            name = getattr(swap, role)
            if name is not None and name not in nodes:
                raise SwapError(f"{swap.tensor}: {role} names no node ({name!r})")
        if swap.held_back and swap.prefetch_after is None:
            raise SwapError(f"{swap.tensor}: ops held back for a copy back that has no "
                            "prefetch op to start after")
        unknown = [name for name in swap.held_back if name not in nodes]
        if unknown:
            raise SwapError(f"{swap.tensor}: held_back names no node ({unknown[0]!r})")
        base = _scope(swap)
        swap_out = result.node.add(name=f"{base}/out", op="Identity", device=HOST,
                                   input=[swap.tensor])
        on_host = [swap_out]
        if swap.prefetch_after is not None:
            # The wait is on the host side: TensorFlow sends a tensor to another device as soon
            # as it exists, so a wait on the swap-in itself would hold the copy already made.
            on_host.append(result.node.add(name=f"{base}/held", op="Identity", device=HOST,
                                           input=[swap_out.name, f"^{swap.prefetch_after}"]))
            # Folded or pruned by Grappler, the prefetch op could drag the edge elsewhere.
            protect(nodes[swap.prefetch_after])
        swap_in = result.node.add(name=f"{base}/in", op="Identity",
                                  device=producer.device or device, input=[on_host[-1].name])
        for name in swap.held_back:
            nodes[name].input.append(f"^{on_host[-1].name}")
            protect(nodes[name])
        if swap.copied_out_before is not None:
            nodes[swap.copied_out_before].input.append(f"^{swap_out.name}")
            protect(nodes[swap.copied_out_before])
        for node in (*on_host, swap_in):
            node.attr["T"].CopyFrom(attr_value_pb2.AttrValue(type=dtype.as_datatype_enum))
            protect(node)
        rewire(nodes, swap, swap_in.name, SwapError)
    _check_acyclic(result, swaps)
    return result


def _scope(swap: Swap) -> str:
    """The name scope of a swap's nodes."""
    return f"{swap.producer}{SWAP}{swap.output_index}"


def _check_acyclic(graph_def: graph_pb2.GraphDef, swaps: Sequence[Swap]) -> None:
    """A swap-in that waits for an op which itself needs the swapped-in tensor, or an op held
    back that the copy back waits for, would deadlock."""
    consumers: dict[str, list[str]] = {}
    for node in graph_def.node:
        for text in node.input:
            consumers.setdefault(text.lstrip("^").rsplit(":", 1)[0], []).append(node.name)

    def reaches(starts, target: str) -> bool:
        seen, frontier = set(starts), list(starts)
        while frontier:
            for name in consumers.get(frontier.pop(), ()):
                if name == target:
                    return True
                if name not in seen:
                    seen.add(name)
                    frontier.append(name)
        return False

    for swap in swaps:
        if swap.prefetch_after is None:
            continue
        if reaches([f"{_scope(swap)}/in"], swap.prefetch_after):
            raise SwapError(f"{swap.tensor}: the swap-in waits for {swap.prefetch_after}, which "
                            "needs the swapped-in tensor: the step would deadlock")
        if swap.held_back and reaches(swap.held_back, swap.prefetch_after):
            raise SwapError(f"{swap.tensor}: an op held back for the copy back leads to "
                            f"{swap.prefetch_after}, which the copy back waits for: the step "
                            "would deadlock")


def swap_function(function, swaps: Sequence[Swap], device: Optional[str] = None):
    """A ConcreteFunction with the swaps made, as a tf.function over the same inputs."""
    graph_def = insert_swaps(function.graph.as_graph_def(), swaps, device, function.graph)
    return callable_over(graph_def, function)
