"""The callback's decisions, chosen together once when training begins, from the options, the
planner and the model; and the report they make together."""

from __future__ import annotations

import dataclasses
from typing import Optional

import keras

from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.keras.strategies.accumulation import AccumulatedSteps
from tf_ucudnn.keras.strategies.batch_norm import BatchNormTraining, choose_batch_norm
from tf_ucudnn.keras.strategies.convolutions import ConvolutionPlanning
from tf_ucudnn.keras.strategies.memory import MemoryStrategy, NoMemoryPlan
from tf_ucudnn.keras.strategies.prefetch import InputCopies, choose_input_prefetch
from tf_ucudnn.keras.strategies.profiling_budget import ProfilingBudget
from tf_ucudnn.keras.strategies.step_trial import StepTrials, choose_step_trials
from tf_ucudnn.keras.strategies.swaps import SwapsAndRecomputations
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.options import KerasOptions
from tf_ucudnn.report import RewriteReport

# The kinds of memory handling tried under a memory budget, in order; the last takes any model.
MEMORY_KINDS = (AccumulatedSteps, SwapsAndRecomputations)


def memory_kind(model: keras.Model, options: KerasOptions) -> tuple[type, dict]:
    """The kind of memory handling for `model`, and the kinds passed over with why."""
    if options.memory_budget is None:
        return NoMemoryPlan, {}
    if model.steps_per_execution != 1:
        raise ValueError("MicroBatchCallback with a memory_budget trains one step per call: "
                         f"compile the model with steps_per_execution=1, not "
                         f"{model.steps_per_execution}")
    passed_over = {}
    for kind in MEMORY_KINDS[:-1]:
        refusal = kind.refusal(model, options)
        if refusal is None:
            return kind, passed_over
        passed_over[kind.NAME] = refusal
    return MEMORY_KINDS[-1], passed_over


@dataclasses.dataclass
class Strategies:
    """One training run's decisions; `begin` in this order, closed in reverse."""

    convolutions: ConvolutionPlanning
    batch_norm: BatchNormTraining
    memory: MemoryStrategy
    trial: StepTrials
    input: InputCopies

    def _each(self) -> list:
        return [getattr(self, field.name) for field in dataclasses.fields(self)]

    def begin(self) -> None:
        try:
            for strategy in self._each():
                strategy.begin()
        except BaseException:
            self.close()  # what those begun changed
            raise

    def close(self) -> None:
        for strategy in reversed(self._each()):
            strategy.close()

    def report(self) -> RewriteReport:
        """What the decisions made of the run so far."""
        convolutions = self.convolutions
        return RewriteReport(
            layers=list(convolutions.layers), left_alone=list(convolutions.left_alone),
            fused=list(convolutions.fused), not_fused=list(convolutions.not_fused),
            memory=self.memory.plan, memory_workspaces=self.memory.workspaces,
            trial=self.trial.result, batch_norm_kernel=self.batch_norm.kernel,
            input_prefetch=self.input.report_text,
            strategies={field.name: getattr(self, field.name).choice()
                        for field in dataclasses.fields(self)})


def choose_strategies(model: keras.Model, options: KerasOptions,
                      planner: Optional[LayerPlanner], device_model: Optional[DeviceModel],
                      epoch_steps: Optional[int]) -> Strategies:
    """Each decision for training `model` (compiled) with `options`; `planner` None for the
    options' own, `epoch_steps` the steps Keras runs an epoch (None where unknown)."""
    kind, passed_over = memory_kind(model, options)
    profiling = ProfilingBudget.choose(options, planner, epoch_steps, kind.plans_at_first_batch)
    convolutions = ConvolutionPlanning(model, options, planner, profiling)
    return Strategies(convolutions, choose_batch_norm(model, options),
                      kind(model, options, convolutions, device_model, passed_over),
                      choose_step_trials(options), choose_input_prefetch(model, options))
