"""Micro-batch plans: which micro-batches a convolution kernel runs, each with which cuDNN algorithm.

Plans are plain data. They travel to the C++ ops as two list attributes per kernel,
`micro_batches` (ints) and `algorithms` (strings), and to disk as JSON.

An algorithm is written as comma-separated `key=value` pairs so that the format can grow past the
legacy algorithm enums (for instance to cuDNN graph-API engine configurations) without changing
the attribute types:

    "algo=1"                  cudnnConvolution*Algo_t value 1, math mode from TensorFlow's settings
    "algo=1,math=tensor_op"   ... with an explicit cudnnMathType_t
    "auto"                    chosen by cuDNN's heuristics at run time
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.errors import TfUcudnnError


def even_sizes(total: int, parts: int) -> list[int]:
    """`total` in `parts` sizes as even as can be, the larger first; the callers check `parts`
    (each with its own error)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


# Kernel names, as in the profile data: one convolution layer has these three.
FORWARD = "fwd"
BACKPROP_INPUT = "bwd_data"
BACKPROP_FILTER = "bwd_filter"
KERNELS = (FORWARD, BACKPROP_INPUT, BACKPROP_FILTER)

# cudnnMathType_t names, by their enum value.
MATH_TYPES = ("default", "tensor_op", "tensor_op_allow_conversion", "fma")

# Number of legacy algorithms per kernel (cuDNN 9's *_ALGO_COUNT).
ALGORITHM_COUNTS = {FORWARD: 8, BACKPROP_INPUT: 6, BACKPROP_FILTER: 7}


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One cuDNN algorithm choice; `algo=None` means cuDNN's heuristics choose at run time."""

    algo: Optional[int] = None
    math: Optional[str] = None

    def __post_init__(self):
        if self.algo is not None and (not isinstance(self.algo, int) or isinstance(self.algo, bool)
                                      or self.algo < 0):
            raise ValueError(f"algorithm must be a non-negative int or None, got {self.algo!r}")
        if self.math is not None and self.math not in MATH_TYPES:
            raise ValueError(f"math must be one of {MATH_TYPES} or None, got {self.math!r}")
        if self.algo is None and self.math is not None:
            raise ValueError("a math mode needs an explicit algorithm")

    @classmethod
    def parse(cls, text: str) -> "Algorithm":
        text = text.strip()
        if text == "auto":
            return cls()
        fields = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or key.strip() in fields:
                raise ValueError(f"cannot parse algorithm {text!r}: expected 'algo=N[,math=NAME]'")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"algo", "math"}
        if unknown or "algo" not in fields:
            raise ValueError(f"cannot parse algorithm {text!r}: expected 'algo=N[,math=NAME]'")
        # ASCII digits only, as the op library reads them (Python's int() would also take "1_0").
        if not re.fullmatch(r"[+-]?[0-9]+", fields["algo"]):
            raise ValueError(f"cannot parse algorithm {text!r}: algo is not an integer")
        algo = int(fields["algo"])
        return cls(algo=algo, math=fields.get("math"))

    def to_attr(self) -> str:
        if self.algo is None:
            return "auto"
        return f"algo={self.algo}" + (f",math={self.math}" if self.math else "")

    def __str__(self) -> str:
        return self.to_attr()


def workspace_attr(kernel: str = "") -> str:
    """The internal attribute (TensorFlow lets a node carry those beside its op's own; the op's
    kernel does not read it) giving the memory planner the workspace of a planned node's kernel
    (""), or, on a forward node, of its gradient's ("backprop_input_", "backprop_filter_")."""
    return f"_ucudnn_{kernel}workspace_bytes"


