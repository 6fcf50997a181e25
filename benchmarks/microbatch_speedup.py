"""μ-cuDNN's per-kernel result, measured through tf_ucudnn's ops on this GPU.

For each model: profile every distinct convolution geometry (all legacy algorithms and, where the
op library was built with cudnn-frontend, all engine configurations, at power-of-two micro-batch
sizes), then for each workspace limit plan every kernel two ways, both within the limit: the best
undivided candidate, and the dynamic program's micro-batched plan. Both plans run through the ops,
side by side in this one process, and so does TensorFlow's own op for the layer (Conv2D, or
DepthwiseConv2dNative for depthwise layers; its autotuner, its default workspace limit) as the
plain-TensorFlow reference.

    python benchmarks/microbatch_speedup.py --models alexnet resnet50 mobilenet_v2 --batch 256 \
        --limits-mib 8 64 512 --out benchmarks/results/microbatch_speedup_h100.json

`--data-format channels_last` measures the models in NHWC, Keras's default layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

import tensorflow as tf

import tf_ucudnn
from tf_ucudnn.conv_planning.database_planner import kernels_run
from tf_ucudnn.conv_planning.kernel_dp import NoFeasiblePlanError, fastest_configuration
from tf_ucudnn.core.plan import BACKPROP_INPUT, FORWARD, KERNELS
from tf_ucudnn.core.units import MIB
from tf_ucudnn.graph.conv_layers import DEPTHWISE, find_conv_layers, trace_model, unique_geometries
from tf_ucudnn.keras import models
from tf_ucudnn.kernels.library import engines_available
from tf_ucudnn.profiling import ProfileDatabase, step_trace
from tf_ucudnn.profiling.profiler import current_machine, profile


def _output_dims(g):
    return [(size + 2 * p - ((k - 1) * d + 1)) // s + 1
            for size, k, p, s, d in zip(g.input_dims, g.filter_dims, g.pads, g.strides,
                                        g.dilations)]


def _tensors(g, batch, seed):
    """Random input, filter (as tf_ucudnn's ops take it: [spatial..., in / groups, out]) and
    output gradient for a geometry (its own layout)."""
    channels_last = g.layout.endswith("C")

    def full(channels, spatial):
        return [batch, *spatial, channels] if channels_last else [batch, channels, *spatial]

    dtype = tf.as_dtype(g.dtype)
    normal = lambda shape, seed: tf.cast(tf.random.stateless_normal(shape, [seed, 0]), dtype)
    return (normal(full(g.in_channels, g.input_dims), 3 * seed + 1),
            normal([*g.filter_dims, g.filter_in_channels, g.out_channels], 3 * seed + 2),
            normal(full(g.out_channels, _output_dims(g)), 3 * seed + 3))


def _attrs(g):
    pads = [[p, p] for p in g.pads]
    if g.layout.endswith("C"):
        return dict(strides=[1, *g.strides, 1], dilations=[1, *g.dilations, 1],
                    padding=[[0, 0], *pads, [0, 0]], data_format=g.layout)
    return dict(strides=[1, 1, *g.strides], dilations=[1, 1, *g.dilations],
                padding=[[0, 0], [0, 0], *pads], data_format=g.layout)


def _tensorflow_runner(g, kernel, depthwise):
    """TensorFlow's own op for the kernel as a function of (x, w, dy): Conv2D's, or for a
    depthwise layer DepthwiseConv2dNative's (filter [kh, kw, C, M], the grouped filter's channels
    c*M+m)."""
    a = _attrs(g)
    explicit = [v for pair in a["padding"] for v in pair]
    common = dict(strides=a["strides"], dilations=a["dilations"], padding="EXPLICIT",
                  explicit_paddings=explicit, data_format=a["data_format"])
    if depthwise:
        shape = [*g.filter_dims, g.in_channels, g.out_channels // g.in_channels]
        if kernel == FORWARD:
            return lambda x, w, dy: tf.raw_ops.DepthwiseConv2dNative(
                input=x, filter=tf.reshape(w, shape), **common)
        if kernel == BACKPROP_INPUT:
            return lambda x, w, dy: tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
                input_sizes=tf.shape(x), filter=tf.reshape(w, shape), out_backprop=dy, **common)
        return lambda x, w, dy: tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=x, filter_sizes=shape, out_backprop=dy, **common)
    if kernel == FORWARD:
        return lambda x, w, dy: tf.raw_ops.Conv2D(input=x, filter=w, **common)
    if kernel == BACKPROP_INPUT:
        return lambda x, w, dy: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=tf.shape(x), filter=w, out_backprop=dy, **common)
    return lambda x, w, dy: tf.raw_ops.Conv2DBackpropFilter(
        input=x, filter_sizes=tf.shape(w), out_backprop=dy, **common)


def _runner(g, kernel, plan):
    """One kernel through tf_ucudnn's op with `plan`, as a function of (x, w, dy)."""
    a = _attrs(g)
    if kernel == FORWARD:
        return lambda x, w, dy: tf_ucudnn.conv2d(x, w, plan=plan, **a)
    if kernel == BACKPROP_INPUT:
        return lambda x, w, dy: tf_ucudnn.conv2d_backprop_input(tf.shape(x), w, dy, plan=plan,
                                                                **a)
    return lambda x, w, dy: tf_ucudnn.conv2d_backprop_filter(x, tf.shape(w), dy, plan=plan, **a)


