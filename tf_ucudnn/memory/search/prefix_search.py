"""The search over a step's micro-batched prefixes: where no plan of swaps and recomputations
fits the budget in whole batches, the step's first ops up to a cut (a pooling's output) run in
micro-batches, at the shallowest cut where a plan fits, in the count that predicts the shortest
step (`plan_step_with_prefix` for a graph; `plan_with_micro_batches` also serves a Keras
model's step)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, NamedTuple, Optional

from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.core.units import MIB
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.passes.graph_prefix import cut_candidates, micro_batched_prefix
from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.step_plan import (
    MemoryPlan,
    apply_memory_plan,
    op_times,
    plan_step_memory,
)
from tf_ucudnn.options import DEFAULT_MICRO_BATCHES


class Planned(NamedTuple):
    """What `plan_with_micro_batches` chose: the step planned (a ConcreteFunction) and its plan,
    the cut up to which it runs in micro-batches (None: whole batches), how many, and every
    choice tried before, with why it was passed over."""

    step: object
    plan: MemoryPlan
    cut: Optional[str]
    micro_batches: int
    passed_over: list[str]


def plan_with_micro_batches(trace: Callable[[Optional[str], int], object], budget_bytes: int,
                            device_model: DeviceModel, step_ms: Optional[float],
                            cuts: Iterable[tuple[str, Optional[str]]],
                            micro_batches: Iterable[int] = DEFAULT_MICRO_BATCHES,
                            batch_size: Optional[int] = None,
                            whole_batches: bool = True) -> Planned:
    """Plans `trace(None, 1)`, the step in whole batches (unless not `whole_batches`: a plan
    that fits may still leave the allocator no room for the first layers' largest tensors,
    when its free space is split); if no plan fits the budget, the step
    with its ops up to a cut in micro-batches, `trace(cut, count)`: the first of `cuts` (pairs of
    a cut and None, or the reason it cannot be made; worked out only when reached) at which a
    plan fits, in whichever of `micro_batches` gives the shortest predicted step (counts over
    `batch_size` are not tried; a trace may refuse others with a PrefixError). BudgetError,
    with the smallest shortfall, if nothing fits; its message lists what was tried. `step_ms`,
    the whole-batch step's measured time, calibrates each step's op times."""
    passed_over, errors = [], []
    micro_batches = tuple(micro_batches)  # tried again for each cut
    whole_ms = None  # the whole-batch step's roofline estimate, to scale `step_ms` by

    def attempt(cut: Optional[str], count: int):
        nonlocal whole_ms
        where = f"up to {cut} in {count} micro-batches" if cut else "whole batches"
        try:
            step = trace(cut, count)
        except PrefixError as error:
            passed_over.append(f"{where}: {error}")
            return None
        # `step_ms` is the whole-batch step's; micro-batches run the prefix twice, so theirs is
        # longer by what the estimates add.
        calibrated = None
        if step_ms is not None:
            if whole_ms is None:
                whole = step if cut is None else trace(None, 1)
                whole_ms = sum(op_times(whole.graph, device_model, None, None))
            calibrated = step_ms * sum(op_times(step.graph, device_model, None, None)) / whole_ms
        try:
            return step, plan_step_memory(step, budget_bytes, device_model, step_ms=calibrated)
        except BudgetError as error:
            errors.append(error)
            passed_over.append(f"{where}: {error.shortfall_bytes / MIB:.1f} MiB over")
            return None

    result, chosen = attempt(None, 1) if whole_batches else None, (None, 1)
    if not whole_batches:
        passed_over.append("whole batches: not tried, as asked")
    if result is None:
        for cut, refusal in cuts:
            if refusal is not None:
                passed_over.append(f"up to {cut}: {refusal}")
                continue
            fitting = {count: found for count in micro_batches
                       if (batch_size is None or count <= batch_size)
                       and (found := attempt(cut, count))}
            if fitting:
                count = min(fitting, key=lambda c: fitting[c][1].decisions.prediction.step_ms)
                result, chosen = fitting[count], (cut, count)
                break
    if result is None:
        error = min(errors, key=lambda e: e.shortfall_bytes)
        raise BudgetError(error.budget_bytes, error.prediction, tried="; ".join(passed_over))
    return Planned(*result, *chosen, passed_over)


@dataclasses.dataclass
class PrefixStepPlan:
    """A training step planned under a budget by `plan_step_with_prefix`: its memory plan, the
    tensor up to which its ops run in micro-batches (None if the plan fits without), how many,
    and every choice tried before, with why it was passed over."""

    plan: MemoryPlan
    cut: Optional[str]
    micro_batches: int
    passed_over: list[str]

    def to_json(self) -> dict:
        """The choice, without the plan (its own `to_json`)."""
        return {"cut": self.cut, "micro_batches": self.micro_batches,
                "passed_over": self.passed_over}

    def to_text(self) -> str:
        return "\n".join([
            f"the ops up to {self.cut} run in {self.micro_batches} micro-batches, which the peak "
            "above counts" if self.cut
            else "whole batches",
            *(f"  passed over {item}" for item in self.passed_over)])


def plan_step_with_prefix(function, budget_bytes: int, device_model: DeviceModel,
                          step_ms: Optional[float] = None,
                          micro_batches: Iterable[int] = DEFAULT_MICRO_BATCHES,
                          cuts: Optional[Iterable[str]] = None):
    """A training step (a ConcreteFunction) planned to fit `budget_bytes`, as a tf.function with
    its PrefixStepPlan. Its swaps and recomputations are planned first; if no such plan fits,
    its ops up to a cut run in micro-batches too (`graph_prefix.micro_batched_prefix`): the first
    of `cuts` (tensors; by default the forward poolings' outputs, shallowest first) at which the
    plan fits, in whichever of `micro_batches` gives the shortest predicted step, as
    `plan_keras_step` does for a Keras model. BudgetError, with the smallest shortfall, if
    nothing fits; its message lists what was tried."""
    step, prefix = choose_prefix(function, budget_bytes, device_model, step_ms, micro_batches,
                                 cuts)
    return apply_memory_plan(step, prefix.plan), prefix


def choose_prefix(function, budget_bytes: int, device_model: DeviceModel,
                  step_ms: Optional[float], micro_batches: Iterable[int],
                  cuts: Optional[Iterable[str]] = None):
    """The search of `plan_step_with_prefix`, its plan not yet made in the step: the step chosen
    (`function`, or a ConcreteFunction of it with its ops up to the cut in micro-batches) and
    its PrefixStepPlan."""
    def trace(cut: Optional[str], count: int):
        return function if cut is None else \
            micro_batched_prefix(function, cut, count).get_concrete_function()

    found = plan_with_micro_batches(trace, budget_bytes, device_model, step_ms,
                                    cut_candidates(function, cuts), micro_batches)
    return found.step, PrefixStepPlan(found.plan, found.cut, found.micro_batches,
                                      found.passed_over)
