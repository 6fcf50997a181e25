"""The batch-size tuner (AccUDNN's): for a model and a memory budget, the batch size with the most
predicted images per second, with its memory plan.

Each candidate batch size's training step is traced and planned; a batch whose step cannot fit the
budget is reported with the shortfall, not dropped silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable, Iterable, Optional, Union

import tensorflow as tf

from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.keras.batch_norm_forms import fused_batch_norm, kernel_name
from tf_ucudnn.keras.microbatched_prefix import cut, microbatched_model_call
from tf_ucudnn.keras.streamed_conv_bn import streamed_conv_batch_norm
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.step_plan import (
    MemoryPlan,
    apply_memory_plan,
    plan_step_memory,
    plan_with_micro_batches,
)

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BatchTrial:
    batch_size: int
    images_per_second: Optional[float]  # None: the budget cannot be met
    step_ms: Optional[float]
    peak_bytes: int  # predicted with the plan, or without one when it cannot fit
    reason: str = ""
    micro_batched_until: Optional[str] = None  # the layers run in micro-batches, if any
    micro_batches: int = 1


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
                f"peak {trial.peak_bytes / MIB:.1f} MiB"
                + (f", up to {trial.micro_batched_until} in {trial.micro_batches} micro-batches"
                   if trial.micro_batched_until else "") + ")" if trial.images_per_second
                else f"does not fit: {trial.reason}"))
        lines.append(f"best: batch {self.best.batch_size}" if self.best else
                     "no batch size fits the budget")
        return "\n".join(lines)


def keras_training_step(model: tf.keras.Model, batch_size: int, loss=None, optimizer=None,
                        fuse_batch_norm: Union[bool, str] = False,
                        micro_batched_until: Optional[str] = None, micro_batches: int = 1,
                        stream_conv_batch_norm: int = 0):
    """A model's training step (loss, gradients, optimizer update) for one batch size, traced;
    with `fuse_batch_norm` (True or "cudnn", "xla", "ucudnn"), its batch normalization layers
    traced as fused kernels (`tf_ucudnn.keras.batch_norm_forms`; a warning names each layer left
    unfused, and why); with `micro_batched_until`, the layers up to that one run in
    `micro_batches` micro-batches, made again for the backward pass
    (`tf_ucudnn.keras.microbatched_prefix`); with `stream_conv_batch_norm` (a count of
    micro-batches, 0 for none), each convolution and the batch normalization reading it train
    as one op whose backward is streamed in that many micro-batches
    (`tf_ucudnn.keras.streamed_conv_bn`; one warning names the layers not paired, and why), the
    other batch normalizations as `fuse_batch_norm` says."""
    loss = loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = optimizer or tf.keras.optimizers.SGD(0.01)
    variables = model.trainable_variables
    optimizer.build(variables)
    forward = (microbatched_model_call(cut(model, micro_batched_until), micro_batches)
               if micro_batched_until else lambda x: model(x, training=True))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, forward(x))
        optimizer.apply_gradients(zip(tape.gradient(value, variables), variables))
        return value

    specs = (tf.TensorSpec([batch_size, *model.input_shape[1:]]),
             tf.TensorSpec([batch_size], tf.int32))
    kernel = kernel_name(fuse_batch_norm)
    with contextlib.ExitStack() as switched:
        if kernel is not None:
            for unfused in switched.enter_context(fused_batch_norm(model, kernel)):
                warnings.warn(f"{unfused.layer}: batch normalization left unfused: "
                              f"{unfused.reason}")
        if stream_conv_batch_norm:
            unpaired = switched.enter_context(
                streamed_conv_batch_norm(model, stream_conv_batch_norm))
            if unpaired:  # one warning: in ResNet-50, by design, most layers
                warnings.warn(f"{len(unpaired)} layer(s) not streamed with a convolution: "
                              + "; ".join(f"{u.layer}: {u.reason}" for u in unpaired))
        return step.get_concrete_function(*specs)


def tune_batch_size(step_for: Callable[[int], object], batch_sizes: Iterable[int],
                    budget_bytes: int, model: DeviceModel,
                    measured_ms: Optional[Callable[[int], dict]] = None) -> TuningReport:
    """Plans each batch size's step (`step_for(batch)`, a ConcreteFunction) under the budget and
    picks the most images per second; `measured_ms(batch)` may give measured op times."""
    return _tune(lambda batch: (plan_step_memory(step_for(batch), budget_bytes, model,
                                                 measured_ms(batch) if measured_ms else None),
                                {}), batch_sizes, budget_bytes)


def tune_keras_batch_size(keras_model: tf.keras.Model, batch_sizes: Iterable[int],
                          budget_bytes: int, model: DeviceModel,
                          step_ms: Optional[Callable[[int], float]] = None,
                          fuse_batch_norm: Union[bool, str] = False,
                          micro_batches: Iterable[int] = (4, 8)) -> TuningReport:
    """`tune_batch_size` for a Keras model, each batch planned by `plan_keras_step` (its first
    layers in micro-batches where nothing else fits, as each trial records); `step_ms(batch)`
    may give the measured step time without a plan, to calibrate the op times."""
    def plan(batch):
        _, chosen = plan_keras_step(keras_model, batch, budget_bytes, model,
                                    step_ms(batch) if step_ms else None, fuse_batch_norm,
                                    micro_batches)
        return chosen.plan, {"micro_batched_until": chosen.micro_batched_until,
                             "micro_batches": chosen.micro_batches}
    return _tune(plan, batch_sizes, budget_bytes)


def _tune(plan_for, batch_sizes: Iterable[int], budget_bytes: int) -> TuningReport:
    """The trials of `plan_for(batch)` (a MemoryPlan and what else the trial records) and the
    best of them."""
    trials, best, best_plan = [], None, None
    for batch in sorted(set(batch_sizes)):
        try:
            plan, details = plan_for(batch)
        except BudgetError as error:
            trials.append(BatchTrial(batch, None, None, error.prediction.peak_bytes, str(error)))
            continue
        prediction = plan.decisions.prediction
        trial = BatchTrial(batch, batch / prediction.step_ms * 1e3, prediction.step_ms,
                           prediction.peak_bytes, **details)
        trials.append(trial)
        if best is None or trial.images_per_second > best.images_per_second:
            best, best_plan = trial, plan
    return TuningReport(budget_bytes, trials, best, best_plan)


@dataclasses.dataclass
class KerasStepPlan:
    """A Keras model's training step planned under a budget: its memory plan, the layers run in
    micro-batches (none if the plan fits without), and every choice tried before, with why it
    was passed over."""

    plan: MemoryPlan
    micro_batched_until: Optional[str]
    micro_batches: int
    passed_over: list[str]

    def to_json(self) -> dict:
        return {"micro_batched_until": self.micro_batched_until,
                "micro_batches": self.micro_batches, "passed_over": self.passed_over,
                "plan": self.plan.to_json()}


def plan_keras_step(model: tf.keras.Model, batch_size: int, budget_bytes: int,
                    device_model: DeviceModel, step_ms: Optional[float] = None,
                    fuse_batch_norm: Union[bool, str] = False,
                    micro_batches: Iterable[int] = (4, 8), cuts: Optional[Iterable[str]] = None,
                    trace: Optional[Callable[[Optional[str], int], object]] = None,
                    stream_conv_batch_norm: int = 0, whole_batches: bool = True):
    """The training step of `model` at `batch_size`, planned to fit `budget_bytes`, as a
    tf.function with its KerasStepPlan. The step's swaps and recomputations are planned first;
    if no such plan fits, the model's first layers run in micro-batches too: cut after the
    shallowest layer of `cuts` (default: the poolings) at which the plan fits, in whichever of
    `micro_batches` gives the shortest predicted step. BudgetError, with the smallest
    shortfall, if nothing fits; its message lists what was tried. `trace(layer, count)` gives
    the step to plan (a ConcreteFunction), the layers up to `layer` in `count` micro-batches
    (`layer` None: whole batches); by default `keras_training_step`'s, with
    `stream_conv_batch_norm` as it takes it. Without `whole_batches`, only the cuts are tried:
    the first layers' largest tensors are then never whole on the device, where a plan in whole
    batches may fit its budget and still leave the allocator no free chunk large enough for
    them (as a ResNet's stem tensors at large batches)."""
    def traced(layer: Optional[str], count: int):
        return (trace(layer, count) if trace is not None else
                keras_training_step(model, batch_size, fuse_batch_norm=fuse_batch_norm,
                                    micro_batched_until=layer, micro_batches=count,
                                    stream_conv_batch_norm=stream_conv_batch_norm))

    found = plan_with_micro_batches(traced, budget_bytes, device_model, step_ms,
                                    _cuts(model, cuts), micro_batches, batch_size, whole_batches)
    return apply_memory_plan(found.step, found.plan), KerasStepPlan(
        found.plan, found.cut, found.micro_batches, found.passed_over)


_POOLINGS = (tf.keras.layers.MaxPooling2D, tf.keras.layers.AveragePooling2D,
             tf.keras.layers.MaxPooling3D, tf.keras.layers.AveragePooling3D)


def _cuts(model: tf.keras.Model, names: Optional[Iterable[str]]):
    """The layers (`names`, or the poolings) to cut the model after, in order, each with None
    where it can be cut there, else the reason."""
    names = list(names) if names is not None else [
        layer.name for layer in model.layers if isinstance(layer, _POOLINGS)]
    for name in names:
        try:
            cut(model, name)
        except PrefixError as error:
            yield name, str(error)
            continue
        yield name, None
