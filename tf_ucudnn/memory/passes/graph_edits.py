"""What the swap and recomputation passes share: a kept tensor and the backward ops reading it,
and the NodeDef edits that hand those readers a replacement and keep Grappler's hands off."""

from __future__ import annotations

import dataclasses

from tensorflow.core.framework import attr_value_pb2


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """`tensor` ("op:index") and the backward ops (node names) that read it."""

    tensor: str
    backward_consumers: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "backward_consumers", tuple(self.backward_consumers))

    @property
    def producer(self) -> str:
        return self.tensor.rsplit(":", 1)[0]

    @property
    def output_index(self) -> int:
        return int(self.tensor.rsplit(":", 1)[1]) if ":" in self.tensor else 0

    def input_names(self) -> set[str]:
        """How a NodeDef input refers to the tensor: "op" or "op:0" for output 0, else "op:i"."""
        index = self.output_index
        return ({self.producer, f"{self.producer}:0"} if index == 0
                else {f"{self.producer}:{index}"})


def rewire(nodes: dict, kept: KeptTensor, replacement: str, error: type) -> None:
    """Has every backward consumer of `kept` read `replacement` instead; `error` (raised with the
    tensor and the reason) when a consumer is missing or does not read it."""
    referring = kept.input_names()
    for name in kept.backward_consumers:
        consumer = nodes.get(name)
        if consumer is None:
            raise error(f"{kept.tensor}: no backward consumer node {name!r}")
        positions = [i for i, text in enumerate(consumer.input) if text in referring]
        if not positions:
            raise error(f"{kept.tensor}: {name} does not read it")
        for i in positions:
            consumer.input[i] = replacement


def unreplaced_readers(nodes: dict, kept: KeptTensor) -> list[str]:
    """The backward consumers of `kept` that are not in `nodes` or still read the tensor itself:
    none once a swap or recomputation has handed them its replacement."""
    referring = kept.input_names()
    return [name for name in kept.backward_consumers
            if name not in nodes or referring & set(nodes[name].input)]


def protect(node) -> None:
    """Marks a node for Grappler to keep as it is (not folded, pruned or merged)."""
    node.attr["_grappler_do_not_remove"].CopyFrom(attr_value_pb2.AttrValue(b=True))
