"""The one order of passes every entry point runs: find the convolutions, plan them, rewrite them,
then plan the step's memory.

    graph -> profiles -> plan -> rewritten graph

`conv_planner` gives the planner for the convolutions (the caller's, or the database planner the
options describe, or, where none can be set up, one that leaves each layer alone saying why, so
the report names every convolution either way). `plan_graph` runs the passes on a graph or a
ConcreteFunction; the Keras callback plans layer by layer with the same planner.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from tf_ucudnn.conv_planning.database_planner import DatabasePlanner, PlannerError
from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.graph.functions import inline_function_calls, is_concrete_function
from tf_ucudnn.graph.rewrite import apply_graph_pass, rewrite_convolutions
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.search.step_plan import plan_step_with_prefix
from tf_ucudnn.memory.search.workspace_choice import plan_step_with_workspaces
from tf_ucudnn.options import Options
from tf_ucudnn.parallel.spatial_split import split_graph_def
from tf_ucudnn.report import RewriteReport


def leave_alone_because(reason: str) -> LayerPlanner:
    """A planner that plans nothing and says why for each layer."""
    return lambda layer: reason


@contextlib.contextmanager
def conv_planner(options: Options, planner: Optional[LayerPlanner] = None,
                 **planner_settings) -> Iterator[Optional[LayerPlanner]]:
    """The convolutions' planner: `planner` if given; None where the options leave convolutions
    to TensorFlow; else a `DatabasePlanner` (with `planner_settings`), closed on exit. Where no
    measurements can be had (no GPU, nothing imported), a planner that leaves every layer alone
    with that reason; a profile database that cannot be read is an error."""
    if planner is not None:
        yield planner
        return
    if not options.plans_convolutions:
        yield None
        return
    try:
        opened = DatabasePlanner.open(
            options.workspace_limit, options.database, options.profiles, device=options.device,
            cudnn_version=options.cudnn_version, workspace_budget=options.workspace_budget,
            **planner_settings)
    except PlannerError as error:
        yield leave_alone_because(f"no planner: {error}")
        return
    with opened:
        yield opened


# Why layers keep their convolution, bias and activation apart: under a memory budget, and where
# XLA compiles the step.
UNFUSED_UNDER_MEMORY_BUDGET = ("under a memory budget: the memory plan (swaps, recomputations, "
                               "workspaces) is not yet tested with fused layers")
UNFUSED_UNDER_XLA = "compiled by XLA, which has no kernel for the fused op"


def plan_graph(target, options: Options, planner: Optional[LayerPlanner] = None, *,
               spatial_devices: Optional[Sequence[str]] = None, inline_functions: bool = False,
               device_model: Optional[DeviceModel] = None, step_ms: Optional[float] = None,
               unfused_because: Optional[str] = None):
    """Runs the passes on a GraphDef, a tf.Graph or a ConcreteFunction: the convolutions planned
    and rewritten (or split over `spatial_devices`, each part planned), each fused with its bias
    and ReLU where it can be, unless `unfused_because` or a memory budget says why not; then,
    with a memory budget, the step's swaps, recomputations and micro-batched first ops. Returns
    (rewritten, report); a ConcreteFunction gives a callable over the same inputs and
    variables."""
    if options.memory_budget is not None and not is_concrete_function(target):
        raise TypeError("memory_budget plans a training step: pass its ConcreteFunction "
                        f"(got {type(target).__name__})")
    report = RewriteReport()
    with conv_planner(options, planner) as chosen:
        if spatial_devices:
            rewritten, report = apply_graph_pass(target, lambda graph_def, graph: split_graph_def(
                graph_def, list(spatial_devices), chosen, graph),
                inline_functions=inline_functions)
        elif chosen is not None:
            if options.memory_budget is not None:
                unfused_because = UNFUSED_UNDER_MEMORY_BUDGET
            rewritten, report = rewrite_convolutions(target, chosen,
                                                     inline_functions=inline_functions,
                                                     unfused_because=unfused_because)
        fronts = (kernel_fronts(chosen, report)
                  if options.memory_budget is not None and chosen is not None else {})
    if not report.layers and not report.spatial:
        # Nothing rewritten: the step goes on as given, its tensors keeping their names.
        rewritten = (inline_function_calls(target)
                     if inline_functions and is_concrete_function(target) else target)
    if options.memory_budget is None:
        return rewritten, report
    step = rewritten.get_concrete_function() if hasattr(rewritten, "get_concrete_function") \
        else rewritten
    device_model = device_model or DeviceModel.measure()
    if fronts:
        planned, report.memory_prefix, report.memory_workspaces = plan_step_with_workspaces(
            step, fronts, options.memory_budget, device_model, step_ms=step_ms,
            micro_batches=options.micro_batches)
    else:
        planned, report.memory_prefix = plan_step_with_prefix(
            step, options.memory_budget, device_model, step_ms=step_ms,
            micro_batches=options.micro_batches)
    report.memory = report.memory_prefix.plan
    return planned, report


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
