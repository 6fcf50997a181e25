"""Training beyond GPU memory: the largest batch plain TensorFlow trains under a memory cap, its
images per second, and the same with tf_ucudnn's memory plan (swaps, recomputations, and the
first layers in micro-batches where nothing else fits), side by side in one run (each
tf_ucudnn trial in a process of its own, as a training job would start).

    python benchmarks/beyond_memory.py --models resnet50 vgg16 resnet152 --memory-limit-gib 16 \\
        --out benchmarks/results/beyond_memory_h100.json

The cap is a logical GPU with `memory_limit` (the size of the GPUs in the SuperNeurons, AccUDNN
and ooc_cuDNN papers). tf_ucudnn is asked for 4x, then 3x and 2x TensorFlow's largest batch, each
with memory budgets under the cap (TensorFlow's allocator needs some room of its own), until one
trains. The budgets shrink by the ratio of the liveness prediction to TensorFlow's measured peak
at its own largest batch, both recorded. With `--fuse-batch-norm [cudnn|xla|ucudnn]`,
tf_ucudnn's steps train batch normalization as fused kernels (`tf_ucudnn.keras.batch_norm_forms`);
with `--stream-conv-bn N`, each convolution and the batch normalization after it train as one op
whose backward runs in N micro-batches (`tf_ucudnn.keras.streamed_conv_bn`).
TensorFlow's own step is also run at its largest batch the way the planned steps run (without
Grappler's layout optimizer, batch normalization fused if asked): it calibrates the plans' op
times, and tells the share of the speed those settings give from the plan's (VGG16's planned
steps, without the layout optimizer, ran 60% faster than TensorFlow's default step on the H100).
With `--keras-fit-tries N`, Keras's `model.fit` is timed too, compiled with its defaults (XLA on
a GPU, which the planned steps do not use but for batch normalization with `xla`), from
TensorFlow's largest batch, each batch size in a child process under the same cap and allocator: on the H100
it ran ResNet-50 at batch 192 2.5 times as fast as TensorFlow's default step.
With `--keras-callback`, the batch and budget of the trial that trained are trained again the
way a Keras user would, with `model.fit` and `tf_ucudnn.MicroBatchCallback` (its convolutions
left to TensorFlow, as in the trials), in a child process under the same cap.
Without a GPU, `--smoke` runs the same steps on a small model on the CPU, to check the script.

Under the cap, TensorFlow's BFC allocator can fail with enough memory free but split into chunks
smaller than a request (ResNet-50 at 768, results/beyond_memory_h200_resnet50_768_allocator.json;
each trial records the allocator's first failure, `allocator_first_out_of_memory`). The trials
may run with CUDA's allocator instead (`--trial-allocator cuda_malloc_async`, which the
failure's own message suggests), on a device with only the cap left free, TensorFlow's own step
timed the same way beside them; and with the first layers never whole (`--cut LAYER`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional

import tensorflow as tf
from gpu_names import device_name
from step_planning_args import add_step_planning_arguments

from tf_ucudnn.keras.step_timing import fit_two_epochs
from tf_ucudnn.profiling.allocator_log import out_of_memory_report


def _cap_gpu_memory(limit_gib: float) -> str:
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "CPU (no GPU; no cap)"
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(limit_gib * 1024))])
    return device_name()


def _images_per_second(step, batch: int, shape, steps: int, synchronous: bool = False,
                       started: Optional[list] = None) -> float:
    """Two untimed steps (the first builds and autotunes), then `steps` timed ones, each
    started as soon as the last returned, or (`synchronous`) once its loss is known. Each
    step's number goes into `started` as it starts, to tell which one failed."""
    x = tf.random.stateless_uniform([batch, *shape], seed=[1, 2])
    y = tf.zeros([batch], tf.int32)
    started = [] if started is None else started
    for _ in range(2):
        started.append(len(started) + 1)
        step(x, y).numpy()
    start = time.perf_counter()
    for _ in range(steps):
        started.append(len(started) + 1)
        loss = step(x, y)
        if synchronous:
            loss.numpy()
    loss.numpy()
    return batch * steps / (time.perf_counter() - start)


