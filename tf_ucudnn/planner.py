"""From a layer to its LayerPlan, using measured profiles: what `tf_ucudnn.rewrite`, the Keras
callback and the SavedModel converter call for each convolution they find. Each kernel gets
μ-cuDNN's dynamic program under the workspace limit.

A layer whose three kernels run best undivided still gets tf_ucudnn's op by default, with the
measured best algorithm: TensorFlow's own choice under the same limit can be far slower (on an H100
in NHWC float32 at 64 MiB, Keras VGG16 trains at 277 img/s with TensorFlow's choices, while the
implicit-GEMM algorithm it passes over needs under 20 MiB). `leave_undivided_to_tensorflow` keeps
TensorFlow's op for such layers instead, reported as "no gain".
"""

from __future__ import annotations

import collections
import os
import re
from typing import Iterable, Optional, Union

import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from tf_ucudnn import ops
from tf_ucudnn.graph.conv_layers import ConvLayer
from tf_ucudnn.optimization.kernel_dp import NoFeasiblePlanError, fastest_configuration
from tf_ucudnn.plan import KERNELS, LayerPlan
from tf_ucudnn.profiling import ProfileDatabase
from tf_ucudnn.profiling.profiler import Machine, current_machine, profile

MIB = 1 << 20
DEFAULT_DATABASE = os.path.join(os.path.expanduser("~"), ".cache", "tf_ucudnn", "profiles.sqlite")

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9}


def parse_bytes(value: Union[int, str]) -> int:
    """64MiB, 1.5GiB, 512MB or a plain number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a size must not be negative, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size: write e.g. 64MiB, 1GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class PlannerError(RuntimeError):
    """Why no planner could be set up (no measurements to plan with), for the user to read."""


def resolve_machine(database: ProfileDatabase, device: Optional[str] = None,
                    cudnn_version: Optional[int] = None) -> tuple[Machine, bool]:
    """Whose measurements to plan with, and whether this process can measure on it."""
    if device is None and ops.gpu_kernels_available() and tf.config.list_physical_devices("GPU"):
        return current_machine(), True
    known = collections.Counter((r.device, r.cudnn_version) for r in database.records())
    matching = [m for m in known if (device is None or m[0] == device)
                and (cudnn_version is None or m[1] == cudnn_version)]
    if len(matching) != 1:
        listing = ", ".join(f"{d!r} cuDNN {v}" for d, v in sorted(known)) or "none"
        raise PlannerError(f"cannot tell which machine's measurements to use (in the database "
                           f"{database.path}: {listing}); on a machine without a GPU, import a "
                           "profile file and name the device and cuDNN version")
    return Machine(*matching[0]), False


class DatabasePlanner:
    """Plans layers from a profile database, measuring missing geometries when it can."""

    def __init__(self, database: ProfileDatabase, workspace_limit_bytes: int, *,
                 machine: Optional[Machine] = None, measure: Optional[bool] = None,
                 deterministic_only: Optional[bool] = None, call_overhead_ms: float = 0.0,
                 leave_undivided_to_tensorflow: bool = False):
        self.database = database
        self.workspace_limit_bytes = workspace_limit_bytes
        self.measure = machine is None if measure is None else measure
        self.machine = machine or current_machine()
        self.deterministic_only = (tf_config.is_op_determinism_enabled()
                                   if deterministic_only is None else deterministic_only)
        self.call_overhead_ms = call_overhead_ms
        self.leave_undivided_to_tensorflow = leave_undivided_to_tensorflow

    @classmethod
    def open(cls, workspace_limit: Union[int, str], database: str = DEFAULT_DATABASE,
             profiles: Iterable[str] = (), device: Optional[str] = None,
             cudnn_version: Optional[int] = None, **options) -> "DatabasePlanner":
        """A planner over the database file (created if new), with `profiles` imported into it.

        On a GPU with the cuDNN kernels it measures what is missing; elsewhere it plans from the
        measurements of `device` (or of the only machine the database holds). Close it when done.
        """
        os.makedirs(os.path.dirname(os.path.abspath(database)), exist_ok=True)
        db = ProfileDatabase(database)
        try:
            for path in profiles:
                db.import_jsonl(path)
            machine, can_measure = resolve_machine(db, device, cudnn_version)
        except BaseException:
            db.close()
            raise
        return cls(db, parse_bytes(workspace_limit), machine=machine, measure=can_measure,
                   **options)

    def close(self) -> None:
        self.database.close()

    def __enter__(self) -> "DatabasePlanner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, layer: ConvLayer) -> Union[LayerPlan, str]:
        geometry = layer.cudnn_geometry()
        if self.measure:
            profile([(geometry, layer.name)], layer.batch_size, self.database, progress=False)
        plans = []
        for kernel in KERNELS:
            timings = self.database.timings(self.machine.device, self.machine.cudnn_version,
                                            geometry, kernel)
            if layer.batch_size not in timings:
                return (f"no profile of its {kernel} kernel at batch {layer.batch_size} on "
                        f"{self.machine.device} (cuDNN {self.machine.cudnn_version})")
            try:
                plans.append(fastest_configuration(
                    kernel, timings, layer.batch_size, self.workspace_limit_bytes,
                    deterministic_only=self.deterministic_only,
                    call_overhead_ms=self.call_overhead_ms).plan)
            except NoFeasiblePlanError as error:
                return f"no plan within the workspace limit: {error}"
        if self.leave_undivided_to_tensorflow and all(len(plan.micro_batches) == 1
                                                      for plan in plans):
            return (f"no gain: within {self.workspace_limit_bytes / MIB:g} MiB every kernel runs "
                    "best undivided, as TensorFlow's own op does")
        return LayerPlan(*plans)
