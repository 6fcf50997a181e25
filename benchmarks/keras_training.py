"""Training throughput of Keras models under `model.fit`, plain and with tf_ucudnn's callback, on
synthetic data: images per second of the epochs after the first (which holds tracing, XLA
compilation, and the callback's profiling and planning), the first epoch's seconds, and the
device's peak memory over the whole run and over the later epochs alone. With `--trace-peak`, one
step after the timed epochs runs under TensorFlow's profiler, which says what was alive at its peak
and where the GPU's time went: kernels by class (convolutions, GEMMs, tf_ucudnn's copies, the
rest), copies, and the time the GPU was busy. `--xla-margin` sets how much faster than XLA's own
convolution a layer's plan must be predicted (negative lets slower plans in, so the callback's
step trial measures them).

TensorFlow reads TF_CUDNN_WORKSPACE_LIMIT_IN_MB once per process, so each configuration is a run
of this script, and `combine` puts their results side by side, each against the baseline
(Keras's default step, which on a GPU XLA compiles):

    python benchmarks/keras_training.py run --label tf_default --out a.json
    TF_CUDNN_WORKSPACE_LIMIT_IN_MB=64 python benchmarks/keras_training.py run --label tf_64mib ...
    TF_CUDNN_WORKSPACE_LIMIT_IN_MB=64 python benchmarks/keras_training.py run \\
        --callback 64MiB --label tf_ucudnn_64mib --out c.json
    python benchmarks/keras_training.py combine a.json b.json c.json --baseline tf_default \\
        --out benchmarks/results/keras_training_h100.json

benchmarks/keras_training_gpu.sh runs every configuration this way on the lent GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time
from typing import Optional

import keras
import tensorflow as tf
from gpu_names import device_name

import tf_ucudnn
from tf_ucudnn.conv_planning.database_planner import DatabasePlanner
from tf_ucudnn.keras import models
from tf_ucudnn.keras.batch_norm_forms import KERNELS
from tf_ucudnn.profiling import ProfileDatabase
from tf_ucudnn.profiling.profiler import current_machine
from tf_ucudnn.profiling.step_trace import alive_at_peak, gpu_activity, read_profile

# Kernel classes by name, the first match wins: cuDNN's and CUTLASS's convolution kernels say
# which pass they run (their GEMM is implicit), so they come before the GEMMs.
KERNEL_CLASSES = (
    ("convolution", re.compile(r"conv|fprop|dgrad|wgrad|winograd|fft|implicit", re.IGNORECASE)),
    ("tf_ucudnn copy or sum", re.compile(r"StridedCopy|Accumulate", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|nvjet|cublas", re.IGNORECASE)),
)


def kernel_summary(space, top: int = 40) -> dict:
    """The first GPU's time in the traced step: its kernels by class, its copies, the time its
    streams were busy and the wall time they spanned, and its `top` kernels by name."""
    activity = next(iter(gpu_activity(space).values()), None)
    if activity is None:
        return {}
    by_class: dict = {}
    for name, kernel in activity.kernels.items():
        kind = next((kind for kind, pattern in KERNEL_CLASSES if pattern.search(name)), "other")
        by_class[kind] = by_class.get(kind, 0.0) + kernel["ms"]
    return {"wall_ms": round(activity.wall_ms, 3), "busy_ms": round(activity.busy_ms, 3),
            "kernel_ms": round(sum(by_class.values()), 3),
            "ms_by_class": {kind: round(ms, 3) for kind, ms in by_class.items()},
            "copies": {name: {"ms": round(copy["ms"], 4), "count": copy["count"]}
                       for name, copy in activity.copies.items()},
            "top": [{"name": name, "ms": round(kernel["ms"], 4), "count": kernel["count"]}
                    for name, kernel in list(activity.kernels.items())[:top]]}


class EpochTimer(keras.callbacks.Callback):
    """Each epoch's seconds, the first epoch's step by step (where its compilations and the
    callback's planning went), whether the step was XLA-compiled, and the device's peak memory of
    the whole run and of the epochs after the first."""

    def __init__(self, device: Optional[str]):
        super().__init__()
        self.seconds = []
        self.first_epoch_steps = []
        self.device = device
        self.peak_bytes = self.steady_peak_bytes = None
        self.jit_compile = None

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1 and self.device:
            self.peak_bytes = tf.config.experimental.get_memory_info(self.device)["peak"]
            tf.config.experimental.reset_memory_stats(self.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if not self.seconds:
            self.first_epoch_steps.append(time.perf_counter() - self._start)

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)
        self.jit_compile = bool(self.model.jit_compile)

    def on_train_end(self, logs=None):
        if self.device:
            peak = tf.config.experimental.get_memory_info(self.device)["peak"]
            self.steady_peak_bytes = peak
            self.peak_bytes = max(self.peak_bytes or 0, peak)


class PeakTrace(keras.callbacks.Callback):
    """Profiles the first step of epoch `epoch` and replays the device allocator's events: the
    step's peak, and what was alive then, summed by the last part of the allocating op's name
    (its type, where TensorFlow named the op)."""

    def __init__(self, epoch: int, logdir: str):
        super().__init__()
        self.epoch, self.logdir = epoch, logdir
        self.result = None
        self._epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch == self.epoch and batch == 0:
            shutil.rmtree(self.logdir, ignore_errors=True)  # one profile: an earlier run's goes
            tf.profiler.experimental.start(self.logdir)

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch != self.epoch or batch != 0:
            return
        tf.profiler.experimental.stop()
        space = read_profile(self.logdir)
        alive = alive_at_peak(space, device_allocator=True, top=100000)
        by_type = {}
        for buffer in alive["largest_alive"]:
            op_type = re.sub(r"_\d+$", "", buffer["op"].rsplit("/", 1)[-1]) or "(no op)"
            by_type[op_type] = by_type.get(op_type, 0) + buffer["bytes"]
        self.result = {
            "peak_bytes": alive["peak_bytes"], "peak_op": alive["peak_op"],
            "alive_bytes_by_op_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1])[:25]),
            "largest_alive": alive["largest_alive"][:25],
            "gpu_kernels": kernel_summary(space)}


def _train(name: str, args) -> dict:
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(args.precision)
    model = models.load_model(name)
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile={"auto": "auto", "on": True, "off": False}[args.jit_compile])
    shape = model.input_shape[1:]
    classes = model.output_shape[-1]
    images = tf.random.stateless_uniform([args.batch, *shape], seed=[1, 2])
    labels = tf.random.stateless_uniform([args.batch], [3, 4], maxval=classes, dtype=tf.int32)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else None
    if args.prefetch_to_device:
        # What a user could write instead of the callback's copies ahead.
        data = data.apply(tf.data.experimental.prefetch_to_device(device or "CPU:0", 2))
    if device:
        tf.config.experimental.reset_memory_stats(device)
    timer = EpochTimer(device)
    callbacks = [timer]
    trace = None
    if args.trace_peak:
        # An epoch beyond the timed ones, so the profiler slows no timed step.
        trace = PeakTrace(args.epochs, os.path.join(args.trace_dir, f"{args.label}_{name}"))
        callbacks.append(trace)
    planner = layer_planner = None
    if args.callback:
        with ProfileDatabase(args.database) as database:
            for path in args.profiles:
                database.import_jsonl(path)
            profiles_before = len(database)
        if args.xla_margin is not None:
            layer_planner = DatabasePlanner.open(args.callback, args.database,
                                                 compare_with_xla=True,
                                                 xla_margin=args.xla_margin)
        fuse_batch_norm = {"keras": False}.get(args.fuse_batch_norm, args.fuse_batch_norm)
        # A planner given plans from its own database: the options name one only for theirs.
        own_planner = {} if layer_planner else {"database": args.database,
                                                "profiles": args.profiles}
        planner = tf_ucudnn.MicroBatchCallback(args.callback, layer_planner, **own_planner,
                                               fuse_batch_norm=fuse_batch_norm,
                                               trial_steps=args.trial_steps,
                                               prefetch_batches=args.prefetch_batches)
        callbacks.insert(0, planner)
    try:
        model.fit(data, epochs=args.epochs + bool(trace), steps_per_epoch=args.steps, verbose=0,
                  shuffle=False, callbacks=callbacks)
    finally:
        if layer_planner:
            layer_planner.close()
    steady = timer.seconds[1:args.epochs]
    result = {
        "img_per_s": args.batch * args.steps / statistics.median(steady),
        "epoch_seconds": timer.seconds[:args.epochs],
        "first_epoch_seconds": timer.seconds[0],
        # Seconds from the epoch's start to the end of each of its steps.
        "first_epoch_step_ends": [round(t, 3) for t in timer.first_epoch_steps],
        "xla": timer.jit_compile,
        "peak_bytes": timer.peak_bytes,
        "steady_peak_bytes": timer.steady_peak_bytes,
    }
    if trace:
        result["peak_trace"] = trace.result
    if planner:
        # Measurements the callback had to make on the GPU (none where the imported profiles
        # held every layer): their time is in the first epoch, their workspace in the peak.
        with ProfileDatabase(args.database) as database:
            result["profiles_measured"] = len(database) - profiles_before
        result["report"] = planner.report.to_json()
        result["layers_planned"] = len(planner.report.layers)
        result["layers_left_alone"] = len(planner.report.left_alone)
    return result


def run(args) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    device = device_name()
    cudnn = (current_machine().cudnn_version
             if gpus and tf_ucudnn.gpu_kernels_available() else None)
    results = {"label": args.label, "device": device, "tensorflow": tf.__version__,
               "cudnn": cudnn,
               "batch": args.batch, "precision": args.precision,
               "tf32": tf.config.experimental.tensor_float_32_execution_enabled(),
               "TF_CUDNN_WORKSPACE_LIMIT_IN_MB": os.environ.get("TF_CUDNN_WORKSPACE_LIMIT_IN_MB"),
               "callback_workspace_limit": args.callback, "xla_margin": args.xla_margin,
               "fuse_batch_norm": args.fuse_batch_norm,
               "prefetch_batches": args.prefetch_batches if args.callback else None,
               "prefetch_to_device": args.prefetch_to_device,
               "jit_compile": args.jit_compile,
               "steps_per_epoch": args.steps, "epochs": args.epochs, "models": {}}
    for name in args.models:
        results["models"][name] = _train(name, args)
        print(args.label, name, f"{results['models'][name]['img_per_s']:.1f} img/s", flush=True)
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)


def combine(args) -> None:
    runs = [json.load(open(path)) for path in args.runs]
    names = list(dict.fromkeys(name for run_ in runs for name in run_["models"]))
    baseline = {run_["label"]: run_ for run_ in runs}.get(args.baseline)
    table = {}
    lines = ["configuration | model | img/s | vs baseline | peak GB (later epochs) | first epoch s",
             "--- | --- | --- | --- | --- | ---"]
    for run_ in runs:
        for name in names:
            row = run_["models"].get(name)
            if row is None:
                continue
            base = baseline["models"].get(name) if baseline else None
            ratio = row["img_per_s"] / base["img_per_s"] if base else None
            table.setdefault(name, {})[run_["label"]] = {
                "img_per_s": round(row["img_per_s"], 1),
                "vs_baseline": None if ratio is None else round(ratio, 3),
                "peak_gb": _gb(row.get("peak_bytes")),
                "steady_peak_gb": _gb(row.get("steady_peak_bytes")),
                "first_epoch_s": round(row["epoch_seconds"][0], 1),
                "xla": row.get("xla")}
            cell = table[name][run_["label"]]
            lines.append(f"{run_['label']} | {name} | {cell['img_per_s']} | "
                         f"{'' if ratio is None else f'{ratio:.0%}'} | {cell['peak_gb']} "
                         f"({cell['steady_peak_gb']}) | {cell['first_epoch_s']}")
    repeats = _against_own_baseline(runs, args.baseline)
    if repeats:
        lines += ["", f"each configuration against {args.baseline} of the same round "
                      "(REPEATS: label_rN is round N)",
                  "configuration | model | img/s by round | vs baseline by round | median"]
        for label, models_ in repeats.items():
            for name, row in models_.items():
                lines.append(f"{label} | {name} | {' / '.join(map(str, row['img_per_s']))} | "
                             f"{' / '.join(f'{r:.1%}' for r in row['vs_baseline'])} | "
                             f"{row['median_vs_baseline']:.1%}")
    print(f"against {args.baseline}\n" + "\n".join(lines))
    # Each configuration's first epoch (tracing, compiling, and the callback's profiling, planning
    # and step trial), per model.
    first_epoch_s = {run_["label"]: {name: round(row["epoch_seconds"][0], 1)
                                     for name, row in run_["models"].items()} for run_ in runs}
    with open(args.out, "w") as out:
        json.dump({"benchmark": "keras_training", "baseline": args.baseline,
                   "first_epoch_s": first_epoch_s, "table": table,
                   "against_own_round": repeats, "runs": runs}, out, indent=1)


def _against_own_baseline(runs, baseline: str) -> dict:
    """Configurations run in rounds (labels label, label_r2, ...): each round's img/s against
    the baseline's in the same round, and the median ratio. Empty unless some ran twice."""
    by_label = {run_["label"]: run_ for run_ in runs}
    rounds: dict = {}
    for label in by_label:
        match = re.fullmatch(r"(.+?)(?:_r(\d+))?", label)
        rounds.setdefault(match.group(1), []).append((int(match.group(2) or 1), label))
    result = {}
    for config, labels in rounds.items():
        if config == baseline or len(labels) < 2:
            continue
        for name in by_label[labels[0][1]]["models"]:
            speeds, ratios = [], []
            for round_, label in sorted(labels):
                base = by_label.get(baseline if round_ == 1 else f"{baseline}_r{round_}")
                row, base_row = (by_label[label]["models"].get(name),
                                 base and base["models"].get(name))
                if row and base_row:
                    speeds.append(round(row["img_per_s"], 1))
                    ratios.append(row["img_per_s"] / base_row["img_per_s"])
            if ratios:
                result.setdefault(config, {})[name] = {
                    "img_per_s": speeds, "vs_baseline": [round(r, 4) for r in ratios],
                    "median_vs_baseline": round(statistics.median(ratios), 4)}
    return result


def _gb(value):
    return None if value is None else round(value / 1e9, 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="train each model in this process, one configuration")
    one.add_argument("--models", nargs="+", default=["vgg16", "resnet50"])
    one.add_argument("--batch", type=int, default=128)
    one.add_argument("--steps", type=int, default=20, help="steps per epoch")
    one.add_argument("--epochs", type=int, default=3, help="the first one is not timed")
    one.add_argument("--callback", help="train with MicroBatchCallback at this workspace limit")
    one.add_argument("--trial-steps", type=int, default=10,
                     help="the callback's step trial where XLA compiles the step")
    one.add_argument("--xla-margin", type=float,
                     help="with --callback: how much faster than XLA's convolution a plan must "
                          "be predicted (the callback's own: 0.1)")
    one.add_argument("--fuse-batch-norm", choices=[*sorted(KERNELS), "keras"],
                     help="with --callback: the batch normalization kernel it trains with from "
                          "the first step, or keras for Keras's own (unset: its step trial "
                          "decides)")
    one.add_argument("--prefetch-batches", type=int, default=2,
                     help="with --callback: the batches it copies to the GPU ahead of their "
                          "steps (0: none)")
    one.add_argument("--prefetch-to-device", action="store_true",
                     help="feed fit tf.data's prefetch_to_device, two batches ahead")
    one.add_argument("--jit-compile", choices=["auto", "on", "off"], default="auto")
    one.add_argument("--precision", choices=["float32", "mixed_bfloat16"], default="float32",
                     help="Keras's dtype policy for the model")
    one.add_argument("--database", default="/tmp/tf_ucudnn_profiles.sqlite")
    one.add_argument("--profiles", nargs="*", default=[],
                     help="JSON-lines profiles to import first (measured earlier on this GPU)")
    one.add_argument("--trace-peak", action="store_true",
                     help="profile one step after the timed epochs: what is alive at its peak")
    one.add_argument("--trace-dir", default="/tmp/keras_training_traces")
    one.add_argument("--label", required=True)
    one.add_argument("--out", required=True)
    many = commands.add_parser("combine", help="put runs side by side")
    many.add_argument("runs", nargs="+")
    many.add_argument("--baseline", default="tf_default",
                      help="the label every other run is compared with (Keras's default step)")
    many.add_argument("--out", required=True)
    args = parser.parse_args()
    run(args) if args.command == "run" else combine(args)


if __name__ == "__main__":
    main()
