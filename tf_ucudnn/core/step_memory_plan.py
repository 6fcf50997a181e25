"""What every plan for a training step's memory says, whichever way it fits the step in the
budget: the swaps and recomputations of `memory.search.step_plan.MemoryPlan`, or the whole step
in micro-batches of `keras.accumulated_step.AccumulationPlan`. A report holds one of them as
`RewriteReport.memory`."""

from __future__ import annotations

import abc


class StepMemoryPlan(abc.ABC):
    """A step's memory plan as plain data: how it fits the step (`kind`), its budget, the peak it
    predicts before the step runs, as JSON and as text."""

    kind: str  # "swaps_and_recomputations" or "micro_batched_step"
    budget_bytes: int
    predicted_peak_bytes: int

    @abc.abstractmethod
    def to_json(self) -> dict:
        ...

    @abc.abstractmethod
    def to_text(self) -> str:
        ...
