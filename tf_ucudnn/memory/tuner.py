"""The batch-size tuner (AccUDNN's): for a model and a memory budget, the batch size with the most
predicted images per second, with its memory plan.

Each candidate batch size's training step is traced and planned; a batch whose step cannot fit the
budget is reported with the shortfall, not dropped silently.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Iterable, Optional

import tensorflow as tf

from tf_ucudnn.batch_norm_fusion import fused_batch_norm
from tf_ucudnn.memory.performance_model import BudgetError, DeviceModel
from tf_ucudnn.memory.planner import MemoryPlan, plan_step_memory

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BatchTrial:
    batch_size: int
    images_per_second: Optional[float]  # None: the budget cannot be met
    step_ms: Optional[float]
    peak_bytes: int  # predicted with the plan, or without one when it cannot fit
    reason: str = ""


@dataclasses.dataclass
class TuningReport:
    budget_bytes: int
    trials: list[BatchTrial]
    best: Optional[BatchTrial]
    plan: Optional[MemoryPlan]  # the best batch's

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes,
                "trials": [dataclasses.asdict(t) for t in self.trials],
                "best": dataclasses.asdict(self.best) if self.best else None,
                "plan": self.plan.to_json() if self.plan else None}

    def to_text(self) -> str:
        lines = [f"batch-size tuning under {self.budget_bytes / MIB:.1f} MiB"]
        for trial in self.trials:
            lines.append(f"  batch {trial.batch_size}: " + (
                f"{trial.images_per_second:.1f} img/s predicted ({trial.step_ms:.3f} ms/step, "
                f"peak {trial.peak_bytes / MIB:.1f} MiB)" if trial.images_per_second
                else f"does not fit: {trial.reason}"))
        lines.append(f"best: batch {self.best.batch_size}" if self.best else
                     "no batch size fits the budget")
        return "\n".join(lines)


def keras_training_step(model: tf.keras.Model, batch_size: int, loss=None, optimizer=None,
                        fuse_batch_norm: bool = False):
    """A model's training step (loss, gradients, optimizer update) for one batch size, traced;
    with `fuse_batch_norm`, its batch normalization layers traced as fused kernels (a warning
    names each layer left unfused, and why)."""
    loss = loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = optimizer or tf.keras.optimizers.SGD(0.01)
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(value, variables), variables))
        return value

    specs = (tf.TensorSpec([batch_size, *model.input_shape[1:]]),
             tf.TensorSpec([batch_size], tf.int32))
    if not fuse_batch_norm:
        return step.get_concrete_function(*specs)
    with fused_batch_norm(model) as left_alone:
        for unfused in left_alone:
            warnings.warn(f"{unfused.layer}: batch normalization left unfused: {unfused.reason}")
        return step.get_concrete_function(*specs)


def tune_batch_size(step_for: Callable[[int], object], batch_sizes: Iterable[int],
                    budget_bytes: int, model: DeviceModel,
                    measured_ms: Optional[Callable[[int], dict]] = None) -> TuningReport:
    """Plans each batch size's step (`step_for(batch)`, a ConcreteFunction) under the budget and
    picks the most images per second; `measured_ms(batch)` may give measured op times."""
    trials, best, best_plan = [], None, None
    for batch in sorted(set(batch_sizes)):
        step = step_for(batch)
        try:
            plan = plan_step_memory(step, budget_bytes, model,
                                    measured_ms(batch) if measured_ms else None)
        except BudgetError as error:
            trials.append(BatchTrial(batch, None, None, error.prediction.peak_bytes, str(error)))
            continue
        prediction = plan.decisions.prediction
        trial = BatchTrial(batch, batch / prediction.step_ms * 1e3, prediction.step_ms,
                           prediction.peak_bytes)
        trials.append(trial)
        if best is None or trial.images_per_second > best.images_per_second:
            best, best_plan = trial, plan
    return TuningReport(budget_bytes, trials, best, best_plan)
