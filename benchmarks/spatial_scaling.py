"""Hybrid data x spatial parallelism of a CosmoFlow-style model over the GPUs of one host, side by
side in one run: strong scaling (a fixed sample split over more GPUs), weak scaling (the volume
growing with the GPU count along the split depth), data x spatial mixes at the largest GPU count,
and samples too large for one GPU trained on several; each set against the scaling model's
prediction, calibrated by the measured one-GPU speed and device-to-device bandwidth.

    python benchmarks/spatial_scaling.py --edge 128 --batch 4 --devices 1 2 --large-edge 512 768 \\
        --steps 5 --out benchmarks/results/spatial_scaling_h200x2.json

`--memory-limit-gib` caps each GPU (a logical device with `memory_limit`), to show a sample that
needs more than one GPU of that size. Without GPUs, `--smoke` runs it on logical CPUs with a tiny
volume, to check the script. `--sections strong timeline` traces one step on one GPU and on the
most, to show where the devices wait for each other: each GPU's time with no kernel, its longest
gaps with the ops around them, its kernel time per op type, and its copies to or from the others.

`--workers 1 2 4` measures data parallelism across worker processes instead (TensorFlow's
MultiWorkerMirroredStrategy, `tf_ucudnn.parallel.multi_worker`): for each count, that many local
workers, each splitting its `--batch` samples over `--spatial` GPUs of its own (logical CPUs
with `--smoke`), their img/s. With TF_CONFIG set, `--workers` alone makes this process one
worker of the cluster it names, and worker 0 writes the result.

    python benchmarks/spatial_scaling.py --workers 1 2 --spatial 2 --edge 128 --batch 4 \\
        --out benchmarks/results/spatial_scaling_workers.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Optional

import numpy as np
import tensorflow as tf
from gpu_names import gpu_names

FILTERS = (16, 32, 64, 128, 256)
SECTIONS = ("strong", "weak", "mixes", "large", "timeline")


def _setup_devices(smoke: bool, count: int, memory_limit_gib: float) -> list[str]:
    if smoke:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * count)
        return [f"/CPU:{i}" for i in range(count)]
    gpus = tf.config.list_physical_devices("GPU")[:count]
    if len(gpus) < count:
        raise SystemExit(f"{count} GPUs asked for, {len(gpus)} visible")
    if memory_limit_gib:
        for gpu in gpus:
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(int(memory_limit_gib * 1024))])
    return [f"/GPU:{i}" for i in range(count)]


def _build(make_model, size, channels, batch, strategy=None):
    """A compiled model and a batch already on its first device, as a prefetching loader would
    leave it: the host copy of a 128^3 batch would otherwise dominate the step. `size`: an
    edge, or (depth, height, width)."""
    tf.keras.utils.set_random_seed(0)
    shape = (size,) * 3 if isinstance(size, int) else size
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = make_model()
        model.compile(tf.keras.optimizers.SGD(1e-3), "mse")
    with tf.device(model.mesh[0][0]):
        x = tf.random.stateless_uniform([batch, *shape, channels], seed=[1, 2])
        y = tf.zeros([batch, 4])
    return model, x, y


def _time_steps(make_model, size, channels, batch, steps, strategy=None):
    """Seconds per Keras training step (`train_on_batch`, so data groups go through the
    strategy's all-reduce), after one step to build and trace."""
    started = time.perf_counter()
    model, x, y = _build(make_model, size, channels, batch, strategy)
    built = time.perf_counter()
    model.train_on_batch(x, y)
    start = time.perf_counter()
    print(f"  built in {built - started:.1f} s, first step in {start - built:.1f} s", flush=True)
    for _ in range(steps):
        loss = model.train_on_batch(x, y)
    float(loss)
    return (time.perf_counter() - start) / steps, model


def _timeline(make_model, size, channels, batch, gaps: int = 10) -> dict:
    """One training step traced with the GPUs' kernels and copies, after one to build it: each
    GPU's busy and idle time, its longest gaps with no kernel and the ops around them, and its
    copies to or from another device, all on one clock."""
    from tf_ucudnn.profiling import step_trace

    model, x, y = _build(make_model, size, channels, batch)
    model.train_on_batch(x, y)
    logdir = tempfile.mkdtemp(prefix="spatial_scaling")
    tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=2, device_tracer_level=1))
    try:
        float(model.train_on_batch(x, y))
    finally:
        tf.profiler.experimental.stop()
    space = step_trace.read_profile(logdir)
    shutil.rmtree(logdir)
    events = step_trace.gpu_events(space)
    if not events:
        gpus = [plane.name for plane in space.planes
                if plane.name.startswith(step_trace.GPU_PLANE)]
        return {"skipped": "the timeline is GPU-only: " + (
            f"no kernel on {gpus} is tagged with its op" if gpus else "the trace has no GPU")}
    timeline = step_trace.gpu_timeline(step_trace.op_spans(events), gaps)
    copies = step_trace.cross_device_copies(events)
    kernel_ms = step_trace.kernel_ms_by_op_type(events)
    for device, row in timeline.items():
        row["kernel_ms_by_op_type"] = kernel_ms.get(device, {})
        row["cross_device_copies"] = copies.get(device, [])
    return {"wall_ms": max(row["wall_ms"] for row in timeline.values()), "devices": timeline}


