"""The Keras callback: `model.fit(..., callbacks=[tf_ucudnn.MicroBatchCallback("64MiB")])`.

Keras 3 traces `fit`'s train function with the batch dimension unknown, so the real batch size is
first seen when a step runs. The callback therefore lets the first step run with TensorFlow's own
convolutions while each convolution layer records the shape of its input; after that step it plans
every layer for that shape, switches the layers to tf_ucudnn's ops carrying their plans, and has
Keras build its train, test and predict functions again. An input of another shape (a last,
partial batch) runs undivided. Under a memory budget the first step may not fit as it is, so none
runs unplanned: the first call of the train function takes the first batch, plans at its shape
and trains it with the planned step. When training ends the model is plain again.

What the callback does is decided once a training run, when it begins, by the strategies of
`tf_ucudnn.keras.strategies` (each named with why in `report.strategies`): how the convolutions are
planned, which kernel batch normalization trains with, how the step meets a memory budget, whether
the planned step is timed against Keras's before it is kept, and whether batches are copied to the
GPU ahead of their steps. This class hands Keras's hooks to them.
"""

from __future__ import annotations

import time
from typing import Optional

import keras

from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.keras.accumulated_step import AccumulationPlan
from tf_ucudnn.keras.planned_step import KerasStepPlan
from tf_ucudnn.keras.strategies.accumulation import AccumulatedSteps
from tf_ucudnn.keras.strategies.base import retrace
from tf_ucudnn.keras.strategies.choice import Strategies, choose_strategies
from tf_ucudnn.keras.strategies.step_trial import RunningTrial, keras_own
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.options import KerasOptions, Size
from tf_ucudnn.report import RewriteReport


