"""The memory planner: a training step's swaps and recomputations under a memory budget, made.

From the step's liveness (tensors, sizes, execution order) and each op's time (measured where
given, else the device model's roofline), `plan_memory` chooses what to swap and what to recompute
so that the predicted peak fits the budget at the least predicted step time; the swap and
recomputation passes then change the graph accordingly. A budget that cannot be met raises
BudgetError, saying by how much, before anything runs.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import tensorflow as tf

from tf_ucudnn.graph.functions import callable_over
from tf_ucudnn.memory.liveness import ALIASING_OPS, LivenessReport, analyze
from tf_ucudnn.memory.performance_model import DeviceModel, MemoryDecisions, plan_memory
from tf_ucudnn.memory.recompute import Recompute, insert_recomputes, recomputable
from tf_ucudnn.memory.swap import Swap, insert_swaps

MIB = 1 << 20


@dataclasses.dataclass
class MemoryPlan:
    """What was decided, and the predictions before and after, as plain data."""

    budget_bytes: int
    liveness: LivenessReport
    decisions: MemoryDecisions
    swaps: list[Swap]
    recomputes: list[Recompute]

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "unplanned_peak_bytes":
                self.liveness.peak_bytes + self.liveness.persistent_bytes,
                "decisions": self.decisions.to_json(),
                "swaps": [dataclasses.asdict(s) for s in self.swaps],
                "recomputes": [dataclasses.asdict(r) for r in self.recomputes]}

    def to_text(self) -> str:
        prediction = self.decisions.prediction
        before = self.liveness.peak_bytes + self.liveness.persistent_bytes
        return (f"memory plan for a {self.budget_bytes / MIB:.1f} MiB budget: peak "
                f"{before / MIB:.1f} -> {prediction.peak_bytes / MIB:.1f} MiB with "
                f"{len(self.swaps)} swap(s) and {len(self.recomputes)} recomputation(s); "
                f"predicted step {prediction.step_ms:.3f} ms, of which "
                f"{prediction.exposed_transfer_ms:.3f} ms waiting for transfers")


def _op_times(graph: tf.Graph, model: DeviceModel,
              measured_ms: Optional[Mapping[str, float]]) -> list[float]:
    measured_ms = measured_ms or {}
    return [measured_ms.get(op.name, model.op_ms(op)) for op in graph.get_operations()]


def _recompute_costs(graph: tf.Graph, report: LivenessReport, op_ms) -> dict[str, float]:
    """Kept tensors whose producer may run again, whose inputs are held until then anyway, and
    whose backward readers read them directly (not through an alias)."""
    operations = graph.get_operations()
    last_use = {t.name: max(t.consumers, default=t.producer) for t in report.tensors}
    costs = {}
    for tensor in report.kept():
        producer = operations[tensor.producer]
        if recomputable(producer) is not None:
            continue
        first_backward = tensor.backward_consumers[0]
        direct = all(any(read.name == tensor.name for read in operations[i].inputs)
                     for i in tensor.backward_consumers)
        held = all(last_use.get(t.name, first_backward) >= first_backward
                   for t in producer.inputs)
        if direct and held:
            costs[tensor.name] = op_ms[tensor.producer]
    return costs


def plan_step_memory(function, budget_bytes: int, model: DeviceModel,
                     measured_ms: Optional[Mapping[str, float]] = None) -> MemoryPlan:
    """Plans a training step's memory (a ConcreteFunction with its gradient ops)."""
    graph = function.graph
    report = analyze(function)
    op_ms = _op_times(graph, model, measured_ms)
    operations = graph.get_operations()

    def anchored(index: int, consumers) -> int:
        """The op at `index`, or the last one before it fit to start a swap-in or recomputation
        after. Not ops without inputs (constants run whenever the executor likes, so they time
        nothing); not stateful ones (variable reads get ordering edges of their own from
        tf.function); not ops sharing an input with a reader of the swapped tensor (TensorFlow's
        fusions, such as oneDNN's filter gradient with bias gradient, would merge the two and
        close a cycle through the swap-in)."""
        shared = {t.name for i in consumers for t in operations[i].inputs}

        def unfit(op):
            return (not op.inputs or op.op_def.is_stateful
                    or any(t.dtype in (tf.resource, tf.variant) for t in op.inputs)
                    or any(t.name in shared for t in op.inputs))
        while index > 0 and unfit(operations[index]):
            index -= 1
        return index

    decisions = plan_memory(op_ms, report.tensors, model, budget_bytes,
                            persistent_bytes=report.persistent_bytes,
                            recompute_ms=_recompute_costs(graph, report, op_ms),
                            candidates={t.name for t in report.kept()},
                            prefetch_point=lambda t, i: anchored(i, t.backward_consumers))
    by_name = {t.name: t for t in report.tensors}

    def readers(buffer: str):
        """Backward readers of a buffer, grouped by the tensor (buffer or alias) they read."""
        tensor = by_name[buffer]
        groups: dict[str, list[str]] = {}
        for index in tensor.backward_consumers:
            op = operations[index]
            for read in op.inputs:
                if _buffer(read) == buffer:
                    groups.setdefault(read.name, []).append(op.name)
        return groups

    swaps = [Swap(read, tuple(dict.fromkeys(names)), operations[decision.prefetch_after].name)
             for decision in decisions.swaps
             for read, names in readers(decision.tensor).items()]
    recomputes = [Recompute(read, tuple(dict.fromkeys(names)),
                            operations[anchored(by_name[decision.tensor].backward_consumers[0] - 1,
                                                by_name[decision.tensor].backward_consumers)].name)
                  for decision in decisions.recomputes
                  for read, names in readers(decision.tensor).items()]
    return MemoryPlan(budget_bytes, report, decisions, swaps, recomputes)


def _buffer(tensor: tf.Tensor) -> str:
    while tensor.op.type in ALIASING_OPS and tensor.op.inputs and \
            tensor.op.inputs[0].dtype not in (tf.resource, tf.variant):
        tensor = tensor.op.inputs[0]
    return tensor.name


def apply_memory_plan(function, plan: MemoryPlan):
    """The step with the plan's recomputations and swaps made, as a tf.function."""
    graph_def = insert_recomputes(function.graph.as_graph_def(), plan.recomputes, function.graph)
    graph_def = insert_swaps(graph_def, plan.swaps)
    return callable_over(graph_def, function)
