"""The network-wide integer linear program: one configuration per kernel under a memory budget.

Each kernel of each layer offers its Pareto front of (time, workspace) configurations (see
`kernel_dp.pareto_configurations`); the ILP picks exactly one per kernel to minimize the total
predicted time, in one of two memory models:

* `shared_workspace` (μ-cuDNN's workspace division): every kernel owns its workspace for the whole
  run, so the workspaces together must fit the budget:  sum_k workspace_k <= budget.
* `dynamic_allocator`: workspaces are allocated just before a kernel runs and freed after it (as
  TensorFlow's allocator does), so each kernel only has to fit beside the tensors live at that
  point:  live_k + workspace_k <= budget, one constraint per kernel in execution order. The
  constraints share no variables, so this is a per-kernel choice; it is kept in the same ILP so
  that both modes give the same kind of answer and error.

Solved exactly (no optimality gap) with PuLP's bundled CBC, serially, so that results do not
depend on the machine.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import pulp

from tf_ucudnn.conv_planning.kernel_dp import KernelConfiguration
from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import KERNELS, KernelPlan, LayerPlan

SHARED_WORKSPACE = "shared_workspace"
DYNAMIC_ALLOCATOR = "dynamic_allocator"
MODES = (SHARED_WORKSPACE, DYNAMIC_ALLOCATOR)

# The model is written in MiB: byte counts reach 1e10, which would strain CBC's tolerances.
# Dividing by a power of two is exact, and the choice is checked in whole bytes afterwards.
_MIB = float(1 << 20)


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """The configurations one kernel may use, and the bytes of tensors live while it runs."""

    layer: str
    kernel: str
    configurations: tuple[KernelConfiguration, ...]
    live_bytes: int = 0  # used by the dynamic_allocator mode only

    def __post_init__(self):
        object.__setattr__(self, "configurations", tuple(self.configurations))
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not self.configurations:
            raise ValueError(f"{self.name} has no configurations to choose from")
        if self.live_bytes < 0:
            raise ValueError(f"{self.name}: live_bytes must be non-negative, got {self.live_bytes}")

    @property
    def name(self) -> str:
        return f"{self.layer}/{self.kernel}"


@dataclasses.dataclass(frozen=True)
class PlannedKernel:
    layer: str
    kernel: str
    configuration: KernelConfiguration
    live_bytes: int

    def to_json(self) -> dict:
        return {"layer": self.layer, "kernel": self.kernel, "live_bytes": self.live_bytes,
                **self.configuration.to_json()}


@dataclasses.dataclass(frozen=True)
class NetworkPlan:
    """The ILP's choice, kernels in the order given. `memory_bytes` is what the budget bounds:
    the sum of workspaces (shared_workspace) or the peak of live bytes + workspace
    (dynamic_allocator)."""

    mode: str
    budget_bytes: int
    kernels: tuple[PlannedKernel, ...]
    total_time_ms: float
    memory_bytes: int

    def layer_plans(self) -> dict[str, LayerPlan]:
        """Plans by layer, ready for the ops; kernels not in the ILP keep the default plan."""
        by_layer: dict[str, dict[str, KernelPlan]] = {}
        for planned in self.kernels:
            by_layer.setdefault(planned.layer, {})[planned.kernel] = planned.configuration.plan
        return {layer: LayerPlan(*(plans.get(name, KernelPlan()) for name in KERNELS))
                for layer, plans in by_layer.items()}

    def to_json(self) -> dict:
        return {"mode": self.mode, "budget_bytes": self.budget_bytes,
                "total_time_ms": self.total_time_ms, "memory_bytes": self.memory_bytes,
                "kernels": [planned.to_json() for planned in self.kernels]}


class InfeasibleBudgetError(TfUcudnnError, ValueError):
    """No choice of configurations fits the budget. `shortfall_bytes` says by how much at least,
    `kernels` names the kernels (layer/kernel) that cannot fit or need the most."""

    def __init__(self, message: str, shortfall_bytes: int, kernels: Sequence[str]):
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes
        self.kernels = tuple(kernels)


def optimize_network(options: Sequence[KernelOptions], budget_bytes: int,
                     mode: str = SHARED_WORKSPACE) -> NetworkPlan:
    """Picks one configuration per kernel to minimize total time; kernels in execution order."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not options:
        raise ValueError("no kernels to plan")
    names = [o.name for o in options]
    if len(set(names)) != len(names):
        raise ValueError(f"each layer/kernel may appear once; repeated: "
                         f"{sorted({n for n in names if names.count(n) > 1})}")
    _check_feasible(options, budget_bytes, mode)

    # Under a shared workspace, kernels with the same configurations (repeated blocks) are
    # interchangeable: one integer count per configuration replaces one binary per kernel. Without
    # this, the symmetric duplicates make CBC's proof of optimality take minutes at ResNet size.
    groups: dict = {}
    for k, o in enumerate(options):
        groups.setdefault(o.configurations if mode == SHARED_WORKSPACE else k, []).append(k)
    members = list(groups.values())

    problem = pulp.LpProblem("tf_ucudnn_network", pulp.LpMinimize)
    counts = [[problem.add_variable(f"n_{g}_{i}", lowBound=0, upBound=len(kernels),
                                    cat=pulp.LpInteger)
               for i in range(len(options[kernels[0]].configurations))]
              for g, kernels in enumerate(members)]

    def total(value_of):  # sum over all chosen configurations of value_of(configuration)
        return pulp.LpAffineExpression(
            [(n, value_of(c)) for kernels, ns in zip(members, counts)
             for n, c in zip(ns, options[kernels[0]].configurations)])

    problem.setObjective(total(lambda c: c.time_ms))
    for g, (kernels, ns) in enumerate(zip(members, counts)):
        problem.addConstraint(pulp.LpAffineExpression([(n, 1.0) for n in ns]) == len(kernels),
                              f"choose_{g}")
    if mode == SHARED_WORKSPACE:
        problem.addConstraint(total(lambda c: c.workspace_bytes / _MIB) <= budget_bytes / _MIB,
                              "budget")
    else:
        for g, ([k], ns) in enumerate(zip(members, counts)):
            problem.addConstraint(pulp.LpAffineExpression(
                [(n, c.workspace_bytes / _MIB) for n, c in zip(ns, options[k].configurations)])
                <= (budget_bytes - options[k].live_bytes) / _MIB, f"budget_{g}")

    problem.solve(_solver())
    if problem.status != pulp.LpStatusOptimal:
        raise RuntimeError(f"CBC did not solve the network ILP: {pulp.LpStatus[problem.status]}")

    # Hand each group's chosen configurations to its kernels, both in the order given.
    chosen: dict[int, KernelConfiguration] = {}
    for kernels, ns in zip(members, counts):
        configurations = options[kernels[0]].configurations
        picks = [c for n, c in zip(ns, configurations) for _ in range(round(n.value()))]
        if len(picks) != len(kernels):
            raise RuntimeError(f"CBC's solution is not integral for {options[kernels[0]].name}")
        chosen.update(zip(kernels, picks))
    planned = [PlannedKernel(o.layer, o.kernel, chosen[k], o.live_bytes)
               for k, o in enumerate(options)]
    if mode == SHARED_WORKSPACE:
        memory = sum(p.configuration.workspace_bytes for p in planned)
    else:
        memory = max(p.live_bytes + p.configuration.workspace_bytes for p in planned)
    if memory > budget_bytes:  # guards against solver tolerances; whole bytes are the truth
        raise RuntimeError(f"CBC's solution needs {memory} bytes, over the budget {budget_bytes}")
    return NetworkPlan(mode=mode, budget_bytes=budget_bytes, kernels=tuple(planned),
                       total_time_ms=sum(p.configuration.time_ms for p in planned),
                       memory_bytes=memory)


