"""A layer's time as XLA's own convolution would run it and as a plan would, predicted from its
kernels' timing tables; and a bound on any plan's time from the whole batch's timings alone.

XLA's own convolution is predicted as the fastest undivided run of the whole batch in the direct
form (XLA neither divides a batch nor changes a convolution's form) with any workspace (XLA's
autotuner is not held to a limit). Only the kernels a training step runs count (`kernels_run`).

The bound (`plan_bound_ms`) lets a planner see, from the whole batch's timings alone, that no plan
can beat XLA by the margin it asks, and so leave the micro-batches unmeasured. It assumes that
per-sample throughput does not rise as the batch shrinks: no micro-batch of b samples runs faster
than b/B of the fastest whole-batch run (of B samples, in any form with any workspace). Then a
plan of micro-batches b_1 + ... + b_k = B takes at least T(B), the fastest whole-batch time, plus
one call's overhead. Checked on the measured tables of shared/profiles, profiling/data and the
H200's ResNet-50 (H100 fp32 and fp16, H200 fp32; 282 kernels): a size's fastest run beats the
whole batch's per sample at 17 of 2109 sizes, all at half or a quarter of the batch, by up to
1.17x in fp32 and 1.97x in fp16. Of 470 layer decisions (each layer under five workspace limits,
margin 10%), the bound leaves 4 to XLA that measuring everything would plan, all in fp16:
AlexNet's conv3, whose filter gradient runs twice as fast per sample at half the batch. In fp32
it decides as measuring everything does.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from tf_ucudnn.conv_planning.kernel_dp import NoFeasiblePlanError, fastest_configuration
from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.plan import BACKPROP_INPUT, DIRECT, KERNELS, Algorithm, LayerPlan
from tf_ucudnn.profiling.records import KernelTimings


@dataclasses.dataclass(frozen=True)
class LayerPrediction:
    """A layer's predicted time, the kernels training runs together, from the profile database:
    as XLA's own convolution would run it and as its plan would. None where the database cannot
    tell."""

    xla_ms: Optional[float]
    plan_ms: Optional[float]


def kernels_run(layer: ConvLayer) -> tuple[str, ...]:
    """The layer's kernels a training step runs: all three, but no input gradient where no
    variable feeds the input (`ConvLayer.input_gradient`)."""
    return tuple(k for k in KERNELS if layer.input_gradient or k != BACKPROP_INPUT)


def xla_ms(layer: ConvLayer, tables: Mapping[str, KernelTimings], *,
           deterministic_only: bool) -> Optional[float]:
    """XLA's own convolution's predicted time; None where a kernel has no direct whole-batch
    run."""
    return _fastest_whole_batch_ms(layer, tables, deterministic_only, DIRECT, 0.0)


def plan_bound_ms(layer: ConvLayer, tables: Mapping[str, KernelTimings], *,
                  deterministic_only: bool, call_overhead_ms: float) -> Optional[float]:
    """What no plan of the layer is faster than, by the module's assumption: its fastest
    whole-batch run in any form with any workspace, plus one call's overhead, kernel by kernel.
    Needs the whole batch's timings only."""
    return _fastest_whole_batch_ms(layer, tables, deterministic_only, None, call_overhead_ms)


def _fastest_whole_batch_ms(layer, tables, deterministic_only, form, call_overhead_ms):
    total = 0.0
    for kernel in kernels_run(layer):
        try:
            total += fastest_configuration(
                kernel, tables[kernel], layer.batch_size, None,
                deterministic_only=deterministic_only, micro_batch_sizes=[layer.batch_size],
                call_overhead_ms=call_overhead_ms, form=form).time_ms
        except NoFeasiblePlanError:
            return None
    return total


def planned_ms(layer: ConvLayer, plan: LayerPlan, tables: Mapping[str, KernelTimings],
               call_overhead_ms: float) -> Optional[float]:
    """The measured time of the plan's kernels that training runs; None if one of its
    micro-batches was not measured."""
    times = [_kernel_planned_ms(plan.kernel(kernel), tables[kernel], call_overhead_ms)
             for kernel in kernels_run(layer)]
    return None if None in times else sum(times)


def _kernel_planned_ms(kernel_plan, timings, call_overhead_ms: float) -> Optional[float]:
    total = 0.0
    for micro_batch in kernel_plan.micro_batches:
        matching = [t.time_ms for t in timings.get(micro_batch.size, ())
                    if _runs_as_planned(t.algorithm, micro_batch.algorithm)]
        if not matching:
            return None
        total += min(matching) + call_overhead_ms
    return total


def _runs_as_planned(measured: Algorithm, planned: Algorithm) -> bool:
    """Whether a measurement is of what a plan runs: the same engine configuration, or the same
    legacy algorithm in the planned math mode (any, where the plan leaves it to TensorFlow), in
    the planned form."""
    if planned.is_engine:
        return measured == planned
    if planned.algo is None:  # cuDNN's heuristics choose at run time: nothing measured is it
        return False
    return (measured.algo == planned.algo and planned.math in (None, measured.math)
            and measured.form == planned.form)
