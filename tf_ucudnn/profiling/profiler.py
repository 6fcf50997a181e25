"""Measures cuDNN on the GPU: every algorithm of every kernel of each layer at candidate
micro-batch sizes, through the UcudnnProfileConvolution op on real buffers: the legacy algorithms
(cudnnFind*AlgorithmEx, with the math TensorFlow uses for the dtype) and, where asked, the
graph-API engine configurations cuDNN's heuristics offer and their knob variants (each run between
CUDA events, each recorded with whether cuDNN notes it deterministic). A strided convolution's
candidates are measured in the other forms it can take too (`forms_to_measure`).
Results go to a ProfileDatabase, so each geometry is measured once per machine and cuDNN version.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

import tensorflow as tf
from tqdm.auto import tqdm

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import (
    CHANNELS_FIRST,
    DIRECT,
    KERNELS,
    SPACE_TO_DEPTH,
    SUBSAMPLED,
    Algorithm,
)
from tf_ucudnn.kernels.library import engines_available, gpu_kernels_available, op_library
from tf_ucudnn.profiling.database import ProfileDatabase
from tf_ucudnn.profiling.records import (
    POWER_OF_TWO,
    KernelTimings,
    ProfileRecord,
    micro_batch_sizes,
)

# What the shared profiles were measured with; cudnnFind tries no more than this.
DEFAULT_WORKSPACE_LIMIT = 4 << 30

# What the op times: the legacy algorithm enums, or the graph-API engine configurations.
LEGACY = "legacy"
ENGINES = "engines"
CANDIDATES = (LEGACY, ENGINES)


class ProfilerUnavailable(TfUcudnnError, RuntimeError):
    """No GPU, or tf_ucudnn was built without its cuDNN kernels."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where measurements are valid: the database keys on both."""

    device: str
    cudnn_version: int


def current_machine(device: str = "/GPU:0") -> Machine:
    if not gpu_kernels_available():
        raise ProfilerUnavailable(
            "tf_ucudnn was built without its cuDNN kernels (no CUDA toolkit or cuDNN found at "
            "build time); rebuild on a machine with them to profile")
    gpus = tf.config.list_physical_devices("GPU")
    index = int(device.rsplit(":", 1)[-1])
    if index >= len(gpus):
        raise ProfilerUnavailable(f"no GPU {device}: TensorFlow sees {len(gpus)} GPU(s)")
    name = tf.config.experimental.get_device_details(gpus[index]).get("device_name", "GPU")
    with tf.device("/CPU:0"):
        version = int(op_library().ucudnn_cudnn_version())
    return Machine(name, version)


def _full_shape(geometry: ConvGeometry, batch: int, channels: int, spatial) -> list[int]:
    channels_last = geometry.layout.endswith("C")
    return [batch, *spatial, channels] if channels_last else [batch, channels, *spatial]


def _output_dims(geometry: ConvGeometry) -> tuple[int, ...]:
    return tuple((size + 2 * pad - ((k - 1) * d + 1)) // s + 1
                 for size, k, pad, s, d in zip(geometry.input_dims, geometry.filter_dims,
                                               geometry.pads, geometry.strides, geometry.dilations))


def _op_attrs(geometry: ConvGeometry) -> dict:
    pads = [[p, p] for p in geometry.pads]
    if geometry.layout.endswith("C"):
        strides, dilations, pairs = [1, *geometry.strides, 1], [1, *geometry.dilations, 1], \
            [[0, 0], *pads, [0, 0]]
    else:
        strides, dilations, pairs = [1, 1, *geometry.strides], [1, 1, *geometry.dilations], \
            [[0, 0], [0, 0], *pads]
    return {"strides": strides, "dilations": dilations, "padding": "EXPLICIT",
            "explicit_paddings": [v for pair in pairs for v in pair],
            "data_format": geometry.layout}


