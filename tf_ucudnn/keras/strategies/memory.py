"""How the training step meets the options' memory budget: the kinds' common protocol, and the
kind without a budget.

Under a budget the first step may not fit as it is, so none runs unplanned: the callback hands the
first batch to the kind's `first_step`, which plans the convolutions at the batch's shape
(`ConvolutionPlanning.plan_as_traced`), plans the step, makes Keras's train function train with
that plan, and trains the batch. The kinds are tried in the order of `choice.MEMORY_KINDS`, each
saying why it cannot train the model (`refusal`) or taking it; the last one takes any model. A new
kind subclasses `MemoryStrategy` and is listed there.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import keras
import tensorflow as tf

from tf_ucudnn.core.step_memory_plan import StepMemoryPlan
from tf_ucudnn.keras.strategies.base import Strategy
from tf_ucudnn.keras.strategies.convolutions import ConvolutionPlanning
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.options import KerasOptions


def batch_specs(data):
    """The TensorSpecs of one batch of Keras's data."""
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), data)


class MemoryStrategy(Strategy):
    """One kind of memory handling. `plan`: its StepMemoryPlan once made, for the report;
    `workspaces`: the kernels' workspaces chosen with it (a WorkspacePlan), where it chose them;
    `passed_over`: the kinds tried before it, by name, with why each refused the model."""

    NAME: ClassVar[str]
    # False: Keras's own first step runs as it is, and the convolutions are planned after it.
    plans_at_first_batch: ClassVar[bool] = True

    def __init__(self, reason: str, model: keras.Model, options: KerasOptions,
                 convolutions: ConvolutionPlanning, device_model: Optional[DeviceModel] = None,
                 passed_over: Optional[dict] = None):
        super().__init__(self.NAME, reason)
        self.model, self.options, self.convolutions = model, options, convolutions
        self.device_model = device_model
        self.passed_over = dict(passed_over or {})
        self.plan: Optional[StepMemoryPlan] = None
        self.workspaces = None

    @classmethod
    def refusal(cls, model: keras.Model, options: KerasOptions) -> Optional[str]:
        """Why this kind cannot train `model` under the options' budget, or None."""
        return None

    def first_step(self, data):
        """Plans the step at the first batch `data` and trains it; returns Keras's logs."""
        raise NotImplementedError(f"{type(self).__name__} does not plan at the first batch")


class NoMemoryPlan(MemoryStrategy):
    NAME = "none"
    plans_at_first_batch = False

    def __init__(self, model: keras.Model, options: KerasOptions,
                 convolutions: ConvolutionPlanning, device_model=None, passed_over=None):
        super().__init__("no memory_budget", model, options, convolutions)
