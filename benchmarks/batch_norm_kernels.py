"""Training batch normalization on a channels-last float32 activation, five ways, forward and
backward: time per step and the GPU memory held beyond the input, side by side in one run.

    python benchmarks/batch_norm_kernels.py --shape 192 56 56 256 --out $OUT/bn.json

- fused_nhwc: tf_ucudnn.keras.batch_norm_forms's "cudnn" kernel, FusedBatchNormV3 on the input as it
  is; TensorFlow's GPU kernel transposes float32 NHWC to NCHW and back (two activation-sized
  temporaries forward, three backward).
- fused_rows: the same kernel given the input seen as [N*H*W, C, 1, 1] NCHW: no transposes, but
  cuDNN is slow on that shape (ResNet-50's step at batch 192 on the H100: 128.3 img/s, against
  1604.8 with the transposes, both with Grappler's layout optimizer).
- xla: tf_ucudnn.keras.batch_norm_forms's "xla" kernel: the moments, the normalization and the
  written-out gradient, each way one XLA computation over the channels-last input (its
  statistics summed in one read).
- ucudnn: its "ucudnn" kernel, tf_ucudnn's own op: cuDNN's batch normalization on the NHWC
  descriptor (persistent spatial mode), one call each way.
- keras: Keras's own BatchNormalization layer in training, its gradient by autodiff.

With `--jit-compile` each step is one XLA computation, as in Keras's default training step on a
GPU: Keras's layer, the "xla" kernel and FusedBatchNormV3 (XLA's batch-norm-training op there)
side by side say whether a written-out gradient beats XLA's fusions of the autodiff one.

    python benchmarks/batch_norm_kernels.py --jit-compile \\
        --variants keras xla fused_nhwc --out $OUT/bnx.json
"""

from __future__ import annotations

import argparse
import json
import time

import keras
import tensorflow as tf
from gpu_names import device_name

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


def keras_layer(x, scale, offset):
    layer = keras.layers.BatchNormalization(epsilon=MIN_EPSILON)
    layer.build(x.shape)
    layer.gamma.assign(scale)
    layer.beta.assign(offset)
    # The tf.Variables under Keras's own, which the tape watches.
    return (lambda x, *_: layer(x, training=True)), [layer.gamma.value, layer.beta.value]


def _ops(normalization):
    return lambda x, scale, offset: (normalization, [scale, offset])


# Each variant's builder: called once with the step's tensors, it returns the normalization and
# the scale and offset to differentiate (a Keras layer's are its variables).
VARIANTS = {"fused_nhwc": _ops(fused_nhwc), "fused_rows": _ops(fused_rows), "xla": _ops(xla),
            "ucudnn": _ops(ucudnn), "keras": keras_layer}


def measure(name: str, shape, steps: int, jit_compile: bool = False) -> dict:
    x = tf.random.stateless_normal(shape, seed=[1, 2])
    dy = tf.random.stateless_normal(shape, seed=[3, 4])
    batch_norm, (scale, offset) = VARIANTS[name](x, tf.ones([shape[-1]]), tf.zeros([shape[-1]]))

    @tf.function(jit_compile=jit_compile)
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
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--jit-compile", action="store_true",
                        help="each step one XLA computation, as Keras's default step on a GPU")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {"benchmark": "batch_norm_kernels", "tensorflow": tf.__version__,
               "device": device_name(),
               "shape": args.shape, "jit_compile": args.jit_compile, "variants": {}}
    for name in args.variants:
        results["variants"][name] = measure(name, args.shape, args.steps, args.jit_compile)
        print(name, results["variants"][name], flush=True)
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
