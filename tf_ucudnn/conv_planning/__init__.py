"""Offline planning from measured timings: the per-kernel DP, the network ILP and plan reports."""

from tf_ucudnn.conv_planning.kernel_dp import (
    NONDETERMINISTIC_ALGORITHMS,
    KernelConfiguration,
    NoFeasiblePlanError,
    fastest_configuration,
    is_deterministic,
    pareto_configurations,
)
from tf_ucudnn.conv_planning.network_ilp import (
    DYNAMIC_ALLOCATOR,
    MODES,
    SHARED_WORKSPACE,
    InfeasibleBudgetError,
    KernelOptions,
    NetworkPlan,
    PlannedKernel,
    optimize_network,
)
from tf_ucudnn.conv_planning.plan_report import (
    KernelReport,
    PlanReport,
    kernel_limit_report,
    network_report,
)

__all__ = [
    "DYNAMIC_ALLOCATOR", "MODES", "NONDETERMINISTIC_ALGORITHMS", "SHARED_WORKSPACE",
    "InfeasibleBudgetError", "KernelConfiguration", "KernelOptions", "KernelReport",
    "NetworkPlan", "NoFeasiblePlanError", "PlanReport", "PlannedKernel",
    "fastest_configuration", "is_deterministic", "kernel_limit_report", "network_report",
    "optimize_network", "pareto_configurations",
]