WORKSPACE_ATTR = workspace_attr()


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    size: int
    algorithm: Algorithm = Algorithm()
    # The cuDNN workspace it needs, where profiles tell; what it runs is size and algorithm.
    workspace_bytes: Optional[int] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size <= 0:
            raise ValueError(f"micro-batch size must be a positive int, got {self.size!r}")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The micro-batches of one kernel, in execution order. Empty: one batch, algorithm at run time."""

    micro_batches: tuple[MicroBatch, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "micro_batches", tuple(self.micro_batches))

    @classmethod
    def of(cls, *pairs: tuple[int, Optional[int]]) -> "KernelPlan":
        """KernelPlan.of((32, 1), (32, 1)): micro-batches from (size, algo) pairs."""
        return cls(tuple(MicroBatch(size, Algorithm(algo)) for size, algo in pairs))

    @classmethod
    def uniform(cls, batch_size: int, micro_batch_size: int,
                algorithm: Algorithm = Algorithm()) -> "KernelPlan":
        """Equal micro-batches of `micro_batch_size`, the last one taking the remainder."""
        if batch_size < 0:
            raise ValueError(f"batch size must not be negative, got {batch_size!r}")
        if micro_batch_size <= 0:
            raise ValueError(f"micro-batch size must be positive, got {micro_batch_size!r}")
        full, rest = divmod(batch_size, micro_batch_size)
        sizes = [micro_batch_size] * full + ([rest] if rest else [])
        return cls(tuple(MicroBatch(size, algorithm) for size in sizes))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(mb.size for mb in self.micro_batches)

    @property
    def workspace_bytes(self) -> Optional[int]:
        """The workspace the kernel needs (its micro-batches run one at a time: the largest),
        None unless every micro-batch's is known."""
        sizes = [mb.workspace_bytes for mb in self.micro_batches]
        return max(sizes) if sizes and None not in sizes else None

    @property
    def batch_size(self) -> Optional[int]:
        return sum(self.sizes) if self.micro_batches else None

    def attrs(self) -> dict:
        """The op attributes that carry this plan."""
        return {
            "micro_batches": list(self.sizes),
            "algorithms": [mb.algorithm.to_attr() for mb in self.micro_batches],
        }

    @classmethod
    def from_attrs(cls, micro_batches: Sequence[int], algorithms: Sequence[str]) -> "KernelPlan":
        if len(micro_batches) != len(algorithms):
            raise ValueError(f"{len(micro_batches)} micro-batches but {len(algorithms)} algorithms")
        return cls(tuple(MicroBatch(int(size), Algorithm.parse(_text(algo)))
                         for size, algo in zip(micro_batches, algorithms)))

    def to_json(self) -> list:
        return [{"size": mb.size, "algorithm": mb.algorithm.to_attr()}
                | ({} if mb.workspace_bytes is None else {"workspace_bytes": mb.workspace_bytes})
                for mb in self.micro_batches]

    @classmethod
    def from_json(cls, data: Iterable[Mapping]) -> "KernelPlan":
        return cls(tuple(MicroBatch(int(item["size"]), Algorithm.parse(item["algorithm"]),
                                    item.get("workspace_bytes"))
                         for item in data))

    def __str__(self) -> str:
        if not self.micro_batches:
            return "undivided, algorithm chosen at run time"
        return " + ".join(f"{mb.size}@{mb.algorithm}" for mb in self.micro_batches)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Plans for the three kernels of one convolution layer."""

    forward: KernelPlan = KernelPlan()
    backprop_input: KernelPlan = KernelPlan()
    backprop_filter: KernelPlan = KernelPlan()

    def kernel(self, name: str) -> KernelPlan:
        return {FORWARD: self.forward, BACKPROP_INPUT: self.backprop_input,
                BACKPROP_FILTER: self.backprop_filter}[name]

    def with_kernel(self, name: str, plan: KernelPlan) -> "LayerPlan":
        """This plan with kernel `name`'s replaced by `plan`."""
        field = {FORWARD: "forward", BACKPROP_INPUT: "backprop_input",
                 BACKPROP_FILTER: "backprop_filter"}[name]
        return dataclasses.replace(self, **{field: plan})

    def to_json(self) -> dict:
        return {name: self.kernel(name).to_json() for name in KERNELS}

    @classmethod
    def from_json(cls, data: Mapping) -> "LayerPlan":
        return cls(*(KernelPlan.from_json(data.get(name, ())) for name in KERNELS))

    def dumps(self) -> str:
        return json.dumps(self.to_json())


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# Gives a layer its plan, or a string saying why the layer is left alone.
LayerPlanner = Callable[[ConvLayer], Union[LayerPlan, str]]


class PlannerAnswerError(TfUcudnnError, TypeError):
    """A planner answered a layer with neither a LayerPlan nor a reason."""


def plan_or_reason(planner: LayerPlanner, layer: ConvLayer) -> Union[LayerPlan, str]:
    """`planner`'s answer for `layer`: a LayerPlan, or a string saying why it is left alone."""
    answer = planner(layer)
    if not isinstance(answer, (LayerPlan, str)):
        raise PlannerAnswerError(
            f"{layer.name}: the planner returned {answer!r}; a planner returns a LayerPlan, or a "
            "string saying why the layer is left alone")
    return answer
