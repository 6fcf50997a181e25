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
import glob
import json
import os
import re
import tempfile

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2


def _stats(plane, event) -> dict:
    values = {}
    for stat in event.stats:
        kind = stat.WhichOneof("value")
        values[plane.stat_metadata[stat.metadata_id].name] = (
            plane.stat_metadata[stat.ref_value].name if kind == "ref_value"
            else getattr(stat, kind))
    return values


def read_profile(xspace_path: str) -> xplane_pb2.XSpace:
    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as file:
        space.ParseFromString(file.read())
    return space


def alive_at_peak(space: xplane_pb2.XSpace, device_allocator: bool, top: int = 40) -> dict:
    """Replays the allocator events of one profile: the peak, the op at it, and the largest
    buffers alive then, with the op that allocated each."""
    events = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                kind = plane.event_metadata[event.metadata_id].name
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = _stats(plane, event)
                if ("GPU" in str(stats.get("allocator_name", ""))) == device_allocator:
                    events.append((line.timestamp_ns + event.offset_ps / 1000, kind, stats))
    events.sort(key=lambda e: e[0])
    live, peak, at_peak, peak_op = {}, -1, {}, None
    for _, kind, stats in events:
        if kind == "MemoryAllocation":
            live[stats.get("addr")] = (int(stats.get("requested_bytes", 0)),
                                       str(stats.get("tf_op", "")))
        else:
            live.pop(stats.get("addr"), None)
        in_use = int(stats.get("bytes_allocated", 0))
        if in_use > peak:
            peak, at_peak, peak_op = in_use, dict(live), str(stats.get("tf_op", ""))
    largest = sorted(at_peak.values(), key=lambda v: -v[0])[:top]
    return {"peak_bytes": peak, "peak_op": peak_op, "events": len(events),
            "largest_alive": [{"bytes": size, "op": op} for size, op in largest]}


def measured_op_ms(space: xplane_pb2.XSpace, on_gpu: bool) -> dict:
    """Each op's time in one profile, in ms: on a GPU, its kernels' (the device tracer tags
    each kernel with the op that launched it); on the CPU, its own run on the executor's
    threads."""
    times: dict = {}
    for plane in space.planes:
        if on_gpu != plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not on_gpu and not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = (str(_stats(plane, event).get("tf_op", "")) if on_gpu
                        else plane.event_metadata[event.metadata_id].name)
                if ":" in name and "::" not in name:  # "op:Type", not a runtime's "Class::method"
                    op = name.rsplit(":", 1)[0]
                    times[op] = times.get(op, 0.0) + event.duration_ps / 1e9
    return times


def gpu_intervals(space: xplane_pb2.XSpace) -> dict:
    """Each op's GPU activity in one profile: (first start, last end) in ms from the step's first
    kernel, kernels and copies alike, with whether any was a copy."""
    spans: dict = {}
    for plane in space.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                stats = _stats(plane, event)
                name = str(stats.get("tf_op", ""))
                if ":" not in name or "::" in name:
                    continue
                start = line.timestamp_ns / 1e6 + event.offset_ps / 1e9
                end = start + event.duration_ps / 1e9
                copy = "memcpy" in plane.event_metadata[event.metadata_id].name.lower()
                first, last, copies = spans.get(name.rsplit(":", 1)[0], (start, end, False))
                spans[name.rsplit(":", 1)[0]] = (min(first, start), max(last, end),
                                                 copies or copy)
    origin = min((first for first, _, _ in spans.values()), default=0.0)
    return {op: (first - origin, last - origin, copy) for op, (first, last, copy) in spans.items()}


def timeline_report(spans: dict, swaps) -> dict:
    """The step's wall time on the GPU, the time no kernel ran (copies aside), and for each swap
    when its copy back ran against its prefetch op and its first backward consumer: a copy
    that ends after the consumer could have started leaves the GPU waiting; one that starts long
    before the prefetch op holds the tensor early."""
    kernels = sorted((first, last, op) for op, (first, last, copy) in spans.items() if not copy)
    idle, reached, before, gaps = 0.0, kernels[0][0] if kernels else 0.0, None, []
    for first, last, op in kernels:
        if first > reached:
            idle += first - reached
            gaps.append({"ms": round(first - reached, 2), "at_ms": round(reached, 2),
                         "after": before, "before": op})
        if last > reached:
            reached, before = last, op
    from tf_ucudnn.memory.swap import SWAP

    rows = []
    # The traced function's ops carry the scope of its call: match on the graph's own names.
    spans = {op.split("/", 1)[1] if op.startswith("ucudnn/") else op: span
             for op, span in spans.items()}
    for swap in swaps:
        scope = f"{swap.producer}{SWAP}{swap.output_index}/"
        copies = [(first, last) for op, (first, last, copy) in spans.items()
                  if copy and op.startswith(scope)]
        copies_out = [(first, last) for op, (first, last, copy) in spans.items()
                      if copy and re.fullmatch(re.escape(swap.producer) + r"/_\d+", op)]
        consumers = [spans[c][0] for c in swap.backward_consumers if c in spans]
        prefetch = spans.get(swap.prefetch_after)
        gate = spans.get(swap.copied_out_before)
        rows.append({"tensor": swap.tensor, "prefetch_after": swap.prefetch_after,
                     "prefetch_op_ms": prefetch and round(prefetch[0], 2),
                     "copy_out_ms": [round(x, 2) for x in min(copies_out)] if copies_out else None,
                     "copy_in_ms": [round(x, 2) for x in min(copies)] if copies else None,
                     "first_consumer_ms": round(min(consumers), 2) if consumers else None,
                     "copied_out_before": swap.copied_out_before,
                     "copied_out_before_ms": gate and round(gate[0], 2)})
    return {"wall_ms": max((last for _, last, _ in spans.values()), default=0.0),
            "no_kernel_running_ms": idle, "swaps": rows,
            "longest_gaps": sorted(gaps, key=lambda gap: -gap["ms"])[:20]}


