"""Plan reports: what was chosen per kernel, against the best undivided run under the same limit.

A report is plain data (`to_json`) and prints as a text table (`to_text`). Two ways to build one:

* `kernel_limit_report`: every kernel planned alone under one workspace limit (μ-cuDNN's
  per-kernel limit), against the fastest single algorithm on the whole batch within that limit;
* `network_report`: a `NetworkPlan` against the same ILP restricted to undivided configurations
  (same mode, same budget), which the caller solves.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from tf_ucudnn.conv_planning.kernel_dp import (
    KernelConfiguration,
    NoFeasiblePlanError,
    fastest_configuration,
)
from tf_ucudnn.conv_planning.network_ilp import DYNAMIC_ALLOCATOR, NetworkPlan
from tf_ucudnn.core.plan import DIRECT, KernelPlan
from tf_ucudnn.profiling.records import KernelTimings

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class KernelReport:
    layer: str
    kernel: str
    chosen: KernelConfiguration
    # None where no undivided algorithm fits the limit.
    undivided: Optional[KernelConfiguration]
    # The kernel's own limit, where it has one (per-kernel limit, or budget less live bytes).
    workspace_limit_bytes: Optional[int] = None

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
                "speedup": self.speedup}


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
                k.layer, k.kernel, summarize(k.chosen.plan), f"{k.chosen.time_ms:.3f}",
                f"{k.chosen.workspace_bytes / _MIB:.1f}",
                "none fits" if undivided is None else summarize(undivided.plan),
                "-" if undivided is None else f"{undivided.time_ms:.3f}",
                "-" if undivided is None else f"{undivided.workspace_bytes / _MIB:.1f}",
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
        try:
            undivided = fastest_configuration(kernel, timings, batch_size, workspace_limit,
                                              deterministic_only=deterministic_only,
                                              micro_batch_sizes=[batch_size],
                                              call_overhead_ms=call_overhead_ms,
                                              form=DIRECT)
        except NoFeasiblePlanError:
            undivided = None
        kernels.append(KernelReport(layer, kernel, chosen, undivided, workspace_limit))
    title = (f"per-kernel workspace limit {workspace_limit / _MIB:g} MiB, batch {batch_size}"
             + (", deterministic algorithms only" if deterministic_only else ""))
    return PlanReport(title, tuple(kernels))


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
    title = f"{plan.mode}, budget {plan.budget_bytes / _MIB:g} MiB"
    if undivided is None:
        title += " (no undivided plan fits the budget)"
    return PlanReport(title, tuple(kernels))
