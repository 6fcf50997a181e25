"""Plan reports: what was chosen per kernel, against the best undivided run under the same limit.

A report is plain data (`to_json`) and prints as a text table (`to_text`). Ways to build one:

* `kernel_limit_report`: every kernel planned alone under one workspace limit (μ-cuDNN's
  per-kernel limit), against the fastest single algorithm on the whole batch within that limit;
* `network_report`: a `NetworkPlan` against the same ILP restricted to undivided configurations
  (same mode, same budget), which the caller solves;
* `database_report`: a graph's layers planned by a `DatabasePlanner` in either way, as the
  rewrite would plan them (with the layers it leaves to TensorFlow's or XLA's own convolution),
  which is what `tf-ucudnn plan` prints.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from tf_ucudnn.conv_planning.kernel_dp import (
    KernelConfiguration,
    NoFeasiblePlanError,
    fastest_configuration,
)
from tf_ucudnn.conv_planning.network_ilp import (
    DYNAMIC_ALLOCATOR,
    SHARED_WORKSPACE,
    InfeasibleBudgetError,
    NetworkPlan,
)
from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import DIRECT, KERNELS, KernelPlan, LayerPlan
from tf_ucudnn.core.units import MIB
from tf_ucudnn.profiling.records import KernelTimings

if TYPE_CHECKING:
    from tf_ucudnn.conv_planning.database_planner import DatabasePlanner


class PlanError(TfUcudnnError, RuntimeError):
    """Why no plan could be made, for the command line to print."""


@dataclasses.dataclass(frozen=True)
class KernelReport:
    layer: str
    kernel: str
    chosen: KernelConfiguration
    # None where no undivided algorithm fits the limit.
    undivided: Optional[KernelConfiguration]
    # The kernel's own limit, where it has one (per-kernel limit, or budget less live bytes).
    workspace_limit_bytes: Optional[int] = None
    # Why the layer keeps TensorFlow's or XLA's own convolution, where it does: `chosen` is then
    # that convolution's run (undivided, the fastest at any workspace).
    left_alone: Optional[str] = None

    @property
    def speedup(self) -> Optional[float]:
        if self.undivided is None or self.chosen.time_ms == 0:
            return None
        return self.undivided.time_ms / self.chosen.time_ms

    def to_json(self) -> dict:
        return {"layer": self.layer, "kernel": self.kernel,
                "workspace_limit_bytes": self.workspace_limit_bytes,
                "micro_batches": self.chosen.plan.to_json(),
                "time_ms": self.chosen.time_ms, "workspace_bytes": self.chosen.workspace_bytes,
                "undivided": None if self.undivided is None else self.undivided.to_json(),
                "speedup": self.speedup, "left_alone": self.left_alone}


@dataclasses.dataclass(frozen=True)
class PlanReport:
    title: str
    kernels: tuple[KernelReport, ...]

    def __post_init__(self):
        object.__setattr__(self, "kernels", tuple(self.kernels))

    @property
    def total_time_ms(self) -> float:
        return sum(k.chosen.time_ms for k in self.kernels)

    @property
    def total_undivided_time_ms(self) -> Optional[float]:
        """None when some kernel has no undivided choice: the totals would not compare."""
        if any(k.undivided is None for k in self.kernels):
            return None
        return sum(k.undivided.time_ms for k in self.kernels)

    @property
    def speedup(self) -> Optional[float]:
        undivided = self.total_undivided_time_ms
        if undivided is None or self.total_time_ms == 0:
            return None
        return undivided / self.total_time_ms

    def to_json(self) -> dict:
        return {"title": self.title, "kernels": [k.to_json() for k in self.kernels],
                "total_time_ms": self.total_time_ms,
                "total_undivided_time_ms": self.total_undivided_time_ms,
                "speedup": self.speedup}

    def to_text(self) -> str:
        header = ("layer", "kernel", "micro-batches", "ms", "ws MiB", "undivided", "ms", "ws MiB",
                  "speedup")
        rows = [header]
        for k in self.kernels:
            undivided = k.undivided
            rows.append((
                k.layer, k.kernel, ("own: " if k.left_alone else "") + summarize(k.chosen.plan),
                f"{k.chosen.time_ms:.3f}",
                f"{k.chosen.workspace_bytes / MIB:.1f}",
                "none fits" if undivided is None else summarize(undivided.plan),
                "-" if undivided is None else f"{undivided.time_ms:.3f}",
                "-" if undivided is None else f"{undivided.workspace_bytes / MIB:.1f}",
                "-" if k.speedup is None else f"{k.speedup:.2f}x"))
        total_undivided = self.total_undivided_time_ms
        rows.append(("total", "", "", f"{self.total_time_ms:.3f}", "", "",
                     "-" if total_undivided is None else f"{total_undivided:.3f}", "",
                     "-" if self.speedup is None else f"{self.speedup:.2f}x"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        numeric = {3, 4, 6, 7, 8}
        lines = [self.title]
        for number, row in enumerate(rows):
            cells = [cell.rjust(w) if i in numeric else cell.ljust(w)
                     for i, (cell, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
            if number == 0 or number == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        left_alone = {k.layer: k.left_alone for k in self.kernels if k.left_alone}
        if left_alone:
            lines.append(f"own: {len(left_alone)} layer(s) keep TensorFlow's or XLA's own "
                         "convolution, shown undivided at its fastest at any workspace:")
            lines += [f"  {layer}: {reason}" for layer, reason in left_alone.items()]
        return "\n".join(lines)


def summarize(plan: KernelPlan) -> str:
    """Runs of equal micro-batches folded: '8x32@algo=1,math=default'."""
    runs: list[list] = []
    for mb in plan.micro_batches:
        if runs and runs[-1][1] == mb:
            runs[-1][0] += 1
        else:
            runs.append([1, mb])
    return " + ".join(f"{count}x{mb.size}@{mb.algorithm}" for count, mb in runs)


def kernel_limit_report(tables: Mapping[tuple[str, str], KernelTimings], batch_size: int,
                        workspace_limit: int, *, deterministic_only: bool = False,
                        call_overhead_ms: float = 0.0) -> PlanReport:
    """Each (layer, kernel) table planned alone under `workspace_limit` bytes, in given order."""
    kernels = []
    for (layer, kernel), timings in tables.items():
        chosen = fastest_configuration(kernel, timings, batch_size, workspace_limit,
                                       deterministic_only=deterministic_only,
                                       call_overhead_ms=call_overhead_ms)
        kernels.append(KernelReport(layer, kernel, chosen, _undivided(
            kernel, timings, batch_size, workspace_limit, deterministic_only, call_overhead_ms),
            workspace_limit))
    return PlanReport(_kernel_limit_title(workspace_limit, batch_size, deterministic_only),
                      tuple(kernels))


def _kernel_limit_title(workspace_limit: int, batch_size: int, deterministic_only: bool) -> str:
    return (f"per-kernel workspace limit {workspace_limit / MIB:g} MiB, batch {batch_size}"
            + (", deterministic algorithms only" if deterministic_only else ""))


def _undivided(kernel: str, timings: KernelTimings, batch_size: int,
               workspace_limit: Optional[int], deterministic_only: bool,
               call_overhead_ms: float) -> Optional[KernelConfiguration]:
    """The fastest single call on the whole batch, as TensorFlow's own convolution runs it,
    within `workspace_limit` (None: any); None where none is measured or fits."""
    try:
        return fastest_configuration(kernel, timings, batch_size, workspace_limit,
                                     deterministic_only=deterministic_only,
                                     micro_batch_sizes=[batch_size],
                                     call_overhead_ms=call_overhead_ms, form=DIRECT)
    except NoFeasiblePlanError:
        return None


def network_report(plan: NetworkPlan, undivided: Optional[NetworkPlan]) -> PlanReport:
    """`plan` against `undivided`: the same ILP over undivided configurations, None if infeasible."""
    baseline = {} if undivided is None else {(p.layer, p.kernel): p.configuration
                                             for p in undivided.kernels}
    kernels = []
    for planned in plan.kernels:
        limit = (plan.budget_bytes - planned.live_bytes if plan.mode == DYNAMIC_ALLOCATOR
                 else None)
        kernels.append(KernelReport(planned.layer, planned.kernel, planned.configuration,
                                    baseline.get((planned.layer, planned.kernel)), limit))
    title = f"{plan.mode}, budget {plan.budget_bytes / MIB:g} MiB"
    if undivided is None:
        title += " (no undivided plan fits the budget)"
    return PlanReport(title, tuple(kernels))


def layer_label(layer: ConvLayer) -> str:
    """A layer's name in reports: its convolution op's, less the op's own suffix."""
    return layer.name.removesuffix("/convolution").removesuffix("/Conv2D")


