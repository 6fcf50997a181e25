"""`tf_ucudnn.rewrite`: the graph passes put together, with their planners built from options.

    fast_step, report = tf_ucudnn.rewrite(step, workspace_limit="32MiB")
    options = tf_ucudnn.Options(workspace_limit="32MiB", memory_budget="16GiB")
    big_step, report = tf_ucudnn.rewrite(step, options=options)
    smaller_step, report = tf_ucudnn.rewrite(step, options=options, memory_budget="12GiB")
    split_step, report = tf_ucudnn.rewrite(step, spatial_split=2)

Convolutions are rewritten first (their plans bound each kernel's workspace); with a memory budget
the rewritten training step then gets the swaps and recomputations that fit its tensors in the
budget, and where they cannot, its first ops run in micro-batches too. With a spatial split, each
convolution layer is split over devices instead, each device's part planned.
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.options import Options, OptionsError
from tf_ucudnn.parallel import spatial
from tf_ucudnn.pipeline import UNFUSED_UNDER_XLA, entry_options, plan_graph


def rewrite(target, planner: Optional[LayerPlanner] = None, *,
            options: Optional[Options] = None, spatial_split: Optional[int] = None,
            devices: Optional[Sequence[str]] = None, device_model=None,
            step_ms: Optional[float] = None, inline_functions: bool = False,
            jit_compile: bool = False, **overrides):
    """Rewrites a GraphDef, a tf.Graph or a ConcreteFunction; returns (rewritten, report).

    A GraphDef or tf.Graph gives a GraphDef; a ConcreteFunction gives a tf.function over the same
    inputs, outputs and captured variables, compiled by XLA with `jit_compile` (tf_ucudnn's ops
    become XLA custom calls on the GPU). With `inline_functions`, a ConcreteFunction's calls to
    other functions (a restored SavedModel's signatures are such calls) are inlined first.

    Each planned convolution read by a BiasAdd alone, itself read by one Relu or by no
    activation, runs with them as one fused op (`tf_ucudnn.kernels.fused_conv`), named as the
    last op it replaces; the report's `fused` lists those and `not_fused` the other planned
    layers with why. The fused op has no XLA kernel: with `jit_compile=True` nothing is fused,
    and a rewritten function with fused layers cannot be compiled by XLA later.

    The settings are `options` (a `tf_ucudnn.Options`; its defaults if None) with any of its
    settings given by keyword over it: `workspace_limit`, `workspace_budget`, `memory_budget`,
    `micro_batches`, `database`, `profiles`, `device`, `cudnn_version` (sizes in bytes or such
    as "16GiB"; see `tf_ucudnn.Options` for each and its default). A name that is no setting is
    an OptionsError naming it.

    Convolution plans come from `planner` (any callable from ConvLayer to LayerPlan or a reason),
    or from the profile `database` (with `profiles` imported into it) for `workspace_limit` per
    kernel (None leaves the convolutions to TensorFlow) and/or a `workspace_budget` shared by all
    kernels. The settings only that planner reads (`Options.PLANNER_SETTINGS`), given beside a
    `planner`, are an OptionsError naming them. Where no measurements can be had, each
    convolution is reported left alone with the reason.

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
    pass (`tf_ucudnn.memory.passes.graph_prefix`): after the shallowest pooling at which the plan
    then fits, in whichever of `micro_batches` gives the shortest predicted step. The report's
    `memory` is the plan, its `memory_prefix` the choice (the pooling's output and the count,
    or none) with every choice passed over and why. A budget that cannot be met raises
    `tf_ucudnn.memory.BudgetError`, saying by how much and what was tried.
    """
    options = entry_options(options, planner, **overrides)
    splits = spatial_split is not None or devices is not None
    if planner is None and not options.plans_convolutions and not splits and \
            options.memory_budget is None:
        raise OptionsError("nothing to plan: workspace_limit=None leaves the convolutions to "
                           "TensorFlow; give a spatial_split or a memory_budget too")
    if splits:
        devices = list(devices) if devices else spatial.default_devices(spatial_split)
        if spatial_split is not None and len(devices) != spatial_split:
            raise OptionsError(f"spatial_split={spatial_split} but {len(devices)} devices given")
    rewritten, report = plan_graph(
        target, options, planner, spatial_devices=devices, inline_functions=inline_functions,
        device_model=device_model, step_ms=step_ms,
        unfused_because=UNFUSED_UNDER_XLA if jit_compile else None)
    return _compiled(rewritten, jit_compile), report


def _compiled(rewritten, jit_compile: bool):
    if not jit_compile:
        return rewritten
    if not callable(rewritten):
        raise TypeError("jit_compile compiles a function: rewrite a ConcreteFunction, not a "
                        f"{type(rewritten).__name__}")
    return tf.function(rewritten, jit_compile=True)
