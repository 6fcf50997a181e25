"""From a layer to its LayerPlan, using measured profiles: what `tf_ucudnn.rewrite` calls for each
convolution it finds. Each kernel gets μ-cuDNN's dynamic program under the workspace limit; a
layer whose three kernels would all run undivided gains nothing and keeps TensorFlow's own op.
"""

from __future__ import annotations

from typing import Optional, Union

from tf_ucudnn.graph.conv_layers import ConvLayer
from tf_ucudnn.optimization.kernel_dp import NoFeasiblePlanError, fastest_configuration
from tf_ucudnn.plan import KERNELS, LayerPlan
from tf_ucudnn.profiling import ProfileDatabase
from tf_ucudnn.profiling.profiler import Machine, current_machine, profile

MIB = 1 << 20


class DatabasePlanner:
    """Plans layers from a profile database, measuring missing geometries when it can."""

    def __init__(self, database: ProfileDatabase, workspace_limit_bytes: int, *,
                 machine: Optional[Machine] = None, measure: Optional[bool] = None,
                 deterministic_only: bool = False, call_overhead_ms: float = 0.0):
        self.database = database
        self.workspace_limit_bytes = workspace_limit_bytes
        self.measure = machine is None if measure is None else measure
        self.machine = machine or current_machine()
        self.deterministic_only = deterministic_only
        self.call_overhead_ms = call_overhead_ms

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
        if all(len(plan.micro_batches) == 1 for plan in plans):
            return (f"no gain: within {self.workspace_limit_bytes / MIB:g} MiB every kernel runs "
                    "best undivided, as TensorFlow's own op does")
        return LayerPlan(*plans)