def database_report(layers: Sequence[ConvLayer], planner: "DatabasePlanner",
                    mode: str = SHARED_WORKSPACE,
                    live_bytes: Optional[Mapping[tuple[ConvLayer, str], int]] = None
                    ) -> PlanReport:
    """Every kernel of `layers` (one graph's, at one batch size) planned by `planner`, as the
    rewrite plans them: without a workspace budget, each alone within the planner's workspace
    limit (`kernel_limit_report`'s comparison); with one, together by the ILP in `mode`
    (`DatabasePlanner.plan_network`, `live_bytes` as it takes them; `network_report`'s
    comparison). A layer the planner leaves to TensorFlow's or XLA's own convolution
    (`DatabasePlanner.screen`) shows that convolution's run. Raises PlanError where the
    measurements to plan a layer are missing."""
    missing = [(layer, reason) for layer in layers
               if isinstance(reason := planner.timings(layer), str)]
    if missing:
        machine = planner.machine
        raise PlanError(
            f"no measurements of {len(missing)} of the {len(layers)} convolution(s) at batch "
            f"{layers[0].batch_size} on {machine.device} (cuDNN {machine.cudnn_version}), e.g. "
            f"{layer_label(missing[0][0])}: {missing[0][1]}. Measure them on that GPU "
            "(tf-ucudnn profile), or import their profiles")
    labels = {layer: layer_label(layer) for layer in layers}
    if planner.workspace_budget_bytes is None:
        report, plans = _per_kernel_report(layers, planner, labels)
    else:
        planning = planner.plan_network(layers, mode, live_bytes, names=labels)
        if planning.reasons:
            layer, reason = next(iter(planning.reasons.items()))
            raise PlanError(f"{labels[layer]}: {reason}")
        try:
            undivided = planner.plan_network(layers, mode, live_bytes, undivided=True,
                                             names=labels)
        except InfeasibleBudgetError:
            undivided = None
        report = network_report(planning.plan, None if undivided is None or undivided.reasons
                                else undivided.plan)
        plans = planning.layer_plans()
    return _with_own_convolutions(report, layers, planner, plans, labels)


