"""Each planned convolution kernel's workspace, chosen together with the step's swaps and
recomputations under one budget.

A kernel tf_ucudnn plans has a Pareto front of plans (μ-cuDNN's desirable set): less workspace,
more time. Its workspace is held while its op runs, and the liveness analysis counts it there
(`<op>:scratch`), so it can be the step's peak. Every kernel starts with its fastest plan
within the workspace limit. Then, while the op running at the predicted peak is such a kernel
with a plan of less workspace, that plan is tried: it is kept where the step then fits the
budget where it did not (or misses it by no more), or fits with a shorter predicted step (the
memory plan's, plus the kernels' measured extra time). Each try is one memory plan.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence

from tf_ucudnn.conv_planning.kernel_dp import KernelConfiguration
from tf_ucudnn.core.units import format_bytes
from tf_ucudnn.graph.functions import CALL_SCOPE, callable_over
from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.passes.node_edits import set_kernel_plan
from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.prefix_search import choose_prefix


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What planning the step's memory with some kernels' plans gave: the planned result (None
    if the budget was missed), its predicted step time, and the op (node name) at the peak."""

    result: object
    step_ms: Optional[float]
    peak_node: str
    error: Optional[BudgetError] = None


@dataclasses.dataclass(frozen=True)
class KernelWorkspace:
    """One kernel's chosen plan against its fastest."""

    node: str
    chosen: KernelConfiguration
    fastest: KernelConfiguration

    @property
    def extra_ms(self) -> float:
        return self.chosen.time_ms - self.fastest.time_ms

    def to_json(self) -> dict:
        return {"node": self.node, "workspace_bytes": self.chosen.workspace_bytes,
                "time_ms": self.chosen.time_ms,
                "fastest_workspace_bytes": self.fastest.workspace_bytes,
                "fastest_time_ms": self.fastest.time_ms, "plan": self.chosen.plan.to_json()}


@dataclasses.dataclass
class WorkspacePlan:
    """The kernels whose workspace the budget lowered, and each step down tried, with why it
    was kept or not; `chosen`, every kernel's plan as chosen (its fastest, or its lowered one)."""

    lowered: list[KernelWorkspace]
    tried: list[str]
    chosen: dict = dataclasses.field(default_factory=dict)

    @property
    def extra_ms(self) -> float:
        return sum(k.extra_ms for k in self.lowered)

    def to_json(self) -> dict:
        return {"lowered": [k.to_json() for k in self.lowered], "extra_ms": self.extra_ms,
                "tried": self.tried}

    def to_text(self) -> str:
        if not self.lowered:
            return "every planned kernel keeps its fastest plan within the workspace limit"
        return "\n".join(
            [f"{len(self.lowered)} kernel(s) given less workspace for the budget, "
             f"{self.extra_ms:.3f} ms more:"]
            + [f"  {k.node}: {format_bytes(k.fastest.workspace_bytes)} -> "
               f"{format_bytes(k.chosen.workspace_bytes)}, +{k.extra_ms:.3f} ms"
               for k in self.lowered])


