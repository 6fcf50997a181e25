"""Issue 23's table: Keras's `model.fit` (compiled by XLA, as Keras does on a GPU) at its largest
batch under a memory cap, beside `model.fit` with `MicroBatchCallback(memory_budget=...)` at a
multiple of that batch, each in a fresh process of its own under the same cap, on one GPU:

    python benchmarks/keras_beyond_memory.py --models vgg16 resnet50 resnet152 --out FILE

Keras's largest batch is searched from `--start` (per model) in steps of `--step`, up while they
train or down until one does, at most `--tries` batches (beyond_memory.py's `keras_fit`). The
callback's run trains at `--factor` times that batch under `--budget-fraction` of the cap (the rest
is left to the allocator's fragmentation and what XLA holds beside its buffers). The JSON keeps
`keras_fit` and `keras_callback` per model, as beyond_memory.py writes them, and the callback's run
says which way it planned the step (the whole step in micro-batches, or swaps and recomputations)
and its predicted and measured peaks; a step in micro-batches also its step time (`step_ms`),
measured and predicted at Keras fit's measured time per image. With `--tune FACTOR ...`,
`tune_keras_batch_size` first picks the best of those multiples of Keras's batch under the same
budget (`keras_tuned`), each trial's step measured in its micro-batches in the tuner's process
(`tuner_measured` beside the callback's step where the micro-batches are the same, with
`measured_over_tuner_measured`), and the callback also trains the batch it picks
(`keras_callback_tuned`), unless it is the one above.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from beyond_memory import in_child, keras_fit

STARTS = {"resnet50": 192, "vgg16": 128, "resnet152": 80, "smoke": 8}


def train_with_callback(name: str, batch: int, budget: int, fit: dict, tuned: dict, args,
                        environment: dict) -> dict:
    """`model.fit` with the callback at `batch` under `budget`, in a child, beside `fit` (and
    the tuner's trial of `batch` in `tuned`, if any)."""
    callback, failure, _ = in_child(
        ["--keras-callback-child", name, str(batch), str(budget), "--steps", str(args.steps),
         "--link-gb-s", *map(str, args.link_gb_s), "--trial-allocator", args.allocator,
         *args.callback_options], args.memory_limit_gib, environment)
    callback = callback or {"batch": batch, "error": failure}
    if callback.get("img_per_s") and fit["img_per_s"]:
        callback["vs_keras_fit"] = callback["img_per_s"] / fit["img_per_s"]
        if "accumulation" in callback:
            # The step runs Keras's own compiled step once per micro-batch: predicted at Keras
            # fit's measured time per image, beside the step measured, and the tuner's
            # measurement of it where the tuner planned the same micro-batches.
            predicted, measured = (batch / rate * 1e3 for rate in (fit["img_per_s"],
                                                                    callback["img_per_s"]))
            callback["step_ms"] = {"predicted": predicted, "measured": measured,
                                   "measured_over_predicted": measured / predicted,
                                   "predicted_from": "Keras fit's time per image"}
            trial = next((t for t in tuned.get("trials", ()) if t["batch_size"] == batch), {})
            if trial.get("step_ms") and trial.get("accumulated_micro_batch") == \
                    callback["accumulation"]["micro_batch_size"]:
                callback["step_ms"] |= {"tuner_measured": trial["step_ms"],
                                        "measured_over_tuner_measured":
                                            measured / trial["step_ms"]}
    print(name, "callback", batch, json.dumps(callback)[:400], flush=True)
    return callback


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["vgg16", "resnet50", "resnet152"])
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--budget-fraction", type=float, default=0.85)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--start", type=int, help="the first batch tried (default per model)")
    parser.add_argument("--step", type=int, default=16)
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--allocator", choices=["bfc", "cuda_malloc_async"], default="bfc")
    parser.add_argument("--link-gb-s", type=float, nargs=2, default=[25.0, 25.0])
    parser.add_argument("--repeats", type=int, default=1,
                        help="train the callback's 4x batch this many times, each in a fresh "
                        "process (keras_callback_repeats; keras_callback_trained counts them); 0: "
                        "none (with --tune, the tuned batch only where it is another)")
    parser.add_argument("--tune", type=float, nargs="*", default=[], metavar="FACTOR",
                        help="also tune the batch among these multiples of Keras's batch")
    parser.add_argument("--callback-options", nargs=argparse.REMAINDER, default=[],
                        help="beyond_memory.py options for the callback's run (last)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    environment = ({"TF_GPU_ALLOCATOR": args.allocator} if args.allocator != "bfc" else {})
    results = {"benchmark": "keras_beyond_memory", "date": datetime.date.today().isoformat(),
               "command": " ".join(sys.argv), "memory_limit_gib": args.memory_limit_gib,
               "budget_fraction": args.budget_fraction, "factor": args.factor, "models": {}}
    for name in args.models:
        fit = keras_fit(name, args.start or STARTS[name], args.step, args.steps, args.tries,
                        args.memory_limit_gib, args.allocator)
        print(name, "Keras fit", json.dumps(fit)[:400], flush=True)
        entry = {"keras_fit": fit}
        results["models"][name] = entry
        if fit["largest_batch_tried"]:
            batch = args.factor * fit["largest_batch_tried"]
            budget = int(args.budget_fraction * args.memory_limit_gib * (1 << 30))
            tuned = {}
            if args.tune:
                batches = [int(f * fit["largest_batch_tried"]) for f in args.tune]
                tuned, failure, _ = in_child(
                    ["--tune-child", name, str(budget), *map(str, batches),
                     "--steps", str(args.steps), "--link-gb-s",
                     *map(str, args.link_gb_s), "--trial-allocator", args.allocator,
                     *args.callback_options], args.memory_limit_gib, environment)
                entry["keras_tuned"] = tuned or {"error": failure}
                tuned = tuned or {}
                for trial in tuned.get("trials", ()):  # whole, as a cut log line would not be
                    print(name, "tuned", json.dumps(trial), flush=True)
                print(name, "tuned: best batch", tuned.get("best_batch"), flush=True)
            if args.repeats > 0:
                entry["keras_callback"] = train_with_callback(name, batch, budget, fit, tuned,
                                                              args, environment)
            if args.repeats > 1:  # robust near the budget: each run a fresh process
                entry["keras_callback_repeats"] = [entry["keras_callback"]] + [
                    train_with_callback(name, batch, budget, fit, tuned, args, environment)
                    for _ in range(args.repeats - 1)]
                entry["keras_callback_trained"] = sum(
                    bool(run.get("img_per_s")) for run in entry["keras_callback_repeats"])
            best = tuned.get("best_batch")
            if best and best != batch:
                entry["keras_callback_tuned"] = train_with_callback(
                    name, best, budget, fit, tuned, args, environment)
        with open(args.out, "w") as f:  # after each model, lest a time limit lose them all
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
