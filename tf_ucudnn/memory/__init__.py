"""Training beyond device memory: liveness analysis, the performance model that plans swapping and
recomputation, the passes that make them, out-of-core convolution, and the batch-size tuner."""

from tf_ucudnn.memory.graph_prefix import micro_batch_prefix, prefix_cuts
from tf_ucudnn.memory.liveness import LivenessReport, analyze
from tf_ucudnn.memory.out_of_core import out_of_core_conv2d
from tf_ucudnn.memory.performance_model import (
    BudgetError,
    DeviceModel,
    MemoryDecisions,
    plan_memory,
    predict,
)
from tf_ucudnn.memory.planner import PrefixStepPlan, plan_step_with_prefix
from tf_ucudnn.memory.recompute import Recompute, insert_recomputes
from tf_ucudnn.memory.swap import Swap, insert_swaps
from tf_ucudnn.memory.microbatched_prefix import PrefixError, cut, run_in_micro_batches
from tf_ucudnn.memory.tuner import (
    KerasStepPlan,
    TuningReport,
    keras_training_step,
    plan_keras_step,
    tune_batch_size,
    tune_keras_batch_size,
)

__all__ = [
    "BudgetError", "DeviceModel", "KerasStepPlan", "LivenessReport", "MemoryDecisions",
    "PrefixError", "PrefixStepPlan", "Recompute", "Swap", "TuningReport", "analyze", "cut",
    "insert_recomputes", "insert_swaps", "keras_training_step", "micro_batch_prefix",
    "out_of_core_conv2d", "plan_keras_step", "plan_memory", "plan_step_with_prefix", "predict",
    "prefix_cuts", "run_in_micro_batches", "tune_batch_size", "tune_keras_batch_size",
]
