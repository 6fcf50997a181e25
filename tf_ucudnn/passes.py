"""The graph passes, each with a contract, and the manager that runs them in order.

    manager = PassManager((CONVOLUTION_REWRITE, MEMORY_PLANNING))
    graph_def, report = manager.run(graph_def, RewriteReport(), context, given={FUNCTION_GRAPH})

A pass takes a GraphDef and the report so far and hands on both, reading everything else from
one `PassContext`. It declares the properties it `requires` and those it `guarantees`. Before any
pass runs, the manager checks that each requirement is given with the input or guaranteed by an
earlier pass; after each pass, it runs the check of each property the pass guarantees. A
requirement not met, or a guarantee broken, is a `PassContractError` naming the pass and the
property. (After torch.fx's PassBase and PassManager, with declared properties, checked the same
way for every pass, in place of their requires/ensures hooks.)

This module sits above the passes it wraps (graph/rewrite.py, parallel/spatial_split.py and the
memory search of memory/search/) and below `pipeline`, which chooses the passes from the options.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.core.units import format_bytes
from tf_ucudnn.graph.functions import callable_over
from tf_ucudnn.graph.rewrite import REPLACEMENTS, rewrite_graph_def, unreported_convolutions
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.passes.graph_edits import unreplaced_readers
from tf_ucudnn.memory.search.prefix_search import choose_prefix
from tf_ucudnn.memory.search.step_plan import planned_graph_def
from tf_ucudnn.memory.search.workspace_choice import choose_step_workspaces
from tf_ucudnn.options import Options
from tf_ucudnn.parallel.spatial_split import SPLIT_CALL, split_graph_def
from tf_ucudnn.report import RewriteReport


class PassContractError(TfUcudnnError, RuntimeError):
    """A pass run where a property it requires does not hold, or a property it guarantees broken
    by it; names the pass and the property."""


@dataclasses.dataclass
class PassContext:
    """What a pass reads besides the graph_def and the report: the options, what the caller
    injected (the convolutions' planner, the device model, the step's measured time, the devices
    of a spatial split, why no layer may be fused), and what the graph_def is over."""

    options: Options
    planner: Optional[LayerPlanner] = None
    device_model: Optional[DeviceModel] = None
    step_ms: Optional[float] = None
    spatial_devices: tuple[str, ...] = ()
    unfused_because: Optional[str] = None
    # The ConcreteFunction whose inputs, outputs and variables the graph_def's placeholders are
    # (None for a bare graph); a pass that traces the step anew sets the one it traced.
    function: Optional[object] = None
    # The tf.Graph the graph_def was built from, for shapes a bare GraphDef may not hold (None:
    # imported where needed); the manager drops it once a pass hands on another graph_def.
    graph: Optional[tf.Graph] = None


@dataclasses.dataclass(frozen=True)
class PassOutcome:
    """What a guarantee is checked on: the graph_def a pass was given, the one it handed on, the
    report it handed on and the context."""

    before: graph_pb2.GraphDef
    after: graph_pb2.GraphDef
    report: RewriteReport
    context: PassContext


@dataclasses.dataclass(frozen=True)
class Property:
    """Something true of a graph_def and its report. `check` lists what breaks it in a pass's
    outcome (nothing where it holds); a property only the input can give has none."""

    description: str
    check: Optional[Callable[[PassOutcome], list[str]]] = dataclasses.field(
        default=None, compare=False, repr=False)


def _unreported(outcome: PassOutcome) -> list[str]:
    return unreported_convolutions(outcome.before, outcome.report)


def _unsplit_without_reason(outcome: PassOutcome) -> list[str]:
    """The main graph's convolutions the split kept that the report gives no reason for, and
    the layers it reports split whose nodes are not calls of their split functions."""
    explained = {item.node for item in outcome.report.left_alone if not item.scope}
    nodes = {node.name: node for node in outcome.after.node}
    kept = [f"{node.name} ({node.op}) not split, with no reason reported"
            for node in outcome.after.node if node.op in REPLACEMENTS
            and node.name not in explained]
    uncalled = [f"{name} reported split but no {SPLIT_CALL}" for item in outcome.report.spatial
                for name in item.nodes.values()
                if name not in nodes or nodes[name].op != SPLIT_CALL]
    return kept + uncalled


def _over_budget(outcome: PassOutcome) -> list[str]:
    plan, budget = outcome.report.memory, outcome.context.options.memory_budget
    if plan is None:
        return ["the report holds no memory plan"]
    if plan.predicted_peak_bytes > budget:
        return [f"a predicted peak of {format_bytes(plan.predicted_peak_bytes)} for a budget of "
                f"{format_bytes(budget)}"]
    return []


def _plan_not_in_graph(outcome: PassOutcome) -> list[str]:
    plan = outcome.report.memory
    if plan is None:
        return ["the report holds no memory plan"]
    nodes = {node.name: node for node in outcome.after.node}
    return [f"{kept.tensor} {made}, yet {reader} is missing or reads it still"
            for made, planned in (("swapped", plan.swaps), ("recomputed", plan.recomputes))
            for kept in planned for reader in unreplaced_readers(nodes, kept)]


FUNCTION_GRAPH = Property("the graph is a ConcreteFunction's, which can be traced again")
EVERY_CONVOLUTION_REPORTED = Property(
    "every convolution is rewritten, split or reported left alone with why", _unreported)
UNSPLIT_ONLY_WITH_REASON = Property(
    "no convolution is left unsplit but with the reason it cannot be split",
    _unsplit_without_reason)
MEMORY_WITHIN_BUDGET = Property("the memory plan's predicted peak is within the budget",
                                _over_budget)
MEMORY_PLAN_IN_GRAPH = Property("every planned swap and recomputation is in the graph",
                                _plan_not_in_graph)


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """One pass: `run(graph_def, report, context)` returns the graph_def and the report with
    what it did added; the graph_def given, where it changes nothing."""

    name: str
    run: Callable[[graph_pb2.GraphDef, RewriteReport, PassContext],
                  tuple[graph_pb2.GraphDef, RewriteReport]]
    requires: tuple[Property, ...] = ()
    guarantees: tuple[Property, ...] = ()


# What a convolution pass reports, added to the report it was given.
CONVOLUTION_FINDINGS = ("layers", "left_alone", "fused", "not_fused", "spatial")


def _with_findings(report: RewriteReport, found: RewriteReport) -> RewriteReport:
    return dataclasses.replace(report, **{name: getattr(report, name) + getattr(found, name)
                                          for name in CONVOLUTION_FINDINGS})


# A convolution pass that rewrote nothing hands on the graph_def it was given, so that the step
# goes on as given, its tensors keeping their names.
def _rewrite(graph_def, report: RewriteReport, context: PassContext):
    rewritten, found = rewrite_graph_def(graph_def, context.planner, context.graph,
                                         context.unfused_because)
    return (rewritten if found.layers else graph_def), _with_findings(report, found)


def _split(graph_def, report: RewriteReport, context: PassContext):
    split, found = split_graph_def(graph_def, context.spatial_devices, context.planner,
                                   context.graph)
    return (split if found.spatial else graph_def), _with_findings(report, found)


def _step_function(graph_def: graph_pb2.GraphDef, context: PassContext):
    """The step the graph_def is, as a ConcreteFunction: the context's function itself while no
    pass changed its graph (its tensors keep their names), else the graph_def run over its
    inputs and variables."""
    if context.graph is context.function.graph:
        return context.function
    return callable_over(graph_def, context.function).get_concrete_function()


def kernel_fronts(planner: LayerPlanner, report: RewriteReport) -> dict:
    """Each planned kernel's node (in the main graph) with its Pareto front of plans, where the
    planner gives them (`workspace_front`), for choosing workspaces with the step's memory."""
    front_of = getattr(planner, "workspace_front", None)
    if front_of is None:
        return {}
    fronts = {}
    for layer in report.layers:
        if layer.scope:
            continue  # in a library function, which the memory plan does not see into
        front = front_of(layer.layer)
        fronts.update({node: front[kernel] for kernel, node in layer.nodes.items()
                       if kernel in front})
    return fronts


