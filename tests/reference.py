"""Float64 references for the micro-batched convolutions, built from TensorFlow's own ops.

TensorFlow's CPU convolutions support neither NCHW/NCDHW nor, in their backprop, dilations > 1.
The references therefore always compute in float64, channels-last, with an explicitly dilated
filter (zeros between the taps, which is the same convolution with dilation 1) and, where a TF
op lacks EXPLICIT padding (3-D), with the input padded by `tf.pad` and VALID padding. Everything
here is differentiable, so `tf.GradientTape` over `conv` gives reference gradients; the
`backprop_*` functions call TensorFlow's raw backprop ops directly.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np
import tensorflow as tf

Padding = Union[str, Sequence[Sequence[int]]]


@dataclasses.dataclass(frozen=True)
class Conv:
    """One convolution configuration, described the way tf.nn.conv2d / conv3d take it."""

    input_shape: tuple  # in data_format order
    filter_shape: tuple  # spatial..., in_channels, out_channels
    strides: tuple = ()  # spatial only; () means all 1
    padding: Padding = "VALID"  # "SAME", "VALID" or full-rank [before, after] pairs
    data_format: Optional[str] = None
    dilations: tuple = ()  # spatial only; () means all 1

    @property
    def nd(self) -> int:
        return len(self.input_shape) - 2

    @property
    def fmt(self) -> str:
        return self.data_format or ("NHWC" if self.nd == 2 else "NDHWC")

    @property
    def channels_last(self) -> bool:
        return self.fmt.endswith("C")

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    @property
    def spatial_strides(self) -> list:
        return list(self.strides) or [1] * self.nd

    @property
    def spatial_dilations(self) -> list:
        return list(self.dilations) or [1] * self.nd

    def full(self, spatial: Sequence[int]) -> list:
        """A spatial-only list in the full-rank data_format order, as the ops' attributes take it."""
        return [1, *spatial, 1] if self.channels_last else [1, 1, *spatial]

    @property
    def output_shape(self) -> tuple:
        return tuple(conv(np.zeros(self.input_shape), np.zeros(self.filter_shape), self).shape)

    def kwargs(self) -> dict:
        """Keyword arguments for tf_ucudnn.conv2d / conv3d and their backprop wrappers."""
        return {"strides": self.spatial_strides, "padding": self.padding,
                "data_format": self.fmt, "dilations": self.spatial_dilations}

    def raw_attrs(self) -> dict:
        """Attributes for the raw generated ops (tf_ucudnn.ops._ops.*)."""
        if isinstance(self.padding, str):
            padding, explicit = self.padding, []
        else:
            padding, explicit = "EXPLICIT", [v for pair in self.padding for v in pair]
        return {"strides": self.full(self.spatial_strides), "padding": padding,
                "explicit_paddings": explicit, "data_format": self.fmt,
                "dilations": self.full(self.spatial_dilations)}

    def __str__(self) -> str:
        pad = self.padding if isinstance(self.padding, str) else \
            "EXPLICIT" + "".join(f"{a}{b}" for a, b in self.padding)
        parts = [self.fmt, "x".join(map(str, self.input_shape)),
                 "f" + "x".join(map(str, self.filter_shape)), pad]
        if any(s != 1 for s in self.spatial_strides):
            parts.append("s" + "".join(map(str, self.spatial_strides)))
        if any(d != 1 for d in self.spatial_dilations):
            parts.append("d" + "".join(map(str, self.spatial_dilations)))
        return "-".join(parts)


# ------------------------------------------------------------------------------------------ layout

def _to_channels_last(x, cfg: Conv):
    if cfg.channels_last:
        return x
    return tf.transpose(x, [0, *range(2, cfg.nd + 2), 1])


def _from_channels_last(x, cfg: Conv):
    if cfg.channels_last:
        return x
    return tf.transpose(x, [0, cfg.nd + 1, *range(1, cfg.nd + 1)])


def _channels_last_shape(shape, cfg: Conv) -> list:
    shape = list(shape)
    return shape if cfg.channels_last else [shape[0], *shape[2:], shape[1]]


def _spatial_padding(cfg: Conv) -> list:
    """Explicit [before, after] pairs of the spatial dimensions."""
    pairs = [list(p) for p in cfg.padding]
    return pairs[1:-1] if cfg.channels_last else pairs[2:]


def dilate_filter(w, dilations: Sequence[int]):
    """Inserts dilation - 1 zeros between the taps of each spatial dimension (differentiable)."""
    w = tf.convert_to_tensor(w)
    for axis, d in enumerate(dilations):
        if d == 1:
            continue
        k = w.shape[axis]
        moved = tf.experimental.numpy.moveaxis(w, axis, 0)
        rest = moved.shape[1:]
        spread = tf.concat([moved[:, None], tf.zeros([k, d - 1, *rest], w.dtype)], axis=1)
        spread = tf.reshape(spread, [k * d, *rest])[: (k - 1) * d + 1]
        w = tf.experimental.numpy.moveaxis(spread, 0, axis)
    return w


def undilate_filter(w, dilations: Sequence[int]):
    """The taps of a dilated filter's gradient that belong to the undilated filter."""
    index = tuple(slice(None, None, d) for d in dilations)
    return w[index]


# ------------------------------------------------------------------------------------- forward

def _as64(x):
    return tf.cast(tf.convert_to_tensor(x), tf.float64)


