"""What the memory planner predicts for a Keras model's training step under shrinking budgets,
on the CPU (planning needs no GPU): the peak reached, swaps, recomputations, predicted step time,
and the planning time itself.

    python benchmarks/memory_plan_prediction.py --model resnet50 --batch 256 --step-ms 250 \\
        --out benchmarks/results/memory_plan_prediction_resnet50.json

`--step-ms` is the measured step time without swaps, which calibrates the op time estimates;
`--link-gb-s` the host-device bandwidth each way.

`--measure` also runs each planned step on the CPU and records the peak TensorFlow's allocator
reached, to set against the prediction; it needs the CPU's BFC allocator, which keeps that count:

    TF_CPU_ALLOCATOR_USE_BFC=true python benchmarks/memory_plan_prediction.py --model resnet50 \\
        --batch 16 --step-ms 1000 --link-gb-s 0.000001 --fractions 0.8 0.6 --measure \\
        --out benchmarks/results/memory_plan_measured_cpu_resnet50.json

(A link that slow leaves recomputation alone: on the CPU a swap moves nothing.)

With `--micro-batches`, a budget no plan of whole batches meets runs the first layers in
micro-batches; `--paths keras graph` plans that both through the model's layers (as the callback
does) and through the traced step's graph (as `rewrite` and `tf-ucudnn convert` do), side by side:

    python benchmarks/memory_plan_prediction.py --model vgg16 --batch 960 --step-ms 691.5 \
        --link-gb-s 52 --fractions --budgets-gib 11.2 --micro-batches 8 16 --paths keras graph \
        --out benchmarks/results/memory_plan_prediction_vgg16_graph_prefix.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import tensorflow as tf

from tf_ucudnn.keras import models
from tf_ucudnn.memory import (
    BudgetError,
    DeviceModel,
    analyze,
    keras_training_step,
    plan_keras_step,
    plan_step_with_prefix,
)
from tf_ucudnn.memory.search.step_plan import apply_memory_plan, plan_step_memory


def _measured_peak(step, model, batch: int) -> int:
    """The most memory the CPU allocator had in use during one step (after one to warm up)."""
    x = tf.random.stateless_uniform([batch, *model.input_shape[1:]], seed=[1, 2])
    y = tf.zeros([batch], tf.int32)
    for warm_up in (True, False):
        if not warm_up:
            tf.config.experimental.reset_memory_stats("CPU:0")
        tf.nest.map_structure(lambda t: t.numpy(), step(x, y))
    return tf.config.experimental.get_memory_info("CPU:0")["peak"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=250.0)
    parser.add_argument("--link-gb-s", type=float, default=25.0)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.8, 0.6, 0.4, 0.3],
                        help="budgets as fractions of the unplanned peak")
    parser.add_argument("--budgets-gib", type=float, nargs="+", default=[],
                        help="budgets in GiB, besides the fractions")
    parser.add_argument("--fuse-batch-norm", nargs="?", const="cudnn",
                        choices=["cudnn", "xla", "ucudnn"],
                        help="trace batch normalization as fused kernels")
    parser.add_argument("--micro-batches", type=int, nargs="*", default=[],
                        help="when no plan fits whole batches, run the first layers in this "
                        "many micro-batches (tf_ucudnn.keras.plan_keras_step)")
    parser.add_argument("--stream-conv-bn", type=int, default=0, metavar="N",
                        help="each convolution and the batch normalization after it train as one "
                        "op, its backward in N micro-batches (tf_ucudnn.keras.streamed_conv_bn)")
    parser.add_argument("--paths", nargs="+", choices=["keras", "graph"], default=["keras"],
                        help="with --micro-batches: plan through the Keras model's layers "
                        "(plan_keras_step, as the callback does), through the traced step's graph "
                        "(plan_step_with_prefix, as rewrite and tf-ucudnn convert do), or both, "
                        "side by side")
    parser.add_argument("--measure", action="store_true",
                        help="run each planned step on the CPU and record its measured peak")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = models.load_model(args.model)
    step = keras_training_step(model, args.batch, fuse_batch_norm=args.fuse_batch_norm,
                               stream_conv_batch_norm=args.stream_conv_bn)
    liveness = analyze(step)
    peak = liveness.peak_bytes + liveness.persistent_bytes
    link = DeviceModel("assumed", args.link_gb_s * 1e9, args.link_gb_s * 1e9)
    results = {"benchmark": "memory_plan_prediction", "model": args.model, "batch": args.batch,
               "step_ms": args.step_ms, "fuse_batch_norm": args.fuse_batch_norm,
               "stream_conv_batch_norm": args.stream_conv_bn,
               "link_gb_s": args.link_gb_s, "ops": len(liveness.ops),
               "unplanned_peak_bytes": peak, "budgets": []}
    if args.measure:
        try:
            results["measured_unplanned_peak_bytes"] = _measured_peak(step, model, args.batch)
        except ValueError as error:
            raise SystemExit(f"--measure needs TF_CPU_ALLOCATOR_USE_BFC=true ({error})")
    budgets = [(fraction, int(peak * fraction)) for fraction in args.fractions] + \
        [(None, int(gib * 2**30)) for gib in args.budgets_gib]
    for (fraction, budget), path in itertools.product(
            budgets, args.paths if args.micro_batches else ["whole batches"]):
        start = time.perf_counter()
        row = {"fraction": fraction, "budget_bytes": budget, "path": path}
        try:
            if path == "keras":
                planned, keras_plan = plan_keras_step(model, args.batch, budget, link,
                                                      args.step_ms, args.fuse_batch_norm,
                                                      args.micro_batches,
                                                      stream_conv_batch_norm=args.stream_conv_bn)
                plan = keras_plan.plan
                row.update(prefix_end=keras_plan.prefix_end,
                           micro_batches=keras_plan.micro_batches,
                           passed_over=keras_plan.passed_over)
            elif path == "graph":
                planned, graph_plan = plan_step_with_prefix(step, budget, link, args.step_ms,
                                                            args.micro_batches)
                plan = graph_plan.plan
                row.update(prefix_end=graph_plan.cut,
                           micro_batches=graph_plan.micro_batches,
                           passed_over=graph_plan.passed_over)
            else:
                plan, planned = plan_step_memory(step, budget, link, step_ms=args.step_ms), None
            row.update(plan.decisions.prediction.to_json(), swaps=len(plan.swaps),
                       recomputes=len(plan.recomputes),
                       recomputed_from_swapped=sum(bool(d.swapped_reads)
                                                   for d in plan.decisions.recomputes))
            if args.measure:
                # The step planned, which may run its first layers in micro-batches.
                row["measured_peak_bytes"] = _measured_peak(
                    planned or apply_memory_plan(step, plan), model, args.batch)
        except BudgetError as error:
            row.update(error=str(error), shortfall_bytes=error.shortfall_bytes)
        row["planning_s"] = time.perf_counter() - start
        results["budgets"].append(row)
        print(json.dumps(row)[:240], flush=True)
    with open(args.out, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