def _plan_memory(graph_def, report: RewriteReport, context: PassContext):
    """The search over traced candidates (memory/search/): whole batches or the first ops in
    micro-batches, with the planned kernels' workspaces where the planner gives their fronts."""
    step = _step_function(graph_def, context)
    budget, micro_batches = context.options.memory_budget, context.options.micro_batches
    device_model = context.device_model or DeviceModel.measure()
    fronts = kernel_fronts(context.planner, report) if context.planner is not None else {}
    workspaces = None
    if fronts:
        chosen, prefix, workspaces = choose_step_workspaces(
            step, fronts, budget, device_model, context.step_ms, micro_batches)
    else:
        chosen, prefix = choose_prefix(step, budget, device_model, context.step_ms,
                                       micro_batches)
    context.function = chosen  # the graph_def handed on is the chosen step's
    return planned_graph_def(chosen, prefix.plan), dataclasses.replace(
        report, memory=prefix.plan, memory_prefix=prefix, memory_workspaces=workspaces)


CONVOLUTION_REWRITE = GraphPass("convolution rewrite", _rewrite,
                                guarantees=(EVERY_CONVOLUTION_REPORTED,))
SPATIAL_SPLIT = GraphPass("spatial split", _split,
                          guarantees=(EVERY_CONVOLUTION_REPORTED, UNSPLIT_ONLY_WITH_REASON))
