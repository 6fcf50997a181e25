"""The Keras callback: `model.fit(..., callbacks=[tf_ucudnn.MicroBatchCallback("64MiB")])`.

Keras 3 traces `fit`'s train function with the batch dimension unknown, so the real batch size is
first seen when a step runs. The callback therefore lets the first step run with TensorFlow's own
convolutions while each convolution layer records the shape of its input; after that step it plans
every layer for that shape, switches the layers' convolution to tf_ucudnn's ops carrying their
plans (`keras/layers.py`: a Conv2D's or Conv3D's `convolution_op`, grouped or not, a
DepthwiseConv2D's `call`), and has Keras build its train, test and predict functions again. An
input of another shape (a last, partial batch) runs undivided. When training ends the layers get
their own convolution back, so the model is plain again for whatever follows.

Where Keras compiles the step with XLA (its default on a GPU), it still does: tf_ucudnn's ops
compile to XLA custom calls, and a layer is planned only where the profiles predict its plan
faster than XLA's own convolution. If any layer is planned, a few steps are timed with the plans
and as Keras made the step before them, and the faster step is kept, so the callback does not
leave training slower than Keras's own step. If none is, Keras's step goes on unchanged.

On a GPU, without a memory budget, the train function trains batches copied there ahead of their
steps (`keras/input_prefetch.py`): Keras's step would otherwise wait for its batch to cross.

Under a memory budget the first step may not fit as it is, so none runs unplanned: the first call
of the train function takes the first batch from the data, traces the step at its shape (each
convolution layer notes its input's shape as it is traced), plans the layers and the step's
memory, and trains that batch with the planned step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Optional, Sequence, Union

import keras
import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer, UnsupportedConvolution
from tf_ucudnn.core.plan import LayerPlan, LayerPlanner, plan_or_reason
from tf_ucudnn.core.units import MIB
from tf_ucudnn.graph.conv_layers import fed_by_variables
from tf_ucudnn.keras.accumulated_step import (
    AccumulationPlan,
    accumulated_train_step,
    accumulation_refusal,
    check_batch_norm_statistics,
    compiled_step_peak,
    plan_accumulation,
    train_first_batch,
)
from tf_ucudnn.keras.batch_norm_forms import batch_norm_layers, fused_batch_norm, kernel_name
from tf_ucudnn.keras.input_prefetch import InputPrefetch
from tf_ucudnn.keras.layers import (
    check_keras_convolution,
    conv_filter,
    fused_activation,
    fusion_refusal,
    keras_conv_layer,
    own_convolution,
    switch_convolution,
    switch_fused_call,
)
from tf_ucudnn.keras.micro_batched_prefix import micro_batched_calls
from tf_ucudnn.keras.planned_step import (
    KerasStepPlan,
    plan_keras_step,
    plan_keras_step_with_workspaces,
)
from tf_ucudnn.keras.streamed_conv_bn import streamed_conv_batch_norm
from tf_ucudnn.kernels import fused_conv, ops
from tf_ucudnn.memory import DeviceModel
from tf_ucudnn.options import DEFAULT_WORKSPACE_LIMIT, Options, Size
from tf_ucudnn.pipeline import (
    UNFUSED_UNDER_MEMORY_BUDGET,
    UNFUSED_UNDER_XLA,
    conv_planner,
    leave_alone_because,
)
from tf_ucudnn.profiling.database import ProfileDatabaseError
from tf_ucudnn.report import (
    FusedLayer,
    LeftAlone,
    NotFused,
    RewriteReport,
    RewrittenLayer,
    StepTrial,
)

# How much faster the step trial must find the plans' step than Keras's before keeping it: step
# times scatter by about that much, and Keras's own step is the safe choice.
TRIAL_MARGIN = 0.01
# The batch normalization kernel the step trial tries where `fuse_batch_norm` is left to the
# callback and XLA does not compile the step: one XLA computation each way, where Keras runs
# about twenty ops. Inside XLA's step it reads each activation once less than Keras's moments,
# yet ResNet-50's step was no faster with it (docs/results.md), so it is not tried there.
TRIAL_BATCH_NORM_KERNEL = "xla"

_CONVOLUTION_TYPES = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
                      keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                      keras.layers.Conv3DTranspose, keras.layers.DepthwiseConv1D,
                      keras.layers.DepthwiseConv2D, keras.layers.SeparableConv1D,
                      keras.layers.SeparableConv2D)


@dataclasses.dataclass
class _PatchedLayer:
    layer: keras.layers.Layer
    observed_shape: tf.Variable  # the input shape of the layer's last call, written by the step
    traced_shape: Optional[tuple] = None  # the input's static shape where a trace knew it
    # False where the traced step's input to the layer has no variable upstream (its input
    # gradient never runs); True until a trace says so.
    input_gradient: bool = True
    conv_layer: Optional[ConvLayer] = None
    plan: Optional[LayerPlan] = None
    # Under a memory budget: each kernel's Pareto front of plans, and the names of the forward
    # ops traced with the plan (to tell which layer an op at the peak is).
    fronts: dict = dataclasses.field(default_factory=dict)
    forward_ops: set = dataclasses.field(default_factory=set)


def _convolution_layers(model: keras.Model):
    """Every convolution layer of the model, nested models included, each once."""
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, _CONVOLUTION_TYPES)]


class MicroBatchCallback(keras.callbacks.Callback):
    """Trains the model's Conv2D/Conv3D (grouped or not) and DepthwiseConv2D layers as
    micro-batched cuDNN convolutions.

    Args:
      workspace_limit: each kernel's cuDNN workspace limit, as bytes or a size such as "64MiB";
        None leaves every convolution to TensorFlow (for a memory budget alone).
      planner: gives each layer its plan (or a reason to leave it alone); by default a
        `DatabasePlanner` over `database`, which on a GPU measures what it lacks.
      database: the profile database file of the default planner.
      profiles: JSON-lines profile files the default planner imports first.
      memory_budget: optionally, the device memory the training step must fit in (bytes or a
        size); one step per call: steps_per_execution must be 1. Where no layer of the model
        mixes samples (no normalization by batch statistics) and the loss is averaged over the
        batch, the whole step runs in micro-batches with their gradients summed, the same
        update as the whole batch, compiled by XLA as the model says, in the largest
        micro-batches that the liveness analysis and, under XLA, XLA's own buffer assignment
        put under the budget (`tf_ucudnn.keras.accumulated_step`; `accumulation` holds the
        plan, else `accumulation_refused` says why not). Otherwise the step is traced at the
        real batch size and trained, without XLA, with the swaps and recomputations
        `tf_ucudnn.rewrite` plans for it, the planned kernels' workspaces chosen with them
        (`report.memory_workspaces`); if no such plan fits, the model's first layers run in
        micro-batches too (`tf_ucudnn.keras.plan_keras_step`). A budget that cannot be met
        stops training with a BudgetError or AccumulationError saying by how much.
      accumulate_gradients: False to plan swaps and recomputations under a memory budget even
        where the whole step could run in micro-batches with its gradients summed.
      batch_norm_statistics: under a memory budget, "batch" (the default) keeps each batch
        normalization's statistics the whole batch's, so a model with one is not run in
        micro-batches; "micro_batch" lets it be, each micro-batch normalized by its own
        statistics (ghost batch normalization) and the moving statistics updated once per
        micro-batch: a different update from the whole batch's, asked for by name. The layers
        are listed in `accumulation.normalized_per_micro_batch`.
      micro_batches: the micro-batch counts the first layers may run in under a memory budget
        (none: whole batches only).
      whole_batches: False to run the first layers in micro-batches under a memory budget even
        where a plan in whole batches fits: their largest tensors are then never whole, which
        a GPU allocator whose free memory is split may have no room for.
      device_model: the `tf_ucudnn.memory.DeviceModel` for memory planning (measured on the GPU
        if not given).
      fuse_batch_norm: train the BatchNormalization layers as fused kernels from the first step,
        True or "cudnn" (TensorFlow's FusedBatchNormV3), "xla" or "ucudnn"
        (`tf_ucudnn.keras.batch_norm_forms`): the same results, one kernel each way, and on the
        GPU a faster step (Keras's normalization runs as several elementwise ops each way). The
        layers it cannot fuse are listed in `unfused_batch_norm` with the reason. None (the
        default) leaves it to the step trial: where XLA does not compile the step and no memory
        budget is set, the step with the plans trains them with the `TRIAL_BATCH_NORM_KERNEL`
        kernel, kept only with the plans. False: Keras's own normalization.
      stream_conv_batch_norm: a count of micro-batches, 0 for none: each convolution and the
        batch normalization reading it train as one op whose backward runs in that many
        micro-batches (`tf_ucudnn.keras.streamed_conv_bn`), which lowers the backward pass's
        peak; the layers not paired are in `unstreamed` with the reason. The pairs' gradients
        are TensorFlow's convolutions, so this needs `workspace_limit=None`.
      trial_steps: where some layer is planned or a batch normalization is left to the trial,
        how many steps to time with the plans and as Keras made the step before them (XLA's or
        TensorFlow's own convolutions, Keras's normalization), in turns, before keeping the
        plans if their median step is at least `TRIAL_MARGIN` faster, else Keras's step; 0
        keeps the plans without timing them (and Keras's normalization).
      prefetch_batches: how many batches to copy to the GPU ahead of the steps that train
        them (`tf_ucudnn.keras.input_prefetch`), so that a step does not wait for its batch to
        cross from the host; 0 for none. Not under a memory budget (each batch ahead holds GPU
        memory), nor with `steps_per_execution` above 1, nor for a distribution strategy's
        iterator; `report.input_prefetch` says which.
      verbose: 1 prints a summary of the plans when they are made, 0 prints nothing.

    After planning, `report` holds the plan of every layer and the layers left alone with why,
    the step trial if one ran, and the memory plan if one was made.
    """

    def __init__(self, workspace_limit: Size = DEFAULT_WORKSPACE_LIMIT,
                 planner: Optional[LayerPlanner] = None,
                 *, database: Optional[str] = None, profiles=(),
                 memory_budget: Union[int, str, None] = None, device_model=None,
                 accumulate_gradients: bool = True, batch_norm_statistics: str = "batch",
                 micro_batches: Sequence[int] = (4, 8), whole_batches: bool = True,
                 fuse_batch_norm: Union[bool, str, None] = None, stream_conv_batch_norm: int = 0,
                 trial_steps: int = 10, prefetch_batches: int = 2, verbose: int = 1):
        super().__init__()
        if stream_conv_batch_norm and workspace_limit is not None:
            raise ValueError(f"stream_conv_batch_norm={stream_conv_batch_norm} needs "
                             f"workspace_limit=None, not {workspace_limit!r}: the streamed pairs' "
                             f"gradients are TensorFlow's convolutions, not planned ones")
        self.options = Options(workspace_limit=workspace_limit, memory_budget=memory_budget,
                               micro_batches=micro_batches, database=database,
                               profiles=profiles)
        self._device_model = device_model
        self.whole_batches = whole_batches
        self.accumulate_gradients = accumulate_gradients
        self.batch_norm_statistics = check_batch_norm_statistics(batch_norm_statistics)
        self.memory_plan: Optional[KerasStepPlan] = None
        self.accumulation: Optional[AccumulationPlan] = None
        self.accumulation_refused: Optional[str] = None
        self._planner = planner
        self.verbose = verbose
        if trial_steps < 0:
            raise ValueError(f"trial_steps must be 0 or more, got {trial_steps}")
        self.trial_steps = trial_steps
        if prefetch_batches < 0:
            raise ValueError(f"prefetch_batches must be 0 or more, got {prefetch_batches}")
        self.prefetch_batches = prefetch_batches
        self._prefetch: Optional[InputPrefetch] = None
        self._prefetch_note = ""
        self.report: Optional[RewriteReport] = None
        self._trial: Optional[_Trial] = None
        self._patched: list[_PatchedLayer] = []
        self._jit_compile = None
        self._batch_norm_asked = kernel_name(fuse_batch_norm)
        self._batch_norm_left_to_trial = fuse_batch_norm is None
        self.fuse_batch_norm = self._batch_norm_asked  # the kernel training now, or None
        self.unfused_batch_norm = []
        self.stream_conv_batch_norm = stream_conv_batch_norm
        self.unstreamed = []
        self._layer_switches: Optional[contextlib.ExitStack] = None
        self._layout_kept: Optional[bool] = None  # Grappler's layout optimizer, while it is off

    # Keras hooks.

    def on_train_begin(self, logs=None):
        self.report = None
        self._patched = []
        left_alone = []
        for layer in _convolution_layers(self.model):
            if self.options.workspace_limit is None:
                left_alone.append(LeftAlone(layer.path, "", "workspace_limit=None: "
                                            "TensorFlow's own convolution"))
                continue
            try:
                check_keras_convolution(layer)
            except UnsupportedConvolution as error:
                left_alone.append(LeftAlone(layer.path, "", str(error).removeprefix(
                    f"{layer.path}: ")))
                continue
            observed = tf.Variable(tf.zeros([layer.rank + 2], tf.int64), trainable=False,
                                   name="ucudnn_observed_shape")
            self._patched.append(_PatchedLayer(layer, observed))
        self._left_alone_before_planning = left_alone
        for patched in self._patched:
            switch_convolution(patched.layer, self._recording_op(patched))
        if self.options.memory_budget is not None and self.model.steps_per_execution != 1:
            raise ValueError("MicroBatchCallback with a memory_budget trains one step per call: "
                             f"compile the model with steps_per_execution=1, not "
                             f"{self.model.steps_per_execution}")
        self._layer_switches = contextlib.ExitStack()
        # The batch normalization the step trial tries, undone alone if Keras's step wins.
        self._trial_switches = self._layer_switches.enter_context(contextlib.ExitStack())
        self.fuse_batch_norm, self.unfused_batch_norm = self._batch_norm_asked, []
        if self.fuse_batch_norm:
            self.unfused_batch_norm = self._layer_switches.enter_context(
                fused_batch_norm(self.model, self.fuse_batch_norm))
        if self.stream_conv_batch_norm:
            self.unstreamed = self._layer_switches.enter_context(
                streamed_conv_batch_norm(self.model, self.stream_conv_batch_norm))
        self.accumulation = None
        self.accumulation_refused = (
            None if self.options.memory_budget is None else
            accumulation_refusal(self.model, self.batch_norm_statistics)
            if self.accumulate_gradients else
            "accumulate_gradients=False")
        if self.options.memory_budget is not None and self.model.jit_compile and \
                self.accumulation_refused is not None:
            # The memory-planned step orders its swaps and recomputations by control edges, which
            # XLA would not keep, so XLA is off from the first step on (sparing a compilation for
            # one step); the model's own setting comes back at the end.
            self._jit_compile = self.model.jit_compile
            self.model.jit_compile = False
        self._trial = None
        self._start_prefetch()
        self._retrace()
        if self.options.memory_budget is not None:
            self.model.train_function = self._planning_train_function
            return
        # A first step that fails (out of memory, say) gives the model its own layers back too.
        self._guard_train_function()
        if not self._patched:  # nothing to plan: the report says why for each layer now
            self._plan(lambda patched: None)

    def on_train_batch_begin(self, batch, logs=None):
        if self._trial is not None:
            self._trial.step_began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # Keras hands this callback (not marked async-safe) the step's logs as numbers: the step
        # has finished on the device by now.
        if self._trial is not None:
            self._time_trial_step(time.perf_counter() - self._trial.step_began)
        if self.report is not None and self._prefetch is not None and self._prefetch.passed_over:
            self.report.input_prefetch = self._prefetch_text()  # learnt at a step, after the plans
        if self.report is None and self._patched:
            try:
                self._plan(lambda patched: patched.observed_shape.numpy().tolist())
                batch_norm_tried = self._try_batch_norm()
                if self.report.layers or batch_norm_tried:
                    unplanned = self.model.train_function
                    self._retrace()
                    if self.trial_steps:
                        own = ("XLA's own convolutions" if self.model.jit_compile else
                               "TensorFlow's own convolutions")
                        if batch_norm_tried:
                            own += " and Keras's batch normalization"
                        self._trial = _Trial(StepTrial(self.trial_steps, own), unplanned,
                                             self.model.train_function)
                        self.report.trial = self._trial.result
                # With nothing planned, the step as compiled goes on: tracing it again would
                # cost XLA a compilation for the same step.
            except BaseException:
                self.on_train_end()  # Keras skips it when training stops on an error
                raise
            self._guard_train_function()

    def on_train_end(self, logs=None):
        self._trial = None
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None
        self.fuse_batch_norm = self._batch_norm_asked
        self._restore_layout_optimizer()
        self.model.__dict__.pop("train_step", None)
        for patched in self._patched:
            switch_convolution(patched.layer, None)
        if self._jit_compile is not None:
            self.model.jit_compile = self._jit_compile
            self._jit_compile = None
        if self._layer_switches is not None:
            self._layer_switches.close()
            self._layer_switches = None
        self._patched = []
        self._retrace()

    # Planning.

    def _plan(self, input_shape) -> None:
        """Plans each patched layer for `input_shape(patched)`, its input's shape as a step saw
        it (zeros or None where no step called the layer)."""
        report = RewriteReport(left_alone=list(self._left_alone_before_planning))
        opened, planner = contextlib.ExitStack(), None
        try:
            if self._patched:
                planner = opened.enter_context(conv_planner(
                    self.options, self._planner,
                    compare_with_xla=bool(self.model.jit_compile)))
        except ProfileDatabaseError as error:  # training goes on as it is, and says why
            planner = leave_alone_because(f"no planner: {error}")
        with opened:
            for patched in self._patched:
                patched.plan, patched.fronts = None, {}  # planned again: nothing stale kept
                shape = input_shape(patched)
                if not shape or not all(shape):
                    report.left_alone.append(LeftAlone(
                        patched.layer.path, "", "not called by the first training step"))
                    continue
                patched.conv_layer = keras_conv_layer(
                    patched.layer, shape, patched.layer.compute_dtype, patched.input_gradient)
                plan = plan_or_reason(planner, patched.conv_layer)
                if isinstance(plan, str):
                    report.left_alone.append(LeftAlone(patched.layer.path, "", plan))
                    continue
                patched.plan = plan
                front_of = getattr(planner, "workspace_front", None)
                if self.options.memory_budget is not None and front_of is not None:
                    patched.fronts = front_of(patched.conv_layer)
                report.layers.append(RewrittenLayer(patched.conv_layer, "", {}, plan))
        for patched in self._patched:
            switch_convolution(patched.layer, self._planned_op(patched) if patched.plan else None)
            if patched.plan:
                self._fuse(patched, report)
        if report.layers and not self.model.jit_compile:
            self._layout_kept = _grappler_layout_optimizer_off()
        report.batch_norm_kernel = self.fuse_batch_norm
        report.input_prefetch = self._prefetch_text()
        self.report = report
        if self.verbose:
            print(self.summary(), flush=True)

    # Memory.

    def _planning_train_function(self, iterator):
        """The first step under a memory budget: plans at the first batch's shape, then trains
        that batch with the planned step, which later calls run too."""
        next_data = iterator.get_next_as_optional()
        if not next_data.has_value():
            raise StopIteration
        data = next_data.get_value()
        try:
            specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), data)
            if self.accumulation_refused is None:
                self._plan_accumulation(specs)
            elif self.verbose and self.accumulate_gradients:
                print(f"tf_ucudnn: the step is not run in micro-batches: "
                      f"{self.accumulation_refused}", flush=True)
            self._plan_layers_as_traced(specs)
            if self.accumulation is not None:
                if self.verbose:
                    print(self.accumulation.to_text(), flush=True)
                return self._first_accumulated_step(data, specs)
            planned_step = self._plan_memory(specs)
        except BaseException:
            self.on_train_end()  # Keras skips it when training stops on an error
            raise
        self._guard_train_function()
        return planned_step(data)

    def _plan_accumulation(self, specs) -> None:
        """The whole step in micro-batches, as large as the budget lets the liveness analysis
        predict, for a model whose layers treat each sample on its own."""
        batch = tf.nest.flatten(specs)[0].shape[0]

        def trace(size):
            def resized(spec):
                if spec.shape.rank and spec.shape[0] == batch:
                    return tf.TensorSpec([size, *spec.shape[1:]], spec.dtype)
                return spec
            return tf.function(self.model.train_step).get_concrete_function(
                tf.nest.map_structure(resized, specs))

        self.accumulation = plan_accumulation(self.model, batch, self.options.memory_budget,
                                              trace, self.batch_norm_statistics,
                                              compiled_step_peak(self.model, specs))
        self._accumulate(self.accumulation.micro_batch_size)

    def _accumulate(self, micro_batch_size: int) -> None:
        self.model.__dict__["train_step"] = accumulated_train_step(self.model, micro_batch_size)

    def _plan_layers_as_traced(self, specs) -> None:
        """Plans the layers at the shapes a trace of the step over `specs` gives them (traced,
        not run: each convolution layer notes its input's shape), and makes the step again."""
        for patched in self._patched:
            switch_convolution(patched.layer, self._recording_op(patched))
        tf.function(self.model.train_step).get_concrete_function(specs)
        self._plan(lambda patched: patched.traced_shape)
        self._retrace()
        if self.accumulation is not None:
            self.report.memory = self.accumulation

    def _first_accumulated_step(self, data, specs):
        """Trains the first batch in micro-batches, smaller ones if a GPU says so, the layers
        planned again for each smaller micro-batch."""
        def train(batches):
            return self.model.train_function(batches)  # Keras takes any iterable of batches

        def smaller(size: int) -> None:
            self._accumulate(size)
            self._plan_layers_as_traced(specs)
        logs = train_first_batch(self.accumulation, data, train, smaller, self.verbose)
        self._guard_train_function()
        return logs

    def _plan_memory(self, specs):
        """Plans the step's memory for data of `specs`, makes the planned step Keras's train
        function, and returns what trains one batch with it."""
        batch = tf.nest.flatten(specs)[0].shape[0]
        own_step = tf.function(self.model.train_step)
        device_model = self._device_model or DeviceModel.measure()

        def trace(layer, count):  # traced afresh: the layers' plans may have changed
            with micro_batched_calls(self.model, layer, count) if layer else \
                    contextlib.nullcontext():
                return tf.function(self.model.train_step).get_concrete_function(specs)

        def plan_step(whole=None):  # `whole`: the step in whole batches, if traced already
            return plan_keras_step(
                self.model, batch, self.options.memory_budget, device_model,
                micro_batches=self.options.micro_batches, whole_batches=self.whole_batches,
                trace=lambda layer, count: whole if layer is None and whole is not None
                else trace(layer, count))

        planned = {p.layer.path: p for p in self._patched if p.plan and p.fronts}
        if planned:  # the kernels' workspaces chosen with the memory plan
            (step, self.memory_plan), self.report.memory_workspaces = \
                plan_keras_step_with_workspaces(
                    plan_step, {f"{path}|{kernel}": front for path, p in planned.items()
                                for kernel, front in p.fronts.items()},
                    lambda choice: self._set_kernel_plans(planned, choice),
                    lambda: trace(None, 1),
                    lambda op: next((path for path, p in planned.items()
                                     if op in p.forward_ops), None))
        else:
            step, self.memory_plan = plan_step()
        self.report.memory = self.memory_plan.plan
        if self.verbose:
            print(self.report.memory.to_text(), flush=True)
            if self.memory_plan.prefix_end:
                print(f"  layers up to {self.memory_plan.prefix_end} run in "
                      f"{self.memory_plan.micro_batches} micro-batches", flush=True)

        def train_one(data):
            if tf.nest.flatten(data)[0].shape[0] == batch:
                return step(*tf.nest.flatten(data))
            return own_step(data)  # another batch size (a last, partial one): no memory plan

        def train_function(iterator):
            next_data = iterator.get_next_as_optional()
            if not next_data.has_value():
                raise StopIteration
            return train_one(next_data.get_value())
        self.model.train_function = train_function
        return train_one

    def _set_kernel_plans(self, planned: dict, choice: dict) -> None:
        """Each "layer|kernel" of `choice` planned with its configuration's plan."""
        for key, configuration in choice.items():
            path, kernel = key.split("|")
            patched = planned[path]
            patched.plan = patched.plan.with_kernel(kernel, configuration.plan)
            switch_convolution(patched.layer, self._planned_op(patched))

    def summary(self) -> str:
        if self.report is None:
            return "tf_ucudnn: no plans yet (they are made at the first training step)"
        within = ("" if self.options.workspace_limit is None else
                  f" within {self.options.workspace_limit / MIB:g} MiB of workspace per kernel")
        lines = [f"tf_ucudnn: {len(self.report.layers)} convolution layer(s) micro-batched"
                 f"{within}, {len(self.report.left_alone)} left as they are"
                 + ("; XLA compilation turned off under the memory budget" if self._jit_compile
                    else "; the step compiled by XLA" if self.model.jit_compile else "")]
        lines += self.report.to_text().splitlines()[1:]
        if self.report.batch_norm_kernel:  # what the step trained with, after training too
            lines.append(f"  {len(self.unfused_batch_norm)} batch normalization layer(s) left "
                         f"unfused")
            lines += [f"    {u.layer}: {u.reason}" for u in self.unfused_batch_norm]
        if self.stream_conv_batch_norm:
            lines.append(f"  convolutions trained with their batch normalization, backward in "
                         f"{self.stream_conv_batch_norm} micro-batches; "
                         f"{len(self.unstreamed)} layer(s) not paired")
            lines += [f"    {u.layer}: {u.reason}" for u in self.unstreamed]
        return "\n".join(lines)

    # Switching a layer's convolution.

    @staticmethod
    def _recording_op(patched: _PatchedLayer):
        own_op = own_convolution(patched.layer)

        def convolution_op(inputs, kernel):
            if inputs.shape.is_fully_defined():
                patched.traced_shape = tuple(inputs.shape)
            patched.input_gradient = fed_by_variables(inputs)
            record = patched.observed_shape.assign(tf.shape(inputs, out_type=tf.int64))
            with tf.control_dependencies([record]):
                return own_op(inputs, kernel)
        return convolution_op

    @staticmethod
    def _planned_op(patched: _PatchedLayer):
        own_op = own_convolution(patched.layer)
        layer, plan = patched.conv_layer, patched.plan
        conv = ops.conv2d if layer.num_spatial_dims == 2 else ops.conv3d

        def convolution_op(inputs, kernel):
            if inputs.shape.is_fully_defined() and tuple(inputs.shape) != layer.input_shape:
                return own_op(inputs, kernel)
            # Traced with the batch unknown, the op itself runs another batch size undivided:
            # XLA would compile both branches of a tf.cond, the plan's at the wrong batch too.
            output = conv(inputs, conv_filter(patched.layer, kernel), strides=list(layer.strides),
                          padding=layer.padding, data_format=layer.data_format,
                          dilations=list(layer.dilations),
                          plan=plan, plan_batch_size=layer.batch_size)
            if not tf.executing_eagerly():
                patched.forward_ops.add(output.op.name)
            return output
        return convolution_op

    def _fuse(self, patched: _PatchedLayer, report: RewriteReport) -> None:
        """Runs a planned layer's convolution, bias and activation as one fused op where it can,
        and reports which it did."""
        path = patched.layer.path
        refusal = (UNFUSED_UNDER_XLA if self.model.jit_compile else
                   UNFUSED_UNDER_MEMORY_BUDGET if self.options.memory_budget is not None else
                   fusion_refusal(patched.layer) or fused_conv.plan_refusal(patched.plan))
        if refusal is not None:
            report.not_fused.append(NotFused(path, "", refusal))
            return
        activation = fused_activation(patched.layer)
        switch_fused_call(patched.layer, self._fused_op(patched, activation))
        report.fused.append(FusedLayer(path, "", activation))

    @staticmethod
    def _fused_op(patched: _PatchedLayer, activation: str):
        own_call = type(patched.layer).call.__get__(patched.layer)
        layer, plan = patched.conv_layer, patched.plan
        fused = fused_conv.fused_conv2d if layer.num_spatial_dims == 2 else \
            fused_conv.fused_conv3d

        def fused_op(inputs, kernel, bias):
            if inputs.shape.is_fully_defined() and tuple(inputs.shape) != layer.input_shape:
                return own_call(inputs)  # another shape: the layer's own steps
            return fused(inputs, conv_filter(patched.layer, kernel), bias,
                         strides=list(layer.strides), padding=layer.padding,
                         data_format=layer.data_format, dilations=list(layer.dilations),
                         activation=activation, plan=plan, plan_batch_size=layer.batch_size)
        return fused_op

    def _try_batch_norm(self) -> bool:
        """Where the callback decides (no XLA, no memory budget, a step trial to come),
        switches the batch normalization layers to `TRIAL_BATCH_NORM_KERNEL` for the planned
        step; whether some layer was switched."""
        if not (self._batch_norm_left_to_trial and self.trial_steps
                and self.options.memory_budget is None and not self.model.jit_compile):
            return False
        left_alone = self._trial_switches.enter_context(
            fused_batch_norm(self.model, TRIAL_BATCH_NORM_KERNEL))
        if len(left_alone) == len(batch_norm_layers(self.model)):
            self._trial_switches.close()
            return False
        self.fuse_batch_norm, self.unfused_batch_norm = TRIAL_BATCH_NORM_KERNEL, left_alone
        self.report.batch_norm_kernel = TRIAL_BATCH_NORM_KERNEL
        if self.verbose:  # the summary printed by _plan came before this
            print(f"tf_ucudnn: the step trial tries batch normalization with the "
                  f"{TRIAL_BATCH_NORM_KERNEL!r} kernel; {len(left_alone)} layer(s) left to Keras",
                  flush=True)
        return True

    def _retrace(self) -> None:
        self.model.train_function = None
        self.model.make_train_function()
        self.model.test_function = None
        self.model.predict_function = None

    # The step trial.

    def _time_trial_step(self, seconds: float) -> None:
        trial = self._trial
        trial.steps_seen += 1
        result = trial.result
        # The two steps take turns, so that a drift in the device's speed (its clocks, the
        # allocator settling) weighs on both alike. Each one's first call is not timed: the
        # planned one compiles, and the unplanned one may be optimized again (Grappler's options
        # changed with the plans).
        ran_planned = trial.steps_seen % 2 == 1
        if trial.steps_seen > 2:
            (result.planned_ms if ran_planned else result.unplanned_ms).append(seconds * 1e3)
        if len(result.unplanned_ms) < result.steps:
            self.model.train_function = self._guarded(
                trial.unplanned if ran_planned else trial.planned)
            return
        self._trial = None
        if result.planned_median_ms < (1 - TRIAL_MARGIN) * result.unplanned_median_ms:
            result.kept = "plans"
            self.model.train_function = self._guarded(trial.planned)
        else:
            result.kept = result.own
            reason = (f"measured: the step with the plans took {result.planned_median_ms:.2f} "
                      f"ms, with {result.own} {result.unplanned_median_ms:.2f} ms (the plans "
                      f"must gain {TRIAL_MARGIN:.0%})")
            self.report.left_alone += [LeftAlone(item.layer.name, "", reason)
                                       for item in self.report.layers]
            self.report.layers, self.report.fused, self.report.not_fused = [], [], []
            for patched in self._patched:
                patched.plan = None
                switch_convolution(patched.layer, None)
            if self._batch_norm_left_to_trial:
                self._trial_switches.close()
                self.fuse_batch_norm, self.unfused_batch_norm = None, []
                self.report.batch_norm_kernel = None
            self._restore_layout_optimizer()
            # The step compiled before the plans runs on; tests and predictions trace again.
            self.model.test_function = None
            self.model.predict_function = None
        if self.verbose:
            print("tf_ucudnn:" + result.to_text()[1:], flush=True)

    def _restore_layout_optimizer(self) -> None:
        if self._layout_kept is not None:
            tf.config.optimizer.set_experimental_options({"layout_optimizer": self._layout_kept})
            self._layout_kept = None

    # The input.

    def _start_prefetch(self) -> None:
        device = InputPrefetch.default_device()
        refusal = ("prefetch_batches=0" if not self.prefetch_batches else
                   "no GPU" if device is None else
                   "under a memory budget (each batch ahead holds GPU memory)"
                   if self.options.memory_budget is not None else
                   f"steps_per_execution={self.model.steps_per_execution} (Keras's train "
                   f"function takes several batches a call)"
                   if self.model.steps_per_execution != 1 else None)
        if refusal:
            self._prefetch_note = f"batches not copied ahead: {refusal}"
            return
        self._prefetch = InputPrefetch(device, self.prefetch_batches)
        self._prefetch_note = (f"batches copied to {device} up to {self.prefetch_batches} "
                               f"step(s) ahead")

    def _prefetch_text(self) -> str:
        passed_over = self._prefetch.passed_over if self._prefetch else None
        return f"batches not copied ahead: {passed_over}" if passed_over else self._prefetch_note

    def _guard_train_function(self) -> None:
        self.model.train_function = self._guarded(self.model.train_function)

    def _guarded(self, inner):
        """A step that fails gives the model its own layers back before the error goes on:
        Keras calls no callback when training stops on an error."""

        def train_function(iterator):
            try:
                if self._prefetch is not None:
                    return self._prefetch(inner, iterator)
                return inner(iterator)
            except StopIteration:  # the end of an epoch, not an error
                raise
            except BaseException:
                self.on_train_end()
                raise
        train_function.__qualname__ = inner.__qualname__
        return train_function


@dataclasses.dataclass
class _Trial:
    """A step trial under way: its result so far, and the two train functions it times."""

    result: StepTrial
    unplanned: object
    planned: object
    steps_seen: int = 0
    step_began: float = 0.0


def _grappler_layout_optimizer_off() -> bool:
    """Turns Grappler's layout optimizer off for the functions TensorFlow instantiates from now
    on, and returns its setting before. On a GPU it moves a float32 NHWC graph to NCHW, but
    tf_ucudnn's ops are not among the ops it converts: it transposes every activation around
    them and keeps both layouts of each activation alive for the backward pass. Steps already
    run keep how they were optimized."""
    kept = tf.config.optimizer.get_experimental_options().get("layout_optimizer", True)
    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    return kept
