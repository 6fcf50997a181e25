"""The one order of passes every entry point runs: find the convolutions, plan them, rewrite them,
then plan the step's memory.

    graph -> profiles -> plan -> rewritten graph

`entry_options` folds an entry point's `options=` and keyword settings into one `Options`.
`conv_planner` gives the planner for the convolutions (the caller's, or the database planner the
options describe, or, where none can be set up, one that leaves each layer alone saying why, so
the report names every convolution either way). `plan_graph` chooses the passes from the options
(`choose_passes`) and runs them (`tf_ucudnn.passes`) on a graph or a ConcreteFunction; the Keras
callback plans layer by layer with the same planner.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from tf_ucudnn.conv_planning.database_planner import DatabasePlanner, PlannerError
from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.graph.functions import callable_over, inline_function_calls, is_concrete_function
from tf_ucudnn.graph.rewrite import graph_def_of
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.options import Options
from tf_ucudnn.passes import (
    CONVOLUTION_REWRITE,
    FUNCTION_GRAPH,
    MEMORY_PLANNING,
    SPATIAL_SPLIT,
    GraphPass,
    PassContext,
    PassManager,
)
from tf_ucudnn.report import RewriteReport


def entry_options(options: Optional[Options], planner: Optional[LayerPlanner],
                  **overrides) -> Options:
    """An entry point's settings: `options` (the defaults if None) with its keyword `overrides`
    (`Options.resolve`); settings only the default planner reads, given beside a `planner`, are
    an error naming them (`Options.check_planner`)."""
    resolved = Options.resolve(options, **overrides)
    resolved.check_planner(planner)
    return resolved


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


def choose_passes(options: Options, planner: Optional[LayerPlanner],
                  spatial_devices: Optional[Sequence[str]]) -> list[GraphPass]:
    """The passes the options ask for, in their one order: the convolutions split over
    `spatial_devices`, or rewritten where there is a planner (given, or the options' own);
    then, with a memory budget, the step's memory planned."""
    passes = []
    if spatial_devices:
        passes.append(SPATIAL_SPLIT)
    elif planner is not None or options.plans_convolutions:
        passes.append(CONVOLUTION_REWRITE)
    if options.memory_budget is not None:
        passes.append(MEMORY_PLANNING)
    return passes


def plan_graph(target, options: Options, planner: Optional[LayerPlanner] = None, *,
               spatial_devices: Optional[Sequence[str]] = None, inline_functions: bool = False,
               device_model: Optional[DeviceModel] = None, step_ms: Optional[float] = None,
               unfused_because: Optional[str] = None):
    """Runs the passes on a GraphDef, a tf.Graph or a ConcreteFunction: the convolutions planned
    and rewritten (or split over `spatial_devices`, each part planned), each fused with its bias
    and ReLU where it can be, unless `unfused_because` or a memory budget says why not; then,
    with a memory budget, the step's swaps, recomputations and micro-batched first ops. The
    passes (`choose_passes`) run under a `PassManager`, which checks each one's contract.
    Returns (rewritten, report); a ConcreteFunction gives a callable over the same inputs and
    variables."""
    if options.memory_budget is not None and not is_concrete_function(target):
        raise TypeError("memory_budget plans a training step: pass its ConcreteFunction "
                        f"(got {type(target).__name__})")
    if inline_functions and is_concrete_function(target):
        target = inline_function_calls(target)  # what is handed back if no pass changes it
        graph_def, graph, function = graph_def_of(target.get_concrete_function())
    else:
        graph_def, graph, function = graph_def_of(target)
    manager = PassManager(choose_passes(options, planner, spatial_devices))
    if options.memory_budget is not None:
        unfused_because = UNFUSED_UNDER_MEMORY_BUDGET
    with conv_planner(options, planner) as chosen:
        context = PassContext(options, chosen, device_model, step_ms,
                              tuple(spatial_devices or ()), unfused_because, function, graph)
        planned, report = manager.run(graph_def, RewriteReport(), context,
                                      given=[FUNCTION_GRAPH] if function is not None else [])
    if planned is graph_def:
        # Nothing rewritten: the step goes on as given, its tensors keeping their names.
        return target, report
    if context.function is None:
        return planned, report
    return callable_over(planned, context.function), report