MEMORY_PLANNING = GraphPass("memory planning", _plan_memory, requires=(FUNCTION_GRAPH,),
                            guarantees=(MEMORY_WITHIN_BUDGET, MEMORY_PLAN_IN_GRAPH))


@dataclasses.dataclass(frozen=True)
class PassManager:
    """Runs `passes` in their order, each between the checks of its contract."""

    passes: tuple[GraphPass, ...]

    def __post_init__(self):
        object.__setattr__(self, "passes", tuple(self.passes))
        unchecked = [f"the {graph_pass.name} pass guarantees that {guarantee.description}"
                     for graph_pass in self.passes for guarantee in graph_pass.guarantees
                     if guarantee.check is None]
        if unchecked:
            raise PassContractError(f"{'; '.join(unchecked)}, with no check to run after it")

    def check_order(self, given: Iterable[Property] = ()) -> None:
        """That each pass's requirements are `given` with the input or guaranteed by a pass
        before it."""
        holding, earlier = set(given), []
        for graph_pass in self.passes:
            missing = [p.description for p in graph_pass.requires if p not in holding]
            if missing:
                raise PassContractError(
                    f"the {graph_pass.name} pass requires that {'; '.join(missing)}, which "
                    f"neither the input gives nor a pass before it "
                    f"({', '.join(earlier) or 'none'}) guarantees")
            holding.update(graph_pass.guarantees)
            earlier.append(graph_pass.name)

    def run(self, graph_def: graph_pb2.GraphDef, report: RewriteReport, context: PassContext,
            given: Iterable[Property] = ()) -> tuple[graph_pb2.GraphDef, RewriteReport]:
        """The graph_def and the report after every pass; the order is checked before any runs,
        each guarantee right after its pass."""
        self.check_order(given)
        for graph_pass in self.passes:
            after, report = graph_pass.run(graph_def, report, context)
            if after is not graph_def:
                context.graph = None  # the graph for shapes was the given graph_def's
            outcome = PassOutcome(graph_def, after, report, context)
            for guarantee in graph_pass.guarantees:
                broken = guarantee.check(outcome)
                if broken:
                    more = f" and {len(broken) - 5} more" if len(broken) > 5 else ""
                    raise PassContractError(
                        f"the {graph_pass.name} pass broke its guarantee that "
                        f"{guarantee.description}: {'; '.join(broken[:5])}{more}")
            graph_def = after
        return graph_def, report
