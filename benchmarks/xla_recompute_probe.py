"""Does a recomputation survive XLA? A Keras training step with the memory planner's
recomputations made as clones behind XlaOptimizationBarrier (`recompute_function(...,
jit_compile=True)`), beside the same step compiled by XLA as it is and the recomputed step without
XLA: measured peak and step time of each, in one process on one GPU.

    python benchmarks/xla_recompute_probe.py --model resnet50 --batch 256 --out FILE

The plan is made for `--fraction` of the step's predicted peak with a host link so slow that the
planner recomputes wherever it can; its swaps are left out (XLA would keep no host copy).
"""

from __future__ import annotations

import argparse
import json
import time

import tensorflow as tf
from gpu_names import device_name


def measure(step, x, y, steps: int) -> dict:
    gpus = tf.config.list_logical_devices("GPU")
    try:
        for _ in range(2):  # the first compiles
            float(step(x, y))
        if gpus:
            tf.config.experimental.reset_memory_stats(gpus[0].name)
        start = time.perf_counter()
        for _ in range(steps):
            loss = step(x, y)
        float(loss)
        seconds = (time.perf_counter() - start) / steps
    except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as error:
        return {"error": str(error).splitlines()[0][:300]}
    peak = tf.config.experimental.get_memory_info(gpus[0].name)["peak"] if gpus else None
    return {"step_ms": seconds * 1e3, "img_per_s": x.shape[0] / seconds, "peak_bytes": peak}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from tf_ucudnn.graph.functions import callable_over
    from tf_ucudnn.keras import keras_training_step
    from tf_ucudnn.keras.models import load_model
    from tf_ucudnn.memory import DeviceModel, analyze
    from tf_ucudnn.memory.passes.recompute import recompute_function
    from tf_ucudnn.memory.search.step_plan import plan_step_memory

    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    model = load_model(args.model)
    step = keras_training_step(model, args.batch)
    report = analyze(step)
    predicted = report.peak_bytes + report.persistent_bytes
    budget = int(predicted * args.fraction)
    plan = plan_step_memory(step, budget, DeviceModel("slow link", 1e8, 1e8))
    x = tf.random.stateless_uniform([args.batch, *model.input_shape[1:]], seed=[1, 2])
    y = tf.zeros([args.batch], tf.int32)
    result = {"model": args.model, "batch": args.batch, "predicted_peak_bytes": predicted,
              "budget_bytes": budget, "recomputes": len(plan.recomputes),
              "swaps_left_out": len(plan.swaps),
              "device": device_name()}
    variants = {
        "xla": lambda: callable_over(step.graph.as_graph_def(), step, jit_compile=True),
        "xla_recomputed": lambda: recompute_function(step, plan.recomputes, jit_compile=True),
        "recomputed_without_xla": lambda: recompute_function(step, plan.recomputes),
    }
    for name, make in variants.items():
        result[name] = measure(make(), x, y, args.steps)
        print("probe", name, json.dumps(result[name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
