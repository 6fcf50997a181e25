"""Keras batch normalization trained as one fused kernel (TensorFlow's FusedBatchNormV3).

Why: Keras 3 normalizes a training batch with separate moment and element-wise ops, about
twenty each way per layer. FusedBatchNormV3 (cuDNN's batch normalization on the GPU) runs one
kernel each way, so a network with a normalization after each convolution (a ResNet) trains much
faster with it. The results are the same: the batch's mean and (biased) variance normalize it,
and the moving statistics follow Keras's own update.

Memory: the kernel holds the input, the output's gradient and the input's gradient, but on the GPU
TensorFlow runs float32 channels-last input through cuDNN in NCHW, with transposed copies (two
forward, three backward; `tf_ucudnn.memory.analysis.liveness.kernel_scratch_bytes` counts
them). Keras's ops hold about as much: the liveness analysis predicts about the same peak for
either.

Kernels: "cudnn", TensorFlow's FusedBatchNormV3; "xla", the same arithmetic as one XLA
computation each way on the input as it is, its statistics summed in one read of the input;
"ucudnn", tf_ucudnn's own op (`ops.batch_norm`), cuDNN's batch normalization on an NHWC
descriptor, without the copies.

`fused_batch_norm(model, kernel)` switches a model's BatchNormalization layers while a training
step is traced, and says which layers it left as they are, and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Iterator

import keras
import tensorflow as tf

from tf_ucudnn.kernels import ops

# cuDNN refuses a smaller epsilon (CUDNN_BN_MIN_EPSILON, with TensorFlow's margin).
MIN_EPSILON = 1.001e-5
_FORMATS = {4: "NHWC", 5: "NDHWC"}


@dataclasses.dataclass(frozen=True)
class UnfusedLayer:
    layer: str
    reason: str


def normalized_axis(layer: keras.layers.BatchNormalization):
    """The one axis the layer normalizes (possibly negative), or None if it normalizes more."""
    return layer.axis if isinstance(layer.axis, int) else (
        layer.axis[0] if len(layer.axis) == 1 else None)


def unfusable_because(layer: keras.layers.BatchNormalization, rank: int):
    """None if the layer's training call can be fused for inputs of this rank, else why not."""
    axis = normalized_axis(layer)
    if rank not in _FORMATS:
        return f"inputs of rank {rank}: the fused kernel takes 4-D or 5-D inputs"
    if axis is None or axis % rank != rank - 1:
        return f"normalizes axis {layer.axis}: the fused kernel takes the last (channels) axis"
    if layer.epsilon < MIN_EPSILON:
        return f"epsilon {layer.epsilon} is below cuDNN's minimum {MIN_EPSILON}"
    if layer.renorm:
        return "batch renormalization"
    if layer.synchronized:
        return "synchronized across replicas"
    return None


