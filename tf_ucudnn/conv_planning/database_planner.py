"""From a layer to its LayerPlan, using measured profiles: what `tf_ucudnn.rewrite`, the Keras
callback and the SavedModel converter call for each convolution they find. Each kernel gets
μ-cuDNN's dynamic program under the workspace limit.

With a workspace budget, `prepare` first plans all layers of a graph together: μ-cuDNN's integer
linear program picks one (time, workspace) Pareto configuration per kernel so that the workspaces
together fit the budget (the shared-workspace mode), and each layer then gets its share.

A layer whose three kernels run best undivided still gets tf_ucudnn's op by default, with the
measured best algorithm: TensorFlow's own choice under the same limit can be far slower (it can
pass over a fast algorithm, such as implicit GEMM for VGG16's layers, whose workspace is well
within the limit). `leave_undivided_to_tensorflow` keeps
TensorFlow's op for such layers instead, reported as "no gain".

What is missing is measured as `layer_timings` says: compared with XLA, the whole batch first,
and the micro-batches only where the bound on any plan that the whole batch gives
(`xla_comparison.plan_bound_ms`) leaves room to beat XLA by the margin; within a profiling
budget, if one is given.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from tf_ucudnn.conv_planning.kernel_dp import (
    KernelConfiguration,
    NoFeasiblePlanError,
    fastest_configuration,
    pareto_configurations,
)
from tf_ucudnn.conv_planning.layer_timings import LayerTimings
from tf_ucudnn.conv_planning.network_ilp import (
    SHARED_WORKSPACE,
    KernelOptions,
    NetworkPlan,
    optimize_network,
)
from tf_ucudnn.conv_planning.xla_comparison import (
    LayerPrediction,
    kernels_run,
    plan_bound_ms,
    planned_ms,
    xla_ms,
)
from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import DIRECT, KERNELS, LayerPlan
from tf_ucudnn.core.units import parse_bytes
from tf_ucudnn.kernels.library import gpu_kernels_available
from tf_ucudnn.options import default_database
from tf_ucudnn.profiling import ProfileDatabase, packaged_profiles
from tf_ucudnn.profiling.profiler import Machine, current_machine


class PlannerError(TfUcudnnError, RuntimeError):
    """Why no planner could be set up (no measurements to plan with), for the user to read."""


def resolve_machine(database: ProfileDatabase, device: Optional[str] = None,
                    cudnn_version: Optional[int] = None) -> tuple[Machine, bool]:
    """Whose measurements to plan with, and whether this process can measure on it."""
    if device is None and gpu_kernels_available() and tf.config.list_physical_devices("GPU"):
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
    """Plans layers from a profile database, measuring missing geometries when it can.

    `workspace_limit_bytes` bounds each kernel's workspace (None: no bound);
    `workspace_budget_bytes` bounds their sum over the layers given to `prepare`.
    With `compare_with_xla`, a layer is planned only where its plan is predicted at least
    `xla_margin` faster than XLA's own convolution (see `LayerPrediction`); the others are left
    to XLA, with the two predictions as the reason. The margin covers what a custom call costs
    XLA: the convolution is no longer fused with what surrounds it.

    `profiling_seconds` bounds the time measuring takes (by `clock`; None: no bound): once it is
    spent, a layer that needs measuring is left alone and kept `pending`, for `measure_pending`
    (see `LayerTimings`).
    """

    def __init__(self, database: ProfileDatabase, workspace_limit_bytes: Optional[int], *,
                 workspace_budget_bytes: Optional[int] = None,
                 machine: Optional[Machine] = None, measure: Optional[bool] = None,
                 deterministic_only: Optional[bool] = None, call_overhead_ms: float = 0.0,
                 leave_undivided_to_tensorflow: bool = False, compare_with_xla: bool = False,
                 xla_margin: float = 0.1, profiling_seconds: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.database = database
        self.workspace_limit_bytes = workspace_limit_bytes
        self.measure = machine is None if measure is None else measure
        self.machine = machine or current_machine()
        self.deterministic_only = (tf_config.is_op_determinism_enabled()
                                   if deterministic_only is None else deterministic_only)
        self.call_overhead_ms = call_overhead_ms
        self.leave_undivided_to_tensorflow = leave_undivided_to_tensorflow
        self.compare_with_xla = compare_with_xla
        self.xla_margin = xla_margin
        if workspace_limit_bytes is None and workspace_budget_bytes is None:
            raise ValueError("give a workspace limit per kernel, a workspace budget for all, "
                             "or both")
        self.workspace_budget_bytes = workspace_budget_bytes
        self._network_plans: dict[ConvLayer, Union[LayerPlan, str]] = {}
        # Planning and predicting a layer both read its tables: read (and measured) once.
        self._timings = LayerTimings(
            database, self.machine, self.measure,
            judge_unmeasured=self._left_to_xla_unmeasured if compare_with_xla else None,
            profiling_seconds=profiling_seconds, clock=clock)

    @classmethod
    def open(cls, workspace_limit: Union[int, str, None] = None,
             database: Optional[str] = None, profiles: Iterable[str] = (),
             device: Optional[str] = None, cudnn_version: Optional[int] = None,
             workspace_budget: Union[int, str, None] = None, import_packaged: bool = True,
             **options) -> "DatabasePlanner":
        """A planner over the database file (created if new), with `profiles` imported into it,
        and, with `import_packaged`, the profiles packaged with tf_ucudnn of the machine it plans
        for, where the database has not measured those kernels itself.

        On a GPU with the cuDNN kernels it measures what is missing; elsewhere it plans from the
        measurements of `device` (or of the only machine the database holds). `options` go to the
        constructor (`profiling_seconds`, `compare_with_xla`, ...). Close it when done.
        """
        database = database or default_database()
        os.makedirs(os.path.dirname(os.path.abspath(database)), exist_ok=True)
        db = ProfileDatabase(database)
        try:
            for path in profiles:
                db.import_jsonl(path)
            if import_packaged and device is not None and cudnn_version is not None:
                # Before resolving: a database without this machine's measurements may plan from
                # its packaged ones.
                db.import_missing(packaged_profiles(), device, cudnn_version)
            machine, can_measure = resolve_machine(db, device, cudnn_version)
            if import_packaged:
                db.import_missing(packaged_profiles(), machine.device, machine.cudnn_version)
        except BaseException:
            db.close()
            raise
        return cls(db, None if workspace_limit is None else parse_bytes(workspace_limit),
                   workspace_budget_bytes=(None if workspace_budget is None
                                           else parse_bytes(workspace_budget)),
                   machine=machine, measure=can_measure, **options)

    def close(self) -> None:
        self.database.close()

    def __enter__(self) -> "DatabasePlanner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pending(self) -> tuple[ConvLayer, ...]:
        """The layers left alone because the profiling budget was spent, in the order met."""
        return self._timings.pending

    def measure_pending(self, seconds: float) -> int:
        """Measures pending layers into the database until measuring has taken `seconds`;
        returns how many layers it finished. Those are planned from then on (under a workspace
        budget, once `prepare` runs again)."""
        return self._timings.measure_pending(seconds)

    def _left_to_xla_unmeasured(self, layer: ConvLayer, tables: dict,
                                unmeasured: Sequence[int]) -> Optional[str]:
        """Why the layer is left to XLA before its `unmeasured` micro-batch sizes are: the
        bound on any plan (`plan_bound_ms`) does not gain the margin over XLA's convolution.
        None where it does."""
        xla = xla_ms(layer, tables, deterministic_only=self.deterministic_only)
        bound = plan_bound_ms(layer, tables, deterministic_only=self.deterministic_only,
                              call_overhead_ms=self.call_overhead_ms)
        if xla is None or bound is None or bound <= (1 - self.xla_margin) * xla:
            return None
        return (f"XLA's own convolution, judged from the whole batch alone: no plan is assumed "
                f"faster than the fastest whole-batch run in any form with any workspace, "
                f"{bound:.3f} ms, against {xla:.3f} ms undivided as XLA runs it (a plan must "
                f"gain {self.xla_margin:.0%}); micro-batches of "
                f"{', '.join(map(str, unmeasured))} not measured")

    def prepare(self, layers: Iterable[ConvLayer]) -> None:
        """With a workspace budget, plans `layers` together (the rewrite pass calls this first).

        Raises InfeasibleBudgetError, saying by how much, when the budget cannot be met.
        """
        if self.workspace_budget_bytes is None:
            return
        self._network_plans = {}  # a prepare that fails keeps no plans of one before
        layers = tuple(dict.fromkeys(layers))
        names = tuple(map(str, range(len(layers))))
        options, reasons = self._network_options(layers, names, {}, undivided=False)
        self._network_plans = dict(reasons)
        if options:
            plan = optimize_network(options, self.workspace_budget_bytes, SHARED_WORKSPACE)
            self._network_plans = NetworkPlanning(plan, layers, names, reasons).layer_plans()

    def plan_network(self, layers: Iterable[ConvLayer], mode: str = SHARED_WORKSPACE,
                     live_bytes: Optional[Mapping[tuple[ConvLayer, str], int]] = None,
                     undivided: bool = False,
                     names: Optional[Mapping[ConvLayer, str]] = None) -> "NetworkPlanning":
        """The layers planned together under the workspace budget, as `prepare` plans them, in
        either of the ILP's modes (`network_ilp`): `live_bytes` gives the bytes held beside each
        (layer, kernel) as it runs, for the dynamic_allocator mode. With `undivided`, each
        kernel runs in one call on the whole batch, as TensorFlow's own convolution does: the
        baseline a plan is measured against. `names` gives each layer's name in the plan and
        its errors (by default, its position). What `__call__` gives is left as it was.

        Raises InfeasibleBudgetError, saying by how much, when the budget cannot be met.
        """
        if self.workspace_budget_bytes is None:
            raise ValueError("plan_network needs a planner with a workspace budget")
        layers = tuple(dict.fromkeys(layers))
        named = tuple(names[layer] if names else str(index) for index, layer in enumerate(layers))
        options, reasons = self._network_options(layers, named, live_bytes or {}, undivided)
        plan = (optimize_network(options, self.workspace_budget_bytes, mode) if options
                else None)
        return NetworkPlanning(plan, layers, named, reasons)

    def _network_options(self, layers: tuple[ConvLayer, ...], names: tuple[str, ...],
                         live_bytes: Mapping[tuple[ConvLayer, str], int], undivided: bool):
        """The ILP's options of the layers it can plan, by their names, and why each other
        has none."""
        options, reasons = [], {}
        for layer, name in zip(layers, names):
            tables = self._timings(layer)
            if isinstance(tables, str):
                reasons[layer] = tables
                continue
            try:
                fronts = [self._front(kernel, tables[kernel], layer.batch_size, undivided)
                          for kernel in KERNELS]
            except NoFeasiblePlanError as error:
                reasons[layer] = f"no plan within the workspace limit: {error}"
                continue
            options += [KernelOptions(name, kernel, front, live_bytes.get((layer, kernel), 0))
                        for kernel, front in zip(KERNELS, fronts)]
        return options, reasons

    def _front(self, kernel, timings, batch_size, undivided: bool = False):
        front = pareto_configurations(kernel, timings, batch_size,
                                      deterministic_only=self.deterministic_only,
                                      call_overhead_ms=self.call_overhead_ms,
                                      micro_batch_sizes=[batch_size] if undivided else None,
                                      form=DIRECT if undivided else None)
        if self.workspace_limit_bytes is not None:
            front = tuple(c for c in front if c.workspace_bytes <= self.workspace_limit_bytes)
            if not front:
                raise NoFeasiblePlanError(f"{kernel}: every configuration needs more than "
                                          f"{self.workspace_limit_bytes} bytes")
        return front

    def __call__(self, layer: ConvLayer) -> Union[LayerPlan, str]:
        if self.workspace_budget_bytes is not None:
            if layer not in self._network_plans:
                return "not among the layers planned together under the workspace budget"
            plan = self._network_plans[layer]
        else:
            plan = self._plan_alone(layer)
        return self.screen(layer, plan)

    def screen(self, layer: ConvLayer, plan: Union[LayerPlan, str]) -> Union[LayerPlan, str]:
        """`plan` (the layer's, or why it has none), or why the layer keeps TensorFlow's or
        XLA's own convolution instead (`leave_undivided_to_tensorflow`, `compare_with_xla`)."""
        if isinstance(plan, LayerPlan) and self.leave_undivided_to_tensorflow and all(
                len(plan.kernel(kernel).micro_batches) == 1
                and plan.kernel(kernel).form == DIRECT for kernel in kernels_run(layer)):
            return "no gain: every kernel runs best undivided, as TensorFlow's own op does"
        if isinstance(plan, LayerPlan) and self.compare_with_xla:
            prediction = self.predict(layer, plan)
            if prediction.xla_ms is None or prediction.plan_ms is None:
                return "XLA's own convolution: the profiles cannot predict which is faster"
            if prediction.plan_ms > (1 - self.xla_margin) * prediction.xla_ms:
                return (f"XLA's own convolution is predicted as fast or faster: "
                        f"{prediction.xla_ms:.3f} ms undivided with any workspace, against "
                        f"{prediction.plan_ms:.3f} ms planned (a plan must gain "
                        f"{self.xla_margin:.0%})")
        return plan

    def workspace_front(self, layer: ConvLayer) -> dict:
        """Each kernel's Pareto front of plans within the workspace limit (workspace
        ascending, time descending), for choosing its workspace with the step's memory; empty
        where the database cannot tell."""
        tables = self._timings(layer)
        if isinstance(tables, str):
            return {}
        try:
            return {kernel: self._front(kernel, tables[kernel], layer.batch_size)
                    for kernel in KERNELS}
        except NoFeasiblePlanError:
            return {}

    def predict(self, layer: ConvLayer, plan: Union[LayerPlan, str, None] = None
                ) -> LayerPrediction:
        """The layer's predicted time as XLA's convolution and, if given, as `plan`: the
        kernels training runs (`kernels_run`). Neither for a layer left to XLA before its
        micro-batches were measured."""
        tables = self._timings(layer)
        if isinstance(tables, str):
            return LayerPrediction(None, None)
        as_xla = xla_ms(layer, tables, deterministic_only=self.deterministic_only)
        if as_xla is None:
            return LayerPrediction(None, None)
        as_planned = (planned_ms(layer, plan, tables, self.call_overhead_ms)
                      if isinstance(plan, LayerPlan) else None)
        return LayerPrediction(as_xla, as_planned)

    def configurations(self, layer: ConvLayer) -> Union[dict[str, KernelConfiguration], str]:
        """Each kernel's fastest configuration within the workspace limit, planned alone (the
        plan `__call__` gives without a workspace budget) with its predicted time and
        workspace; or why the layer has none."""
        tables = self._timings(layer)
        if isinstance(tables, str):
            return tables
        chosen = {}
        for kernel in KERNELS:
            try:
                chosen[kernel] = fastest_configuration(
                    kernel, tables[kernel], layer.batch_size, self.workspace_limit_bytes,
                    deterministic_only=self.deterministic_only,
                    call_overhead_ms=self.call_overhead_ms)
            except NoFeasiblePlanError as error:
                return f"no plan within the workspace limit: {error}"
        return chosen

    def timings(self, layer: ConvLayer) -> Union[dict, str]:
        """kernel -> the layer's timing table the planner plans from, or why there is none."""
        return self._timings(layer)

    def _plan_alone(self, layer: ConvLayer) -> Union[LayerPlan, str]:
        chosen = self.configurations(layer)
        return chosen if isinstance(chosen, str) else LayerPlan(*(chosen[k].plan
                                                                  for k in KERNELS))


@dataclasses.dataclass(frozen=True)
class NetworkPlanning:
    """`DatabasePlanner.plan_network`'s answer: the ILP's plan (None where no layer could be
    planned), whose kernels name their layers by `names`, and why each layer left out of it
    has no plan."""

    plan: Optional[NetworkPlan]
    layers: tuple[ConvLayer, ...]
    names: tuple[str, ...]  # each layer's in the plan
    reasons: Mapping[ConvLayer, str]

    def layer_plans(self) -> dict[ConvLayer, Union[LayerPlan, str]]:
        """Each layer's plan, or why it has none."""
        plans = self.plan.layer_plans() if self.plan is not None else {}
        return {layer: self.reasons[layer] if layer in self.reasons else plans[name]
                for layer, name in zip(self.layers, self.names)}