def choose_workspaces(fronts: Mapping[str, Sequence[KernelConfiguration]],
                      plan_for: Callable[[Mapping[str, KernelConfiguration]], StepOutcome],
                      ) -> tuple[StepOutcome, WorkspacePlan]:
    """The memory plan with each kernel's plan chosen (see the module's docstring). `fronts`
    gives each planned kernel's node its Pareto front (workspace ascending); `plan_for(choice)`
    plans the step's memory with those kernels' plans. Raises the last BudgetError if no choice
    fits."""
    fronts = {node: sorted(front, key=lambda c: c.workspace_bytes)
              for node, front in fronts.items() if front}
    position = {node: len(front) - 1 for node, front in fronts.items()}  # the fastest
    fastest = {node: front[-1] for node, front in fronts.items()}

    def choice():
        return {node: fronts[node][i] for node, i in position.items()}

    def planned() -> tuple[StepOutcome, Optional[float]]:
        """The memory plan with the current choice, and its cost: the predicted step with the
        kernels' extra time (None where the budget is missed)."""
        outcome = plan_for(choice())
        if outcome.result is None:
            return outcome, None
        return outcome, outcome.step_ms + sum(fronts[n][i].time_ms - fastest[n].time_ms
                                              for n, i in position.items())

    best, best_cost = planned()
    tried = []
    while best.peak_node in position and position[best.peak_node] > 0:
        node = best.peak_node
        position[node] -= 1
        candidate, cost = planned()
        down = (f"{node}: {format_bytes(fronts[node][position[node] + 1].workspace_bytes)} -> "
                f"{format_bytes(fronts[node][position[node]].workspace_bytes)}")
        # Missing the budget by no more: the peak may have moved to another kernel whose
        # workspace is as large, which the next round lowers.
        closer = (cost is None and best_cost is None
                  and candidate.error.shortfall_bytes <= best.error.shortfall_bytes)
        if closer or cost is not None and (best_cost is None or cost < best_cost):
            tried.append(f"{down}: kept ({_said(candidate, cost)})")
            best, best_cost = candidate, cost
            continue
        position[node] += 1
        tried.append(f"{down}: not kept ({_said(candidate, cost)})")
        break
    if best.result is None:
        raise best.error
    lowered = [KernelWorkspace(node, fronts[node][i], fastest[node])
               for node, i in position.items() if fronts[node][i] is not fastest[node]]
    return best, WorkspacePlan(lowered, tried, choice())


def _said(outcome: StepOutcome, cost: Optional[float]) -> str:
    if outcome.result is None:
        return f"the budget is missed by {format_bytes(outcome.error.shortfall_bytes)}"
    return (f"predicted step {outcome.step_ms:.3f} ms, with the slower kernels "
            f"{cost:.3f} ms")


def choose_step_workspaces(step, fronts: Mapping[str, Sequence[KernelConfiguration]],
                           budget_bytes: int, device_model: DeviceModel,
                           step_ms: Optional[float], micro_batches: Sequence[int]):
    """`choose_prefix` for a step (a ConcreteFunction) whose planned convolution kernels (node
    name -> Pareto front) have their workspace chosen with the memory plan. Returns the step
    chosen (with those kernels' plans, and the prefix in micro-batches, if any), its
    PrefixStepPlan, whose plan `planned_graph_def` makes in it, and the WorkspacePlan."""
    # The step may run the rewritten graph imported under a scope: its nodes by their names
    # as the rewrite named them.
    in_step = {_node(op.name): op.name for op in step.graph.get_operations()}
    missing = sorted(set(fronts) - set(in_step))
    if missing:
        raise ValueError(f"planned kernels not in the step: {', '.join(missing)}")

    def plan_for(choice: Mapping[str, KernelConfiguration]) -> StepOutcome:
        graph_def = step.graph.as_graph_def()
        nodes = {node.name: node for node in graph_def.node}
        for name, configuration in choice.items():
            set_kernel_plan(nodes[in_step[name]], configuration.plan,
                            configuration.workspace_bytes)
        chosen = callable_over(graph_def, step).get_concrete_function()
        try:
            prefixed, prefix = choose_prefix(chosen, budget_bytes, device_model, step_ms,
                                             micro_batches)
        except BudgetError as error:
            # The error's op indexes whichever step it was closest with (whole batches or a
            # prefix in micro-batches): the step's own peak op names the kernel to lower.
            return StepOutcome(None, None, _node(analyze(chosen).peak_op), error)
        prediction = prefix.plan.decisions.prediction
        return StepOutcome((prefixed, prefix), prediction.step_ms,
                           _node(prefix.plan.liveness.ops[prediction.peak_op].name))

    outcome, workspaces = choose_workspaces(fronts, plan_for)
    prefixed, prefix = outcome.result
    return prefixed, prefix, workspaces


def _node(name: str) -> str:
    """A node's name in the step given, from its name in a step imported from it."""
    while name.startswith(f"{CALL_SCOPE}/"):
        name = name[len(CALL_SCOPE) + 1:]
    return name
