"""What is alive at the allocator's peak when a planned training step runs: TensorFlow's profiler
records each allocation and release with the op that asked for it, and this replays them.

    python benchmarks/memory_trace.py --batch 384 --budget-gib 12 --link-gb-s 46 \\
        --memory-limit-gib 16 --fuse-batch-norm --out $OUT/trace_384.json

The step is planned as beyond_memory.py plans it (`plan_keras_step`: swaps, recomputations, and
the first layers in micro-batches where nothing else fits).

Where the measured peak and the plan's prediction part, the list says which tensors the
prediction did not expect (Grappler's layout transposes, buffers held by copies, recomputations
run early). On the CPU, run with TF_CPU_ALLOCATOR_USE_BFC=true. With `--op-times` the GPU's
kernels are traced too, and each op's measured time is set beside the time the plan assumed
(with `--step-ms`, calibrated as beyond_memory.py calibrates), to tell where a planned step's
time goes: recomputations, swaps, or ops slower than in the unplanned step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile

import tensorflow as tf
from step_planning_args import add_step_planning_arguments

from tf_ucudnn.graph.functions import CALL_SCOPE
from tf_ucudnn.profiling.step_trace import (
    alive_at_peak,
    device_timeline,
    gpu_events,
    measured_op_ms,
    op_spans,
    read_profile,
)


def timeline_report(spans: dict, swaps) -> dict:
    """The step's wall time on the GPU, the time no kernel ran (copies aside), and for each swap
    when its copy back ran against its prefetch op and its first backward consumer: a copy
    that ends after the consumer could have started leaves the GPU waiting; one that starts long
    before the prefetch op holds the tensor early. `spans`: the GPU's, from `op_spans`."""
    from tf_ucudnn.memory.passes.swap import SWAP

    timeline = device_timeline(spans, top=20)
    rows = []
    # The traced function's ops carry the scope of its call: match on the graph's own names.
    spans = {op.split("/", 1)[1] if op.startswith(f"{CALL_SCOPE}/") else op: span
             for op, span in spans.items()}
    for swap in swaps:
        scope = f"{swap.producer}{SWAP}{swap.output_index}/"
        copies = [(span.first_ms, span.last_ms) for op, span in spans.items()
                  if span.copy and op.startswith(scope)]
        copies_out = [(span.first_ms, span.last_ms) for op, span in spans.items()
                      if span.copy and re.fullmatch(re.escape(swap.producer) + r"/_\d+", op)]
        consumers = [spans[c].first_ms for c in swap.backward_consumers if c in spans]
        prefetch = spans.get(swap.prefetch_after)
        gate = spans.get(swap.copied_out_before)
        rows.append({"tensor": swap.tensor, "prefetch_after": swap.prefetch_after,
                     "prefetch_op_ms": prefetch and round(prefetch.first_ms, 2),
                     "copy_out_ms": [round(x, 2) for x in min(copies_out)] if copies_out else None,
                     "copy_in_ms": [round(x, 2) for x in min(copies)] if copies else None,
                     "first_consumer_ms": round(min(consumers), 2) if consumers else None,
                     "copied_out_before": swap.copied_out_before,
                     "copied_out_before_ms": gate and round(gate.first_ms, 2)})
    return {"wall_ms": timeline["wall_ms"], "no_kernel_running_ms": timeline["idle_ms"],
            "swaps": rows, "longest_gaps": timeline["longest_gaps"]}


