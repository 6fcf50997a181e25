"""Whether the step with the plans is timed against Keras's own before it is kept.

Where some layer is planned (or a batch normalization kernel is left to the trial), the two steps
take turns for `trial_steps` steps each, and the plans stay only if their median step is at least
`TRIAL_MARGIN` faster, so the callback does not leave training slower than Keras's own step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from tf_ucudnn.keras.strategies.base import Strategy
from tf_ucudnn.options import KerasOptions
from tf_ucudnn.report import StepTrial

# How much faster the step trial must find the plans' step than Keras's before keeping it: step
# times scatter by about that much, and Keras's own step is the safe choice.
TRIAL_MARGIN = 0.01


def keras_own(jit_compile: bool, batch_norm_tried: bool) -> str:
    """What Keras's own step runs, against which the plans are timed."""
    own = "XLA's own convolutions" if jit_compile else "TensorFlow's own convolutions"
    return own + (" and Keras's batch normalization" if batch_norm_tried else "")


@dataclasses.dataclass
class RunningTrial:
    """A step trial under way: its result so far, and the two train functions it times."""

    result: StepTrial
    unplanned: Callable
    planned: Callable
    steps_seen: int = 0

    def step_timed(self, seconds: float) -> Optional[Callable]:
        """Notes the time of the step that just ran; returns the train function for the next
        step while the trial goes on, None once `result.kept` says which step won."""
        self.steps_seen += 1
        result = self.result
        # The two steps take turns, so that a drift in the device's speed (its clocks, the
        # allocator settling) weighs on both alike. Each one's first call is not timed: the
        # planned one compiles, and the unplanned one may be optimized again (Grappler's options
        # changed with the plans).
        ran_planned = self.steps_seen % 2 == 1
        if self.steps_seen > 2:
            (result.planned_ms if ran_planned else result.unplanned_ms).append(seconds * 1e3)
        if len(result.unplanned_ms) < result.steps:
            return self.unplanned if ran_planned else self.planned
        faster = result.planned_median_ms < (1 - TRIAL_MARGIN) * result.unplanned_median_ms
        result.kept = "plans" if faster else result.own
        return None

    def rejection(self) -> str:
        """Why the planned layers are left alone, where Keras's step won."""
        result = self.result
        return (f"measured: the step with the plans took {result.planned_median_ms:.2f} ms, with "
                f"{result.own} {result.unplanned_median_ms:.2f} ms (the plans must gain "
                f"{TRIAL_MARGIN:.0%})")


class StepTrials(Strategy):
    """`result`: the latest trial's, None before one starts."""

    def __init__(self, steps: int, reason: str):
        super().__init__("timed" if steps else "untimed", reason)
        self.steps = steps
        self.result: Optional[StepTrial] = None

    def start(self, planned: Callable, unplanned: Callable, own: str) -> Optional[RunningTrial]:
        """A trial of `planned` against `unplanned` (Keras's step, running `own`), or None where
        the plans are kept untimed."""
        if not self.steps:
            return None
        self.result = StepTrial(self.steps, own)
        return RunningTrial(self.result, unplanned, planned)


def choose_step_trials(options: KerasOptions) -> StepTrials:
    if options.memory_budget is not None:
        return StepTrials(0, "under a memory budget the planned step is the one that fits")
    if not options.trial_steps:
        return StepTrials(0, "trial_steps=0: the plans kept untimed")
    return StepTrials(options.trial_steps, f"{options.trial_steps} step(s) each way in turns; "
                                           f"the plans kept if {TRIAL_MARGIN:.0%} faster")
