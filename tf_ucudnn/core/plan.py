"""Micro-batch plans: which micro-batches a convolution kernel runs, each with which cuDNN algorithm.

Plans are plain data. They travel to the C++ ops as two list attributes per kernel,
`micro_batches` (ints) and `algorithms` (strings), and to disk as JSON.

An algorithm is written as comma-separated `key=value` pairs, so that one string attribute holds
either a legacy algorithm enum or a cuDNN graph-API engine configuration:

    "algo=1"                  cudnnConvolution*Algo_t value 1, math mode from TensorFlow's settings
    "algo=1,math=tensor_op"   ... with an explicit cudnnMathType_t
    "auto"                    chosen by cuDNN's heuristics at run time
    "engine=12"               graph-API engine 12 (a global engine index of the convolution's
                              operation graph) with its default knob choices
    "engine=12,knobs=SPLIT_K_SLC:2/TILE_SIZE:5"
                              ... with those knobs set: `NAME:VALUE` pairs joined by '/', NAME a
                              cudnnBackendKnobType_t without its CUDNN_KNOB_TYPE_ prefix (as
                              cudnn-frontend's KnobType_t spells it), VALUE an integer

    "engine=58,subsampled=1"  ... run as a stride-1 convolution on a copy of the input's strided
                              samples (the `subsampled` form, for a strided 1x1 convolution
                              without padding; a legacy algorithm takes a form too)
    "algo=1,space_to_depth=1" ... run as a stride-1 convolution on a copy of the input in
                              space-to-depth blocks of the stride (the `space_to_depth` form,
                              for a 2-D convolution of one stride above 1, a filter of more than
                              one tap, no dilation or groups)
    "algo=0,channels_first=1" ... run on channels-first copies of a channels-last convolution's
                              tensors (the `channels_first` form)

An engine configuration takes no math mode: the engine decides it. Its knobs are kept sorted by
name, so that one configuration has one text (the op library writes the same). Which engines and
knob names a convolution accepts only cuDNN can say: the op checks that when it runs. A plan's
micro-batches all run in one form (`FORMS`): they share cuDNN's view of the op's tensors.
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

# How cuDNN is given a convolution (cc/cudnn/layout.h): as it is; a strided one as a stride-1
# convolution on a copy of its input's strided samples or of its input in space-to-depth blocks;
# or a channels-last one on channels-first copies of its tensors.
DIRECT = "direct"
SUBSAMPLED = "subsampled"
SPACE_TO_DEPTH = "space_to_depth"
CHANNELS_FIRST = "channels_first"
FORMS = (DIRECT, SUBSAMPLED, SPACE_TO_DEPTH, CHANNELS_FIRST)

_SYNTAX = ("expected 'algo=N[,math=NAME]' or 'engine=N[,knobs=NAME:V/NAME:V...]', either "
           "followed by ',subsampled=1', ',space_to_depth=1' or ',channels_first=1'")
_KNOB_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
# ASCII digits only, as the op library reads them (Python's int() would also take "1_0").
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One cuDNN algorithm choice: a legacy algorithm (`algo`, `math`), a graph-API engine
    configuration (`engine`, `knobs`), or neither: cuDNN's heuristics choose at run time. Either
    of the first two may run a strided convolution in another `form` (`FORMS`) than as it is.

    `knobs` may be given as a mapping or (name, value) pairs; it is kept as pairs sorted by name.
    """

    algo: Optional[int] = None
    math: Optional[str] = None
    engine: Optional[int] = None
    knobs: tuple[tuple[str, int], ...] = ()
    form: str = DIRECT

    def __post_init__(self):
        if self.algo is not None and (not _is_int(self.algo) or self.algo < 0):
            raise ValueError(f"algorithm must be a non-negative int or None, got {self.algo!r}")
        if self.math is not None and self.math not in MATH_TYPES:
            raise ValueError(f"math must be one of {MATH_TYPES} or None, got {self.math!r}")
        if self.algo is None and self.math is not None:
            raise ValueError("a math mode needs an explicit algorithm")
        if self.engine is not None and (not _is_int(self.engine) or self.engine < 0):
            raise ValueError(f"engine must be a non-negative int or None, got {self.engine!r}")
        if self.engine is not None and self.algo is not None:
            raise ValueError("an algorithm is either a legacy algorithm or an engine, not both")
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {self.form!r}")
        if self.form != DIRECT and self.algo is None and self.engine is None:
            raise ValueError(f"a {self.form} run needs an explicit algorithm or engine")
        pairs = self.knobs.items() if isinstance(self.knobs, Mapping) else self.knobs
        knobs = tuple(sorted((name, value) for name, value in pairs))
        if knobs and self.engine is None:
            raise ValueError("knobs need an engine")
        for name, value in knobs:
            if not isinstance(name, str) or not _KNOB_NAME.fullmatch(name):
                raise ValueError(f"a knob name is a KnobType_t name such as SPLIT_K_SLC, got "
                                 f"{name!r}")
            if not _is_int(value):
                raise ValueError(f"knob {name} must have an int value, got {value!r}")
        names = [name for name, _ in knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"a knob is given twice in {names}")
        object.__setattr__(self, "knobs", knobs)

    @property
    def is_engine(self) -> bool:
        return self.engine is not None

    @property
    def order_key(self) -> tuple:
        """A total order over algorithms (heuristics' choice, legacy ones, then engines), so that
        ties between equally fast candidates never depend on where they came from."""
        form = FORMS.index(self.form)
        if self.engine is not None:
            return (2, self.engine, "", self.knobs, form)
        if self.algo is not None:
            return (1, self.algo, self.math or "", (), form)
        return (0, 0, "", (), form)

    @classmethod
    def parse(cls, text: str) -> "Algorithm":
        text = text.strip()
        if text == "auto":
            return cls()
        fields = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or key.strip() in fields:
                raise ValueError(f"cannot parse algorithm {text!r}: {_SYNTAX}")
            fields[key.strip()] = value.strip()
        flagged = [form for form in FORMS[1:] if form in fields]
        for form in flagged:
            if fields.pop(form) != "1":
                raise ValueError(f"cannot parse algorithm {text!r}: {form} must be 1 where given")
        if len(flagged) > 1:
            raise ValueError(f"cannot parse algorithm {text!r}: more than one form given")
        form = flagged[0] if flagged else DIRECT
        if flagged and not fields:
            raise ValueError(f"cannot parse algorithm {text!r}: {form} needs an algorithm or "
                             "engine")
        # An algo makes it a legacy algorithm (so "algo=1,engine=2" has an unknown key).
        kind, allowed = ("algo", {"algo", "math"}) if "algo" in fields or "engine" not in fields \
            else ("engine", {"engine", "knobs"})
        if set(fields) - allowed or kind not in fields:
            raise ValueError(f"cannot parse algorithm {text!r}: {_SYNTAX}")
        if not _INTEGER.fullmatch(fields[kind]):
            raise ValueError(f"cannot parse algorithm {text!r}: {kind} is not an integer")
        if kind == "algo":
            return cls(algo=int(fields["algo"]), math=fields.get("math"), form=form)
        knobs = []
        if "knobs" in fields:
            for item in fields["knobs"].split("/"):
                name, sep, value = item.partition(":")
                if not sep or not _INTEGER.fullmatch(value.strip()):
                    raise ValueError(f"cannot parse algorithm {text!r}: knob {item!r} is not "
                                     "NAME:INTEGER")
                knobs.append((name.strip(), int(value)))
        return cls(engine=int(fields["engine"]), knobs=tuple(knobs), form=form)

    def to_attr(self) -> str:
        suffix = f",{self.form}=1" if self.form != DIRECT else ""
        if self.engine is not None:
            knobs = "/".join(f"{name}:{value}" for name, value in self.knobs)
            return f"engine={self.engine}" + (f",knobs={knobs}" if knobs else "") + suffix
        if self.algo is None:
            return "auto"
        return f"algo={self.algo}" + (f",math={self.math}" if self.math else "") + suffix

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
    # The scratch it needs, where profiles tell: cuDNN's workspace (and, in a form other than
    # direct, the copy of its input); what it runs is size and algorithm.
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
        if len({mb.algorithm.form for mb in self.micro_batches}) > 1:
            raise ValueError(f"all of a plan's micro-batches run in one form: {self}")

    @property
    def form(self) -> str:
        """The form its micro-batches run in (`FORMS`)."""
        return self.micro_batches[0].algorithm.form if self.micro_batches else DIRECT

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