class MicroBatchCallback(keras.callbacks.Callback):
    """Trains the model's Conv2D/Conv3D (grouped or not) and DepthwiseConv2D layers as
    micro-batched cuDNN convolutions, and its step within a memory budget where one is given.

    Args:
      workspace_limit: each kernel's cuDNN workspace limit, as bytes or a size such as "64MiB";
        None leaves every convolution to TensorFlow (for a memory budget alone). Left out: the
        options' limit.
      planner: gives each layer its plan (or a reason to leave it alone); by default a
        `DatabasePlanner` over the options' database, which on a GPU measures what it lacks.
      options: a `tf_ucudnn.KerasOptions`, whose docstring describes every setting (the memory
        budget, the step trial, batch normalization's kernel, the batches copied ahead, ...).
      device_model: the `tf_ucudnn.memory.DeviceModel` for memory planning (measured on the GPU
        if not given).
      **overrides: KerasOptions settings by name, over `options` (memory_budget="16GiB",
        trial_steps=0, ...); a name that is no setting, or a bad value, is an OptionsError
        naming it.

    After planning, `report` holds the plan of every layer and the layers left alone with why,
    the memory plan and step trial where they ran, and each decision with why; `accumulation`
    (else `accumulation_refused`, why not) or `memory_plan` the memory plan as made.
    """

    def __init__(self, workspace_limit: Size = ..., planner: Optional[LayerPlanner] = None, *,
                 options: Optional[KerasOptions] = None,
                 device_model: Optional[DeviceModel] = None, **overrides):
        super().__init__()
        if workspace_limit is not ...:
            overrides["workspace_limit"] = workspace_limit
        self.options = KerasOptions.resolve(options, **overrides)
        self.options.check_planner(planner)
        self.planner, self.device_model = planner, device_model
        self.strategies: Optional[Strategies] = None  # chosen when training begins
        self._planned = False
        self._trial: Optional[RunningTrial] = None
        self._step_began: Optional[float] = None
        self._keras_step = None  # Keras's train function as it made it, before any plan

    @property
    def report(self) -> Optional[RewriteReport]:
        return self.strategies.report() if self._planned else None

    @property
    def accumulation(self) -> Optional[AccumulationPlan]:
        plan = self.strategies and self.strategies.memory.plan
        return plan if isinstance(plan, AccumulationPlan) else None

    @property
    def accumulation_refused(self) -> Optional[str]:
        return self.strategies and self.strategies.memory.passed_over.get(AccumulatedSteps.NAME)

    @property
    def memory_plan(self) -> Optional[KerasStepPlan]:
        return getattr(self.strategies and self.strategies.memory, "step_plan", None)

    @property
    def unfused_batch_norm(self) -> list:
        return self.strategies.batch_norm.unfused if self.strategies else []

    @property
    def unstreamed(self) -> list:
        return self.strategies.batch_norm.unstreamed if self.strategies else []

    # Keras hooks.

    def on_train_begin(self, logs=None):
        self._planned, self._trial, self._step_began = False, None, None
        self.strategies = choose_strategies(self.model, self.options, self.planner,
                                            self.device_model, self.params.get("steps"))
        self.strategies.begin()
        self._retrace()
        self._keras_step = self.model.train_function
        if self.strategies.memory.plans_at_first_batch:
            self.model.train_function = self._planning_train_function
            return
        # A first step that fails (out of memory, say) gives the model its own layers back too.
        self._install(self._keras_step)
        if not self.strategies.convolutions.patched:  # nothing to plan: the report says why now
            self._planned = True
            self._print_summary()

    def on_epoch_begin(self, epoch, logs=None):
        # Layers measured at the last epoch's end that now get plans: planned, and tried anew.
        if self._planned and self._trial is None and \
                self.strategies.convolutions.newly_plannable():
            self._plan_and_train(self.strategies.convolutions.replan)

    def on_epoch_end(self, epoch, logs=None):
        if self._planned:
            self.strategies.convolutions.measure_pending()

    def on_train_batch_begin(self, batch, logs=None):
        if self._trial is not None or (
                not self._planned and self.strategies.convolutions.profiling.wants_step_time()):
            self._step_began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # Keras hands this callback (not marked async-safe) the step's logs as numbers: the step
        # has finished on the device by now.
        seconds = None
        if self._step_began is not None:
            seconds, self._step_began = time.perf_counter() - self._step_began, None
        if self._trial is not None:
            self._trial_step_timed(seconds)
        elif not self._planned:
            convolutions = self.strategies.convolutions
            convolutions.step_ended(seconds)
            if convolutions.ready_to_plan:
                self._plan_and_train(convolutions.plan_observed)

    def on_train_end(self, logs=None):
        self._trial = None
        self.strategies.close()
        self._retrace()

    def summary(self) -> str:
        report = self.report
        if report is None:
            return "tf_ucudnn: no plans yet (they are made at the first training step)"
        within = (f" within {self.options.describe_workspace()}"
                  if self.options.plans_convolutions else "")
        lines = [f"tf_ucudnn: {len(report.layers)} convolution layer(s) micro-batched{within}, "
                 f"{len(report.left_alone)} left as they are"
                 + ("; the step compiled by XLA" if self.model.jit_compile else "")]
        lines += report.to_text().splitlines()[1:]
        return "\n".join(lines + self.strategies.batch_norm.summary_lines())

    # Planning.

    def _plan_and_train(self, plan_layers) -> None:
        """Plans the layers (`plan_layers()`) and trains with the plans from the next step on,
        timed against Keras's own step first where the trial strategy says so."""
        strategies = self.strategies
        try:
            plan_layers()
            self._planned = True
            batch_norm_tried = strategies.batch_norm.try_trial_kernel()
            self._print_summary()
            # With nothing planned, the step as compiled goes on: tracing it again would cost
            # XLA a compilation for the same step.
            if strategies.convolutions.layers or batch_norm_tried:
                self._retrace()
                planned = self.model.train_function
                self._trial = strategies.trial.start(
                    planned, self._keras_step, keras_own(self.model.jit_compile, batch_norm_tried))
                self._install(planned)
        except BaseException:
            self.on_train_end()  # Keras skips it when training stops on an error
            raise

    def _planning_train_function(self, iterator):
        """The first step under a memory budget: the memory strategy plans at the first batch's
        shape and trains it with the planned step, which later calls run too."""
        next_data = iterator.get_next_as_optional()
        if not next_data.has_value():
            raise StopIteration
        try:
            logs = self.strategies.memory.first_step(next_data.get_value())
        except BaseException:
            self.on_train_end()  # Keras skips it when training stops on an error
            raise
        self._planned = True
        self._install(self.model.train_function)
        self._print_summary()
        return logs

    def _trial_step_timed(self, seconds: float) -> None:
        next_step = self._trial.step_timed(seconds)
        if next_step is not None:
            self._install(next_step)
            return
        trial, self._trial = self._trial, None
        if trial.result.kept == "plans":
            self._install(trial.planned)
        else:
            self.strategies.convolutions.drop_plans(trial.rejection())
            self.strategies.batch_norm.drop_trial_kernel()
            # The step compiled before the plans runs on; tests and predictions trace again.
            self._install(trial.unplanned)
            self.model.test_function = self.model.predict_function = None
        if self.options.verbose:
            print("tf_ucudnn:" + trial.result.to_text()[1:], flush=True)

    def _print_summary(self) -> None:
        if self.options.verbose:
            print(self.summary(), flush=True)

    # Keras's functions.

    def _retrace(self) -> None:
        retrace(self.model)

    def _install(self, train_function) -> None:
        self.model.train_function = self._guarded(train_function)

    def _guarded(self, inner):
        """`inner` training its batches as the input strategy says; a step that fails gives the
        model its own layers back before the error goes on: Keras calls no callback when
        training stops on an error."""
        batches = self.strategies.input

        def train_function(iterator):
            try:
                return batches.train(inner, iterator)
            except StopIteration:  # the end of an epoch, not an error
                raise
            except BaseException:
                self.on_train_end()
                raise
        train_function.__qualname__ = inner.__qualname__
        return train_function