def cudnn_normalization(x, scale, offset, epsilon):
    """y, the batch's mean and its biased variance, by FusedBatchNormV3."""
    y, mean, unbiased_variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=offset, mean=tf.zeros([0]), variance=tf.zeros([0]),
        epsilon=epsilon, data_format=_FORMATS[len(x.shape)], is_training=True)
    # The kernel's variance is Bessel-corrected; Keras's moving variance follows the biased one.
    count = tf.cast(tf.size(x) // x.shape[-1], tf.float32)
    return y, mean, unbiased_variance * (count - 1.0) / count


@tf.function(jit_compile=True, autograph=False)
def xla_forward(x, scale, offset, epsilon):
    """The normalization and its statistics, both sums over x in one read (Keras's moments read
    it twice: the mean, then the squares about it). The sums are about one sample of each
    channel, a shift near the mean, so that E[d^2] - E[d]^2 cancels little in float32."""
    axes = list(range(len(x.shape) - 1))
    shift = tf.stop_gradient(x[(0,) * len(axes)])
    shifted = x - shift
    shifted_mean = tf.reduce_mean(shifted, axes)
    variance = tf.maximum(tf.reduce_mean(tf.square(shifted), axes) - tf.square(shifted_mean), 0.0)
    mean = shifted_mean + shift
    inv_std = tf.math.rsqrt(variance + epsilon)
    return (x - mean) * (inv_std * scale) + offset, mean, variance, inv_std


@tf.function(jit_compile=True, autograph=False)
def xla_backward(dy, x, mean, inv_std, scale):
    axes = list(range(len(x.shape) - 1))
    count = tf.cast(tf.size(x) // x.shape[-1], x.dtype)
    x_hat = (x - mean) * inv_std
    d_offset = tf.reduce_sum(dy, axes)
    d_scale = tf.reduce_sum(dy * x_hat, axes)
    dx = (scale * inv_std / count) * (count * dy - d_offset - x_hat * d_scale)
    return dx, d_scale, d_offset


def xla_normalization(x, scale, offset, epsilon):
    """y, the batch's mean and its biased variance, each way one XLA computation: channels-last
    as it is, so no transposed copies, and the gradient keeps x only (as the fused kernel)."""

    @tf.custom_gradient
    def normalize(x, scale, offset):
        y, mean, variance, inv_std = xla_forward(x, scale, offset, epsilon)

        def gradient(dy, *_statistics_gradients):  # the statistics feed moving averages only
            return xla_backward(dy, x, mean, inv_std, scale)
        return (y, tf.stop_gradient(mean), tf.stop_gradient(variance)), gradient
    return normalize(x, scale, offset)


def ucudnn_normalization(x, scale, offset, epsilon):
    """y, the batch's mean and its biased variance, by tf_ucudnn's own op: cuDNN's batch
    normalization on the channels-last tensor as it is, so no transposed copies."""
    y, mean, inv_std = ops.batch_norm(x, scale, offset, epsilon)
    variance = tf.math.reciprocal(tf.square(inv_std)) - epsilon
    return y, tf.stop_gradient(mean), tf.stop_gradient(variance)


# By name, as `tf_ucudnn.options.BATCH_NORM_KERNELS` lists them.
KERNELS = {"cudnn": cudnn_normalization, "xla": xla_normalization,
           "ucudnn": ucudnn_normalization}


@tf.function(jit_compile=True, autograph=False)
def gradient_sums(dy, z, mean, inv_std):
    """Per channel: sum(dy) (the offset's gradient) and sum(dy * x_hat) (the scale's)."""
    axes = list(range(len(z.shape) - 1))
    return tf.reduce_sum(dy, axes), tf.reduce_sum(dy * ((z - mean) * inv_std), axes)


@tf.function(jit_compile=True, autograph=False)
def normalization_gradient(dy, z, mean, inv_std, scale, d_offset, d_scale, count):
    """One micro-batch of the batch normalization's input gradient, from the whole batch's
    statistics and sums, and its per-channel sum (the convolution bias's gradient)."""
    x_hat = (z - mean) * inv_std
    dz = (scale * inv_std / count) * (count * dy - d_offset - x_hat * d_scale)
    return dz, tf.reduce_sum(dz, list(range(len(z.shape) - 1)))


def _fused_call(self, inputs, training=None, mask=None, *, normalization):
    if not (training and self.trainable) or mask is not None or \
            inputs.dtype not in (tf.float16, tf.bfloat16, tf.float32) or \
            unfusable_because(self, len(inputs.shape)) is not None:
        return type(self).call(self, inputs, training=training, mask=mask)
    x = tf.cast(inputs, tf.float32)  # as Keras: statistics in float32
    channels = x.shape[-1]
    scale = tf.cast(self.gamma, tf.float32) if self.scale else tf.ones([channels])
    offset = tf.cast(self.beta, tf.float32) if self.center else tf.zeros([channels])
    y, mean, variance = normalization(x, scale, offset, self.epsilon)
    update_moving_statistics(self, mean, variance)
    return tf.cast(y, self.compute_dtype)


def update_moving_statistics(layer: keras.layers.BatchNormalization, mean, variance) -> None:
    """Keras's own update of a layer's moving mean and variance from a batch's."""
    for moving, batch in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
        moving.assign(moving * layer.momentum
                      + tf.cast(batch, moving.dtype) * (1.0 - layer.momentum))


def batch_norm_layers(model: keras.Model) -> list:
    """The model's BatchNormalization layers, nested ones included."""
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization)]


@contextlib.contextmanager
def fused_batch_norm(model: keras.Model, kernel: str = "cudnn") -> Iterator[list[UnfusedLayer]]:
    """While open, the model's BatchNormalization layers train with the fused kernel ("cudnn",
    "xla" or "ucudnn": `KerasOptions.batch_norm_kernel`); yields the layers left as they are
    (known from their built input shape), with the reason."""
    normalization = KERNELS[kernel]
    switched, left_alone = [], []
    for layer in batch_norm_layers(model):
        shape = getattr(layer, "_build_shapes_dict", None) or {}
        rank = len(next(iter(shape.values()))) if shape else None
        reason = unfusable_because(layer, rank) if rank is not None else None
        if reason is not None:
            left_alone.append(UnfusedLayer(layer.path, reason))
            continue
        layer.call = types.MethodType(
            functools.partial(_fused_call, normalization=normalization), layer)
        switched.append(layer)
    try:
        yield left_alone
    finally:
        for layer in switched:
            del layer.call
