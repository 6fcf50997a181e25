"""A Keras model's training step, traced at one batch size and planned to fit a memory budget:
its swaps and recomputations, and where those are not enough, its first layers in micro-batches.
The callback plans its step with `plan_keras_step` (or `plan_keras_step_with_workspaces`, its
planned kernels' workspaces chosen with it), and the batch-size tuner each candidate's."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable, Iterable, Mapping, Optional, Union

import tensorflow as tf

from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.core.plan import BACKPROP_FILTER, BACKPROP_INPUT, FORWARD
from tf_ucudnn.keras.batch_norm_forms import fused_batch_norm
from tf_ucudnn.keras.micro_batched_prefix import cut, micro_batched_model_call
from tf_ucudnn.keras.models import outputs_probabilities
from tf_ucudnn.keras.streamed_conv_bn import streamed_conv_batch_norm
from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.prefix_search import plan_with_micro_batches
from tf_ucudnn.memory.search.step_plan import MemoryPlan, apply_memory_plan
from tf_ucudnn.memory.search.workspace_choice import StepOutcome, WorkspacePlan, choose_workspaces
from tf_ucudnn.options import DEFAULT_MICRO_BATCHES, KerasOptions


def keras_training_step(model: tf.keras.Model, batch_size: int, loss=None, optimizer=None,
                        fuse_batch_norm: Union[bool, str] = False,
                        prefix_end: Optional[str] = None, micro_batches: int = 1,
                        stream_conv_batch_norm: int = 0):
    """A model's training step (loss, gradients, optimizer update) for one batch size, traced;
    with `fuse_batch_norm` (True or "cudnn", "xla", "ucudnn"), its batch normalization layers
    traced as fused kernels (`tf_ucudnn.keras.batch_norm_forms`; a warning names each layer left
    unfused, and why); with `prefix_end`, the layers up to that one run in
    `micro_batches` micro-batches, made again for the backward pass
    (`tf_ucudnn.keras.micro_batched_prefix`); with `stream_conv_batch_norm` (a count of
    micro-batches, 0 for none), each convolution and the batch normalization reading it train
    as one op whose backward is streamed in that many micro-batches
    (`tf_ucudnn.keras.streamed_conv_bn`; one warning names the layers not paired, and why), the
    other batch normalizations as `fuse_batch_norm` says."""
    # Keras's TensorFlow backend reads a softmax's logits either way: only the warning differs.
    loss = loss or tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=not outputs_probabilities(model))
    optimizer = optimizer or tf.keras.optimizers.SGD(0.01)
    variables = model.trainable_variables
    optimizer.build(variables)
    forward = (micro_batched_model_call(cut(model, prefix_end), micro_batches)
               if prefix_end else lambda x: model(x, training=True))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, forward(x))
        optimizer.apply_gradients(zip(tape.gradient(value, variables), variables))
        return value

    specs = (tf.TensorSpec([batch_size, *model.input_shape[1:]]),
             tf.TensorSpec([batch_size], tf.int32))
    kernel = KerasOptions(fuse_batch_norm=fuse_batch_norm).batch_norm_kernel
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


@dataclasses.dataclass
class KerasStepPlan:
    """A Keras model's training step planned under a budget: its memory plan, the layers run in
    micro-batches (none if the plan fits without), and every choice tried before, with why it
    was passed over."""

    plan: MemoryPlan
    prefix_end: Optional[str]
    micro_batches: int
    passed_over: list[str]

    def to_json(self) -> dict:
        return {"prefix_end": self.prefix_end,
                "micro_batches": self.micro_batches, "passed_over": self.passed_over,
                "plan": self.plan.to_json()}


def plan_keras_step(model: tf.keras.Model, batch_size: int, budget_bytes: int,
                    device_model: DeviceModel, step_ms: Optional[float] = None,
                    fuse_batch_norm: Union[bool, str] = False,
                    micro_batches: Iterable[int] = DEFAULT_MICRO_BATCHES,
                    cuts: Optional[Iterable[str]] = None,
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
                                    prefix_end=layer, micro_batches=count,
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


_KERNEL_OF_OP = {f"UcudnnConv{rank}D{suffix}": kernel for rank in (2, 3) for suffix, kernel in
                 (("", FORWARD), ("BackpropInput", BACKPROP_INPUT),
                  ("BackpropFilter", BACKPROP_FILTER))}


def planned_kernel(graph: tf.Graph, op_name: str, layer_of_op: Mapping[str, str]
                   ) -> Optional[str]:
    """"layer|kernel" for a planned convolution op of a traced step (`layer_of_op` names the
    layer of each planned forward op), else None. A gradient op is its forward op's: the input
    gradient reads the same filters, the filter gradient the same input (and has the filters'
    shape)."""
    op = graph.get_operation_by_name(op_name) if op_name else None
    kernel = _KERNEL_OF_OP.get(op.type) if op is not None else None
    if kernel is None:
        return None
    forwards = [op]
    if kernel == BACKPROP_INPUT:
        forwards = [c for c in op.inputs[1].consumers() if _KERNEL_OF_OP.get(c.type) == FORWARD]
    elif kernel == BACKPROP_FILTER:
        forwards = [c for c in op.inputs[0].consumers() if _KERNEL_OF_OP.get(c.type) == FORWARD
                    and c.inputs[1].shape == op.outputs[0].shape]
    layers = {layer_of_op.get(forward.name) for forward in forwards} - {None}
    return f"{layers.pop()}|{kernel}" if len(layers) == 1 else None


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A training step traced for planning, and the layer of each planned forward op in it."""

    step: object  # a ConcreteFunction
    layer_of_op: Mapping[str, str]


