"""Memory handled by running the whole step in micro-batches with their gradients summed
(`tf_ucudnn.keras.accumulated_step`): for a model whose layers treat each sample on its own (or
whose batch normalization is asked to take each micro-batch's statistics) and whose loss is
averaged over the batch, the same update as the whole batch, compiled by XLA as the model says, in
the largest micro-batches the budget lets the analysis predict."""

from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf

from tf_ucudnn.keras.accumulated_step import (
    AccumulationPlan,
    accumulated_train_step,
    accumulation_refusal,
    compiled_step_peak,
    plan_accumulation,
    train_first_batch,
    train_step_trace,
)
from tf_ucudnn.keras.strategies.base import retrace
from tf_ucudnn.keras.strategies.memory import MemoryStrategy, batch_specs
from tf_ucudnn.options import KerasOptions


class AccumulatedSteps(MemoryStrategy):
    """`plan`: the AccumulationPlan, once made."""

    NAME = AccumulationPlan.kind

    def __init__(self, model, options, convolutions, device_model=None, passed_over=None):
        super().__init__("each sample's loss and gradient are its own: the whole step in "
                         "micro-batches, gradients summed", model, options, convolutions,
                         device_model, passed_over)

    @classmethod
    def refusal(cls, model: keras.Model, options: KerasOptions) -> Optional[str]:
        if not options.accumulate_gradients:
            return "accumulate_gradients=False"
        return accumulation_refusal(model, options.batch_norm_statistics)

    def first_step(self, data):
        """Plans the micro-batch for the first batch, and trains that batch in micro-batches,
        smaller ones if a GPU says so, the layers planned again for each smaller one."""
        specs = batch_specs(data)
        self.plan = plan_accumulation(self.model, tf.nest.flatten(specs)[0].shape[0],
                                      self.options.memory_budget,
                                      train_step_trace(self.model, specs),
                                      self.options.batch_norm_statistics,
                                      compiled_step_peak(self.model, specs))
        self.undo.callback(self.model.__dict__.pop, "train_step", None)
        self._train_in_micro_batches(self.plan.micro_batch_size, specs)
        # The plan is printed with the callback's summary, after the first batch.
        return train_first_batch(  # Keras's train function takes any iterable of batches
            self.plan, data, lambda batches: self.model.train_function(batches),
            lambda size: self._train_in_micro_batches(size, specs), self.options.verbose)

    def _train_in_micro_batches(self, size: int, specs) -> None:
        """Keras's step over micro-batches of `size`, its convolutions planned for them."""
        self.model.__dict__["train_step"] = accumulated_train_step(self.model, size)
        self.convolutions.plan_as_traced(specs)
        retrace(self.model)