# The timed function's own ops (each call's first element, summed), which are not the kernel's.
HARNESS_OP_TYPES = frozenset({"AddN", "Reshape", "Shape", "StridedSlice"})


@dataclasses.dataclass(frozen=True)
class Timing:
    """How each kernel is timed: one call per operand set, all in one tf.function as a training
    step runs its ops (no Python between them), the GPU synchronized at the end; the median of
    `repeats` runs. Each call has operands of its own, so that no graph optimization merges the
    calls into one. With `gpu_trace_dir`, one more run under TensorFlow's profiler gives the
    GPU's own time: the kernels and copies the calls launched, each tagged with its op."""

    repeats: int
    gpu_trace_dir: Optional[str] = None

    def measure(self, run, operands) -> dict:
        """{"ms": mean wall time per call} and, with a trace directory, "gpu_ms" and
        "gpu_kernels"."""
        @tf.function
        def calls_in_a_graph(operands):
            # One element of each result, summed: the function waits for every call.
            return tf.add_n([tf.reshape(run(*tensors), [-1])[0] for tensors in operands])

        # Operands are arguments, not captures, so that no traced function holds them after.
        calls_in_a_graph(operands).numpy()  # tracing, warm-up: autotuning, allocations
        samples = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            calls_in_a_graph(operands).numpy()
            samples.append((time.perf_counter() - start) * 1e3 / len(operands))
        result = {"ms": statistics.median(samples)}
        if self.gpu_trace_dir:
            result["gpu_ms"], result["gpu_kernels"] = self._gpu_time(calls_in_a_graph, operands)
        return result

    def _gpu_time(self, calls_in_a_graph, operands) -> tuple[float, dict]:
        """The GPU's time per call, and the kernels that took it (the five longest by name,
        ms per call): which cuDNN kernel TensorFlow's own op ran, beside the plan's."""
        shutil.rmtree(self.gpu_trace_dir, ignore_errors=True)
        tf.profiler.experimental.start(self.gpu_trace_dir,
                                       options=tf.profiler.experimental.ProfilerOptions(
                                           host_tracer_level=1, device_tracer_level=1))
        try:
            calls_in_a_graph(operands).numpy()
        finally:
            tf.profiler.experimental.stop()
        events = step_trace.gpu_events(step_trace.read_profile(self.gpu_trace_dir))
        by_name: dict[str, float] = {}
        for event in events:
            if event.op_type not in HARNESS_OP_TYPES:
                by_name[event.name] = (by_name.get(event.name, 0.0)
                                       + (event.end_ms - event.start_ms) / len(operands))
        longest = sorted(by_name.items(), key=lambda item: -item[1])[:5]
        return sum(by_name.values()), {name[:160]: ms for name, ms in longest}