def _error_text(error: tf.errors.OpError) -> str:
    """The reason, without the Python stack TensorFlow puts before it."""
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line.startswith("  ") and "defined at" not in line]
    return " ".join(lines[-3:])[:500]


def _copy_bandwidth(source: str, target: str, megabytes: int = 256) -> float:
    with tf.device(source):
        data = tf.random.uniform([megabytes << 18])
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        with tf.device(target):
            copied = tf.identity(data)
        tf.reduce_sum(copied).numpy()
        best = min(best, time.perf_counter() - start)
    return (megabytes << 20) / best


WORKERS_TIMEOUT_S = 3600  # one cluster's run, start to end


def _worker_args(args, data: str, workers: int) -> list[str]:
    """The arguments of `python -m tf_ucudnn.parallel.multi_worker` for a cluster of
    `workers`, one step more than timed (the first traces)."""
    filters = FILTERS[:3] if args.smoke else FILTERS
    return [data, "--spatial-split", str(args.spatial), "--global-batch",
            str(args.batch * workers), "--steps", str(args.steps + 1),
            "--filters", *map(str, filters), "--learning-rate", "1e-3"]


def _workers_row(run: dict, spatial: int) -> dict:
    workers = run["layout"]["num_workers"]
    return {"workers": workers, "spatial": spatial, "global_batch": run["layout"]["global_batch"],
            "step_s": float(np.median(run["step_seconds"][1:])),
            "images_per_s": run["images_per_second"],
            "images_per_s_per_worker": run["images_per_second"] / workers}


