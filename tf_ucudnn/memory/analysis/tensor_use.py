"""What the liveness analysis says of each tensor of a step, and a tensor's size: the facts the
cost model and the memory search work from."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class TensorUse:
    """A tensor of the step: its size, the op producing it and the ops reading it (indices into
    the execution order). `backward_consumers` are the readers after the forward pass."""

    name: str
    bytes: int
    producer: int
    consumers: tuple[int, ...]
    backward_consumers: tuple[int, ...] = ()
    device: str = ""  # where its buffer is; each device's peak is its own

    def __post_init__(self):
        object.__setattr__(self, "consumers", tuple(sorted(self.consumers)))
        object.__setattr__(self, "backward_consumers", tuple(sorted(self.backward_consumers)))
        if not set(self.backward_consumers) <= set(self.consumers):
            raise ValueError(f"{self.name}: backward consumers must be among its consumers")

    @functools.cached_property
    def last_forward_use(self) -> int:
        forward = [c for c in self.consumers if c not in self.backward_consumers]
        return max(forward, default=self.producer)


def tensor_bytes(tensor) -> Optional[int]:
    """A tensor's size on the device: 0 for handles (resources, variants), None if unknown."""
    if tensor.dtype in (tf.resource, tf.variant):
        return 0
    if not tensor.shape.is_fully_defined():
        return None
    return tensor.shape.num_elements() * tensor.dtype.size