def benchmark_model(name, batch, limits_mib, database, machine, timing, calls,
                    call_overhead_ms, engines, data_format):
    model = models.load_model(name, data_format)
    layers, skipped = find_conv_layers(trace_model(model, batch))
    by_name = {layer.name: layer for layer in layers}
    geometries = unique_geometries(layers)
    depthwise = {layer.name for layer in layers if layer.op_type == DEPTHWISE}
    profile([(g, f"{name}.{names[0]}") for g, names in geometries.items()], batch, database,
            engines=engines)
    rows = []
    with tf.device("/GPU:0"):
        for g, names in geometries.items():
            operands = [_tensors(g, batch, seed) for seed in range(calls)]
            # TensorFlow runs a depthwise layer with its own op, whatever its geometry.
            tensorflow_op = DEPTHWISE if names[0] in depthwise else "Conv2D"
            for kernel in KERNELS:
                timings = database.timings(machine.device, machine.cudnn_version, g, kernel)
                if not engines:
                    timings = {size: [t for t in measured if not t.algorithm.is_engine]
                               for size, measured in timings.items()}
                reference = timing.measure(
                    _tensorflow_runner(g, kernel, tensorflow_op == DEPTHWISE), operands)
                row = {"geometry": str(g), "layers": names, "kernel": kernel,
                       "training_layers": sum(kernel in kernels_run(by_name[layer])
                                              for layer in names),
                       "tensorflow_op": tensorflow_op,
                       **{f"tensorflow_{key}": value for key, value in reference.items()},
                       "limits": {}}
                for limit in limits_mib:
                    entry = {}
                    for label, sizes in (("undivided", [batch]), ("micro_batched", None)):
                        try:
                            config = fastest_configuration(kernel, timings, batch, limit * MIB,
                                                           micro_batch_sizes=sizes,
                                                           call_overhead_ms=call_overhead_ms)
                        except NoFeasiblePlanError as error:
                            entry[label] = {"error": str(error)}
                            continue
                        measured = timing.measure(_runner(g, kernel, config.plan), operands)
                        entry[label] = {
                            "plan": config.plan.to_json(),
                            "predicted_ms": config.time_ms,
                            "workspace_bytes": config.workspace_bytes,
                            **{f"measured_{key}": value for key, value in measured.items()},
                        }
                    row["limits"][str(limit)] = entry
                rows.append(row)
                print(f"{name} {g} {kernel}: TF {row['tensorflow_ms']:.3f} ms; " + "; ".join(
                    f"{limit} MiB undivided {e['undivided'].get('measured_ms', float('nan')):.3f}"
                    f" vs micro {e['micro_batched'].get('measured_ms', float('nan')):.3f}"
                    for limit, e in row["limits"].items()), flush=True)
    return {"model": name, "batch": batch, "conv_layers": len(layers),
            "distinct_geometries": len(geometries), "skipped": skipped, "kernels": rows,
            "totals": network_totals(rows, limits_mib),
            "training_totals": network_totals(rows, limits_mib, training=True)}


