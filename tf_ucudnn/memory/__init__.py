"""Training beyond device memory: liveness analysis, the performance model that plans swapping and
recomputation, the passes that make them, and out-of-core convolution."""

from tf_ucudnn.memory.liveness import LivenessReport, analyze
from tf_ucudnn.memory.out_of_core import out_of_core_conv2d
from tf_ucudnn.memory.performance_model import (
    BudgetError,
    DeviceModel,
    MemoryDecisions,
    plan_memory,
    predict,
)
from tf_ucudnn.memory.recompute import Recompute, insert_recomputes
from tf_ucudnn.memory.swap import Swap, insert_swaps

__all__ = [
    "BudgetError", "DeviceModel", "LivenessReport", "MemoryDecisions", "Recompute", "Swap",
    "analyze", "insert_recomputes", "insert_swaps", "out_of_core_conv2d", "plan_memory",
    "predict",
]