def _check_feasible(options: Sequence[KernelOptions], budget_bytes: int, mode: str) -> None:
    """Raises InfeasibleBudgetError naming the culprits, before the solver would just say 'no'."""
    smallest = {o.name: min(c.workspace_bytes for c in o.configurations) for o in options}
    if mode == SHARED_WORKSPACE:
        shortfall = sum(smallest.values()) - budget_bytes
        if shortfall > 0:
            largest = sorted(smallest, key=lambda name: (-smallest[name], name))[:3]
            listing = ", ".join(f"{name} ({smallest[name]} bytes)" for name in largest)
            raise InfeasibleBudgetError(
                f"the smallest workspaces of all {len(options)} kernels add up to "
                f"{sum(smallest.values())} bytes, {shortfall} bytes over the budget of "
                f"{budget_bytes}; the largest are {listing}", shortfall, largest)
    else:
        over = {o.name: o.live_bytes + smallest[o.name] - budget_bytes for o in options}
        failing = [o for o in options if over[o.name] > 0]
        if failing:
            worst = max(failing, key=lambda o: over[o.name])
            raise InfeasibleBudgetError(
                f"{len(failing)} kernel(s) cannot fit the budget of {budget_bytes} bytes; worst: "
                f"{worst.name} needs {worst.live_bytes} live + {smallest[worst.name]} workspace "
                f"bytes, {over[worst.name]} bytes over", over[worst.name],
                [o.name for o in failing])


def _solver() -> pulp.LpSolver:
    # PuLP 3.x marks its bundled CBC as deprecated (removed in PuLP 4); it is still the solver
    # that comes with every install, so the warning is only noise for our users.
    # No `threads` option: CBC's default search is serial (deterministic), whereas asking for
    # threads, even one, starts a thread pool that now and then stalls the bundled CBC 2.10.3
    # for 10 s.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, gapRel=0.0)