def _multi_worker(args) -> Optional[dict]:
    """Img/s of data parallelism across worker processes, each with a spatial group of its own:
    local clusters of each count in `args.workers`, or (TF_CONFIG set) this worker's share of
    the cluster it names, which worker 0 reports."""
    from tf_ucudnn.parallel import multi_worker
    from tf_ucudnn.parallel.data import make_synthetic_volumes
    from tf_ucudnn.parallel.local_cluster import LocalCluster

    workdir = tempfile.mkdtemp(prefix="spatial_scaling_workers")
    data = os.path.join(workdir, "volumes.h5")
    results = {"benchmark": "spatial_scaling", "mode": "multi_worker",
               "tensorflow": tf.__version__, "edge": args.edge, "batch_per_worker": args.batch,
               "spatial": args.spatial, "steps": args.steps, "workers": []}
    try:
        if "TF_CONFIG" in os.environ:
            if args.workers:
                raise SystemExit("with TF_CONFIG set, --workers takes no counts: this process "
                                 "is one worker of the cluster TF_CONFIG names")
            workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
            make_synthetic_volumes(data, args.batch * workers, args.edge, args.channels)
            run = multi_worker.main(_worker_args(args, data, workers))
            if run.layout["index"]:
                return None
            results["workers"].append(_workers_row(run.to_json(), args.spatial))
            return results
        if not args.workers:
            raise SystemExit("--workers: worker counts to run, or TF_CONFIG set to join its "
                             "cluster")
        gpus = len(tf.config.list_physical_devices("GPU"))
        if not args.smoke and gpus < max(args.workers) * args.spatial:
            raise SystemExit(f"{max(args.workers)} workers x {args.spatial} GPUs asked for, "
                             f"{gpus} visible")
        make_synthetic_volumes(data, args.batch * max(args.workers), args.edge, args.channels)

        def env(index):  # each worker its own GPUs, or none (logical CPUs) for the smoke test
            first = index * args.spatial
            return {"CUDA_VISIBLE_DEVICES": "" if args.smoke else ",".join(
                map(str, range(first, first + args.spatial)))}

        for workers in args.workers:
            out = os.path.join(workdir, f"{workers}_workers_{{index}}.json")
            with LocalCluster(lambda index: [
                    sys.executable, "-m", "tf_ucudnn.parallel.multi_worker",
                    *_worker_args(args, data, workers), "--out", out], workers,
                    os.path.join(workdir, f"{workers}_workers_logs"), env) as cluster:
                statuses = cluster.wait(WORKERS_TIMEOUT_S)
                failed = next((i for i, status in enumerate(statuses) if status), None)
                if failed is not None:
                    raise SystemExit(f"worker {failed} of {workers} exited with "
                                     f"{statuses[failed]}:\n{cluster.output(failed)[-3000:]}")
            with open(out.format(index=0)) as chief:
                row = _workers_row(json.load(chief), args.spatial)
            results["workers"].append(row)
            print("workers", row, flush=True)
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edge", type=int, default=128)
    parser.add_argument("--large-edge", type=int, nargs="*", default=[512],
                        help="volume edges too large for one device, trained at batch 1 on one "
                        "device and on all")
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--memory-limit-gib", type=float, default=0.0)
    parser.add_argument("--tensorflow-conv", action="store_true",
                        help="each device's convolutions by TensorFlow's own Conv3D instead of "
                        "tf_ucudnn's op, for comparison")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS[:-1],
                        help="what to run; strong scaling always runs, as the others are "
                        "measured against its one-device step. `timeline` (GPU only) traces "
                        "one strong-scaling step on one device and on the most, and records "
                        "each GPU's busy and idle time, its longest gaps, its kernel time per op "
                        "type and its copies between devices")
    parser.add_argument("--workers", type=int, nargs="*",
                        help="worker process counts to measure instead of the sections: data "
                        "parallelism across local worker processes, `--batch` samples each; "
                        "with TF_CONFIG set, give no count to be one worker of its cluster")
    parser.add_argument("--spatial", type=int, default=2,
                        help="with --workers, the devices each worker splits its samples over")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.workers is not None:
        results = _multi_worker(args)
        if results:
            with open(args.out, "w") as out:
                json.dump(results, out, indent=1)
        return
    all_devices = _setup_devices(args.smoke, max(args.devices), args.memory_limit_gib)

    from tf_ucudnn.parallel import spatial
    from tf_ucudnn.parallel.cosmoflow import SpatialCosmoFlow

    if args.tensorflow_conv:
        def tensorflow_conv3d(x, filters, padding, strides, dilations, plan=None):
            return tf.nn.conv3d(tf.pad(x, padding), filters, strides, "VALID",
                                dilations=dilations)
        spatial.ops.conv3d = tensorflow_conv3d
    from tf_ucudnn.parallel.scaling import Link, cosmoflow_step_cost

    filters = FILTERS[:3] if args.smoke else FILTERS

    def cosmoflow(size, mesh):
        return lambda: SpatialCosmoFlow(size, args.channels, filters, mesh=mesh)

    results = {"benchmark": "spatial_scaling", "tensorflow": tf.__version__,
               "devices": gpu_names() or all_devices,
               "memory_limit_gib": args.memory_limit_gib or None,
               "convolution": "tensorflow" if args.tensorflow_conv else "tf_ucudnn",
               "edge": args.edge,
               "batch": args.batch, "filters": list(filters), "steps": args.steps}

    def record(section, row):
        results.setdefault(section, []).append(row)
        print(section, row, flush=True)

    step_s = {}
    for count in args.devices:
        step_s[count], model = _time_steps(cosmoflow(args.edge, [all_devices[:count]]),
                                           args.edge, args.channels, args.batch, args.steps)
        record("strong", {"devices": count, "spatial": count, "step_s": step_s[count],
                          "efficiency": step_s[1] / (count * step_s[count])})
    parameters = int(sum(np.prod(v.shape) for v in model.trainable_variables))

    # Weak scaling: the split dimension (depth) grows with the devices, each keeps one edge^3.
    for count in args.devices if "weak" in args.sections else ():
        size = (args.edge * count, args.edge, args.edge)
        seconds, _ = _time_steps(cosmoflow(size, [all_devices[:count]]), size, args.channels,
                                 args.batch, args.steps)
        weak_one = results["weak"][0]["step_s"] if count > 1 else seconds
        record("weak", {"devices": count, "volume": list(size), "step_s": seconds,
                        "efficiency": weak_one / seconds})

    count = max(args.devices)
    mixes = [d for d in range(1, count + 1) if count % d == 0] if "mixes" in args.sections else []
    for groups in mixes:
        per_group = count // groups
        mesh = [all_devices[g * per_group:(g + 1) * per_group] for g in range(groups)]
        strategy = (tf.distribute.MirroredStrategy([group[0] for group in mesh])
                    if groups > 1 else None)
        seconds, _ = _time_steps(cosmoflow(args.edge, mesh), args.edge, args.channels,
                                 args.batch, args.steps, strategy)
        record("mixes", {"data": groups, "spatial": per_group, "step_s": seconds,
                         "efficiency": step_s[1] / (count * seconds)})

    # The scaling model, calibrated by the one-device speed and a device-to-device copy.
    one = cosmoflow_step_cost(args.edge, args.channels, filters, args.batch, 1, 1,
                              Link(1.0, 1.0, 1.0), parameters)
    flops = one.compute_s / step_s[1]
    if count > 1:
        bandwidth = _copy_bandwidth(all_devices[0], all_devices[1])
        link = Link(flops, bandwidth, bandwidth)
        predicted = {}
        for devices in sorted({*args.devices, 4, 8}):
            predicted[f"strong_{devices}"] = cosmoflow_step_cost(
                args.edge, args.channels, filters, args.batch, devices, 1, link,
                parameters).to_json()
            predicted[f"weak_{devices}"] = cosmoflow_step_cost(
                args.edge, args.channels, filters, args.batch, devices, 1, link, parameters,
                depth=args.edge * devices).to_json()
        for row in results.get("mixes", []):
            predicted[f"mix_{row['data']}x{row['spatial']}"] = cosmoflow_step_cost(
                args.edge, args.channels, filters, args.batch, row["spatial"], row["data"],
                link, parameters).to_json()
        results["scaling_model"] = {"flops": flops, "device_to_device_bytes_per_s": bandwidth,
                                    "predicted": predicted}

    for edge in args.large_edge if "large" in args.sections else ():
        run = {"edge": edge, "batch": 1}
        for devices in (1, count):
            print(f"large sample: {edge}^3 on {devices} device(s)", flush=True)
            started = time.perf_counter()
            try:
                run[f"step_s_{devices}"], _ = _time_steps(
                    cosmoflow(edge, [all_devices[:devices]]), edge, args.channels, 1, args.steps)
            except tf.errors.OpError as error:  # out of memory, or a tensor cuDNN cannot take
                run[f"step_s_{devices}"] = None
                run[f"error_{devices}"] = f"{type(error).__name__}: {_error_text(error)}"
            # Building, tracing and (where it fails) the allocator's retries, with the steps.
            run[f"seconds_{devices}"] = time.perf_counter() - started
            tf.keras.backend.clear_session()
        record("large_sample", run)

    if "timeline" in args.sections:  # where the devices of a spatial split wait for each other
        results["timeline"] = {}
        for devices in sorted({1, count}, reverse=True):
            trace = _timeline(cosmoflow(args.edge, [all_devices[:devices]]), args.edge,
                              args.channels, args.batch)
            results["timeline"][f"spatial_{devices}"] = trace
            print("timeline", devices, trace.get("skipped") or {
                device: {key: row[key] for key in ("wall_ms", "busy_ms", "idle_ms")}
                for device, row in trace["devices"].items()}, flush=True)
    with open(args.out, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