def _try(run):
    """run()'s result, or None and why it ran out of memory. TensorFlow reports some
    out-of-memory failures as other errors (a convolution whose every algorithm failed to get
    its workspace is a NotFoundError, or an internal error that cuDNN "failed to allocate the
    scratch space"), so the message decides."""
    try:
        return run(), None
    except tf.errors.OpError as error:
        message = str(error)
        if not isinstance(error, tf.errors.ResourceExhaustedError) and not any(
                sign in message for sign in ("RESOURCE_EXHAUSTED", "Out of memory",
                                             "failed to allocate the scratch space")):
            raise
        reason = [line.strip() for line in message.splitlines()
                  if line.strip() and not line.startswith("  ") and "defined at" not in line]
        return None, "out of memory: " + " ".join(reason[-3:])[:400]


def _plain_images_per_second(model, batch: int, shape, steps: int):
    """TensorFlow's own training step's images per second at `batch`, or None and why it ran
    out of memory."""
    from tf_ucudnn.memory import keras_training_step

    return _try(lambda: _images_per_second(keras_training_step(model, batch), batch, shape,
                                           steps))


def _peak_bytes(step, batch: int, shape) -> Optional[int]:
    """The most GPU memory TensorFlow had in use during one step (None without a GPU)."""
    if not tf.config.list_logical_devices("GPU"):
        return None
    x = tf.random.stateless_uniform([batch, *shape], seed=[1, 2])
    y = tf.zeros([batch], tf.int32)
    step(x, y).numpy()
    tf.config.experimental.reset_memory_stats("GPU:0")
    step(x, y).numpy()
    return tf.config.experimental.get_memory_info("GPU:0")["peak"]


def _largest_plain_batch(model, shape, start: int, max_batch: int, steps: int):
    """Doubling, then halving the gap: the largest batch (multiple of `start`) that trains."""
    def trains(batch):
        return _plain_images_per_second(model, batch, shape, steps)[0]

    good, bad, rates = None, None, {}
    batch = start
    while batch <= max_batch:
        rate = trains(batch)
        if rate is None:
            bad = batch
            break
        good, rates[batch] = batch, rate
        batch *= 2
    while good and bad and bad - good > start:
        middle = (good + bad) // 2 // start * start
        rate = trains(middle)
        if rate is None:
            bad = middle
        else:
            good, rates[middle] = middle, rate
    return good, rates.get(good)


def keras_fit(name: str, batch: int, step: int, steps: int, tries: int,
               memory_limit_gib: float, allocator: str) -> dict:
    """Keras's own training loop as a user runs it (`model.fit`, compiled with its defaults: XLA
    where the model allows): images per second at up to `tries` batch sizes, `batch` first,
    then `step` apart, up while they train or down until one does. Each batch is an XLA
    compilation of its own (a minute or so for ResNet-50 on the H100), and runs in a process of
    its own under the same cap, with the trials' `allocator`: under BFC's `memory_limit`,
    TensorFlow 2.21 has aborted inside XLA (an allocator check) rather than report running out
    of memory, which would end this run too."""
    trials, failures, size = {}, {}, batch
    while len(trials) < tries and size > 0 and size not in trials:
        result, failure, _ = in_child(
            ["--keras-fit-child", name, str(size), str(steps), "--trial-allocator", allocator],
            memory_limit_gib, {"TF_GPU_ALLOCATOR": allocator} if allocator != "bfc" else {})
        trials[size] = result.get("img_per_s")
        if trials[size] is None:
            failures[size] = result.get("error") or failure
        size += step if trials[size] else -step
    largest = max((b for b, r in trials.items() if r), default=None)
    return {"allocator": allocator, "largest_batch_tried": largest,
            "img_per_s": trials.get(largest),
            "img_per_s_by_batch": trials, "failures": failures}


