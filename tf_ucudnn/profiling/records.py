"""Profile records: what one cuDNN algorithm measured on one convolution kernel and micro-batch.

Records are plain data and travel as JSON lines. Two line layouts are read:

* this module's own, which `write_jsonl` writes and which holds any 2-D or 3-D geometry:
  `input_dims`, `filter_dims`, `pads`, `strides`, `dilations` as lists, `math` as a name, and
  `groups` for a grouped convolution (absent: 1, as in lines written before groups were);
* the layout of the measured files in shared/profiles (2-D only): `height`, `width`,
  `kernel_h`, `kernel_w`, square `pad` and `stride`, dilation 1, `math` as its cudnnMathType_t
  value.

A line measures either a legacy algorithm (`algo` and `math`) or a cuDNN graph-API engine
configuration (`engine`, and `knobs` as an object of knob name to value where any are set; see
`tf_ucudnn.core.plan.Algorithm`). Lines without `engine`, as all written before engines were,
are legacy algorithms. `"form"` names a run in another form than as the convolution is (see
`tf_ucudnn.core.plan.FORMS`; absent: direct), whose time and workspace include its copies. An
engine line may say `"deterministic"` (whether cuDNN notes the configuration deterministic;
absent: not recorded, as in lines written before it was); a legacy algorithm's determinism is
known by its number (`tf_ucudnn.conv_planning.is_deterministic`).

A file that cannot be read or written raises `ProfileFileError`, naming the file (and the line)
and the reason. `packaged_profiles()` lists the measured profiles shipped with the package.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import math as _math
import os
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.files import written_whole
from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import ALGORITHM_COUNTS, DIRECT, KERNELS, MATH_TYPES, Algorithm

UNDIVIDED = "undivided"
POWER_OF_TWO = "power_of_two"
ALL_SIZES = "all"
POLICIES = (UNDIVIDED, POWER_OF_TWO, ALL_SIZES)

PathLike = Union[str, os.PathLike]

PACKAGED_PROFILES_DIR = Path(__file__).resolve().parent / "data"


class ProfileFileError(TfUcudnnError, ValueError):
    """A profile file that cannot be read or written; names the file (and line) and why."""


def packaged_profiles() -> tuple[Path, ...]:
    """The measured profiles shipped with tf_ucudnn, so that planning works without a GPU and a
    first plan on these machines measures less (`DatabasePlanner.open` imports its machine's),
    all cuDNN 9.14, float32, power-of-two micro-batches: NVIDIA H100 80GB HBM3, VGG16 and
    ResNet-50 in NHWC up to batch 128, AlexNet and ResNet-50 in NCHW up to batch 256 (legacy
    algorithms); NVIDIA H200, ResNet-50 in NHWC up to batch 128 (legacy algorithms and engine
    configurations, in every form)."""
    return tuple(sorted(PACKAGED_PROFILES_DIR.glob("*.jsonl.gz")))


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """One kernel of one layer on one machine: the unit a timing table belongs to."""

    device: str
    cudnn_version: int
    geometry: ConvGeometry
    kernel: str


@dataclasses.dataclass(frozen=True)
class AlgorithmTiming:
    """One algorithm's measurement at one micro-batch size: what the optimizer chooses from.

    The algorithm is a legacy one (`algo`, `math`) or an engine configuration (`engine`, `knobs`;
    `algo` and `math` None), with `Algorithm`'s fields; `from_algorithm` builds one from either.
    """

    algo: Optional[int]
    math: Optional[str]
    time_ms: float
    workspace_bytes: int
    engine: Optional[int] = None
    knobs: tuple[tuple[str, int], ...] = ()
    form: str = DIRECT
    # An engine configuration's determinism as cuDNN notes it; None where not recorded.
    deterministic: Optional[bool] = None

    def __post_init__(self):
        # Algorithm checks the fields fit together and keeps knobs in their canonical order.
        object.__setattr__(self, "knobs", self.algorithm.knobs)

    @classmethod
    def from_algorithm(cls, algorithm: Algorithm, time_ms: float, workspace_bytes: int,
                       deterministic: Optional[bool] = None) -> "AlgorithmTiming":
        return cls(algorithm.algo, algorithm.math, time_ms, workspace_bytes, algorithm.engine,
                   algorithm.knobs, algorithm.form, deterministic)

    # Built once: planning asks a table's thousands of timings for theirs many times, and each
    # Algorithm checks its fields.
    @functools.cached_property
    def algorithm(self) -> Algorithm:
        return Algorithm(self.algo, self.math, self.engine, self.knobs, self.form)


# Micro-batch size -> the algorithms measured at that size.
KernelTimings = Mapping[int, Sequence[AlgorithmTiming]]


@dataclasses.dataclass(frozen=True)
class ProfileRecord:
    device: str
    cudnn_version: int
    geometry: ConvGeometry
    kernel: str
    batch_size: int
    # A legacy algorithm; both None for an engine configuration.
    algo: Optional[int]
    math: Optional[str]
    time_ms: float
    workspace_bytes: int
    # A label for people (e.g. "alexnet.conv2"); not part of any key, the geometry is.
    layer: Optional[str] = None
    # A graph-API engine configuration instead of a legacy algorithm (as in `Algorithm`).
    engine: Optional[int] = None
    knobs: tuple[tuple[str, int], ...] = ()
    form: str = DIRECT  # as in `Algorithm`
    # Whether cuDNN notes an engine configuration deterministic; None where not recorded, and
    # always for a legacy algorithm (its number says).
    deterministic: Optional[bool] = None

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not _is_int(self.batch_size) or self.batch_size <= 0:
            raise ValueError(f"batch size must be a positive int, got {self.batch_size!r}")
        if self.engine is not None:
            if self.algo is not None or self.math is not None:
                raise ValueError("a record measures a legacy algorithm (algo, math) or an engine "
                                 "configuration, not both")
        elif not _is_int(self.algo) or not 0 <= self.algo < ALGORITHM_COUNTS[self.kernel]:
            raise ValueError(f"{self.kernel} algorithm must be an int in "
                             f"[0, {ALGORITHM_COUNTS[self.kernel]}), got {self.algo!r}")
        elif self.math not in MATH_TYPES:
            raise ValueError(f"math must be one of {MATH_TYPES}, got {self.math!r}")
        if self.deterministic is not None and (self.engine is None
                                               or not isinstance(self.deterministic, bool)):
            raise ValueError(f"deterministic is true or false for an engine configuration, and "
                             f"not given for a legacy algorithm, got {self.deterministic!r}")
        # Algorithm checks the engine and knobs and keeps the knobs in their canonical order.
        object.__setattr__(self, "knobs", self.algorithm.knobs)
        if not _math.isfinite(self.time_ms) or self.time_ms < 0:
            raise ValueError(f"time_ms must be finite and non-negative, got {self.time_ms!r}")
        if not _is_int(self.workspace_bytes) or self.workspace_bytes < 0:
            raise ValueError(f"workspace_bytes must be a non-negative int, got "
                             f"{self.workspace_bytes!r}")

    @property
    def kernel_key(self) -> KernelKey:
        return KernelKey(self.device, self.cudnn_version, self.geometry, self.kernel)

    @property
    def algorithm(self) -> Algorithm:
        return Algorithm(self.algo, self.math, self.engine, self.knobs, self.form)

    @property
    def timing(self) -> AlgorithmTiming:
        return AlgorithmTiming.from_algorithm(self.algorithm, self.time_ms, self.workspace_bytes,
                                              self.deterministic)

    def to_json(self) -> dict:
        g = self.geometry
        data = {"device": self.device, "cudnn": self.cudnn_version}
        if self.layer is not None:
            data["layer"] = self.layer
        data.update({
            "dtype": g.dtype, "format": g.layout,
            "in_channels": g.in_channels, "out_channels": g.out_channels,
            "input_dims": list(g.input_dims), "filter_dims": list(g.filter_dims),
            "pads": list(g.pads), "strides": list(g.strides), "dilations": list(g.dilations),
            **({"groups": g.groups} if g.groups != 1 else {}),
            "kernel": self.kernel, "batch": self.batch_size,
        })
        if self.engine is None:
            data.update({"algo": self.algo, "math": self.math})
        else:
            data["engine"] = self.engine
            if self.knobs:
                data["knobs"] = dict(self.knobs)
            if self.deterministic is not None:
                data["deterministic"] = self.deterministic
        if self.form != DIRECT:
            data["form"] = self.form
        data.update({"time_ms": self.time_ms, "workspace_bytes": self.workspace_bytes})
        return data

    @classmethod
    def from_json(cls, data: Mapping, device: Optional[str] = None,
                  cudnn_version: Optional[int] = None) -> "ProfileRecord":
        """Reads either line layout; `device`/`cudnn_version` fill in lines that lack them."""
        device = data.get("device", device)
        cudnn_version = data.get("cudnn", cudnn_version)
        if device is None or cudnn_version is None:
            raise ValueError("the line names no device or cuDNN version and none was given")
        if "input_dims" in data:
            geometry = ConvGeometry(
                in_channels=data["in_channels"], out_channels=data["out_channels"],
                input_dims=data["input_dims"], filter_dims=data["filter_dims"], pads=data["pads"],
                strides=data["strides"], dilations=data["dilations"], dtype=data["dtype"],
                layout=data["format"], groups=data.get("groups", 1))  # older lines: ungrouped
        else:  # shared/profiles layout: square padding and stride, dilation 1
            geometry = ConvGeometry(
                in_channels=data["in_channels"], out_channels=data["out_channels"],
                input_dims=(data["height"], data["width"]),
                filter_dims=(data["kernel_h"], data["kernel_w"]),
                pads=(data["pad"],) * 2, strides=(data["stride"],) * 2, dilations=(1, 1),
                dtype=data["dtype"], layout=data["format"])
        if "engine" in data:
            knobs = data.get("knobs", {})
            if not isinstance(knobs, dict):
                raise ValueError(f"knobs must be an object of knob name to value, got {knobs!r}")
            # An engine line with algo or math too is refused by the constructor.
            algorithm = dict(algo=data.get("algo"), math=data.get("math"), engine=data["engine"],
                             knobs=tuple(knobs.items()),
                             deterministic=data.get("deterministic"))
        else:
            math = data["math"]
            if _is_int(math):
                if not 0 <= math < len(MATH_TYPES):
                    raise ValueError(f"math {math} is not a cudnnMathType_t value")
                math = MATH_TYPES[math]
            algorithm = dict(algo=data["algo"], math=math)
        return cls(device=device, cudnn_version=int(cudnn_version), geometry=geometry,
                   kernel=data["kernel"], batch_size=data["batch"],
                   time_ms=float(data["time_ms"]), workspace_bytes=data["workspace_bytes"],
                   layer=data.get("layer"), form=data.get("form", DIRECT),
                   **algorithm)


def read_jsonl(path: PathLike, device: Optional[str] = None,
               cudnn_version: Optional[int] = None) -> list[ProfileRecord]:
    """Reads a JSON-lines profile file (gzipped if its name ends in .gz). A file that cannot be
    read, or a bad line, raises ProfileFileError naming the file and line."""
    name = os.fspath(path)
    try:
        lines = _opener(path)(path, "rt", encoding="utf-8")
    except OSError as error:
        raise ProfileFileError(f"{name}: cannot open: {_reason(error)}") from None
    records, number = [], 0
    with lines:
        try:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    records.append(_parse_line(line, device, cudnn_version, f"{name}:{number}"))
        except (OSError, EOFError, zlib.error, UnicodeDecodeError) as error:
            # Lines are read in blocks: the one after the last good line is the first unreadable.
            raise ProfileFileError(f"{name}:{number + 1}: cannot read: {_reason(error)}") from None
    return records


def _parse_line(line: str, device: Optional[str], cudnn_version: Optional[int],
                where: str) -> ProfileRecord:
    try:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object: {line.strip()[:60]}")
        return ProfileRecord.from_json(data, device, cudnn_version)
    except json.JSONDecodeError as error:
        reason = f"not JSON ({error.msg} at column {error.colno})"
    except KeyError as error:
        reason = f"missing field {error}"
    except (ValueError, TypeError) as error:
        reason = str(error)
    raise ProfileFileError(f"{where}: bad profile record: {reason}")


def _reason(error: BaseException) -> str:
    """An I/O error in words, without the path (the message names it already)."""
    if isinstance(error, EOFError):
        return "the compressed data ends early (a truncated file)"
    if isinstance(error, (gzip.BadGzipFile, zlib.error)):
        return f"not valid gzip data ({error})"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text ({error.reason})"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error)


def _opener(path: PathLike):
    return gzip.open if os.fspath(path).endswith(".gz") else open


def write_jsonl(path: PathLike, records: Iterable[ProfileRecord]) -> int:
    """Writes records one JSON object a line (gzipped if the name ends in .gz); returns how many.

    The file appears whole or not at all: it is written beside its name, then renamed. A file
    that cannot be written raises ProfileFileError naming it.
    """
    name = os.fspath(path)
    count = 0
    try:
        with written_whole(name) as partial, _opener(path)(partial, "wt", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(record.to_json()) + "\n")
                count += 1
    except OSError as error:
        raise ProfileFileError(f"{name}: cannot write: {_reason(error)}") from None
    return count


def group_by_kernel(
        records: Iterable[ProfileRecord]) -> dict[KernelKey, dict[int, tuple[AlgorithmTiming, ...]]]:
    """Timing tables, one per kernel of each layer: micro-batch size -> algorithms, fastest first."""
    tables: dict[KernelKey, dict[int, list[AlgorithmTiming]]] = defaultdict(
        lambda: defaultdict(list))
    for record in records:
        tables[record.kernel_key][record.batch_size].append(record.timing)
    return {key: {size: fastest_first(timings) for size, timings in sorted(by_size.items())}
            for key, by_size in tables.items()}


def fastest_first(timings: Iterable[AlgorithmTiming]) -> tuple[AlgorithmTiming, ...]:
    """Sorted by time; ties broken so that the order never depends on where rows came from."""
    return tuple(sorted(timings,
                        key=lambda t: (t.time_ms, t.workspace_bytes, t.algorithm.order_key)))


def micro_batch_sizes(batch_size: int, policy: str) -> tuple[int, ...]:
    """Micro-batch sizes worth measuring for a mini-batch, by μ-cuDNN's policies.

    `power_of_two` keeps the whole batch too, so that not dividing is always a candidate.
    """
    if not _is_int(batch_size) or batch_size <= 0:
        raise ValueError(f"batch size must be a positive int, got {batch_size!r}")
    if policy == UNDIVIDED:
        return (batch_size,)
    if policy == POWER_OF_TWO:
        powers = [1 << k for k in range(batch_size.bit_length()) if 1 << k < batch_size]
        return (*powers, batch_size)
    if policy == ALL_SIZES:
        return tuple(range(1, batch_size + 1))
    raise ValueError(f"micro-batch size policy must be one of {POLICIES}, got {policy!r}")


def _is_int(value) -> bool:
    # bool is an int subclass, but `true` in a JSON line is a mistake, not a 1 (as in plan.py).
    return isinstance(value, int) and not isinstance(value, bool)
