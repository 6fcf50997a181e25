"""How the callback plans each convolution layer.

When training begins, each Conv2D, Conv3D (grouped or not) and DepthwiseConv2D layer is switched to
an op that notes its input's shape (`planned_layers.recording_op`); the other convolution layers
are reported left alone with why. The layers are planned at the shapes a step ran or a trace saw,
through `tf_ucudnn.pipeline.conv_planner` (the planner given, or the options' profile database),
and switched to tf_ucudnn's ops with their plans, fused with their bias and activation where they
can be. Grappler's layout optimizer is off while planned layers train without XLA. A planner that
left layers waiting to be measured (`profiling_budget`) is kept open to measure them at epochs'
ends. When training ends, every layer has its own convolution back and the optimizer its setting.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import keras
import tensorflow as tf

from tf_ucudnn.core.conv_layer import UnsupportedConvolution
from tf_ucudnn.core.plan import LayerPlan, LayerPlanner, plan_or_reason
from tf_ucudnn.keras.layers import (
    check_keras_convolution,
    fused_activation,
    fusion_refusal,
    keras_conv_layer,
    switch_convolution,
    switch_fused_call,
)
from tf_ucudnn.keras.planned_layers import (
    PatchedLayer,
    convolution_layers,
    fused_op,
    planned_op,
    recording_op,
)
from tf_ucudnn.keras.strategies.base import Strategy
from tf_ucudnn.keras.strategies.profiling_budget import ProfilingBudget
from tf_ucudnn.kernels import fused_conv
from tf_ucudnn.options import KerasOptions
from tf_ucudnn.pipeline import (
    UNFUSED_UNDER_MEMORY_BUDGET,
    UNFUSED_UNDER_XLA,
    conv_planner,
    leave_alone_because,
)
from tf_ucudnn.profiling.database import ProfileDatabaseError
from tf_ucudnn.report import FusedLayer, LeftAlone, NotFused, RewrittenLayer

# How the profile database's planner begins the reason of a layer it left waiting to be measured.
NOT_MEASURED_YET = "not measured yet"


@contextlib.contextmanager
def layout_optimizer_off():
    """Grappler's layout optimizer off for the functions TensorFlow instantiates while open. On a
    GPU it moves a float32 NHWC graph to NCHW, but tf_ucudnn's ops are not among the ops it
    converts: it transposes every activation around them and keeps both layouts of each
    activation alive for the backward pass. Steps already run keep how they were optimized."""
    kept = tf.config.optimizer.get_experimental_options().get("layout_optimizer", True)
    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"layout_optimizer": kept})


class ConvolutionPlanning(Strategy):
    """The convolution layers' plans: `layers` planned, `left_alone` with why, `fused` and
    `not_fused` of the planned ones (the report's lists, from the latest planning)."""

    def __init__(self, model: keras.Model, options: KerasOptions,
                 planner: Optional[LayerPlanner], profiling: ProfilingBudget):
        if options.plans_convolutions:
            source = ("by the planner given" if planner is not None else
                      f"from the profiles in {options.database}")
            budget = profiling.describe()
            super().__init__("planned", f"{options.describe_workspace()}, {source}"
                             + (f"; {budget}" if budget else ""))
        else:
            super().__init__("tensorflow", "workspace_limit=None: TensorFlow's own convolutions")
        self.model, self.options, self.profiling = model, options, profiling
        self.given_planner = planner
        self.planner: Optional[LayerPlanner] = None  # while open
        self.patched: list[PatchedLayer] = []
        self.left_before_planning: list[LeftAlone] = []
        self.layers, self.left_alone, self.fused, self.not_fused = [], [], [], []
        self._planner_open = contextlib.ExitStack()
        self._layout = contextlib.ExitStack()

    def begin(self) -> None:
        for layer in convolution_layers(self.model):
            if not self.options.plans_convolutions:
                self.left_before_planning.append(LeftAlone(
                    layer.path, "", "workspace_limit=None: TensorFlow's own convolution"))
                continue
            try:
                check_keras_convolution(layer)
            except UnsupportedConvolution as error:
                self.left_before_planning.append(LeftAlone(
                    layer.path, "", str(error).removeprefix(f"{layer.path}: ")))
                continue
            self.patched.append(PatchedLayer.of(layer))
        self.left_alone = list(self.left_before_planning)
        self.undo.callback(self._own_convolutions)
        self.undo.enter_context(self._layout)
        self.undo.enter_context(self._planner_open)
        for patched in self.patched:
            switch_convolution(patched.layer, recording_op(patched))

    # Planning.

    def step_ended(self, seconds: Optional[float]) -> None:
        """A step before planning ended (timed where `profiling` asked): the first one's input
        shapes are the ones to plan for (a later one may be an epoch's last, partial batch)."""
        if self.profiling.steps_seen == 0:
            for patched in self.patched:
                patched.first_shape = tuple(patched.observed_shape.numpy().tolist())
        self.profiling.step_ended(seconds)

    @property
    def ready_to_plan(self) -> bool:
        return self.profiling.ready

    def plan_observed(self) -> None:
        """Plans each layer for its input in the first step."""
        self.plan(lambda patched: patched.first_shape)

    def plan_as_traced(self, specs) -> None:
        """Plans each layer at the shape a trace of the model's train step over `specs` gives its
        input (traced, not run)."""
        for patched in self.patched:
            switch_convolution(patched.layer, recording_op(patched))
        tf.function(self.model.train_step).get_concrete_function(specs)
        self.plan(lambda patched: patched.traced_shape)

    def replan(self) -> None:
        """Plans each layer again for the shape it was planned for."""
        self.plan(lambda patched: patched.conv_layer and patched.conv_layer.input_shape)

    def plan(self, shape_of: Callable[[PatchedLayer], Optional[tuple]]) -> None:
        """Plans each layer for `shape_of(patched)`, its input's shape (zeros or None where no
        step called the layer), and switches it to its plan's op."""
        self.layers, self.fused, self.not_fused = [], [], []
        self.left_alone = list(self.left_before_planning)
        planner = self._open_planner() if self.patched else None
        for patched in self.patched:
            patched.plan, patched.fronts = None, {}  # planned again: nothing stale kept
            shape = shape_of(patched)
            if not shape or not all(shape):
                self.left_alone.append(LeftAlone(patched.layer.path, "",
                                                 "not called by the first training step"))
                continue
            patched.conv_layer = keras_conv_layer(patched.layer, shape,
                                                  patched.layer.compute_dtype,
                                                  patched.input_gradient)
            plan = plan_or_reason(planner, patched.conv_layer)
            if isinstance(plan, str):
                self.left_alone.append(LeftAlone(patched.layer.path, "", plan))
                continue
            patched.plan = plan
            front_of = getattr(planner, "workspace_front", None)
            if self.options.memory_budget is not None and front_of is not None:
                patched.fronts = front_of(patched.conv_layer)
            self.layers.append(RewrittenLayer(patched.conv_layer, "", {}, plan))
        if not (self.profiling.measures_later and getattr(planner, "pending", None)):
            self._planner_open.close()
            self.planner = None
        for patched in self.patched:
            switch_convolution(patched.layer, planned_op(patched) if patched.plan else None)
            if patched.plan:
                self._fuse(patched)
        self._layout.close()
        if self.layers and not self.model.jit_compile:
            self._layout.enter_context(layout_optimizer_off())

    def drop_plans(self, reason: str) -> None:
        """Every layer back to its own convolution, the planned ones left alone for `reason`."""
        self.left_alone += [LeftAlone(item.layer.name, "", reason) for item in self.layers]
        self.layers, self.fused, self.not_fused = [], [], []
        for patched in self.patched:
            patched.plan = None
        self._own_convolutions()
        self._layout.close()

    def _open_planner(self) -> LayerPlanner:
        if self.planner is None:
            try:
                self.planner = self._planner_open.enter_context(conv_planner(
                    self.options, self.given_planner,
                    compare_with_xla=bool(self.model.jit_compile),
                    **self.profiling.planner_settings(self.given_planner)))
            except ProfileDatabaseError as error:  # training goes on as it is, and says why
                self.planner = leave_alone_because(f"no planner: {error}")
        return self.planner

    def _fuse(self, patched: PatchedLayer) -> None:
        """Runs a planned layer's convolution, bias and activation as one fused op where it can,
        and notes which it did."""
        path = patched.layer.path
        refusal = (UNFUSED_UNDER_XLA if self.model.jit_compile else
                   UNFUSED_UNDER_MEMORY_BUDGET if self.options.memory_budget is not None else
                   fusion_refusal(patched.layer) or fused_conv.plan_refusal(patched.plan))
        if refusal is not None:
            self.not_fused.append(NotFused(path, "", refusal))
            return
        activation = fused_activation(patched.layer)
        switch_fused_call(patched.layer, fused_op(patched, activation))
        self.fused.append(FusedLayer(path, "", activation))

    def _own_convolutions(self) -> None:
        for patched in self.patched:
            switch_convolution(patched.layer, None)

    # Layers left waiting to be measured.

    def measure_pending(self) -> int:
        """At an epoch's end: measures the layers the planner left waiting, within the profiling
        budget; how many it measured."""
        measure = getattr(self.planner, "measure_pending", None)
        seconds = self.profiling.later_seconds
        if measure is None or seconds is None or not self.planner.pending:
            return 0
        measured = measure(seconds)
        if self.options.verbose and measured:
            print(f"tf_ucudnn: measured {measured} layer(s) in up to {seconds:.1f} s; "
                  f"{len(self.planner.pending)} still waiting", flush=True)
        return measured

    def newly_plannable(self) -> bool:
        """Whether a layer left waiting to be measured gets a plan now."""
        waiting = {item.node for item in self.left_alone
                   if item.reason.startswith(NOT_MEASURED_YET)}
        return self.planner is not None and any(
            isinstance(plan_or_reason(self.planner, patched.conv_layer), LayerPlan)
            for patched in self.patched if patched.layer.path in waiting)