def in_child(arguments: list, memory_limit_gib: float,
              environment: Optional[dict] = None) -> tuple[dict, Optional[str], str]:
    """This script's JSON answer to `arguments`, run in a process of its own under the same
    cap (with `environment`'s variables added); if it gave none, how the process ended; and its
    standard error."""
    child = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *arguments,
         "--memory-limit-gib", str(memory_limit_gib), "--out", os.devnull],
        capture_output=True, text=True, env={**os.environ, **(environment or {})})
    lines = child.stdout.strip().splitlines()
    if child.returncode == 0 and lines:
        return json.loads(lines[-1]), None, child.stderr
    tail = [line for line in child.stderr.splitlines() if line.strip()][-3:]
    return {}, f"exit status {child.returncode}: " + " | ".join(tail)[-400:], child.stderr


def _keras_fit_child(name: str, batch: int, steps: int, smoke: bool) -> dict:
    """One batch size of `keras_fit`, in this process (its child)."""
    model = _compiled_model(name, smoke)
    data = _one_batch_repeated(model, batch)

    epochs = []

    def timed():  # as the callback's run is timed
        return batch / fit_two_epochs(model, data, steps, epochs)
    rate, error = _try(timed)
    peak = (tf.config.experimental.get_memory_info("GPU:0")["peak"]
            if tf.config.list_logical_devices("GPU") else None)
    return {"jit_compile": bool(model.jit_compile), "img_per_s": rate, "error": error,
            "epoch_seconds": epochs, "peak_bytes": peak}