def op_time_report(step_graph, measured: dict, link, step_ms, top: int = 60) -> dict:
    """The measured op times against those the plan assumed (`op_times`: the device model's
    roofline, scaled to `step_ms` if given), in total, for the recomputations and swaps, and
    for the ops that differ most."""
    from tf_ucudnn.memory.passes.recompute import CLONE
    from tf_ucudnn.memory.passes.swap import SWAP
    from tf_ucudnn.memory.search.step_plan import op_times

    operations = step_graph.get_operations()
    assumed = dict(zip((op.name for op in operations), op_times(step_graph, link, None, step_ms)))
    types = {op.name: op.type for op in operations}
    rows = [{"op": name, "type": types.get(name, "?"), "measured_ms": ms,
             "assumed_ms": assumed.get(name)} for name, ms in measured.items()]

    def total(keep) -> float:
        return sum(row["measured_ms"] for row in rows if keep(row["op"]))
    return {"measured_ms": total(lambda op: True), "assumed_ms": sum(assumed.values()),
            "measured_recomputations_ms": total(lambda op: CLONE in op),
            "measured_swaps_ms": total(lambda op: SWAP in op),
            "largest_differences": sorted(
                rows, key=lambda row: -abs(row["measured_ms"] - (row["assumed_ms"] or 0.0)))[:top]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--budget-gib", type=float, help="plan under this budget (none: as is)")
    parser.add_argument("--link-gb-s", type=float, nargs="+", default=[46.0],
                        metavar="GB_S", help="host link bandwidth to plan with: one for both "
                        "ways, or device-to-host then host-to-device (as beyond_memory.py "
                        "measures and records them, to plan the step it ran)")
    parser.add_argument("--step-ms", type=float, help="the unplanned step's time, if measured")
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    add_step_planning_arguments(parser)  # as beyond_memory.py plans
    parser.add_argument("--op-times", action="store_true",
                        help="trace the GPU's kernels too, and compare each op's measured time "
                        "with the time the plan assumed")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if len(args.link_gb_s) > 2:
        parser.error("--link-gb-s takes one bandwidth or two (device to host, host to device)")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_logical_device_configuration(gpus[0], [
            tf.config.LogicalDeviceConfiguration(memory_limit=int(args.memory_limit_gib * 1024))])
    device = "GPU:0" if gpus else "CPU:0"

    # As beyond_memory.py runs planned steps: Grappler's layout copies and the autotuning's
    # copies of convolution outputs are not in the plan.
    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    os.environ.setdefault("TF_DISABLE_RZ_CHECK", "1")
    from tf_ucudnn.keras import models
    from tf_ucudnn.memory import DeviceModel, keras_training_step, plan_keras_step

    model = models.load_model(args.model)
    result = {"benchmark": "memory_trace", "model": args.model, "batch": args.batch,
              "device": device, "budget_gib": args.budget_gib, "link_gb_s": args.link_gb_s,
              "fuse_batch_norm": args.fuse_batch_norm,
              "stream_conv_batch_norm": args.stream_conv_bn,
              "TF_DISABLE_RZ_CHECK": os.environ["TF_DISABLE_RZ_CHECK"]}
    to_host, to_device = args.link_gb_s if len(args.link_gb_s) == 2 else args.link_gb_s * 2
    link = DeviceModel("given", to_host * 1e9, to_device * 1e9)
    if args.budget_gib:
        step, chosen = plan_keras_step(model, args.batch, int(args.budget_gib * 2**30), link,
                                       args.step_ms, args.fuse_batch_norm, args.micro_batches,
                                       cuts=[args.cut] if args.cut else None,
                                       stream_conv_batch_norm=args.stream_conv_bn,
                                       whole_batches=args.cut is None)
        result.update(swaps=len(chosen.plan.swaps), recomputes=len(chosen.plan.recomputes),
                      prefix_end=chosen.prefix_end,
                      micro_batches=chosen.micro_batches,
                      predicted_peak_bytes=chosen.plan.decisions.prediction.peak_bytes)
    else:
        step = keras_training_step(model, args.batch, fuse_batch_norm=args.fuse_batch_norm,
                                   stream_conv_batch_norm=args.stream_conv_bn)
    x = tf.random.stateless_uniform([args.batch, *model.input_shape[1:]], seed=[1, 2])
    y = tf.zeros([args.batch], tf.int32)
    logdir = tempfile.mkdtemp(prefix="memory_trace")
    for profiled in (False, True):  # the first step builds and tunes; the second is traced
        if profiled:
            tf.config.experimental.reset_memory_stats(device)
            tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(
                host_tracer_level=3, device_tracer_level=int(args.op_times)))
        try:
            step(x, y).numpy()
        except tf.errors.OpError as error:  # the message's own lines, not the traceback's
            lines = [line.strip() for line in str(error).splitlines()
                     if line.strip() and not line.startswith("  ") and "defined at" not in line]
            result["error" if profiled else "first_step_error"] = " ".join(lines)[-600:]
        finally:
            if profiled:
                tf.profiler.experimental.stop()
            else:  # the autotuning step's own peak, which the traced step's does not show
                result["first_step_peak_bytes"] = tf.config.experimental.get_memory_info(
                    device)["peak"]
    result["measured_peak_bytes"] = tf.config.experimental.get_memory_info(device)["peak"]
    space = read_profile(logdir)  # read once: with the device tracer on, it is large
    result.update(alive_at_peak(space, device_allocator=bool(gpus)))
    if args.op_times:
        graph = step.graph if hasattr(step, "graph") else step.get_concrete_function(x, y).graph
        result["op_times"] = op_time_report(graph,
                                            measured_op_ms(space, on_gpu=bool(gpus)), link,
                                            args.step_ms)
        if gpus and args.budget_gib:
            spans = op_spans(gpu_events(space)).get("/device:GPU:0", {})
            result["timeline"] = timeline_report(spans, chosen.plan.swaps)
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("largest_alive", "op_times", "timeline")}),
          flush=True)


if __name__ == "__main__":
    main()
