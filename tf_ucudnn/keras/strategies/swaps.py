"""Memory handled by swaps and recomputations: the step traced at the first batch's size and
trained, without XLA, with the swaps and recomputations `tf_ucudnn.rewrite` plans for it, the
planned kernels' workspaces chosen with them; if no such plan fits, the model's first layers run in
micro-batches too (`tf_ucudnn.keras.planned_step`). Any model can be planned so: this kind is the
last one tried. A budget it cannot meet stops training with a BudgetError saying by how much."""

from __future__ import annotations

import contextlib
from typing import Mapping, Optional

import keras
import tensorflow as tf

from tf_ucudnn.keras.layers import switch_convolution
from tf_ucudnn.keras.micro_batched_prefix import micro_batched_calls
from tf_ucudnn.keras.planned_layers import PatchedLayer, planned_op
from tf_ucudnn.keras.planned_step import (
    KerasStepPlan,
    TracedStep,
    plan_keras_step,
    plan_keras_step_with_workspaces,
)
from tf_ucudnn.keras.strategies.base import retrace
from tf_ucudnn.keras.strategies.memory import MemoryStrategy, batch_specs
from tf_ucudnn.memory.cost.device_model import DeviceModel


@contextlib.contextmanager
def jit_compile_off(model: keras.Model):
    """The model's step not compiled by XLA while open; its own setting back after."""
    kept = model.jit_compile
    model.jit_compile = False
    try:
        yield
    finally:
        model.jit_compile = kept


class SwapsAndRecomputations(MemoryStrategy):
    """`step_plan`: the KerasStepPlan, once made; `plan` its MemoryPlan."""

    NAME = "swaps_and_recomputations"

    def __init__(self, model, options, convolutions, device_model=None, passed_over=None):
        passed = "; ".join(f"not {name}: {why}" for name, why in (passed_over or {}).items())
        xla = "; XLA off (it would not keep the plan's order)" if model.jit_compile else ""
        super().__init__((passed or "the kind any model can take") + xla, model, options,
                         convolutions, device_model, passed_over)
        self.step_plan: Optional[KerasStepPlan] = None

    def begin(self) -> None:
        if self.model.jit_compile:
            # The planned step orders its swaps and recomputations by control edges, which XLA
            # would not keep: XLA is off from the first step on (sparing a compilation for one
            # step).
            self.undo.enter_context(jit_compile_off(self.model))

    def first_step(self, data):
        if self.options.verbose and self.options.accumulate_gradients:
            for name, why in self.passed_over.items():
                print(f"tf_ucudnn: the step is not run as {name}: {why}", flush=True)
        specs = batch_specs(data)
        self.convolutions.plan_as_traced(specs)
        retrace(self.model)
        return self._plan_memory(specs)(data)

    def _plan_memory(self, specs):
        """Plans the step's memory for data of `specs`, makes the planned step Keras's train
        function, and returns what trains one batch with it."""
        model, options = self.model, self.options
        batch = tf.nest.flatten(specs)[0].shape[0]
        own_step = tf.function(model.train_step)
        device_model = self.device_model or DeviceModel.measure()
        # The layers whose kernels have a front of plans to choose their workspaces from.
        planned = {p.layer.path: p for p in self.convolutions.patched if p.plan and p.fronts}

        def trace(choice: Mapping, prefix_end: Optional[str] = None,
                  micro_batches: int = 1) -> TracedStep:
            self._set_kernel_plans(planned, choice)
            with micro_batched_calls(model, prefix_end, micro_batches) if prefix_end else \
                    contextlib.nullcontext():
                step = tf.function(model.train_step).get_concrete_function(specs)
            return TracedStep(step, {op: path for path, p in planned.items()
                                     for op in p.forward_ops})

        settings = {"micro_batches": options.micro_batches,
                    "whole_batches": options.whole_batches}
        fronts = {f"{path}|{kernel}": front for path, p in planned.items()
                  for kernel, front in p.fronts.items()}
        if fronts:
            step, self.step_plan, self.workspaces = plan_keras_step_with_workspaces(
                model, batch, options.memory_budget, device_model, fronts, trace, **settings)
            self._set_kernel_plans(planned, self.workspaces.chosen)
        else:
            step, self.step_plan = plan_keras_step(
                model, batch, options.memory_budget, device_model,
                trace=lambda layer, count: trace({}, layer, count).step, **settings)
        self.plan = self.step_plan.plan
        if options.verbose and self.step_plan.prefix_end:
            print(f"tf_ucudnn: layers up to {self.step_plan.prefix_end} run in "
                  f"{self.step_plan.micro_batches} micro-batches", flush=True)

        def train_one(data):
            if tf.nest.flatten(data)[0].shape[0] == batch:
                return step(*tf.nest.flatten(data))
            return own_step(data)  # another batch size (a last, partial one): no memory plan

        def train_function(iterator):
            next_data = iterator.get_next_as_optional()
            if not next_data.has_value():
                raise StopIteration
            return train_one(next_data.get_value())
        model.train_function = train_function
        return train_one

    @staticmethod
    def _set_kernel_plans(planned: dict[str, PatchedLayer], choice: Mapping) -> None:
        """Each "layer|kernel" of `choice` planned with its KernelConfiguration's plan."""
        for key, configuration in choice.items():
            path, kernel = key.split("|")
            patched = planned[path]
            patched.plan = patched.plan.with_kernel(kernel, configuration.plan)
            switch_convolution(patched.layer, planned_op(patched))
