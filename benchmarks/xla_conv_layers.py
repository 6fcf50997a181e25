"""Each distinct convolution layer of a Keras model, trained one step at a time under
tf.function(jit_compile=True): XLA's own convolution against tf_ucudnn's micro-batched plan (an
XLA custom call on the GPU), side by side, with the profile database's predictions of both.

A step is the layer's forward pass and both gradients. The prediction for XLA's convolution is the
best undivided algorithm at the full batch with any workspace; the plan's is its micro-batches'
measured times. The layer check the callback makes rests on that prediction; this benchmark says
how well it holds. With `--predict-only` nothing is timed (no GPU needed): each layer's two
predictions and the network's totals (`predicted_totals`), from the profiles alone.

    python benchmarks/xla_conv_layers.py --models resnet50 vgg16 --batch 128 \\
        --profiles benchmarks/results/h100-cudnn9.14-fp32-nhwc-vgg16-resnet50-b128.jsonl.gz \\
        --out xla_conv_layers.json
    python benchmarks/xla_conv_layers.py --predict-only --models resnet50 --batch 128 \\
        --profiles benchmarks/results/h100-cudnn9.14-fp32-nhwc-*-engines.jsonl.gz --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import tensorflow as tf
from gpu_names import device_name

import tf_ucudnn
from tf_ucudnn.conv_planning.database_planner import DatabasePlanner
from tf_ucudnn.graph.conv_layers import find_conv_layers, trace_model
from tf_ucudnn.keras import models


def _step(layer, plan):
    """One jit-compiled forward and backward pass of `layer`, with `plan` or XLA's own op."""
    nd = layer.num_spatial_dims
    kwargs = {"strides": list(layer.strides), "padding": layer.padding,
              "data_format": layer.data_format, "dilations": list(layer.dilations)}
    if plan is None:
        conv = tf.nn.conv2d if nd == 2 else tf.nn.conv3d
    else:
        planned = tf_ucudnn.conv2d if nd == 2 else tf_ucudnn.conv3d

        def conv(x, w, **kwargs):
            return planned(x, w, plan=plan, **kwargs)

    @tf.function(jit_compile=True)
    def step(x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = conv(x, w, **kwargs)
        dx, dw = tape.gradient(y, [x, w], output_gradients=dy)
        return tf.reduce_sum(dx[:1]) + tf.reduce_sum(dw[:1])
    return step


def _milliseconds(step, args, iterations: int) -> tuple[float, float]:
    """(first call, with compilation; median of the later calls), in ms."""
    start = time.perf_counter()
    float(step(*args))
    first = (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        float(step(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return first, sorted(times)[len(times) // 2]


def predicted_totals(rows: list, margin: float) -> dict:
    """Over the layers both predictions cover, each counted as often as the network has it: XLA's
    convolution, the plans, and how many layers' plans gain at least `margin` (the callback's
    check); the layers not covered are named."""
    covered = [row for row in rows if row["predicted_xla_ms"] is not None
               and row["predicted_plan_ms"] is not None]
    return {"layers": sum(row["count"] for row in covered),
            "xla_ms": sum(row["count"] * row["predicted_xla_ms"] for row in covered),
            "plan_ms": sum(row["count"] * row["predicted_plan_ms"] for row in covered),
            "layers_gaining_the_margin": sum(
                row["count"] for row in covered
                if row["predicted_plan_ms"] <= (1 - margin) * row["predicted_xla_ms"]),
            "not_predicted": [row["layer"] for row in rows if row not in covered]}


def run(args) -> dict:
    results = {"benchmark": "xla_conv_layers", "device": device_name(),
               "tensorflow": tf.__version__,
               "batch": args.batch, "workspace_limit": args.workspace_limit,
               "tf32": tf.config.experimental.tensor_float_32_execution_enabled(),
               "iterations": args.iterations, "command": " ".join(sys.argv), "models": {}}
    with DatabasePlanner.open(args.workspace_limit, args.database, args.profiles) as planner:
        results["profiles_of"] = {"device": planner.machine.device,
                                  "cudnn_version": planner.machine.cudnn_version}
        for name in args.models:
            layers, _ = find_conv_layers(trace_model(models.load_model(name), args.batch))
            rows, seen = [], set()
            for layer in layers:
                key = (layer.input_shape, layer.filter_shape, layer.strides, layer.padding)
                if key in seen:
                    continue
                seen.add(key)
                row = {"layer": layer.name, "input": list(layer.input_shape),
                       "filter": list(layer.filter_shape), "strides": list(layer.strides),
                       "count": sum((l.input_shape, l.filter_shape, l.strides, l.padding) == key
                                    for l in layers)}
                plan = planner(layer)
                prediction = planner.predict(layer, plan)
                row["predicted_xla_ms"] = prediction.xla_ms
                row["predicted_plan_ms"] = prediction.plan_ms
                row["plan"] = plan if isinstance(plan, str) else plan.to_json()
                if args.predict_only:
                    rows.append(row)
                    continue
                x = tf.random.normal(layer.input_shape)
                w = tf.random.normal(layer.filter_shape)
                channels = [layer.filter_shape[-1]]
                dy = tf.random.normal([layer.batch_size, *layer.output_spatial(), *channels]
                                      if layer.channels_last else
                                      [layer.batch_size, *channels, *layer.output_spatial()])
                row["xla_first_ms"], row["xla_ms"] = _milliseconds(
                    _step(layer, None), (x, w, dy), args.iterations)
                if not isinstance(plan, str):
                    row["plan_first_ms"], row["plan_ms"] = _milliseconds(
                        _step(layer, plan), (x, w, dy), args.iterations)
                rows.append(row)
                print(name, row["layer"], {k: round(v, 3) for k, v in row.items()
                                           if k.endswith("_ms") and v is not None}, flush=True)
            results["models"][name] = rows
            results.setdefault("predicted_totals", {})[name] = predicted_totals(
                rows, planner.xla_margin)
            with open(args.out, "w") as out:
                json.dump(results, out, indent=1)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "vgg16"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workspace-limit", default="64MiB")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--database", help="the profile database (default: tf_ucudnn's)")
    parser.add_argument("--profiles", nargs="*", default=[])
    parser.add_argument("--predict-only", action="store_true",
                        help="the profiles' predictions only, nothing timed")
    parser.add_argument("--out", required=True)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
