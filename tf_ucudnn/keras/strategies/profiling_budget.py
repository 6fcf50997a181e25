"""How long measuring missing profiles may take when the callback plans its convolutions, so that
its first epoch runs about as fast as Keras's.

Measuring a layer's kernels on the GPU takes seconds; a model of many new layers would spend its
first epoch measuring. A planner that can leave layers unmeasured (a `DatabasePlanner`, or one
given with `measure_pending`) measures within a budget instead: the options'
`profiling_seconds`, else `profiling_share` of the first epoch's estimated time, its first step
(which traces and compiles, as Keras's first epoch does) and Keras's other steps at the step time
measured on the steps after it, before planning (those steps train with Keras's own convolutions,
so nothing is lost). The layers left waiting are measured at the ends of later epochs, each
within the share of a later epoch (its steps at that step time)
(`ConvolutionPlanning.measure_pending`), except under a memory budget, whose plans are made once,
at the first batch, before any step runs.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Optional

from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.options import KerasOptions

# Steps timed after the first to estimate an epoch: enough for a median, few enough that the
# plans come early in the first epoch.
ESTIMATE_STEPS = 3


def takes_budget(options: KerasOptions, planner: Optional[LayerPlanner]) -> bool:
    """Whether the planner can leave layers unmeasured and measure them later."""
    if planner is not None:
        return callable(getattr(planner, "measure_pending", None))
    return options.plans_convolutions  # the options' own: a DatabasePlanner


@dataclasses.dataclass
class ProfilingBudget:
    fixed_seconds: Optional[float] = None  # the options' profiling_seconds
    share: Optional[float] = None  # else this share of an epoch, estimated from timed steps
    epoch_steps: Optional[int] = None
    timed_steps: int = 0  # steps timed (after the first) before planning
    measures_later: bool = False  # whether layers left waiting are measured at epochs' ends
    steps_seen: int = 0
    first_step_seconds: Optional[float] = None  # tracing and compiling included
    step_seconds: list = dataclasses.field(default_factory=list)  # the steps after the first

    @classmethod
    def choose(cls, options: KerasOptions, planner: Optional[LayerPlanner],
               epoch_steps: Optional[int], plans_at_first_batch: bool) -> "ProfilingBudget":
        """The budget for `planner` (None: the options' own), `epoch_steps` as Keras runs them
        (None where unknown); `plans_at_first_batch` where the plans come before any step."""
        if not takes_budget(options, planner):
            return cls()
        if options.profiling_seconds is not None:
            return cls(fixed_seconds=options.profiling_seconds,
                       measures_later=not plans_at_first_batch)
        timed = min(ESTIMATE_STEPS, (epoch_steps or 1) - 1)
        if options.profiling_share is None or plans_at_first_batch or timed < 1:
            return cls()
        return cls(share=options.profiling_share, epoch_steps=epoch_steps, timed_steps=timed,
                   measures_later=True)

    @property
    def seconds(self) -> Optional[float]:
        """The budget, once known; None for none (everything measured when first asked)."""
        if self.fixed_seconds is not None:
            return self.fixed_seconds
        if self.share is None or len(self.step_seconds) < self.timed_steps:
            return None
        return self.share * (self.first_step_seconds + (self.epoch_steps - 1)
                             * statistics.median(self.step_seconds))

    @property
    def later_seconds(self) -> Optional[float]:
        """The budget at a later epoch's end: the share of that epoch, its steps at the measured
        step time (the first epoch's share, which holds the compile, would take most of an
        epoch of a few seconds)."""
        if self.fixed_seconds is not None:
            return self.fixed_seconds
        if self.share is None or len(self.step_seconds) < max(self.timed_steps, 1):
            return None
        return self.share * self.epoch_steps * statistics.median(self.step_seconds)

    def wants_step_time(self) -> bool:
        """Whether the step about to run is to be timed for the estimate."""
        return self.share is not None and len(self.step_seconds) < self.timed_steps

    def step_ended(self, seconds: Optional[float]) -> None:
        """Notes a step before planning, with its time where it was timed."""
        if seconds is not None:
            if self.steps_seen == 0:
                self.first_step_seconds = seconds
            else:
                self.step_seconds.append(seconds)
        self.steps_seen += 1

    @property
    def ready(self) -> bool:
        """Whether the convolutions can be planned now: after the first step, and after the
        steps that estimate the epoch."""
        return self.steps_seen >= 1 and len(self.step_seconds) >= self.timed_steps

    def planner_settings(self, planner: Optional[LayerPlanner]) -> dict:
        """The keyword arguments for `conv_planner` that give the options' own planner the
        budget; none for a planner given, which plans by its own settings."""
        seconds = self.seconds
        return {"profiling_seconds": seconds} if planner is None and seconds is not None else {}

    def describe(self) -> str:
        """The budget in words, "" for none."""
        if self.fixed_seconds is not None:
            return f"profiles measured within {self.fixed_seconds:g} s at a time"
        if self.share is not None:
            return (f"profiles measured within {self.share:.0%} of the first epoch's time "
                    f"(estimated from its first {self.timed_steps + 1} step(s)) at a time")
        return ""