def measure(geometry: ConvGeometry, kernel: str, sizes: Sequence[int], machine: Machine,
            workspace_limit: int = DEFAULT_WORKSPACE_LIMIT, device: str = "/GPU:0",
            layer: Optional[str] = None, candidates: str = LEGACY,
            form: str = DIRECT) -> list[ProfileRecord]:
    """Times every candidate of one kernel at each micro-batch size, on random data:
    `candidates` LEGACY (the algorithm enums) or ENGINES (the engine configurations), run in
    `form` (one of `forms_to_measure(geometry)`)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if candidates not in CANDIDATES:
        raise ValueError(f"candidates must be one of {CANDIDATES}, got {candidates!r}")
    if form not in forms_to_measure(geometry):
        raise ValueError(f"{geometry} is not measured in the {form} form, only in "
                         f"{forms_to_measure(geometry)}")
    batch = max(sizes)
    dtype = tf.as_dtype(geometry.dtype)
    with tf.device(device):
        def random(shape, seed):
            return tf.cast(tf.random.stateless_normal(shape, seed=[seed, 0]), dtype)
        x = random(_full_shape(geometry, batch, geometry.in_channels, geometry.input_dims), 1)
        w = random([*geometry.filter_dims, geometry.filter_in_channels, geometry.out_channels],
                   2)
        dy = random(_full_shape(geometry, batch, geometry.out_channels, _output_dims(geometry)), 3)
        rows, texts = op_library().ucudnn_profile_convolution(
            x, w, dy, kernel=kernel, batch_sizes=list(sizes), workspace_limit=workspace_limit,
            candidates=candidates, form=form, **_op_attrs(geometry))
    records = []
    for (size, time_ms, workspace, deterministic), text in zip(rows.numpy(), texts.numpy()):
        algorithm = Algorithm.parse(text.decode())
        records.append(ProfileRecord(
            device=machine.device, cudnn_version=machine.cudnn_version, geometry=geometry,
            kernel=kernel, batch_size=int(size), algo=algorithm.algo, math=algorithm.math,
            time_ms=float(time_ms), workspace_bytes=int(workspace), layer=layer,
            engine=algorithm.engine, knobs=algorithm.knobs, form=algorithm.form,
            deterministic=bool(deterministic) if algorithm.is_engine else None))
    return records


def forms_to_measure(geometry: ConvGeometry) -> tuple[str, ...]:
    """The forms a convolution's candidates are measured in: as it is, and subsampled, in
    space-to-depth blocks or on channels-first copies where it can run so and may gain
    (`ConvGeometry.can_subsample`, `can_space_to_depth`, `can_run_channels_first`)."""
    return (DIRECT, *((SUBSAMPLED,) if geometry.can_subsample else ()),
            *((SPACE_TO_DEPTH,) if geometry.can_space_to_depth else ()),
            *((CHANNELS_FIRST,) if geometry.can_run_channels_first else ()))


def unmeasured_sizes(timings: KernelTimings, sizes: Sequence[int], candidates: str,
                     form: str = DIRECT) -> list[int]:
    """The sizes at which a kernel's timing table has no measurement of that kind of candidate
    in that form."""
    wanted = (candidates == ENGINES, form)
    # The timing's own fields: building its Algorithm for each of thousands of rows is slow.
    return [s for s in sizes
            if not any((t.engine is not None, t.form) == wanted for t in timings.get(s, ()))]


@dataclasses.dataclass(frozen=True)
class MissingMeasurement:
    """What one `measure` call would add to the database: one kind of candidate of one kernel in
    one form, at the sizes the database lacks."""

    geometry: ConvGeometry
    label: str
    kernel: str
    sizes: tuple[int, ...]
    candidates: str
    form: str


def missing_measurements(geometries: Iterable[tuple[ConvGeometry, str]], sizes: Sequence[int],
                         database: ProfileDatabase, machine: Machine,
                         kernels: Sequence[str] = KERNELS,
                         engines: Optional[bool] = None) -> list[MissingMeasurement]:
    """What the database lacks of (geometry, label) pairs at `sizes` (see `kernel_missing`)."""
    return [missing for geometry, label in geometries for kernel in kernels
            for missing in kernel_missing(
                geometry, label, kernel,
                database.timings(machine.device, machine.cudnn_version, geometry, kernel),
                sizes, engines)]


def kernel_missing(geometry: ConvGeometry, label: str, kernel: str, known: KernelTimings,
                   sizes: Sequence[int], engines: Optional[bool] = None
                   ) -> list[MissingMeasurement]:
    """What a kernel's timing table `known` lacks at `sizes`: legacy algorithms always, engine
    configurations too with `engines` (by default: where the op library was built with
    cudnn-frontend), each kind in each of `forms_to_measure(geometry)`."""
    if engines is None:
        engines = engines_available()
    kinds = (LEGACY, ENGINES) if engines else (LEGACY,)
    return [MissingMeasurement(geometry, label, kernel, tuple(unmeasured), candidates, form)
            for candidates in kinds for form in forms_to_measure(geometry)
            if (unmeasured := unmeasured_sizes(known, sizes, candidates, form))]


def profile(geometries: Iterable[tuple[ConvGeometry, str]], batch_size: int,
            database: ProfileDatabase, policy: str = POWER_OF_TWO,
            kernels: Sequence[str] = KERNELS, workspace_limit: int = DEFAULT_WORKSPACE_LIMIT,
            device: str = "/GPU:0", progress: bool = True,
            engines: Optional[bool] = None, *, sizes: Optional[Sequence[int]] = None,
            machine: Optional[Machine] = None) -> int:
    """Measures what the database lacks for (geometry, label) pairs; returns records added.

    A kernel counts as measured when the database has every size for it: the policy's
    micro-batch sizes of `batch_size`, or `sizes` where given (e.g. the whole batch alone); see
    `missing_measurements` for the kinds of candidate and forms. `machine` saves asking the GPU
    which it is, where the caller knows.
    """
    machine = machine or current_machine(device)
    if sizes is None:
        sizes = micro_batch_sizes(batch_size, policy)
    missing = missing_measurements(geometries, sizes, database, machine, kernels, engines)
    added = 0
    for todo in tqdm(missing, desc="profiling cuDNN", unit="kernel", disable=not progress):
        added += database.insert(measure(todo.geometry, todo.kernel, todo.sizes, machine,
                                         workspace_limit, device, todo.label, todo.candidates,
                                         todo.form))
    return added
