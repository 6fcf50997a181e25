"""The batch-size tuner (AccUDNN's): for a model and a memory budget, the batch size with the most
predicted images per second, with its memory plan.

Each candidate batch size's training step is traced and planned; a batch whose step cannot fit the
budget is reported with the shortfall, not dropped silently. For a compiled Keras model that
`MicroBatchCallback` would train in micro-batches with the gradients summed
(`tf_ucudnn.keras.accumulated_step`), each batch is planned that way, as the callback will train
it: the micro-batch the liveness analysis fits, its step's predicted time once per micro-batch,
or the step measured in those micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Union

import tensorflow as tf

from tf_ucudnn.core.units import MIB
from tf_ucudnn.keras.accumulated_step import (
    AccumulationError,
    AccumulationPlan,
    compiled_step_peak,
    plan_accumulation,
    train_step_trace,
)
from tf_ucudnn.keras.planned_step import plan_keras_step
from tf_ucudnn.keras.strategies.accumulation import AccumulatedSteps
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.step_plan import (
    MemoryPlan,
    plan_step_memory,
)
from tf_ucudnn.options import KerasOptions, OptionsError, Size


@dataclasses.dataclass(frozen=True)
class BatchTrial:
    batch_size: int
    images_per_second: Optional[float]  # None: the budget cannot be met
    step_ms: Optional[float]
    peak_bytes: int  # predicted with the plan, or without one when it cannot fit
    reason: str = ""
    prefix_end: Optional[str] = None  # the layers run in micro-batches, if any
    micro_batches: int = 1
    # The whole step in micro-batches of this size, the gradients summed, if so planned.
    accumulated_micro_batch: Optional[int] = None


@dataclasses.dataclass
class TuningReport:
    budget_bytes: int
    trials: list[BatchTrial]
    best: Optional[BatchTrial]
    plan: Union[MemoryPlan, AccumulationPlan, None]  # the best batch's
    accumulation_refused: Optional[str] = None  # why the steps were not micro-batched whole

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes,
                "trials": [dataclasses.asdict(t) for t in self.trials],
                "best": dataclasses.asdict(self.best) if self.best else None,
                "plan": self.plan.to_json() if self.plan else None,
                "accumulation_refused": self.accumulation_refused}

    def to_text(self) -> str:
        lines = [f"batch-size tuning under {self.budget_bytes / MIB:.1f} MiB"]
        for trial in self.trials:
            lines.append(f"  batch {trial.batch_size}: " + (
                f"{trial.images_per_second:.1f} img/s predicted ({trial.step_ms:.3f} ms/step, "
                f"peak {trial.peak_bytes / MIB:.1f} MiB"
                + (f", up to {trial.prefix_end} in {trial.micro_batches} micro-batches"
                   if trial.prefix_end else "")
                + (f", {trial.micro_batches} micro-batches of {trial.accumulated_micro_batch}, "
                   "gradients summed" if trial.accumulated_micro_batch
                   and trial.micro_batches > 1 else "")
                + ")" if trial.images_per_second
                else f"does not fit: {trial.reason}"))
        lines.append(f"best: batch {self.best.batch_size}" if self.best else
                     "no batch size fits the budget")
        return "\n".join(lines)


def tune_batch_size(step_for: Callable[[int], object], batch_sizes: Iterable[int],
                    budget_bytes: int, device_model: DeviceModel,
                    measured_ms: Optional[Callable[[int], dict]] = None) -> TuningReport:
    """Plans each batch size's step (`step_for(batch)`, a ConcreteFunction) under the budget and
    picks the most images per second; `measured_ms(batch)` may give measured op times."""
    return _tune(_memory_planned(lambda batch: (
        plan_step_memory(step_for(batch), budget_bytes, device_model,
                         measured_ms(batch) if measured_ms else None), {})),
        batch_sizes, budget_bytes)


def tune_keras_batch_size(keras_model: tf.keras.Model, batch_sizes: Iterable[int],
                          memory_budget: Size = None, device_model: Optional[DeviceModel] = None,
                          *, options: Optional[KerasOptions] = None,
                          step_ms: Optional[Callable[[int, int], float]] = None,
                          **overrides) -> TuningReport:
    """`tune_batch_size` for a Keras model, each batch planned as `MicroBatchCallback` would
    train it under the budget (`memory_budget`, else the options'), with the same `options` and
    keyword `overrides` (accumulate_gradients, batch_norm_statistics, fuse_batch_norm,
    micro_batches, whole_batches, stream_conv_batch_norm): where the compiled model allows it,
    the whole step in micro-batches, timed as the micro-batch's predicted step once per
    micro-batch; otherwise by `plan_keras_step` (its first layers in micro-batches where nothing
    else fits, as each trial records). `device_model`: measured on the GPU if not given.

    `step_ms(batch, micro_batch_size)`, where given, measures instead: the step of `batch`
    samples as the callback trains it, in micro-batches of `micro_batch_size` where that is
    smaller (their gradients summed, one update), as `MeasuredStep` does; the op-time model
    describes TensorFlow's graph, and a step XLA compiles wants measuring. Without micro-batches
    of the whole step it calibrates the op times (`step_ms(batch, batch)`). A measurement that
    fails (out of memory) makes its trial one that does not fit, with the error as the reason."""
    if memory_budget is not None:
        overrides["memory_budget"] = memory_budget
    options = KerasOptions.resolve(options, **overrides)
    if options.memory_budget is None:
        raise OptionsError("memory_budget: the tuner plans each batch under a memory budget; "
                           "none was given")
    budget_bytes = options.memory_budget
    device_model = device_model or DeviceModel.measure()
    refused = AccumulatedSteps.refusal(keras_model, options)
    if refused is None:
        return _tune(_accumulated(keras_model, budget_bytes, device_model, step_ms,
                                  options.batch_norm_statistics), batch_sizes, budget_bytes)

    def plan(batch):
        _, chosen = plan_keras_step(keras_model, batch, budget_bytes, device_model,
                                    step_ms(batch, batch) if step_ms else None,
                                    options.batch_norm_kernel or False, options.micro_batches,
                                    stream_conv_batch_norm=options.stream_conv_batch_norm,
                                    whole_batches=options.whole_batches)
        return chosen.plan, {"prefix_end": chosen.prefix_end,
                             "micro_batches": chosen.micro_batches}
    report = _tune(_memory_planned(plan), batch_sizes, budget_bytes)
    report.accumulation_refused = refused
    return report


def _memory_planned(plan_for):
    """The trial of each batch whose step `plan_for(batch)` plans with swaps and recomputations
    (a MemoryPlan and what else the trial records), and its plan if it fits."""
    def trial_for(batch):
        try:
            plan, details = plan_for(batch)
        except BudgetError as error:
            return BatchTrial(batch, None, None, error.prediction.peak_bytes, str(error)), None
        prediction = plan.decisions.prediction
        return BatchTrial(batch, batch / prediction.step_ms * 1e3, prediction.step_ms,
                          prediction.peak_bytes, **details), plan
    return trial_for


def _accumulated(keras_model: tf.keras.Model, budget_bytes: int, device_model: DeviceModel,
                 step_ms: Optional[Callable[[int, int], float]], batch_norm_statistics: str):
    """The trial of each batch with the whole step in micro-batches, as the callback plans it,
    and its plan if it fits."""
    shape = keras_model.input_shape[1:]

    def specs(batch):
        return tf.TensorSpec([batch, *shape]), tf.TensorSpec([batch], tf.int32)

    def trial_for(batch):
        trace = train_step_trace(keras_model, specs(batch))
        try:
            plan = plan_accumulation(keras_model, batch, budget_bytes, trace,
                                     batch_norm_statistics,
                                     compiled_step_peak(keras_model, specs(batch)))
        except AccumulationError as error:
            return BatchTrial(batch, None, None, error.predicted_peak_bytes or 0,
                              str(error)), None
        size = plan.micro_batch_size
        peak = (plan.predicted_peak_bytes if plan.compiled_peak_bytes is None
                else plan.compiled_peak_bytes)
        if step_ms is None:
            total_ms = plan.micro_batches * plan_step_memory(
                trace(size), 1 << 62, device_model).decisions.prediction.step_ms
        else:
            try:
                total_ms = step_ms(batch, size)
            except tf.errors.ResourceExhaustedError as error:
                return BatchTrial(batch, None, None, peak,
                                  f"its step, measured in micro-batches of {size}, ran out of "
                                  f"memory: {error.message.splitlines()[0][:300]}"), None
        return BatchTrial(batch, batch / total_ms * 1e3, total_ms, peak,
                          micro_batches=plan.micro_batches, accumulated_micro_batch=size), plan
    return trial_for


def _tune(trial_for, batch_sizes: Iterable[int], budget_bytes: int) -> TuningReport:
    """`trial_for(batch)` of each batch size (its trial, and its plan where it fits) and the
    best of them."""
    trials, best, best_plan = [], None, None
    for batch in sorted(set(batch_sizes)):
        trial, plan = trial_for(batch)
        trials.append(trial)
        if plan is not None and (best is None
                                 or trial.images_per_second > best.images_per_second):
            best, best_plan = trial, plan
    return TuningReport(budget_bytes, trials, best, best_plan)
