"""How long planning a training step's memory takes on the CPU, phase by phase (issue 23: ResNet-152
at 4x Keras's largest batch at 16 GiB is planned within 5 s on a 2-core CPU).

    python benchmarks/planning_speed.py --out benchmarks/results/planning_speed_cpu.json

For each model, `plan_keras_step` plans its step at the batch given (by default 4x the largest
batch Keras trains in 16 GiB) under `--budget-gib`, with a host link of `--link-gb-s`, the way
beyond_memory.py's trials plan. The seconds are summed over every step the planner tries (whole
batches, then the first layers in micro-batches where nothing fits whole):
  trace_s     tracing each step (TensorFlow's own work: Keras, autograph, the gradient tape);
  analysis_s  the rest of `plan_step_memory`: liveness, op times, recomputation chains, and
              turning the decisions into the passes' swaps and recomputations;
  search_s    the greedy search (`plan_memory`), with the number of predictions it made.
The target is analysis_s + search_s; the plan's decisions and predictions are recorded too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections import Counter

import tensorflow as tf
from step_planning_args import add_step_planning_arguments

from tf_ucudnn.keras import models
from tf_ucudnn.keras.planned_step import keras_training_step, plan_keras_step
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.cost.simulator import StepSimulator
from tf_ucudnn.memory.search import step_plan
from tf_ucudnn.memory.search.greedy import BudgetError

GIB = 1 << 30


def timed(function, seconds: Counter, key: str):
    """`function`, adding the seconds each call takes to `seconds[key]` and counting calls."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - start
            seconds[key + "_calls"] += 1
    return run


def plan_timed(name: str, batch: int, budget_bytes: int, device_model: DeviceModel,
               args) -> dict:
    seconds = Counter()
    model = models.load_model(name)
    trace = timed(lambda layer, count: keras_training_step(
        model, batch, fuse_batch_norm=args.fuse_batch_norm or False, prefix_end=layer,
        micro_batches=count, stream_conv_batch_norm=args.stream_conv_bn), seconds, "trace")
    # The phases inside the planner, timed where the planner calls them.
    patched = {(step_plan, "plan_step_memory"): timed(step_plan.plan_step_memory, seconds,
                                                      "planning"),
               (step_plan, "plan_memory"): timed(step_plan.plan_memory, seconds, "search"),
               (StepSimulator, "predict"): timed(StepSimulator.predict, seconds, "predict")}
    originals = {key: getattr(*key) for key in patched}
    for (owner, attribute), replacement in patched.items():
        setattr(owner, attribute, replacement)
    try:
        _, keras_plan = plan_keras_step(model, batch, budget_bytes, device_model,
                                        micro_batches=args.micro_batches, trace=trace,
                                        cuts=[args.cut] if args.cut else None,
                                        whole_batches=args.cut is None)
    except BudgetError as error:  # planned all the same: the time is what is measured
        keras_plan = None
        missed = error
    finally:
        for (owner, attribute), original in originals.items():
            setattr(owner, attribute, original)
    entry = {"model": name, "batch": batch, "traced_steps": seconds["trace_calls"],
             "trace_s": seconds["trace"], "analysis_s": seconds["planning"] - seconds["search"],
             "search_s": seconds["search"],
             "analysis_and_search_s": seconds["planning"],
             "predictions": seconds["predict_calls"]}
    if keras_plan is None:
        return entry | {"budget_missed_by_gib": missed.shortfall_bytes / GIB}
    plan = keras_plan.plan
    prediction = plan.decisions.prediction
    return entry | {
            "prefix_end": keras_plan.prefix_end,
            "micro_batches": keras_plan.micro_batches,
            "swap_decisions": len(plan.decisions.swaps),
            "recompute_decisions": len(plan.decisions.recomputes),
            "unplanned_peak_gib": (plan.liveness.peak_bytes + plan.liveness.persistent_bytes) / GIB,
            "predicted_peak_gib": prediction.peak_bytes / GIB,
            "predicted_step_ms": prediction.step_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "vgg16", "resnet152"])
    parser.add_argument("--batches", type=int, nargs="+", default=[768, 512, 320],
                        help="one per model: by default 4x Keras's largest batch at 16 GiB")
    parser.add_argument("--budget-gib", type=float, default=13.6, help="0.85 x 16 GiB")
    parser.add_argument("--link-gb-s", type=float, nargs=2, default=[25.0, 25.0],
                        metavar=("TO_HOST", "TO_DEVICE"))
    parser.add_argument("--out", help="write the results here as JSON")
    add_step_planning_arguments(parser)
    args = parser.parse_args()
    if len(args.batches) != len(args.models):
        parser.error("give one batch per model")

    device_model = DeviceModel("given", args.link_gb_s[0] * 1e9, args.link_gb_s[1] * 1e9)
    results = {"benchmark": "planning_speed", "command": " ".join(sys.argv),
               "date": datetime.date.today().isoformat(),
               "machine": {"platform": platform.platform(), "processor": platform.processor(),
                           "cpu_count": os.cpu_count()},
               "tensorflow": tf.__version__, "budget_gib": args.budget_gib,
               "host_link_gb_s": args.link_gb_s, "fuse_batch_norm": args.fuse_batch_norm,
               "stream_conv_batch_norm": args.stream_conv_bn, "models": []}
    for name, batch in zip(args.models, args.batches):
        entry = plan_timed(name, batch, int(args.budget_gib * GIB), device_model, args)
        print(json.dumps(entry), flush=True)
        results["models"].append(entry)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
