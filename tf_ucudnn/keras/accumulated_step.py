"""The whole training step in micro-batches: each micro-batch runs the model's own train_step
(forward pass, loss, gradients), the gradients are summed, and the optimizer updates the weights
once. This is μ-cuDNN's division along the batch, taken from one convolution to the whole step.

For a model whose layers treat each sample on its own (no normalization by batch statistics) and
a loss averaged over the batch, the summed gradient is the whole batch's and the metrics count
each sample once, while the device holds one micro-batch's activations. Under XLA the
micro-batches are one loop in one compiled step, so the step keeps XLA's speed at a batch that
does not fit whole. The micro-batch size is the largest whose step the liveness analysis
predicts under the budget and, for a model Keras compiles with XLA, whose compiled step XLA's own
buffer assignment puts under it too (`compiled_peak`): XLA's buffers are not TensorFlow's, and an
XLA step over the memory aborts the process under TensorFlow's default allocator. A GPU's
measured peak can still ask for a smaller one (`smaller_after_measuring`).

A model with batch normalization gets a different update in micro-batches, so it is refused,
unless the user asks for each micro-batch to be normalized by its own statistics
(`batch_norm_statistics="micro_batch"`: ghost batch normalization, Hoffer et al. 2017), as
large-batch training often does on purpose. The moving statistics are then updated once per
micro-batch, as each micro-batch is a batch to the layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.step_memory_plan import StepMemoryPlan
from tf_ucudnn.core.units import format_bytes
from tf_ucudnn.keras.micro_batched_prefix import batch_dependent_layers
from tf_ucudnn.memory.analysis.compiled_buffers import CompiledBuffersError, compiled_buffers
from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.options import KerasOptions

_MEAN_OVER_BATCH = ("sum_over_batch_size", "mean", None)


class AccumulationError(TfUcudnnError, ValueError):
    """The step cannot be micro-batched under the budget; says why (and, where one sample's
    step was predicted, its peak)."""

    def __init__(self, message: str, predicted_peak_bytes: Optional[int] = None):
        super().__init__(message)
        self.predicted_peak_bytes = predicted_peak_bytes


def normalized_per_micro_batch(model: tf.keras.Model, batch_norm_statistics: str) -> list:
    """The layers that normalize by each micro-batch's statistics in micro-batches, for
    `batch_norm_statistics` as KerasOptions takes it (which names any other value an error)."""
    KerasOptions(batch_norm_statistics=batch_norm_statistics)
    if batch_norm_statistics == "batch":
        return []
    return [layer for layer in batch_dependent_layers(model)
            if isinstance(layer, tf.keras.layers.BatchNormalization)]


def accumulation_refusal(model: tf.keras.Model,
                         batch_norm_statistics: str = "batch") -> Optional[str]:
    """Why `model`'s step in micro-batches would not compute the whole batch's update (or, with
    `batch_norm_statistics="micro_batch"`, that update with each batch normalization taking its
    micro-batch's statistics), or None."""
    per_micro_batch = normalized_per_micro_batch(model, batch_norm_statistics)
    dependent = [layer for layer in batch_dependent_layers(model)
                 if layer not in per_micro_batch]
    if dependent:
        more = f" (and {len(dependent) - 1} more)" if len(dependent) > 1 else ""
        hint = ("; batch_norm_statistics='micro_batch' normalizes each micro-batch by its own "
                "statistics instead" if isinstance(dependent[0],
                                                   tf.keras.layers.BatchNormalization) else "")
        return (f"{dependent[0].name}{more}: {type(dependent[0]).__name__} normalizes each "
                f"sample with statistics of the whole batch{hint}")
    if getattr(model, "optimizer", None) is None:
        return "the model is not compiled with an optimizer"
    for loss in tf.nest.flatten(getattr(model, "loss", None)):
        reduction = getattr(loss, "reduction", None)
        if reduction not in _MEAN_OVER_BATCH:
            return (f"its loss {getattr(loss, 'name', loss)!r} is reduced by {reduction!r}: only a "
                    "loss averaged over the batch sums to the whole batch's from micro-batches")
    return None


def micro_batch_count(batch: int, largest: int) -> int:
    """The fewest equal micro-batches, each of at most `largest` samples, that `batch` divides
    into (one loop of one compiled shape)."""
    return next(count for count in range(1, batch + 1)
                if batch % count == 0 and batch // count <= largest)


@dataclasses.dataclass
class AccumulationPlan(StepMemoryPlan):
    """A step of `batch` samples in micro-batches of `micro_batch_size`, its peak predicted by
    the liveness analysis and, for an XLA step, by XLA's buffer assignment (and measured, once a
    step has run on a GPU), and the sizes passed over with why."""

    batch: int
    micro_batch_size: int
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: Optional[int] = None
    compiled_peak_bytes: Optional[int] = None  # XLA's buffers for the step, where XLA runs it
    compiled_peak_unread: Optional[str] = None  # why XLA's buffers could not be read, if so
    passed_over: list[str] = dataclasses.field(default_factory=list)
    # Layers normalizing by each micro-batch's statistics, not the whole batch's.
    normalized_per_micro_batch: list[str] = dataclasses.field(default_factory=list)

    kind = "micro_batched_step"

    @property
    def micro_batches(self) -> int:
        return self.batch // self.micro_batch_size

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"kind": self.kind, "micro_batches": self.micro_batches}

    def to_text(self) -> str:
        compiled = ("" if self.compiled_peak_bytes is None else
                    f", XLA's buffers {format_bytes(self.compiled_peak_bytes)}")
        measured = ("" if self.measured_peak_bytes is None else
                    f", measured {format_bytes(self.measured_peak_bytes)}")
        lines = [f"tf_ucudnn: the step of {self.batch} in {self.micro_batches} micro-batch(es) of "
                 f"{self.micro_batch_size}, gradients summed: peak predicted "
                 f"{format_bytes(self.predicted_peak_bytes)}{compiled}{measured} under a budget "
                 f"of {format_bytes(self.budget_bytes)}"]
        if self.compiled_peak_unread:
            lines.append(f"  XLA's buffers not read: {self.compiled_peak_unread}")
        if self.normalized_per_micro_batch and self.micro_batches > 1:
            names = self.normalized_per_micro_batch
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            lines.append(f"  batch normalization by each micro-batch's statistics: "
                         f"{', '.join(names[:3])}{more}")
        return "\n".join(lines + [f"  passed over: {why}" for why in self.passed_over])


def plan_accumulation(model: tf.keras.Model, batch: int, budget_bytes: int,
                      trace: Callable[[int], object],
                      batch_norm_statistics: str = "batch",
                      compiled_peak: Optional[Callable[[int], int]] = None) -> AccumulationPlan:
    """The largest micro-batch size that divides `batch` and whose step (`trace(size)`, a
    ConcreteFunction of the model's own train step at that batch) the liveness analysis
    predicts under `budget_bytes` with the gradients' sums beside it, and, where given,
    `compiled_peak(size)` (the whole accumulated step's peak as XLA compiles it) puts under it
    too; where XLA cannot give that (CompiledBuffersError), the plan says why. AccumulationError
    if even one sample does not fit. `batch_norm_statistics` as in `accumulation_refusal`."""
    per_micro_batch = [layer.name for layer in
                       normalized_per_micro_batch(model, batch_norm_statistics)]
    sums = sum(int(np.prod(w.shape)) * tf.as_dtype(w.dtype).size
               for w in model.trainable_weights)
    passed_over = []
    unread = None
    size = batch
    while True:
        report = analyze(trace(size))
        predicted = report.peak_bytes + report.persistent_bytes + (sums if size < batch else 0)
        compiled = None
        if predicted <= budget_bytes:
            if compiled_peak is not None:
                try:
                    compiled = compiled_peak(size)
                except CompiledBuffersError as error:
                    # The first step's check is left: out of memory, or a measured peak.
                    compiled_peak, unread = None, str(error)
            if compiled is None or compiled <= budget_bytes:
                return AccumulationPlan(batch, size, budget_bytes, predicted,
                                        compiled_peak_bytes=compiled,
                                        compiled_peak_unread=unread, passed_over=passed_over,
                                        normalized_per_micro_batch=per_micro_batch)
            passed_over.append(f"micro-batches of {size}: predicted {format_bytes(predicted)}, "
                               f"XLA's buffers {format_bytes(compiled)}")
            # XLA's buffers scale with the micro-batch; a smaller step is checked again.
            estimate = int(size * budget_bytes / compiled)
        else:
            passed_over.append(f"micro-batches of {size}: predicted {format_bytes(predicted)}")
            # The activations scale with the micro-batch; the variables and the sums do not.
            fixed = report.persistent_bytes + sums
            per_sample = max(predicted - fixed, 1) / size
            estimate = int((budget_bytes - fixed) // per_sample)
        if size == 1:
            xla = "" if compiled is None else " in XLA's buffers"
            raise AccumulationError(
                f"{model.name}: even one sample at a time is predicted to need "
                f"{format_bytes(max(predicted, compiled or 0))}{xla}, over the budget of "
                f"{format_bytes(budget_bytes)}", max(predicted, compiled or 0))
        size = batch // micro_batch_count(batch, min(max(estimate, 1), size - 1))


def train_step_trace(model: tf.keras.Model, specs) -> Callable[[int], object]:
    """`trace(size)` for `plan_accumulation`: the model's own train step traced over `specs` (one
    batch's TensorSpecs) with that batch cut to `size` samples."""
    batch = tf.nest.flatten(specs)[0].shape[0]

    def trace(size: int):
        def resized(spec):
            if spec.shape.rank and spec.shape[0] == batch:
                return tf.TensorSpec([size, *spec.shape[1:]], spec.dtype)
            return spec
        return tf.function(model.train_step).get_concrete_function(
            tf.nest.map_structure(resized, specs))
    return trace


def compiled_step_peak(model: tf.keras.Model, specs) -> Optional[Callable[[int], int]]:
    """For a model Keras compiles with XLA (`model.jit_compile`): the peak of its step over a
    batch of `specs` (TensorSpecs of one batch) in micro-batches of a given size, from XLA's
    buffer assignment of that step, compiled for the device it will run on. None for a model
    that runs without XLA."""
    if not getattr(model, "jit_compile", False):
        return None

    def peak(size: int) -> int:
        return compiled_buffers(accumulated_train_step(model, size), specs).peak_bytes
    return peak


def smaller_after_measuring(plan: AccumulationPlan, measured_peak_bytes: int) -> Optional[int]:
    """After a step measured `measured_peak_bytes`: the micro-batch size to train with, if the
    plan's is over the budget (scaled by how far the measurement is above the budget), or None
    if it fits. AccumulationError if no smaller size is left."""
    plan.measured_peak_bytes = measured_peak_bytes
    if measured_peak_bytes <= plan.budget_bytes:
        return None
    return _smaller(plan, plan.budget_bytes / measured_peak_bytes,
                    f"measured {format_bytes(measured_peak_bytes)}")


def smaller_after_running_out(plan: AccumulationPlan, error: str) -> int:
    """After a step ran out of memory (`error`, the message's first line): half the micro-batch
    size, or the next that divides the batch. AccumulationError if no smaller size is left."""
    return _smaller(plan, 0.5, error)


def _smaller(plan: AccumulationPlan, scale: float, why: str) -> int:
    plan.passed_over.append(f"micro-batches of {plan.micro_batch_size}: {why}")
    if plan.micro_batch_size == 1:
        raise AccumulationError(f"one sample at a time: {why}, over the budget of "
                                f"{format_bytes(plan.budget_bytes)}")
    target = min(int(plan.micro_batch_size * scale), plan.micro_batch_size - 1)
    size = plan.batch // micro_batch_count(plan.batch, max(target, 1))
    plan.micro_batch_size, plan.measured_peak_bytes, plan.compiled_peak_bytes = size, None, None
    return size


def train_first_batch(plan: AccumulationPlan, data, train: Callable, smaller: Callable[[int], None],
                      verbose: int = 0):
    """Trains the first batch (`train([data])`) with the plan's micro-batches. Out of memory
    (XLA takes its buffers in one allocation before it runs anything, so nothing trained), the
    micro-batch is halved (`smaller(size)` makes the step again) and the batch trained again.
    On a GPU, a measured peak over the budget then scales the micro-batch down for the steps
    after it: the analysis is of TensorFlow's graph, not of XLA's buffers."""
    gpus = tf.config.list_logical_devices("GPU")
    while True:
        if gpus:
            tf.config.experimental.reset_memory_stats(gpus[0].name)
        try:
            logs = train([data])
            break
        except tf.errors.ResourceExhaustedError as error:
            size = smaller_after_running_out(plan, str(error).strip().splitlines()[0])
            if verbose:
                print(f"{plan.passed_over[-1]}; micro-batches of {size}", flush=True)
            smaller(size)
    if gpus:
        size = smaller_after_measuring(
            plan, tf.config.experimental.get_memory_info(gpus[0].name)["peak"])
        if size is not None:
            if verbose:
                print(f"{plan.passed_over[-1]}: over the budget; micro-batches of {size} from "
                      "now on", flush=True)
            smaller(size)
    return logs


def accumulated_train_step(model: tf.keras.Model, micro_batch_size: int):
    """`model`'s own train_step, run over micro-batches of at most `micro_batch_size` samples in
    one loop, with the optimizer's update made once from the summed gradients."""
    own_step = type(model).train_step.__get__(model)
    optimizer = model.optimizer

    def gradients_of(piece):
        """Runs the model's own step on `piece`, handing back the gradients it would apply."""
        caught = []
        optimizer.__dict__["apply_gradients"] = lambda pairs, *args, **kwargs: caught.extend(pairs)
        try:
            own_step(piece)
        finally:
            optimizer.__dict__.pop("apply_gradients", None)
        return [tf.convert_to_tensor(g) if g is not None else tf.zeros(w.shape, w.dtype)
                for g, w in caught]

    def train_step(data):
        leading = next(t for t in tf.nest.flatten(data) if t is not None)
        batch = leading.shape[0]
        if batch is not None:  # known while tracing: so are the micro-batches
            if batch <= micro_batch_size:
                return own_step(data)
            count = micro_batch_count(batch, micro_batch_size)
            size = batch // count
        else:  # a dataset whose last batch may be partial: sizes XLA still finds constant
            batch = tf.shape(leading)[0]
            candidates = tf.range(1, micro_batch_size + 1)
            size = tf.reduce_max(tf.where(batch % candidates == 0, candidates, 1))
            count = batch // size
        weights = model.trainable_weights

        def piece_of(t, i):
            if t is None or t.shape.rank == 0 or (isinstance(batch, int) and t.shape[0] != batch):
                return t
            return tf.reshape(t, tf.concat([[count, size], tf.shape(t)[1:]], 0))[i]

        def body(i, sums):
            piece = tf.nest.map_structure(lambda t: piece_of(t, i), data)
            grads = gradients_of(piece)
            return i + 1, [s + g / tf.cast(count, g.dtype) for s, g in zip(sums, grads)]

        _, sums = tf.while_loop(
            lambda i, _: i < count, body,
            (tf.constant(0), [tf.zeros(w.shape, w.dtype) for w in weights]),
            parallel_iterations=1)
        optimizer.apply_gradients(zip(sums, weights))
        return model.get_metrics_result()
    return train_step


@contextlib.contextmanager
def accumulating(model: tf.keras.Model, micro_batch_size: int):
    """Within the block, the model trains (`model.train_step`) in micro-batches of at most
    `micro_batch_size`. Keras's train function made before is dropped on entry and on exit, so
    that `fit` makes it again with the step in force."""
    model.__dict__["train_step"] = accumulated_train_step(model, micro_batch_size)
    model.train_function = None
    try:
        yield
    finally:
        model.__dict__.pop("train_step", None)
        model.train_function = None
