"""`tf_ucudnn.rewrite`: the graph passes put together, with their planners built from options.

    fast_step, report = tf_ucudnn.rewrite(step, workspace_limit="64MiB")
    big_step, report = tf_ucudnn.rewrite(step, workspace_limit="64MiB", memory_budget="16GiB")
    split_step, report = tf_ucudnn.rewrite(step, spatial_split=2, workspace_limit="64MiB")

Convolutions are rewritten first (their plans bound each kernel's workspace); with a memory budget
the rewritten training step then gets the swaps and recomputations that fit its tensors in the
budget, and where they cannot, its first ops run in micro-batches too. With a spatial split, each
convolution layer is split over devices instead, each device's part planned.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import tensorflow as tf

from tf_ucudnn.conv_planning.database_planner import DatabasePlanner
from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.core.units import parse_bytes
from tf_ucudnn.graph.functions import inline_function_calls, is_concrete_function
from tf_ucudnn.graph.rewrite import apply_graph_pass, rewrite_convolutions
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.search.step_plan import plan_step_with_prefix
from tf_ucudnn.parallel import spatial
from tf_ucudnn.parallel.spatial_split import split_graph_def
from tf_ucudnn.report import RewriteReport

Size = Union[int, str, None]


def rewrite(target, planner: Optional[LayerPlanner] = None, *, workspace_limit: Size = None,
            workspace_budget: Size = None, memory_budget: Size = None,
            spatial_split: Optional[int] = None, devices: Optional[Sequence[str]] = None,
            device_model=None, step_ms: Optional[float] = None,
            micro_batches: Sequence[int] = (4, 8), inline_functions: bool = False,
            jit_compile: bool = False, **planner_options):
    """Rewrites a GraphDef, a tf.Graph or a ConcreteFunction; returns (rewritten, report).

    A GraphDef or tf.Graph gives a GraphDef; a ConcreteFunction gives a tf.function over the same
    inputs, outputs and captured variables, compiled by XLA with `jit_compile` (tf_ucudnn's ops
    become XLA custom calls on the GPU; any rewritten function may also be wrapped in
    `tf.function(..., jit_compile=True)` later). With `inline_functions`, a ConcreteFunction's
    calls to other functions (a restored SavedModel's signatures are such calls) are inlined
    first.

    Convolution plans come from `planner` (any callable from ConvLayer to LayerPlan or a reason),
    or from a `DatabasePlanner` for `workspace_limit` per kernel and/or a `workspace_budget`
    shared by all kernels (bytes, or sizes such as "64MiB"); `planner_options` go to
    `DatabasePlanner.open`. Without any of these the convolutions are left as they are.

    `spatial_split` (a number of devices, or the `devices` themselves) splits every convolution
    layer of the main graph along its first spatial dimension over that many GPUs (logical CPUs
    where there are not enough GPUs), halos exchanged by TensorFlow's runtime; the plans, if any,
    are then made for each device's part.

    `memory_budget` (a ConcreteFunction of a training step only) plans swaps and recomputations
    so that the step's tensors and variables fit (with a spatial split: the tensors between
    the split layers, whole on the default device; each layer's slabs live inside its call, for
    the call's time, unseen by the plan), with `device_model` (a
    `tf_ucudnn.memory.DeviceModel`; measured on the GPU if not given) and, if given, the measured
    time of the step without swaps (`step_ms`) to calibrate the op time estimates. Where no such
    plan fits, the step's ops up to a pooling run in micro-batches, made again for the backward
    pass (`tf_ucudnn.memory.passes.graph_prefix`): after the shallowest pooling at which the plan then
    fits, in whichever of `micro_batches` gives the shortest predicted step. The report's
    `memory` is the plan, its `memory_prefix` the choice (the pooling's output and the count,
    or none) with every choice passed over and why. A budget that cannot be met raises
    `tf_ucudnn.memory.BudgetError`, saying by how much and what was tried.
    """
    plans_convolutions = planner is not None or workspace_limit is not None or \
        workspace_budget is not None
    splits = spatial_split is not None or devices is not None
    if planner is not None and (workspace_limit is not None or workspace_budget is not None
                                or planner_options):
        raise ValueError("workspace_limit, workspace_budget and planner options are for the "
                         "default planner; a given planner has its own")
    if not plans_convolutions and not splits and memory_budget is None:
        raise ValueError("nothing to plan: give a planner, a workspace_limit, a workspace_budget, "
                         "a spatial_split or a memory_budget")
    if memory_budget is not None and not is_concrete_function(target):
        raise TypeError("memory_budget plans a training step: pass its ConcreteFunction "
                        f"(got {type(target).__name__})")
    if splits:
        devices = list(devices) if devices else spatial.default_devices(spatial_split)
        if spatial_split is not None and len(devices) != spatial_split:
            raise ValueError(f"spatial_split={spatial_split} but {len(devices)} devices given")

    def convolution_pass(conv_planner):
        if splits:
            return apply_graph_pass(target, lambda graph_def, graph: split_graph_def(
                graph_def, devices, conv_planner, graph), inline_functions=inline_functions)
        return rewrite_convolutions(target, conv_planner, inline_functions=inline_functions)

    report = RewriteReport()
    rewritten = target
    if planner is None and plans_convolutions:
        with DatabasePlanner.open(workspace_limit, workspace_budget=workspace_budget,
                                  **planner_options) as default_planner:
            rewritten, report = convolution_pass(default_planner)
    elif planner is not None or splits:
        rewritten, report = convolution_pass(planner)
    elif inline_functions and is_concrete_function(target):
        rewritten = inline_function_calls(target)
    if memory_budget is None:
        return _compiled(rewritten, jit_compile), report

    step = rewritten.get_concrete_function() if hasattr(rewritten, "get_concrete_function") \
        else rewritten
    planned, report.memory_prefix = plan_step_with_prefix(
        step, parse_bytes(memory_budget), device_model or DeviceModel.measure(), step_ms=step_ms,
        micro_batches=micro_batches)
    report.memory = report.memory_prefix.plan
    return _compiled(planned, jit_compile), report


def _compiled(rewritten, jit_compile: bool):
    if not jit_compile:
        return rewritten
    if not callable(rewritten):
        raise TypeError("jit_compile compiles a function: rewrite a ConcreteFunction, not a "
                        f"{type(rewritten).__name__}")
    return tf.function(rewritten, jit_compile=True)
