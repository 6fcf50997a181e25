"""Training beyond device memory, on graphs: liveness analysis (`analysis`), the cost of a step
(`cost`), the search that decides what to swap and recompute (`search`), and the passes that do
it (`passes`). The Keras-level forms (micro-batched first layers, the batch-size tuner) are in
`tf_ucudnn.keras`."""

from tf_ucudnn.memory.analysis.liveness import LivenessReport, analyze
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.cost.simulator import predict
from tf_ucudnn.memory.passes.graph_prefix import micro_batched_prefix, prefix_cuts
from tf_ucudnn.memory.passes.recompute import Recompute, insert_recomputes
from tf_ucudnn.memory.passes.swap import Swap, insert_swaps
from tf_ucudnn.memory.search.greedy import BudgetError, MemoryDecisions, plan_memory
from tf_ucudnn.memory.search.prefix_search import PrefixStepPlan, plan_step_with_prefix

__all__ = [
    "BudgetError", "DeviceModel", "LivenessReport", "MemoryDecisions", "PrefixStepPlan",
    "Recompute", "Swap", "analyze", "insert_recomputes", "insert_swaps", "micro_batched_prefix",
    "plan_memory", "plan_step_with_prefix", "predict", "prefix_cuts",
]
