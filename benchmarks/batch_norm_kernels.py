"""Training batch normalization on a channels-last float32 activation, four ways, forward and
backward: time per step and the GPU memory held beyond the input, side by side in one run.

    python benchmarks/batch_norm_kernels.py --shape 192 56 56 256 --out $OUT/bn.json

- fused_nhwc: tf_ucudnn.keras.batch_norm_forms's "cudnn" kernel, FusedBatchNormV3 on the input as it
  is; TensorFlow's GPU kernel transposes float32 NHWC to NCHW and back (two activation-sized
  temporaries forward, three backward).
- fused_rows: the same kernel given the input seen as [N*H*W, C, 1, 1] NCHW: no transposes, but
  cuDNN is slow on that shape (ResNet-50's step at batch 192 on the H100: 128.3 img/s, against
  1604.8 with the transposes, both with Grappler's layout optimizer).
- xla: tf_ucudnn.keras.batch_norm_forms's "xla" kernel: the moments, the normalization and the
  written-out gradient, each way one XLA computation over the channels-last input.
- ucudnn: its "ucudnn" kernel, tf_ucudnn's own op: cuDNN's batch normalization on the NHWC
  descriptor (persistent spatial mode), one call each way.
"""

from __future__ import annotations

import argparse
import json
import time

import tensorflow as tf

from tf_ucudnn.keras.batch_norm_forms import KERNELS, MIN_EPSILON


def fused_nhwc(x, scale, offset):
    return KERNELS["cudnn"](x, scale, offset, MIN_EPSILON)[0]


def fused_rows(x, scale, offset):
    channels = x.shape[-1]
    rows = tf.reshape(x, [-1, channels, 1, 1])
    y = tf.raw_ops.FusedBatchNormV3(
        x=rows, scale=scale, offset=offset, mean=tf.zeros([0]), variance=tf.zeros([0]),
        epsilon=MIN_EPSILON, data_format="NCHW", is_training=True)[0]
    return tf.reshape(y, tf.shape(x))


def xla(x, scale, offset):
    return KERNELS["xla"](x, scale, offset, MIN_EPSILON)[0]


def ucudnn(x, scale, offset):
    return KERNELS["ucudnn"](x, scale, offset, MIN_EPSILON)[0]


VARIANTS = {"fused_nhwc": fused_nhwc, "fused_rows": fused_rows, "xla": xla, "ucudnn": ucudnn}


def measure(name: str, shape, steps: int) -> dict:
    x = tf.random.stateless_normal(shape, seed=[1, 2])
    scale, offset = tf.ones([shape[-1]]), tf.zeros([shape[-1]])
    dy = tf.random.stateless_normal(shape, seed=[3, 4])
    batch_norm = VARIANTS[name]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch([x, scale, offset])
            y = batch_norm(x, scale, offset)
        dx, d_scale, d_offset = tape.gradient(y, [x, scale, offset], output_gradients=dy)
        return tf.reduce_sum(dx) + tf.reduce_sum(d_scale) + tf.reduce_sum(d_offset)

    step().numpy()
    device = "GPU:0" if tf.config.list_logical_devices("GPU") else None
    if device:
        tf.config.experimental.reset_memory_stats(device)
        base = tf.config.experimental.get_memory_info(device)["current"]
    start = time.perf_counter()
    for _ in range(steps):
        out = step()
    out.numpy()
    result = {"ms": (time.perf_counter() - start) / steps * 1e3}
    if device:
        peak = tf.config.experimental.get_memory_info(device)["peak"] - base
        result["held_beyond_inputs_in_activations"] = peak / (4 * tf.size(x).numpy())
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[192, 56, 56, 256])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gpus = tf.config.list_logical_devices("GPU")
    results = {"benchmark": "batch_norm_kernels", "tensorflow": tf.__version__,
               "device": tf.config.experimental.get_device_details(
                   tf.config.list_physical_devices("GPU")[0])["device_name"] if gpus else "CPU",
               "shape": args.shape, "variants": {}}
    for name in args.variants:
        results["variants"][name] = measure(name, args.shape, args.steps)
        print(name, results["variants"][name], flush=True)
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
