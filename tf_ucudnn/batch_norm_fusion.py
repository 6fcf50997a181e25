"""Keras batch normalization trained as one fused kernel (TensorFlow's FusedBatchNormV3).

Why: Keras 3 normalizes a training batch with separate moment and element-wise ops. Their
gradient holds several activation-sized temporaries at once: on ResNet-50 at batch 768, seven
2.5 GB tensors in the first stage's backward pass, a working set the memory planner can neither
swap nor recompute away. FusedBatchNormV3 (cuDNN's batch normalization on the GPU) and its
gradient hold the input, the output's gradient and the input's gradient only, and run as one
kernel each way. The results are the same: the batch's mean and (biased) variance normalize it,
and the moving statistics follow Keras's own update.

`fused_batch_norm(model)` switches a model's BatchNormalization layers while a training step is
traced, and says which layers it left as they are, and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Iterator

import keras
import tensorflow as tf

# cuDNN refuses a smaller epsilon (CUDNN_BN_MIN_EPSILON, with TensorFlow's margin).
MIN_EPSILON = 1.001e-5
_FORMATS = {4: "NHWC", 5: "NDHWC"}


@dataclasses.dataclass(frozen=True)
class UnfusedLayer:
    layer: str
    reason: str


def unfusable_because(layer: keras.layers.BatchNormalization, rank: int):
    """None if the layer's training call can be fused for inputs of this rank, else why not."""
    axis = layer.axis if isinstance(layer.axis, int) else (
        layer.axis[0] if len(layer.axis) == 1 else None)
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


def _fused_call(self, inputs, training=None, mask=None):
    if not (training and self.trainable) or mask is not None or \
            inputs.dtype not in (tf.float16, tf.bfloat16, tf.float32) or \
            unfusable_because(self, len(inputs.shape)) is not None:
        return type(self).call(self, inputs, training=training, mask=mask)
    x = tf.cast(inputs, tf.float32)  # as Keras: statistics in float32
    channels = x.shape[-1]
    scale = tf.cast(self.gamma, tf.float32) if self.scale else tf.ones([channels])
    offset = tf.cast(self.beta, tf.float32) if self.center else tf.zeros([channels])
    y, mean, unbiased_variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=offset, mean=tf.zeros([0]), variance=tf.zeros([0]),
        epsilon=self.epsilon, data_format=_FORMATS[len(x.shape)], is_training=True)
    # The kernel's variance is Bessel-corrected; Keras's moving variance follows the biased one.
    count = tf.cast(tf.size(x) // channels, tf.float32)
    variance = unbiased_variance * (count - 1.0) / count
    for moving, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
        moving.assign(moving * self.momentum
                      + tf.cast(batch, moving.dtype) * (1.0 - self.momentum))
    return tf.cast(y, self.compute_dtype)


def _batch_norm_layers(model: keras.Model) -> list:
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization)]


@contextlib.contextmanager
def fused_batch_norm(model: keras.Model) -> Iterator[list[UnfusedLayer]]:
    """While open, the model's BatchNormalization layers train with the fused kernel; yields the
    layers left as they are (known from their built input shape), with the reason."""
    switched, left_alone = [], []
    for layer in _batch_norm_layers(model):
        shape = getattr(layer, "_build_shapes_dict", None) or {}
        rank = len(next(iter(shape.values()))) if shape else None
        reason = unfusable_because(layer, rank) if rank is not None else None
        if reason is not None:
            left_alone.append(UnfusedLayer(layer.path, reason))
            continue
        layer.call = types.MethodType(_fused_call, layer)
        switched.append(layer)
    try:
        yield left_alone
    finally:
        for layer in switched:
            del layer.call