def network_totals(rows, limits_mib, training=False):
    """Whole-network sums, each geometry counted once per layer using it; with `training`, only
    the kernels a training step runs (`kernels_run`)."""
    count = (lambda r: r["training_layers"]) if training else (lambda r: len(r["layers"]))
    result = {key: sum(count(r) * r[key] for r in rows)
              for key in ("tensorflow_ms", "tensorflow_gpu_ms") if key in rows[0]}
    for limit in limits_mib:
        entry = {}
        for label in ("undivided", "micro_batched"):
            runs = [(count(r), r["limits"][str(limit)][label]) for r in rows]
            if any("error" in run for _, run in runs):
                entry[label] = None
                continue
            entry[label] = {key: sum(n * run[key] for n, run in runs)
                            for key in ("predicted_ms", "measured_ms", "measured_gpu_ms")
                            if key in runs[0][1]}
        if entry["undivided"] and entry["micro_batched"]:
            entry["measured_speedup"] = (entry["undivided"]["measured_ms"]
                                         / entry["micro_batched"]["measured_ms"])
            entry["predicted_speedup"] = (entry["undivided"]["predicted_ms"]
                                          / entry["micro_batched"]["predicted_ms"])
        result[f"{limit}MiB"] = entry
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["alexnet", "resnet50", "mobilenet_v2"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--limits-mib", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--database", default="/tmp/tf_ucudnn_profiles.sqlite")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--call-overhead-ms", type=float, default=0.0,
                        help="host time per micro-batch added to cuDNN's timings when planning")
    parser.add_argument("--gpu-times", action="store_true",
                        help="also the GPU's own time of each kernel, from one run under "
                             "TensorFlow's profiler (the kernels and copies each op launched)")
    parser.add_argument("--legacy-only", action="store_true",
                        help="plan with cuDNN's legacy algorithms alone, not its engine "
                             "configurations")
    parser.add_argument("--data-format", choices=["channels_first", "channels_last"],
                        default="channels_first",
                        help="the models' layout: NCHW, as μ-cuDNN measured, or NHWC, Keras's "
                             "default")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # Each op runs in the layout it is given: Grappler would transpose TensorFlow's ops inside
    # the timed functions (it does not know tf_ucudnn's).
    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    machine = current_machine()
    engines = engines_available() and not args.legacy_only
    results = {"benchmark": "microbatch_speedup", "device": machine.device,
               "cudnn_version": machine.cudnn_version, "tensorflow": tf.__version__,
               "tf32": tf.config.experimental.tensor_float_32_execution_enabled(),
               "host": platform.node(), "dtype": "float32",
               "layout": "NCHW" if args.data_format == "channels_first" else "NHWC",
               "timing": f"median of {args.repeats} x mean of {args.calls} calls (operands of "
                         "their own) in one tf.function" + ("; gpu_ms: the kernels and copies "
                                                           "of one profiled run"
                                                           if args.gpu_times else ""),
               "call_overhead_ms": args.call_overhead_ms,
               "candidates": "legacy algorithms and engine configurations" if engines
               else "legacy algorithms",
               "command": " ".join(sys.argv), "models": []}
    timing = Timing(args.repeats, tempfile.mkdtemp(prefix="microbatch_speedup_trace_")
                    if args.gpu_times else None)
    with ProfileDatabase(args.database) as database:
        for name in args.models:
            results["models"].append(benchmark_model(name, args.batch, args.limits_mib, database,
                                                     machine, timing, args.calls,
                                                     args.call_overhead_ms, engines,
                                                     args.data_format))
            with open(args.out, "w") as out:
                json.dump(results, out, indent=1)
    for model in results["models"]:
        totals = model["totals"]
        gpu = (f", {totals['tensorflow_gpu_ms']:.1f} ms on the GPU"
               if "tensorflow_gpu_ms" in totals else "")
        print(f"\n{model['model']} batch {model['batch']}: {model['conv_layers']} convolutions, "
              f"TensorFlow's own kernels {totals['tensorflow_ms']:.1f} ms (fwd+bwd){gpu}")
        for limit in args.limits_mib:
            entry = model["totals"][f"{limit}MiB"]
            if entry.get("measured_speedup") is None:
                print(f"  {limit:4d} MiB: some kernel has no plan within the limit")
                continue
            gpu = (f", {entry['micro_batched']['measured_gpu_ms']:.1f} ms on the GPU"
                   if "measured_gpu_ms" in entry["micro_batched"] else "")
            print(f"  {limit:4d} MiB: undivided {entry['undivided']['measured_ms']:8.1f} ms, "
                  f"micro-batched {entry['micro_batched']['measured_ms']:8.1f} ms{gpu} -> "
                  f"{entry['measured_speedup']:.2f}x measured "
                  f"({entry['predicted_speedup']:.2f}x predicted)")
            training = model["training_totals"]
            if training["tensorflow_ms"] != totals["tensorflow_ms"]:
                print(f"            the kernels training runs: TensorFlow's "
                      f"{training['tensorflow_ms']:.1f} ms, micro-batched "
                      f"{training[f'{limit}MiB']['micro_batched']['measured_ms']:.1f} ms")


if __name__ == "__main__":
    main()
