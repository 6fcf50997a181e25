"""Strong scaling of a CosmoFlow-style model split spatially over the GPUs of one host, and a
sample too large for one GPU trained on several, side by side in one run; with the scaling model's
prediction for each, from the measured one-GPU speed and device-to-device bandwidth.

    python benchmarks/spatial_scaling.py --edge 128 --batch 4 --devices 1 2 \\
        --large-edge 512 --out benchmarks/results/spatial_scaling_h200x2.json

Without GPUs, `--smoke` runs it on logical CPUs with a tiny volume, to check the script.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import tensorflow as tf

FILTERS = (16, 32, 64, 128, 256)


def _devices(smoke: bool, count: int) -> list[str]:
    if smoke:
        return [f"/CPU:{i}" for i in range(count)]
    return [f"/GPU:{i}" for i in range(count)]


def _time_steps(model, edge, channels, batch, steps):
    x = tf.random.stateless_uniform([batch, edge, edge, edge, channels], seed=[1, 2])
    y = tf.zeros([batch, 4])
    optimizer = tf.keras.optimizers.SGD(1e-3)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    step().numpy()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.numpy()
    return (time.perf_counter() - start) / steps


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edge", type=int, default=128)
    parser.add_argument("--large-edge", type=int, default=512,
                        help="a volume edge too large for one device (0: skip)")
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.smoke:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * max(args.devices))

    from tf_ucudnn.parallel.cosmoflow import SpatialCosmoFlow
    from tf_ucudnn.parallel.scaling import Link, cosmoflow_step_cost

    filters = FILTERS[:3] if args.smoke else FILTERS
    results = {"benchmark": "spatial_scaling", "tensorflow": tf.__version__,
               "devices": [d.name for d in tf.config.list_logical_devices(
                   "CPU" if args.smoke else "GPU")],
               "edge": args.edge, "batch": args.batch, "filters": list(filters), "runs": []}
    step_s = {}
    for count in args.devices:
        tf.keras.utils.set_random_seed(0)
        model = SpatialCosmoFlow(args.edge, args.channels, filters, mesh=[_devices(
            args.smoke, count)])
        step_s[count] = _time_steps(model, args.edge, args.channels, args.batch, args.steps)
        parameters = int(sum(np.prod(v.shape) for v in model.trainable_variables))
        results["runs"].append({"devices": count, "step_s": step_s[count],
                                "efficiency": step_s[args.devices[0]] * args.devices[0]
                                / (count * step_s[count])})
        print(results["runs"][-1], flush=True)

    # The scaling model, calibrated by the one-device speed and a device-to-device copy.
    one = cosmoflow_step_cost(args.edge, args.channels, filters, args.batch, 1, 1,
                              Link(1.0, 1.0, 1.0), parameters)
    flops = one.compute_s / step_s[args.devices[0]] if args.devices[0] == 1 else None
    if flops and max(args.devices) > 1:
        devices = _devices(args.smoke, 2)
        link = Link(flops, _copy_bandwidth(devices[0], devices[1]),
                    _copy_bandwidth(devices[0], devices[1]))
        results["scaling_model"] = {"flops": flops, "halo_bandwidth": link.halo_bandwidth,
                                    "predicted": [{"devices": count, **cosmoflow_step_cost(
                                        args.edge, args.channels, filters, args.batch, count, 1,
                                        link, parameters).to_json()}
                                        for count in [*args.devices, 4, 8]]}
    if args.large_edge:
        count = max(args.devices)
        run = {"edge": args.large_edge, "batch": 1}
        for devices in (1, count):
            tf.keras.utils.set_random_seed(0)
            model = SpatialCosmoFlow(args.large_edge, args.channels, filters,
                                     mesh=[_devices(args.smoke, devices)])
            try:
                run[f"step_s_{devices}"] = _time_steps(model, args.large_edge, args.channels, 1,
                                                       args.steps)
            except tf.errors.ResourceExhaustedError as error:
                run[f"step_s_{devices}"] = None
                run[f"error_{devices}"] = str(error).splitlines()[0][:200]
        results["large_sample"] = run
        print(run, flush=True)
    with open(args.out, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