def op_time_report(step_graph, measured: dict, link, step_ms, top: int = 60) -> dict:
    """The measured op times against those the plan assumed (`op_times`: the device model's
    roofline, scaled to `step_ms` if given), in total, for the recomputations and swaps, and
    for the ops that differ most."""
    from tf_ucudnn.memory.planner import op_times
    from tf_ucudnn.memory.recompute import CLONE
    from tf_ucudnn.memory.swap import SWAP

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
    parser.add_argument("--link-gb-s", type=float, default=46.0)
    parser.add_argument("--step-ms", type=float, help="the unplanned step's time, if measured")
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--fuse-batch-norm", nargs="?", const="cudnn",
                        choices=["cudnn", "xla", "ucudnn"])
    parser.add_argument("--micro-batches", type=int, nargs="*", default=[4, 8],
                        help="micro-batch counts for the first layers where no plan fits whole "
                        "batches, as beyond_memory.py plans (tf_ucudnn.memory.plan_keras_step)")
    parser.add_argument("--op-times", action="store_true",
                        help="trace the GPU's kernels too, and compare each op's measured time "
                        "with the time the plan assumed")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_logical_device_configuration(gpus[0], [
            tf.config.LogicalDeviceConfiguration(memory_limit=int(args.memory_limit_gib * 1024))])
    device = "GPU:0" if gpus else "CPU:0"

    # As beyond_memory.py runs planned steps: Grappler's layout copies and the autotuning's
    # copies of convolution outputs are not in the plan.
    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    os.environ.setdefault("TF_DISABLE_RZ_CHECK", "1")
    from tf_ucudnn import models
    from tf_ucudnn.memory import DeviceModel, keras_training_step, plan_keras_step

    model = models.load_model(args.model)
    result = {"benchmark": "memory_trace", "model": args.model, "batch": args.batch,
              "device": device, "budget_gib": args.budget_gib, "link_gb_s": args.link_gb_s,
              "fuse_batch_norm": args.fuse_batch_norm,
              "TF_DISABLE_RZ_CHECK": os.environ["TF_DISABLE_RZ_CHECK"]}
    link = DeviceModel("given", args.link_gb_s * 1e9, args.link_gb_s * 1e9)
    if args.budget_gib:
        step, chosen = plan_keras_step(model, args.batch, int(args.budget_gib * 2**30), link,
                                       args.step_ms, args.fuse_batch_norm, args.micro_batches)
        result.update(swaps=len(chosen.plan.swaps), recomputes=len(chosen.plan.recomputes),
                      micro_batched_until=chosen.micro_batched_until,
                      micro_batches=chosen.micro_batches,
                      predicted_peak_bytes=chosen.plan.decisions.prediction.peak_bytes)
    else:
        step = keras_training_step(model, args.batch, fuse_batch_norm=args.fuse_batch_norm)
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
    result["measured_peak_bytes"] = tf.config.experimental.get_memory_info(device)["peak"]
    (path,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    space = read_profile(path)  # read once: with the device tracer on, it is large
    result.update(alive_at_peak(space, device_allocator=bool(gpus)))
    if args.op_times:
        graph = step.graph if hasattr(step, "graph") else step.get_concrete_function(x, y).graph
        result["op_times"] = op_time_report(graph,
                                            measured_op_ms(space, on_gpu=bool(gpus)), link,
                                            args.step_ms)
        if gpus and args.budget_gib:
            result["timeline"] = timeline_report(gpu_intervals(space), chosen.plan.swaps)
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("largest_alive", "op_times", "timeline")}),
          flush=True)


if __name__ == "__main__":
    main()
