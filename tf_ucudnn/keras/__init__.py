"""Keras-level training: the callback and the decisions it makes (`strategies/`), layer patching,
batch-norm forms, streamed conv+BN, micro-batched first layers and the batch-size tuner."""

from tf_ucudnn.keras.batch_size_tuner import TuningReport, tune_batch_size, tune_keras_batch_size
from tf_ucudnn.keras.micro_batched_prefix import cut, run_in_micro_batches
from tf_ucudnn.keras.planned_step import KerasStepPlan, keras_training_step, plan_keras_step
from tf_ucudnn.keras.step_timing import MeasuredStep

__all__ = ["KerasStepPlan", "MeasuredStep", "TuningReport", "cut", "keras_training_step",
           "plan_keras_step", "run_in_micro_batches", "tune_batch_size", "tune_keras_batch_size"]
