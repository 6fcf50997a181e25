"""Training throughput of Keras models under `model.fit`, plain and with tf_ucudnn's callback, on
synthetic data: images per second of the epochs after the first (which holds tracing, XLA
compilation, and the callback's profiling and planning).

TensorFlow reads TF_CUDNN_WORKSPACE_LIMIT_IN_MB once per process, so each configuration is a run
of this script, and `--combine` puts their results side by side:

    python benchmarks/keras_training.py run --label tf_default --out a.json
    TF_CUDNN_WORKSPACE_LIMIT_IN_MB=64 python benchmarks/keras_training.py run --label tf_64mib ...
    TF_CUDNN_WORKSPACE_LIMIT_IN_MB=64 python benchmarks/keras_training.py run \\
        --callback 64MiB --label tf_ucudnn_64mib --out c.json
    python benchmarks/keras_training.py combine a.json b.json c.json \\
        --out benchmarks/results/keras_training_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import keras
import tensorflow as tf

import tf_ucudnn
from tf_ucudnn import models


class EpochTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def _train(name: str, args) -> dict:
    keras.utils.set_random_seed(0)
    model = models.load_model(name)
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile={"auto": "auto", "on": True, "off": False}[args.jit_compile])
    shape = model.input_shape[1:]
    classes = model.output_shape[-1]
    images = tf.random.stateless_uniform([args.batch, *shape], seed=[1, 2])
    labels = tf.random.stateless_uniform([args.batch], [3, 4], maxval=classes, dtype=tf.int32)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    timer = EpochTimer()
    callbacks = [timer]
    planner = None
    if args.callback:
        planner = tf_ucudnn.MicroBatchCallback(args.callback, database=args.database,
                                               profiles=args.profiles)
        callbacks.insert(0, planner)
    jit = model.jit_compile
    model.fit(data, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0, shuffle=False,
              callbacks=callbacks)
    steady = timer.seconds[1:]
    result = {
        "img_per_s": args.batch * args.steps / statistics.median(steady),
        "epoch_seconds": timer.seconds,
        "xla": bool(jit) and not args.callback,  # the callback turns XLA off
    }
    if planner:
        result["report"] = planner.report.to_json()
        result["layers_planned"] = len(planner.report.layers)
        result["layers_left_alone"] = len(planner.report.left_alone)
    return result


def run(args) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    device = (tf.config.experimental.get_device_details(gpus[0]).get("device_name")
              if gpus else platform.processor() or "CPU")
    results = {"label": args.label, "device": device, "tensorflow": tf.__version__,
               "batch": args.batch, "dtype": "float32",
               "tf32": tf.config.experimental.tensor_float_32_execution_enabled(),
               "TF_CUDNN_WORKSPACE_LIMIT_IN_MB": os.environ.get("TF_CUDNN_WORKSPACE_LIMIT_IN_MB"),
               "callback_workspace_limit": args.callback, "jit_compile": args.jit_compile,
               "steps_per_epoch": args.steps, "epochs": args.epochs, "models": {}}
    for name in args.models:
        results["models"][name] = _train(name, args)
        print(args.label, name, f"{results['models'][name]['img_per_s']:.1f} img/s", flush=True)
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)


def combine(args) -> None:
    runs = [json.load(open(path)) for path in args.runs]
    names = list(dict.fromkeys(name for run_ in runs for name in run_["models"]))
    table = {name: {run_["label"]: round(run_["models"][name]["img_per_s"], 1)
                    for run_ in runs if name in run_["models"]} for name in names}
    header = ["model"] + [run_["label"] for run_ in runs]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for name in names:
        lines.append(" | ".join([name] + [str(table[name].get(label, "")) for label in header[1:]]))
    print("images per second\n" + "\n".join(lines))
    with open(args.out, "w") as out:
        json.dump({"benchmark": "keras_training", "img_per_s": table, "runs": runs}, out, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="train each model in this process, one configuration")
    one.add_argument("--models", nargs="+", default=["vgg16", "resnet50"])
    one.add_argument("--batch", type=int, default=128)
    one.add_argument("--steps", type=int, default=20, help="steps per epoch")
    one.add_argument("--epochs", type=int, default=3, help="the first one is not timed")
    one.add_argument("--callback", help="train with MicroBatchCallback at this workspace limit")
    one.add_argument("--jit-compile", choices=["auto", "on", "off"], default="auto")
    one.add_argument("--database", default="/tmp/tf_ucudnn_profiles.sqlite")
    one.add_argument("--profiles", nargs="*", default=[],
                     help="JSON-lines profiles to import first (measured earlier on this GPU)")
    one.add_argument("--label", required=True)
    one.add_argument("--out", required=True)
    many = commands.add_parser("combine", help="put runs side by side")
    many.add_argument("runs", nargs="+")
    many.add_argument("--out", required=True)
    args = parser.parse_args()
    run(args) if args.command == "run" else combine(args)


if __name__ == "__main__":
    main()