def _per_kernel_report(layers: Sequence[ConvLayer], planner: "DatabasePlanner",
                       labels: Mapping[ConvLayer, str]) -> tuple[PlanReport, dict]:
    """Each layer planned alone (`DatabasePlanner.configurations`) against the fastest undivided
    run within the same limit; and the layers' plans."""
    limit, kernels, plans = planner.workspace_limit_bytes, [], {}
    for layer in layers:
        chosen = planner.configurations(layer)
        if isinstance(chosen, str):
            raise PlanError(f"{labels[layer]}: {chosen}")
        plans[layer] = LayerPlan(*(chosen[kernel].plan for kernel in KERNELS))
        tables = planner.timings(layer)
        kernels += [KernelReport(labels[layer], kernel, chosen[kernel], _undivided(
                        kernel, tables[kernel], layer.batch_size, limit,
                        planner.deterministic_only, planner.call_overhead_ms), limit)
                    for kernel in KERNELS]
    title = _kernel_limit_title(limit, layers[0].batch_size, planner.deterministic_only)
    return PlanReport(title, tuple(kernels)), plans


def _with_own_convolutions(report: PlanReport, layers: Sequence[ConvLayer],
                           planner: "DatabasePlanner", plans: Mapping[ConvLayer, LayerPlan],
                           labels: Mapping[ConvLayer, str]) -> PlanReport:
    """`report` with each layer the planner leaves to its own convolution
    (`DatabasePlanner.screen`) shown as that convolution runs: undivided, the fastest at any
    workspace, as `DatabasePlanner.predict` counts XLA's (the plan's run where none is
    measured)."""
    left = {labels[layer]: (layer, reason) for layer in layers
            if isinstance(reason := planner.screen(layer, plans[layer]), str)}
    kernels = []
    for row in report.kernels:
        if row.layer in left:
            layer, reason = left[row.layer]
            own = _undivided(row.kernel, planner.timings(layer)[row.kernel], layer.batch_size,
                             None, planner.deterministic_only, 0.0)
            row = dataclasses.replace(row, chosen=own or row.chosen, left_alone=reason)
        kernels.append(row)
    return dataclasses.replace(report, kernels=tuple(kernels))
