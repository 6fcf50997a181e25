"""Each layer's timing tables from the profile database, measured first where the database lacks
them: what `DatabasePlanner` plans from.

Measuring is what makes a first plan slow, so it is done in stages and against a clock. Where the
planner can judge a layer from the whole batch alone (compared with XLA: `xla_comparison`'s bound
on any plan), the whole batch is measured first, and the other micro-batch sizes only where the
judgement leaves the layer to be planned. With a profiling budget, a layer that needs measuring
once measuring has taken that long is left alone for now and kept pending, for `measure_pending`
(between epochs, say); what was measured stays in the database, so that the next run of the same
model plans without measuring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Optional, Sequence, Union

from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import KERNELS
from tf_ucudnn.profiling import POWER_OF_TWO, KernelTimings, ProfileDatabase, micro_batch_sizes
from tf_ucudnn.profiling.profiler import Machine, MissingMeasurement, kernel_missing, profile

# A judgement of a layer from its whole-batch tables: why it is left alone without measuring the
# micro-batch sizes given (those the database lacks), or None to measure them.
JudgeUnmeasured = Callable[[ConvLayer, dict, Sequence[int]], Optional[str]]


@dataclasses.dataclass
class MeasuringTime:
    """Seconds that measuring may take (None: no limit) and has taken, by `clock`. It is looked
    at before each stage of a layer's measuring, so the last stage begun may run over."""

    seconds: Optional[float]
    clock: Callable[[], float] = time.monotonic
    taken: float = 0.0

    @property
    def spent(self) -> bool:
        return self.seconds is not None and self.taken >= self.seconds

    @contextlib.contextmanager
    def timing(self):
        start = self.clock()
        try:
            yield
        finally:
            self.taken += self.clock() - start


class LayerTimings:
    """layer -> kernel -> timing table (or why the layer is not planned from them), read once per
    layer, measured first where `measure` and the database lacks them, within
    `profiling_seconds` (None: no limit) by `clock`.

    With `judge_unmeasured`, the whole batch is measured first, and the other sizes only where it
    gives no reason to leave the layer alone. A planner that does not measure plans from what the
    database has.
    """

    def __init__(self, database: ProfileDatabase, machine: Machine, measure: bool, *,
                 judge_unmeasured: Optional[JudgeUnmeasured] = None,
                 profiling_seconds: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.database = database
        self.machine = machine
        self.measure = measure
        self.judge_unmeasured = judge_unmeasured
        self.budget = MeasuringTime(profiling_seconds, clock)
        self._tables: dict[ConvLayer, Union[dict, str]] = {}
        self._pending: list[ConvLayer] = []
        # Each geometry's tables as the database holds them, read again only after measuring it:
        # reading one kernel's thousands of rows takes tens of milliseconds, and a model's
        # layers share geometries.
        self._known: dict[ConvGeometry, dict[str, KernelTimings]] = {}

    def __call__(self, layer: ConvLayer) -> Union[dict, str]:
        if layer not in self._tables:
            timings = self._measured(layer, self.budget)
            if timings is None:
                self._pending.append(layer)
                timings = (f"not measured yet: the profiling budget of "
                           f"{self.budget.seconds:g} s is spent")
            self._tables[layer] = timings
        return self._tables[layer]

    @property
    def pending(self) -> tuple[ConvLayer, ...]:
        """The layers left alone because the profiling budget was spent, in the order met."""
        return tuple(self._pending)

    def measure_pending(self, seconds: float) -> int:
        """Measures pending layers into the database until measuring has taken `seconds`;
        returns how many layers it finished, which are read from then on."""
        budget = MeasuringTime(seconds, self.budget.clock)
        finished = []
        for layer in self._pending:
            timings = self._measured(layer, budget)
            if timings is not None:
                self._tables[layer] = timings
                finished.append(layer)
        self._pending = [layer for layer in self._pending if layer not in finished]
        return len(finished)

    def _measured(self, layer: ConvLayer, budget: MeasuringTime) -> Union[dict, str, None]:
        """The layer's tables, or why it has none, measuring within `budget` what the database
        lacks; None where measuring is needed and the budget is spent."""
        every_size = micro_batch_sizes(layer.batch_size, POWER_OF_TWO)
        if self.judge_unmeasured is not None and self.measure:
            if not self._measure(layer, (layer.batch_size,), budget):
                return None
            tables = self._read(layer)
            if isinstance(tables, str):
                return tables
            unmeasured = sorted({size for missing in self._missing(layer, every_size)
                                 for size in missing.sizes})
            if unmeasured:
                reason = self.judge_unmeasured(layer, tables, unmeasured)
                if reason:
                    return reason
        if not self._measure(layer, every_size, budget):
            return None
        return self._read(layer)

    def _known_tables(self, geometry: ConvGeometry) -> dict[str, KernelTimings]:
        if geometry not in self._known:
            self._known[geometry] = {
                kernel: self.database.timings(self.machine.device, self.machine.cudnn_version,
                                              geometry, kernel) for kernel in KERNELS}
        return self._known[geometry]

    def _missing(self, layer: ConvLayer, sizes: Sequence[int]) -> list[MissingMeasurement]:
        geometry = layer.cudnn_geometry()
        known = self._known_tables(geometry)
        return [missing for kernel in KERNELS
                for missing in kernel_missing(geometry, layer.name, kernel, known[kernel], sizes)]

    def _measure(self, layer: ConvLayer, sizes: Sequence[int], budget: MeasuringTime) -> bool:
        """Measures what the database lacks of the layer at `sizes`, where measuring; False
        where something is lacking and the budget is spent."""
        if not self.measure or not self._missing(layer, sizes):
            return True
        if budget.spent:
            return False
        geometry = layer.cudnn_geometry()
        with budget.timing():
            profile([(geometry, layer.name)], layer.batch_size, self.database, progress=False,
                    sizes=sizes, machine=self.machine)
        del self._known[geometry]
        return True

    def _read(self, layer: ConvLayer) -> Union[dict, str]:
        tables = self._known_tables(layer.cudnn_geometry())
        for kernel in KERNELS:
            if layer.batch_size not in tables[kernel]:
                return (f"no profile of its {kernel} kernel at batch {layer.batch_size} on "
                        f"{self.machine.device} (cuDNN {self.machine.cudnn_version})")
        return tables