# trace(choice, prefix_end, micro_batches): see plan_keras_step_with_workspaces.
TraceWithKernelPlans = Callable[[Mapping[str, object], Optional[str], int], TracedStep]


def plan_keras_step_with_workspaces(model: tf.keras.Model, batch_size: int, budget_bytes: int,
                                    device_model: DeviceModel, fronts: Mapping[str, list],
                                    trace: TraceWithKernelPlans, *,
                                    micro_batches: Iterable[int] = DEFAULT_MICRO_BATCHES,
                                    whole_batches: bool = True, step_ms: Optional[float] = None,
                                    ) -> tuple[object, KerasStepPlan, WorkspacePlan]:
    """`plan_keras_step` with the planned kernels' workspaces chosen with the memory
    (`tf_ucudnn.memory.search.workspace_choice`): `fronts` gives each "layer|kernel" its Pareto
    front of KernelConfigurations. Returns the planned step, its KerasStepPlan and the
    WorkspacePlan, whose `chosen` the caller gives the layers (the last traced may differ).

    The one callable, `trace(choice, prefix_end, micro_batches)`, belongs to the caller, which
    owns the layers: it plans each "layer|kernel" of `choice` with its KernelConfiguration's plan
    (the layers keep it until the next call) and returns the step traced at `batch_size` as a
    TracedStep, the layers up to `prefix_end` run in `micro_batches` micro-batches (None and 1:
    whole batches)."""
    def plan_for(choice) -> StepOutcome:
        # The op at the peak, found in the step as traced whole (a plan's graph has swapped and
        # recomputed inputs in the way of telling a gradient's layer); the plan starts from it.
        whole = trace(choice, None, 1)
        try:
            step, kept = plan_keras_step(
                model, batch_size, budget_bytes, device_model, step_ms,
                micro_batches=micro_batches, whole_batches=whole_batches,
                trace=lambda layer, count: whole.step if layer is None else
                trace(choice, layer, count).step)
        except BudgetError as error:
            return StepOutcome(None, None, planned_kernel(
                whole.step.graph, analyze(whole.step).peak_op, whole.layer_of_op) or "", error)
        prediction = kept.plan.decisions.prediction
        peak = kept.plan.liveness.ops[prediction.peak_op].name
        found = peak if peak in {op.name for op in whole.step.graph.get_operations()} else None
        return StepOutcome((step, kept), prediction.step_ms,
                           planned_kernel(whole.step.graph, found, whole.layer_of_op) or "")

    outcome, workspaces = choose_workspaces(fronts, plan_for)
    step, kept = outcome.result
    return step, kept, workspaces