def _compiled_model(name: str, smoke: bool):
    """The model compiled as every Keras run here trains it: SGD, sparse cross-entropy."""
    model = _load_model(name, smoke)
    model.compile(tf.keras.optimizers.SGD(0.01),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _one_batch_repeated(model, batch: int) -> tf.data.Dataset:
    images = tf.random.stateless_uniform([batch, *model.input_shape[1:]], seed=[1, 2])
    return tf.data.Dataset.from_tensors((images, tf.zeros([batch], tf.int32))).repeat()


def _load_model(name: str, smoke: bool):
    if not smoke:
        from tf_ucudnn.keras import models
        return models.load_model(name)
    return tf.keras.Sequential([
        tf.keras.Input((32, 32, 3)), tf.keras.layers.Conv2D(8, 3, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(10)])


def _with_tf_ucudnn(model, shape, batch: int, budget: int, device_model, steps: int,
                    step_ms: float, fuse_batch_norm: bool, micro_batches,
                    stream_conv_batch_norm: int, synchronous: bool,
                    cut: Optional[str] = None) -> dict:
    from tf_ucudnn.memory import BudgetError, plan_keras_step

    entry = {"batch": batch}
    try:
        start = time.perf_counter()
        step, keras_plan = plan_keras_step(model, batch, budget, device_model, step_ms,
                                           fuse_batch_norm, micro_batches,
                                           cuts=[cut] if cut else None,
                                           stream_conv_batch_norm=stream_conv_batch_norm,
                                           whole_batches=cut is None)
        entry["planning_s"] = time.perf_counter() - start
    except BudgetError as error:
        entry["error"] = str(error)
        return entry
    memory = keras_plan.plan
    entry.update(swaps=len(memory.swaps), recomputes=len(memory.recomputes),
                 prefix_end=keras_plan.prefix_end,
                 micro_batches=keras_plan.micro_batches, passed_over=keras_plan.passed_over,
                 predicted=memory.decisions.prediction.to_json())
    started = []
    rate, error = _try(lambda: _images_per_second(step, batch, shape, steps, synchronous,
                                                  started))
    entry.update(synchronous_steps=synchronous, steps_started=len(started))
    if tf.config.list_logical_devices("GPU"):  # the first step's autotuning included
        entry["timed_steps_peak_bytes"] = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    entry.update({"img_per_s": rate, "measured_peak_bytes": _peak_bytes(step, batch, shape)}
                 if rate else {"error": error})
    return entry


def _hold_all_but(leave_bytes: int) -> int:
    """Takes, through the CUDA driver and for the process's life, all of the first GPU's free
    memory but `leave_bytes`, before TensorFlow starts on it: then the GPU has that much,
    whatever TensorFlow's allocator (`memory_limit` binds its BFC allocator only; the
    cuda_malloc_async allocator counts it but never refuses past it). Returns the bytes taken."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")

    def check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call}: CUDA driver error {status}")
    check(cuda.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    # TensorFlow uses the device's primary context too: the memory taken here is its own's.
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    taken = free.value - leave_bytes
    if taken > 0:
        pointer = ctypes.c_uint64()
        check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(taken)), "cuMemAlloc")
    return max(taken, 0)


def _child_setup(args) -> dict:
    """A child's GPU, capped as the parent asked: with `memory_limit`, or with --trial-allocator
    cuda_malloc_async, by leaving only that much memory free on the device (then TensorFlow
    takes what it finds free, as on a GPU of that size)."""
    setting = {"allocator": args.trial_allocator}
    if args.trial_allocator == "bfc":
        setting["device"] = _cap_gpu_memory(args.memory_limit_gib)
    elif tf.config.list_physical_devices("GPU"):
        setting["held_bytes"] = _hold_all_but(int(args.memory_limit_gib * (1 << 30)))
    return setting


def _tensorflow_child(args) -> dict:
    """TensorFlow's own step at one batch in this process (a child), capped as the trials are."""
    name, batch = args.tensorflow_child
    batch = int(batch)
    setting = _child_setup(args)
    tf.keras.utils.set_random_seed(0)
    model = _load_model(name, name == "smoke")
    shape = model.input_shape[1:]
    rate, error = _plain_images_per_second(model, batch, shape, args.steps)
    # Whether this allocator lets TensorFlow train a larger batch than the capped search found:
    # if so, that batch is the one the 4x compares with.
    larger = batch + args.start_batch
    larger_rate, larger_error = _plain_images_per_second(model, larger, shape, args.steps)
    return {"batch": batch, **setting, "img_per_s": rate, "error": error,
            "next_batch": {"batch": larger, "img_per_s": larger_rate, "error": larger_error}}


def _trial_child(args) -> dict:
    """One tf_ucudnn trial of `main`, in this process (its child): planned and run in a fresh
    TensorFlow, as a training job would be. In the parent, after TensorFlow's own tries, a
    ResNet-50 plan at 768 ran out of memory under the 16 GiB cap that the same budget's plan
    trained under in a process of its own (benchmarks/memory_trace.py), where the first,
    autotuning step peaked at 15.7 GB."""
    name, batch, budget, step_ms = args.trial_child
    setting = _child_setup(args)
    # Grappler's layout optimizer turns a GPU step to NCHW and copies kept tensors back to NHWC
    # around the swap nodes, copies the plan does not see (5.2 GB on ResNet-50 at batch 384,
    # benchmarks/memory_trace.py): planned steps run without it.
    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    tf.keras.utils.set_random_seed(0)
    from tf_ucudnn.memory import DeviceModel

    model = _load_model(name, name == "smoke")
    link = DeviceModel("given", args.link_gb_s[0] * 1e9, args.link_gb_s[1] * 1e9)
    return {**_with_tf_ucudnn(model, model.input_shape[1:], int(batch), int(budget), link,
                              args.steps, float(step_ms), args.fuse_batch_norm,
                              args.micro_batches, args.stream_conv_bn, args.synchronous_steps,
                              args.cut), **setting}


def _tune_child(args) -> dict:
    """`tune_keras_batch_size` for a model compiled as `_keras_callback_child` compiles it, in
    this process (a child), capped as the trials are: its trials and best batch. Where the
    callback would train the whole step in micro-batches, each trial's step is measured as the
    callback runs it (`MeasuredStep`; `measured_step_ms` by batch and micro-batch): the op-time
    model describes TensorFlow's graph, which XLA's step is not."""
    import keras

    from tf_ucudnn.keras import MeasuredStep, tune_keras_batch_size
    from tf_ucudnn.keras.accumulated_step import accumulation_refusal
    from tf_ucudnn.memory import DeviceModel

    name, budget, *batches = args.tune_child
    setting = _child_setup(args)
    keras.utils.set_random_seed(0)
    model = _compiled_model(name, name == "smoke")
    step_ms = MeasuredStep(model, next(iter(_one_batch_repeated(model, 1))), args.steps)
    accumulated = accumulation_refusal(model, args.batch_norm_statistics) is None
    start = time.perf_counter()
    report = tune_keras_batch_size(
        model, [int(b) for b in batches], int(budget),
        DeviceModel("given", args.link_gb_s[0] * 1e9, args.link_gb_s[1] * 1e9),
        step_ms=step_ms if accumulated else None,
        batch_norm_statistics=args.batch_norm_statistics)
    return {**report.to_json(), "tuning_s": time.perf_counter() - start, **setting,
            "measured_step_ms": step_ms.measurements,
            "best_batch": report.best.batch_size if report.best else None}


def _keras_callback_child(args) -> dict:
    """tf_ucudnn through Keras: `model.fit` with `MicroBatchCallback` under a memory budget, in
    this process (a child), capped as the trials are: the first epoch plans (at its first
    step) and the second is timed."""
    import keras

    import tf_ucudnn
    from tf_ucudnn.memory import DeviceModel

    name, batch, budget = args.keras_callback_child
    batch = int(batch)
    setting = _child_setup(args)
    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    keras.utils.set_random_seed(0)
    model = _compiled_model(name, name == "smoke")
    data = _one_batch_repeated(model, batch)
    callback = tf_ucudnn.MicroBatchCallback(
        None, memory_budget=int(budget),
        device_model=DeviceModel("given", args.link_gb_s[0] * 1e9, args.link_gb_s[1] * 1e9),
        micro_batches=args.micro_batches, whole_batches=args.cut is None,
        fuse_batch_norm=args.fuse_batch_norm or False,
        stream_conv_batch_norm=args.stream_conv_bn,
        batch_norm_statistics=args.batch_norm_statistics, verbose=0)
    epochs = []

    def timed():
        return batch / fit_two_epochs(model, data, args.steps, epochs, [callback])
    rate, error = _try(timed)
    entry = {"batch": batch, "budget_bytes": int(budget), **setting, "epoch_seconds": epochs,
             "img_per_s": rate, "error": error}
    if callback.accumulation is not None:
        entry["accumulation"] = callback.accumulation.to_json()
    elif callback.accumulation_refused:
        entry["accumulation_refused"] = callback.accumulation_refused
    entry["jit_compile"] = bool(model.jit_compile)
    if callback.memory_plan is not None:
        plan = callback.memory_plan
        entry.update(swaps=len(plan.plan.swaps), recomputes=len(plan.plan.recomputes),
                     prefix_end=plan.prefix_end,
                     micro_batches=plan.micro_batches,
                     predicted=plan.plan.decisions.prediction.to_json())
    if rate and tf.config.list_logical_devices("GPU"):
        entry["peak_bytes"] = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    return entry


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "vgg16", "resnet152"])
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--budget-fractions", type=float, nargs="+", default=[0.85, 0.7],
                        help="tf_ucudnn's memory budgets, as fractions of the cap, tried in turn "
                        "while the step runs out of memory (TensorFlow's allocator and "
                        "executor order need room the plan does not see)")
    parser.add_argument("--factors", type=float, nargs="+", default=[4, 3, 2.5, 2, 1.5],
                        help="tf_ucudnn's batches, as multiples of TensorFlow's largest, tried in "
                        "turn until one trains")
    add_step_planning_arguments(parser)  # how tf_ucudnn's steps are planned
    parser.add_argument("--plans-without-autotuning", action="store_true",
                        help="run tf_ucudnn's planned steps with TF_CUDNN_USE_AUTOTUNE=0: the "
                        "first step's autotuning takes memory the plan does not count")
    parser.add_argument("--synchronous-steps", action="store_true",
                        help="time tf_ucudnn's planned steps each after the last one's loss is "
                        "known, not queued back to back")
    parser.add_argument("--start-batch", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--keras-fit-tries", type=int, default=0, metavar="N",
                        help="also time Keras's model.fit, compiled with its defaults (XLA), at "
                        "up to N batch sizes: TensorFlow's largest, then --start-batch apart")
    parser.add_argument("--link-gb-s", type=float, nargs=2, metavar=("D2H", "H2D"),
                        help="host link bandwidths to plan with, instead of measuring them")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--keras-fit-child", nargs=3, metavar=("MODEL", "BATCH", "STEPS"),
                        help=argparse.SUPPRESS)  # one batch of --keras-fit-tries, in a child
    parser.add_argument("--trial-allocator", choices=["bfc", "cuda_malloc_async"], default="bfc",
                        help="TensorFlow's GPU allocator in tf_ucudnn's trials: cuda_malloc_async "
                        "(CUDA's, which TensorFlow's out-of-memory message suggests against "
                        "fragmentation) with only --memory-limit-gib left free on the device; "
                        "TensorFlow's own step is then timed the same way too")
    parser.add_argument("--trial-child", nargs=4, metavar=("MODEL", "BATCH", "BUDGET", "STEP_MS"),
                        help=argparse.SUPPRESS)  # one tf_ucudnn trial, in a child
    parser.add_argument("--tensorflow-child", nargs=2, metavar=("MODEL", "BATCH"),
                        help=argparse.SUPPRESS)  # TensorFlow's step as the trials run, a child
    parser.add_argument("--keras-callback", action="store_true",
                        help="also train the batch and budget of the trial that trained with "
                        "model.fit and tf_ucudnn.MicroBatchCallback, in a child process")
    parser.add_argument("--batch-norm-statistics", choices=["batch", "micro_batch"],
                        default="batch", help="MicroBatchCallback's batch_norm_statistics: "
                        "micro_batch lets a model with batch normalization train in "
                        "micro-batches, each normalized by its own statistics")
    parser.add_argument("--tune-child", nargs="+", metavar="MODEL BUDGET BATCH",
                        help=argparse.SUPPRESS)  # tune_keras_batch_size, in a child
    parser.add_argument("--keras-callback-child", nargs=3, metavar=("MODEL", "BATCH", "BUDGET"),
                        help=argparse.SUPPRESS)  # one --keras-callback run, in a child
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.keras_fit_child:
        name, batch, steps = args.keras_fit_child
        setting = _child_setup(args)
        print(json.dumps({**_keras_fit_child(name, int(batch), int(steps), name == "smoke"),
                          **setting}))
        return
    if args.trial_child:
        print(json.dumps(_trial_child(args)))
        return
    if args.tensorflow_child:
        print(json.dumps(_tensorflow_child(args)))
        return
    if args.keras_callback_child:
        print(json.dumps(_keras_callback_child(args)))
        return
    if args.tune_child:
        print(json.dumps(_tune_child(args)))
        return
    # The first step's convolution autotuning would hold uncounted copies of their outputs
    # (tf_ucudnn.memory.apply_memory_plan); TensorFlow's own steps run the same way.
    os.environ.setdefault("TF_DISABLE_RZ_CHECK", "1")
    device = _cap_gpu_memory(args.memory_limit_gib)

    from tf_ucudnn.memory import DeviceModel, analyze, keras_training_step

    device_model = (DeviceModel("smoke", 1e10, 1e10) if args.smoke else
                    DeviceModel(device, args.link_gb_s[0] * 1e9, args.link_gb_s[1] * 1e9)
                    if args.link_gb_s else DeviceModel.measure())
    results = {"benchmark": "beyond_memory", "device": device, "tensorflow": tf.__version__,
               "memory_limit_gib": args.memory_limit_gib,
               "budget_fractions": args.budget_fractions,
               "fuse_batch_norm": args.fuse_batch_norm,
               "stream_conv_batch_norm": args.stream_conv_bn, "layout_optimizer_in_plans": False,
               "autotuning_in_plans": not args.plans_without_autotuning,
               "prefix_end_in_plans": args.cut,
               "TF_DISABLE_RZ_CHECK": os.environ["TF_DISABLE_RZ_CHECK"],
               "host_link": {"device_to_host_gb_s": device_model.device_to_host / 1e9,
                             "host_to_device_gb_s": device_model.host_to_device / 1e9},
               "models": {}}
    for name in (["smoke"] if args.smoke else args.models):
        tf.config.optimizer.set_experimental_options({"layout_optimizer": True})  # plain TF's own
        tf.keras.utils.set_random_seed(0)
        model = _load_model(name, args.smoke)
        shape = model.input_shape[1:]
        batch, rate = _largest_plain_batch(model, shape, args.start_batch, args.max_batch,
                                           args.steps)
        entry = {"tensorflow": {"largest_batch": batch, "img_per_s": rate}, "tf_ucudnn": []}
        print(name, "TensorFlow's largest batch", batch, rate, flush=True)
        # How far TensorFlow's real peak is above the liveness prediction (its allocator,
        # workspaces and execution order), measured on its own largest batch: the budgets given
        # to the planner shrink by that much.
        scale, calibration_rate = 1.0, rate
        if batch:
            step = keras_training_step(model, batch)
            measured = _peak_bytes(step, batch, shape)
            liveness = analyze(step)
            predicted = liveness.peak_bytes + liveness.persistent_bytes
            entry["tensorflow"].update(measured_peak_bytes=measured,
                                       predicted_peak_bytes=predicted)
            if measured:
                scale = min(1.0, predicted / measured)
            # TensorFlow's own step as the planned steps run it (without the layout optimizer,
            # batch normalization fused if asked; at half the batch if that does not fit at the
            # whole): it calibrates the plans' op times, and tells the share of the speed those
            # settings give from the plan's.
            tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
            for as_planned_batch in (batch, batch // 2)[:2 if batch > 1 else 1]:
                as_planned_rate = _try(lambda: _images_per_second(keras_training_step(
                    model, as_planned_batch, fuse_batch_norm=args.fuse_batch_norm,
                    stream_conv_batch_norm=args.stream_conv_bn),
                    as_planned_batch, shape, args.steps))[0]
                if as_planned_rate:
                    break
            entry["tensorflow_as_planned"] = {
                "batch": as_planned_batch, "fuse_batch_norm": args.fuse_batch_norm,
                "stream_conv_batch_norm": args.stream_conv_bn,
                "layout_optimizer": False, "img_per_s": as_planned_rate}
            calibration_rate = as_planned_rate or rate
            print(name, "as planned", as_planned_batch, as_planned_rate, flush=True)
        if batch and args.keras_fit_tries:
            entry["keras_fit"] = keras_fit(name, batch, args.start_batch, args.steps,
                                            args.keras_fit_tries, args.memory_limit_gib,
                                            args.trial_allocator)
            print(name, "Keras fit", json.dumps(entry["keras_fit"])[:300], flush=True)
        entry["budget_scale"] = scale
        entry["calibration_img_per_s"] = calibration_rate
        trial_environment = ({"TF_GPU_ALLOCATOR": args.trial_allocator}
                             if args.trial_allocator != "bfc" else {})
        if batch and trial_environment:  # TensorFlow's own step, capped as the trials are
            baseline, failure, _ = in_child(
                ["--tensorflow-child", name, str(batch), "--steps", str(args.steps),
                 "--start-batch", str(args.start_batch),
                 "--trial-allocator", args.trial_allocator],
                args.memory_limit_gib, trial_environment)
            entry["tensorflow_as_trials_run"] = baseline or {"batch": batch, "error": failure}
            print(name, "TensorFlow as the trials run", json.dumps(
                entry["tensorflow_as_trials_run"])[:300], flush=True)
        trials = [(factor, fraction) for factor in args.factors
                  for fraction in args.budget_fractions] if batch else []
        plan_options = [
            "--link-gb-s", repr(device_model.device_to_host / 1e9),
            repr(device_model.host_to_device / 1e9), "--steps", str(args.steps),
            "--stream-conv-bn", str(args.stream_conv_bn),
            "--micro-batches", *map(str, args.micro_batches),
            *(["--synchronous-steps"] if args.synchronous_steps else []),
            *(["--cut", args.cut] if args.cut else []),
            "--trial-allocator", args.trial_allocator,
            *(["--fuse-batch-norm", args.fuse_batch_norm] if args.fuse_batch_norm else [])]
        # At log level 0 the allocator maps its memory when it runs out.
        plan_environment = {
            "TF_CPP_MIN_LOG_LEVEL": "0", **trial_environment,
            **({"TF_CUDNN_USE_AUTOTUNE": "0"} if args.plans_without_autotuning else {})}
        for factor, fraction in trials:
            big_batch = int(factor * batch) // args.start_batch * args.start_batch
            # Op times calibrated by TensorFlow's own step (with batch normalization as the
            # plan trains it), scaled to the batch.
            step_ms = big_batch / calibration_rate * 1e3
            budget = int(args.memory_limit_gib * fraction * scale * (1 << 30))
            trial, failure, log = in_child(
                ["--trial-child", name, str(big_batch), str(budget), repr(step_ms),
                 *plan_options], args.memory_limit_gib, plan_environment)
            trial = trial or {"batch": big_batch, "error": failure}
            # The allocator's first failure, which may be an autotuner's workspace it went
            # without: too little memory, or memory too split.
            allocator = out_of_memory_report(log)
            if allocator is not None:
                trial["allocator_first_out_of_memory"] = allocator.to_json()
            trial.update(factor=factor, budget_fraction=fraction)
            if trial.get("img_per_s"):
                trial["vs_tensorflow"] = trial["img_per_s"] / rate
                for baseline in ("tensorflow_as_planned", "tensorflow_as_trials_run",
                                 "keras_fit"):
                    baseline_rate = entry.get(baseline, {}).get("img_per_s")
                    if baseline_rate:
                        trial[f"vs_{baseline}"] = trial["img_per_s"] / baseline_rate
            entry["tf_ucudnn"].append(trial)
            print(name, json.dumps(trial)[:300], flush=True)
            _save(results, name, entry, args.out)  # each trial, lest a time limit lose them all
            if trial.get("img_per_s"):
                break
        trained = [trial for trial in entry["tf_ucudnn"] if trial.get("img_per_s")]
        if trained and args.keras_callback:
            budget = int(args.memory_limit_gib * trained[0]["budget_fraction"] * scale
                         * (1 << 30))
            fit, failure, _ = in_child(
                ["--keras-callback-child", name, str(trained[0]["batch"]), str(budget),
                 *plan_options], args.memory_limit_gib, plan_environment)
            entry["keras_callback"] = fit or {"batch": trained[0]["batch"], "error": failure}
            if entry["keras_callback"].get("img_per_s"):
                entry["keras_callback"]["vs_tensorflow"] = \
                    entry["keras_callback"]["img_per_s"] / rate
            print(name, "Keras fit with the callback", json.dumps(entry["keras_callback"])[:300],
                  flush=True)
        print(name, "TensorFlow", batch, rate, flush=True)
        _save(results, name, entry, args.out)


def _save(results: dict, name: str, entry: dict, path: str) -> None:
    results["models"][name] = entry
    with open(path, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