def conv(x, w, cfg: Conv):
    """The convolution in float64, from tf.nn.convolution (channels-last, dilation 1)."""
    x = _to_channels_last(_as64(x), cfg)
    w = dilate_filter(_as64(w), cfg.spatial_dilations)
    padding = cfg.padding
    if not isinstance(padding, str):
        x = tf.pad(x, [[0, 0], *_spatial_padding(cfg), [0, 0]])
        padding = "VALID"
    y = tf.nn.convolution(x, w, strides=cfg.spatial_strides, padding=padding)
    return _from_channels_last(y, cfg)


def conv_and_grads(x, w, dy, cfg: Conv):
    """Reference output and gradients (input, filter) for the upstream gradient dy, in float64."""
    x, w, dy = _as64(x), _as64(w), _as64(dy)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = conv(x, w, cfg)
    dx, dw = tape.gradient(y, [x, w], output_gradients=dy)
    return y, dx, dw


# ----------------------------------------------------------------------------- raw backprop ops

def _raw_padding(cfg: Conv):
    """(padding, explicit_paddings in NHWC order, extra input padding done by hand)."""
    if isinstance(cfg.padding, str):
        return cfg.padding, [], None
    pairs = _spatial_padding(cfg)
    if cfg.nd == 2:  # Conv2DBackprop* support EXPLICIT on the CPU
        return "EXPLICIT", [0, 0, *[v for p in pairs for v in p], 0, 0], None
    return "VALID", [], pairs  # Conv3DBackprop*V2 do not: pad the input by hand


def backprop_input(input_sizes, w, dy, cfg: Conv):
    """tf.raw_ops.Conv2DBackpropInput / Conv3DBackpropInputV2 in float64."""
    shape = _channels_last_shape(input_sizes, cfg)
    wd = dilate_filter(_as64(w), cfg.spatial_dilations)
    dy = _to_channels_last(_as64(dy), cfg)
    padding, explicit, by_hand = _raw_padding(cfg)
    if by_hand:
        shape = [shape[0], *[s + a + b for s, (a, b) in zip(shape[1:-1], by_hand)], shape[-1]]
    strides = [1, *cfg.spatial_strides, 1]
    if cfg.nd == 2:
        dx = tf.raw_ops.Conv2DBackpropInput(input_sizes=shape, filter=wd, out_backprop=dy,
                                            strides=strides, padding=padding,
                                            explicit_paddings=explicit)
    else:
        dx = tf.raw_ops.Conv3DBackpropInputV2(input_sizes=shape, filter=wd, out_backprop=dy,
                                              strides=strides, padding=padding)
    if by_hand:
        dx = dx[(slice(None), *[slice(a, s - b) for s, (a, b) in zip(shape[1:-1], by_hand)])]
    return _from_channels_last(dx, cfg)


def backprop_filter(x, filter_sizes, dy, cfg: Conv):
    """tf.raw_ops.Conv2DBackpropFilter / Conv3DBackpropFilterV2 in float64."""
    dil = cfg.spatial_dilations
    sizes = [(k - 1) * d + 1 for k, d in zip(filter_sizes[:-2], dil)] + list(filter_sizes[-2:])
    x = _to_channels_last(_as64(x), cfg)
    dy = _to_channels_last(_as64(dy), cfg)
    padding, explicit, by_hand = _raw_padding(cfg)
    if by_hand:
        x = tf.pad(x, [[0, 0], *by_hand, [0, 0]])
    strides = [1, *cfg.spatial_strides, 1]
    if cfg.nd == 2:
        dw = tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=sizes, out_backprop=dy,
                                             strides=strides, padding=padding,
                                             explicit_paddings=explicit)
    else:
        dw = tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=sizes, out_backprop=dy,
                                               strides=strides, padding=padding)
    return undilate_filter(dw, dil)


# ----------------------------------------------------------------------------------- tolerances

# Relative to the error scale below: the unit roundoff of the result type, with headroom for a
# float accumulation over the taps. float16/bfloat16 results are rounded once (half an ulp of
# the result), so twice their unit roundoff bounds the error with room to spare.
RTOL = {
    tf.float64: 1e-12,
    tf.float32: 1e-5,
    tf.float16: 2.0 ** -9,   # 2 x eps(float16) = 4 x its unit roundoff
    tf.bfloat16: 2.0 ** -6,  # 2 x eps(bfloat16)
}


def assert_close(actual, expected, scale, dtype, what=""):
    """|actual - expected| <= RTOL[dtype] * scale elementwise, scale being the sum of |terms|.

    `scale` is the same computation on absolute values (e.g. conv(|x|, |w|)): the size of the
    largest partial sum, which bounds the rounding error of any summation order.
    """
    actual = np.asarray(tf.cast(actual, tf.float64))
    expected = np.asarray(expected, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    # The tiny floor keeps exact zeros (padding-only outputs) comparable.
    bound = RTOL[dtype] * scale + 1e-300
    error = np.abs(actual - expected)
    bad = error > bound
    if bad.any():
        worst = np.unravel_index(np.argmax(error - bound), error.shape)
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements differ beyond rtol {RTOL[dtype]:g} of "
            f"the error scale; worst at {worst}: got {actual[worst]!r}, expected "
            f"{expected[worst]!r}, scale {scale[worst]!r}")


def random(shape, dtype, rng: np.random.Generator):
    """Normal values rounded to `dtype` (returned as a tensor of dtype)."""
    return tf.cast(tf.constant(rng.standard_normal(shape)), dtype)
