"""Float64 references for the micro-batched convolutions, built from TensorFlow's own ops.

TensorFlow's CPU convolutions support neither NCHW/NCDHW nor, in their backprop, dilations > 1.
The references therefore always compute in float64, channels-last, with an explicitly dilated
filter (zeros between the taps: the same convolution with dilation 1). 2-D references use
TensorFlow's own SAME and EXPLICIT padding; 3-D ones pad the input by hand (`tf.pad`) and run
VALID, because tf.nn.conv3d has no EXPLICIT padding and its CPU kernel gets SAME wrong where a
stride exceeds the filter. Everything here is differentiable, so `tf.GradientTape` over `conv`
gives reference gradients (and second-order ones); the `backprop_*` functions call TensorFlow's
raw backprop ops (Conv2DBackpropInput/Filter, Conv3DBackpropInputV2/FilterV2) directly.

Also here, shared by the test modules: the tolerance rule, the plans the tests use, the cases
they run, and `check_conv`, which runs an op with its gradients and compares all three results.
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
    def groups(self) -> int:
        """Input channels over the filter's, as TensorFlow's Conv2D takes them."""
        channels = self.input_shape[-1 if self.channels_last else 1]
        return channels // self.filter_shape[-2]

    @property
    def spatial_strides(self) -> list:
        return list(self.strides) or [1] * self.nd

    @property
    def spatial_dilations(self) -> list:
        return list(self.dilations) or [1] * self.nd

    def full(self, spatial: Sequence[int]) -> list:
        """A spatial-only list in full-rank data_format order, as the ops' attributes take it."""
        return [1, *spatial, 1] if self.channels_last else [1, 1, *spatial]

    @property
    def output_shape(self) -> tuple:
        """TensorFlow's output shape for this convolution (from its own op)."""
        return tuple(conv(np.zeros(self.input_shape), np.zeros(self.filter_shape), self).shape)

    def kwargs(self) -> dict:
        """Keyword arguments for tf_ucudnn.conv2d / conv3d and their backprop wrappers."""
        return {"strides": self.spatial_strides, "padding": self.padding,
                "data_format": self.fmt, "dilations": self.spatial_dilations}

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


def same_padding(cfg: Conv) -> list:
    """TensorFlow's SAME padding as [before, after] pairs of the spatial dimensions.

    From TensorFlow's documentation of SAME: the output has ceil(input / stride) positions and
    the odd pixel of padding goes after.
    """
    spatial = _channels_last_shape(cfg.input_shape, cfg)[1:-1]
    pairs = []
    for size, k, s, d in zip(spatial, cfg.filter_shape, cfg.spatial_strides,
                             cfg.spatial_dilations):
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        pairs.append([total // 2, total - total // 2])
    return pairs


def _spatial_padding(cfg: Conv) -> list:
    """[before, after] pairs of the spatial dimensions, for EXPLICIT padding and 3-D SAME."""
    if cfg.padding == "SAME":
        return same_padding(cfg)
    pairs = [list(p) for p in cfg.padding]
    return pairs[1:-1] if cfg.channels_last else pairs[2:]


def _padded_by_hand(cfg: Conv) -> bool:
    # TensorFlow's CPU Conv3D (Eigen's CuboidConvolution) gets SAME wrong where the stride exceeds
    # the filter (it pads negatively instead of not at all), and tf.nn.conv3d has no EXPLICIT: so
    # 3-D references pad by hand. 2-D references use TensorFlow's own SAME and EXPLICIT padding.
    return cfg.padding != "VALID" and (cfg.nd == 3 or not isinstance(cfg.padding, str))


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
    """The convolution in float64, from tf.nn.conv2d / conv3d (channels-last, dilation 1); a
    grouped one as one convolution per group, concatenated (TensorFlow's CPU kernels have no
    grouped float64 or 3-D convolution)."""
    x = _to_channels_last(_as64(x), cfg)
    w = dilate_filter(_as64(w), cfg.spatial_dilations)
    if cfg.groups > 1:
        ungrouped = dataclasses.replace(
            cfg, input_shape=(*x.shape[:-1], w.shape[-2]), filter_shape=tuple(w.shape),
            data_format=None, dilations=(),
            padding=cfg.padding if isinstance(cfg.padding, str) or cfg.channels_last
            else _pads(*_spatial_padding(cfg)))
        y = tf.concat([conv(xg, wg, ungrouped) for xg, wg in
                       zip(tf.split(x, cfg.groups, -1), tf.split(w, cfg.groups, -1))], -1)
        return _from_channels_last(y, cfg)
    padding = cfg.padding
    if _padded_by_hand(cfg):
        x = tf.pad(x, [[0, 0], *_spatial_padding(cfg), [0, 0]])
        padding = "VALID"
    strides = [1, *cfg.spatial_strides, 1]
    if cfg.nd == 2:
        y = tf.nn.conv2d(x, w, strides=strides, padding=padding, data_format="NHWC")
    else:
        y = tf.nn.conv3d(x, w, strides=strides, padding=padding, data_format="NDHWC")
    return _from_channels_last(y, cfg)


def conv_and_grads(x, w, dy, cfg: Conv):
    """Reference output and gradients (input, filter) for the upstream gradient dy, in float64."""
    x, w, dy = _as64(x), _as64(w), _as64(dy)
    if tf.size(dy) == 0:  # TensorFlow's CPU Conv3DBackpropInputV2 crashes on an empty output
        return conv(x, w, cfg), tf.zeros_like(x), tf.zeros_like(w)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = conv(x, w, cfg)
    dx, dw = tape.gradient(y, [x, w], output_gradients=dy)
    return y, dx, dw


# ----------------------------------------------------------------------------- raw backprop ops

def _raw_padding(cfg: Conv):
    """(padding, explicit_paddings in NHWC order, extra input padding done by hand)."""
    if cfg.padding == "VALID" or (cfg.padding == "SAME" and cfg.nd == 2):
        return cfg.padding, [], None
    pairs = _spatial_padding(cfg)
    if cfg.nd == 2:  # Conv2DBackprop* support EXPLICIT on the CPU
        return "EXPLICIT", [0, 0, *[v for p in pairs for v in p], 0, 0], None
    return "VALID", [], pairs  # Conv3DBackprop*V2 have no EXPLICIT: pad the input by hand


def backprop_input(input_sizes, w, dy, cfg: Conv):
    """tf.raw_ops.Conv2DBackpropInput / Conv3DBackpropInputV2 in float64."""
    if np.prod(np.shape(dy)) == 0:  # nothing flows back (and TF's 3-D op crashes on it)
        return tf.zeros(input_sizes, tf.float64)
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
    if np.prod(np.shape(dy)) == 0:
        return tf.zeros(filter_sizes, tf.float64)
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


def kernel_result(kernel: str, cfg: Conv, x, w, dy):
    """One kernel's result in float64: the output ("fwd"), the input gradient ("bwd_data") or
    the filter gradient ("bwd_filter") of `cfg`, the latter two for the output gradient `dy`."""
    if kernel == "fwd":
        return conv(x, w, cfg)
    if kernel == "bwd_data":
        return backprop_input(cfg.input_shape, w, dy, cfg)
    return backprop_filter(x, cfg.filter_shape, dy, cfg)


def run_kernel(kernel: str, cfg: Conv, x, w, dy, plan):
    """The same kernel of a 2-D convolution through tf_ucudnn's op with `plan`."""
    import tf_ucudnn
    if kernel == "fwd":
        return tf_ucudnn.conv2d(x, w, **cfg.kwargs(), plan=plan)
    if kernel == "bwd_data":
        return tf_ucudnn.conv2d_backprop_input(cfg.input_shape, w, dy, **cfg.kwargs(), plan=plan)
    return tf_ucudnn.conv2d_backprop_filter(x, cfg.filter_shape, dy, **cfg.kwargs(), plan=plan)


# ----------------------------------------------------------------------------------- tolerances

# Per rounding of the result, relative to the error scale below: 4 unit roundoffs of the result
# type for float16 and bfloat16 (whose results are rounded once from a float accumulation: half
# an ulp, i.e. one unit roundoff, of at most the scale), a float32 accumulation's error over the
# few hundred terms these tests sum with room to spare, and float64's likewise.
RTOL = {
    tf.float64: 1e-12,
    tf.float32: 1e-5,
    tf.float16: 4 * 2.0 ** -11,
    tf.bfloat16: 4 * 2.0 ** -8,
}

# Legacy FFT and Winograd algorithms compute in a transformed basis, whose rounding grows with the
# transform size (Lavin & Gray 2016; cuDNN documents them as less accurate): they get
# TRANSFORM_ROUNDINGS roundings.
TRANSFORM_ALGORITHMS = {"fwd": {4, 5, 6, 7}, "bwd_data": {2, 3, 4, 5}, "bwd_filter": {2, 4, 5, 6}}
TRANSFORM_ROUNDINGS = 8


def algorithm_roundings(kernel: str, algo) -> int:
    """The roundings `assert_close` allows a kernel's result by legacy algorithm `algo` (None
    for an engine): more for a transform algorithm, twice for a filter gradient (accumulated
    across micro-batches)."""
    return ((TRANSFORM_ROUNDINGS if algo in TRANSFORM_ALGORITHMS[kernel] else 1)
            * (2 if kernel == "bwd_filter" else 1))


def assert_close(actual, expected, scale, dtype, what="", roundings=1):
    """|actual - expected| <= RTOL[dtype] * roundings * scale, elementwise.

    `scale` is the same computation on absolute values (conv(|x|, |w|) and its gradients for
    |dy|): the largest any partial sum can be, which bounds the rounding error of every
    summation order. `roundings` counts how often the result is rounded to `dtype` on its way:
    once, except where the filter gradient is accumulated in the result type across
    micro-batches (the cuDNN kernels, beta = 1).
    """
    actual = np.asarray(tf.cast(actual, tf.float64))
    expected = np.asarray(expected, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bound = RTOL[dtype] * roundings * scale + 1e-300  # exact zeros (all padding) compare equal
    error = np.abs(actual - expected)
    bad = ~(error <= bound)  # NaN counts as bad
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(error - bound, nan=np.inf),
                                                    -np.inf)), error.shape)
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements differ by more than "
            f"{RTOL[dtype] * roundings:g} x the error scale; worst at {tuple(map(int, worst))}: "
            f"got {actual[worst]!r}, expected {expected[worst]!r}, scale {scale[worst]!r}")


def random(shape, dtype, rng: np.random.Generator):
    """Standard normal values rounded to `dtype`, as a tensor of that dtype."""
    return tf.cast(tf.constant(rng.standard_normal(shape)), dtype)


# ---------------------------------------------------------------------------------------- plans

# Explicit algorithms that cuDNN implements for every shape, stride, data type and math mode
# these tests use, in the NCHW / NCDHW layouts. The CPU kernels accept and ignore every in-range
# algorithm number.
SAFE_ALGORITHMS = {"fwd": (0, 1), "bwd_data": (0, 1), "bwd_filter": (0, 1, 3)}


def safe_algorithms(kernel: str, cfg: Optional[Conv] = None) -> tuple:
    """The explicit algorithms a test may give `kernel` of `cfg` and expect cuDNN to run.

    Seen on an H100 with cuDNN 9 (legacy API), whatever the math mode: channels-last layouts
    lose bwd_filter algorithm 3, as dilations do; NDHWC has no explicit algorithm that runs for
    every stride (only "auto" is safe there). (float64 runs channels-first inside the kernels,
    since cuDNN has no channels-last float64 kernels; these choices hold for it as well.)
    """
    if cfg is None:
        return SAFE_ALGORITHMS[kernel]
    if cfg.groups > 1:  # which explicit algorithms cuDNN runs for groups is not surveyed
        return ("auto",)
    if cfg.channels_last and cfg.nd == 3:
        return ("auto",)
    if kernel == "bwd_filter" and (cfg.channels_last or max(cfg.spatial_dilations) > 1):
        return (0, 1)
    return SAFE_ALGORITHMS[kernel]


def kernel_plan(sizes, kernel: str, algorithms=None, cfg: Optional[Conv] = None):
    """A KernelPlan of `sizes`, cycling through the given algorithms or else the safe ones.

    `algorithms` may hold ints, "auto" or full algorithm strings; None cycles
    safe_algorithms(kernel, cfg).
    """
    import tf_ucudnn
    from tf_ucudnn.core.plan import Algorithm
    choices = algorithms if algorithms is not None else safe_algorithms(kernel, cfg)
    micro_batches = []
    for i, size in enumerate(sizes):
        choice = choices[i % len(choices)]
        algorithm = Algorithm(choice) if isinstance(choice, int) else Algorithm.parse(choice)
        micro_batches.append(tf_ucudnn.MicroBatch(size, algorithm))
    return tf_ucudnn.KernelPlan(tuple(micro_batches))


def layer_plan(fwd=(), bwd_data=None, bwd_filter=None, cfg: Optional[Conv] = None):
    """A LayerPlan with the given sizes per kernel (the backprop ones default to fwd's)."""
    import tf_ucudnn
    bwd_data = fwd if bwd_data is None else bwd_data
    bwd_filter = fwd if bwd_filter is None else bwd_filter
    return tf_ucudnn.LayerPlan(kernel_plan(fwd, "fwd", cfg=cfg),
                               kernel_plan(bwd_data, "bwd_data", cfg=cfg),
                               kernel_plan(bwd_filter, "bwd_filter", cfg=cfg))


def assert_on_device(tensor, device: str):
    """The op ran where it was asked to (eager placement would fall back silently)."""
    kind = device.strip("/").split(":")[0]
    assert f"{kind}:0" in tensor.device, f"ran on {tensor.device}, not {device}"


# ----------------------------------------------------------------------------- a complete check

def check_conv(device: str, cfg: Conv, dtype, plan, rng: np.random.Generator, grads=True,
               jit_compile=False):
    """Runs tf_ucudnn.conv{2,3}d (and its gradients) with `plan` on `device`, compiled by XLA
    with `jit_compile`, and checks the output, the input gradient and the filter gradient
    against the float64 references."""
    import tf_ucudnn
    op = tf_ucudnn.conv2d if cfg.nd == 2 else tf_ucudnn.conv3d
    x = random(cfg.input_shape, dtype, rng)
    w = random(cfg.filter_shape, dtype, rng)
    dy = random(cfg.output_shape, dtype, rng)

    def run(x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = op(x, w, **cfg.kwargs(), plan=plan)
        return (y, *tape.gradient(y, [x, w], output_gradients=dy)) if grads else (y,)

    with tf.device(device):
        results = tf.function(run, jit_compile=True)(x, w, dy) if jit_compile else run(x, w, dy)
    y = results[0]
    assert y.dtype == dtype
    assert_on_device(y, device)
    if grads:
        dx, dw = results[1:]
    expected_y = conv(x, w, cfg)
    assert_close(y, expected_y, conv(tf.abs(x), tf.abs(w), cfg), dtype, f"{cfg} output")
    if not grads:
        return
    _, expected_dx, expected_dw = conv_and_grads(x, w, dy, cfg)
    _, scale_dx, scale_dw = conv_and_grads(tf.abs(x), tf.abs(w), tf.abs(dy), cfg)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert_close(dx, expected_dx, scale_dx, dtype, f"{cfg} input gradient")
    filter_plan = getattr(plan, "backprop_filter", None)
    roundings = 1
    # Filter gradients are summed in the result type across micro-batches: by cuDNN (beta = 1),
    # and by XLA's HLO when it compiles the op.
    if (device.startswith("/GPU") or jit_compile) and filter_plan is not None:
        roundings = max(1, len(filter_plan.sizes))
    assert_close(dw, expected_dw, scale_dw, dtype, f"{cfg} filter gradient", roundings)


# ---------------------------------------------------------------------------------------- cases

@dataclasses.dataclass(frozen=True)
class Case:
    """A convolution and the micro-batch sizes of its three kernels (() is the empty plan)."""

    id: str
    cfg: Conv
    fwd: tuple
    bwd_data: Optional[tuple] = None  # None: as fwd
    bwd_filter: Optional[tuple] = None

    def plan(self):
        return layer_plan(self.fwd, self.bwd_data, self.bwd_filter, self.cfg)

    def kernel_plan(self, kernel: str):
        return kernel_plan(self.sizes(kernel), kernel, cfg=self.cfg)

    def sizes(self, kernel: str) -> tuple:
        value = {"fwd": self.fwd, "bwd_data": self.bwd_data, "bwd_filter": self.bwd_filter}[kernel]
        return self.fwd if value is None else value


def _pads(*spatial_pairs, channels_last=True):
    pairs = [list(p) for p in spatial_pairs]
    return [[0, 0], *pairs, [0, 0]] if channels_last else [[0, 0], [0, 0], *pairs]


CONV2D_CASES = [
    Case("nhwc-same-5=2+3", Conv((5, 7, 7, 3), (3, 3, 3, 4), (1, 1), "SAME", "NHWC"), (2, 3)),
    Case("nhwc-valid-s2-7=1+4+2", Conv((7, 8, 6, 2), (3, 2, 2, 5), (2, 2), "VALID", "NHWC"),
         (1, 4, 2), (7,), (3, 4)),
    Case("nchw-same-s2-5=2+3", Conv((5, 3, 7, 7), (3, 3, 3, 4), (2, 2), "SAME", "NCHW"), (2, 3),
         (1, 4), (5,)),
    Case("nhwc-explicit-asym-s21-ones",
         Conv((4, 6, 5, 2), (3, 3, 2, 3), (2, 1), _pads((1, 2), (0, 3)), "NHWC"), (1, 1, 1, 1)),
    Case("nchw-explicit-asym-d2-6=3+3",
         Conv((6, 2, 9, 8), (3, 2, 2, 4), (1, 1), _pads((2, 0), (1, 1), channels_last=False),
              "NCHW", (2, 2)), (3, 3), (1, 5), (2, 2, 2)),
    Case("nhwc-same-d23-3=1+2", Conv((3, 10, 11, 2), (3, 3, 2, 3), (1, 1), "SAME", "NHWC", (2, 3)),
         (1, 2)),
    Case("nchw-valid-d2-whole", Conv((4, 3, 9, 9), (3, 3, 3, 2), (1, 1), "VALID", "NCHW", (2, 2)),
         (4,)),
    Case("nhwc-same-1x1-s23", Conv((5, 7, 6, 4), (1, 1, 4, 6), (2, 3), "SAME", "NHWC"), (2, 3)),
    Case("nhwc-same-filter-larger-than-input", Conv((3, 4, 3, 2), (5, 5, 2, 3), (1, 1), "SAME"),
         (1, 1, 1)),
    Case("nchw-same-8=3+3+2", Conv((8, 2, 6, 6), (2, 2, 2, 2), (1, 1), "SAME", "NCHW"),
         (3, 3, 2), (8,), (1,) * 8),
    Case("nhwc-same-s2-batch1", Conv((1, 12, 12, 8), (3, 3, 8, 8), (2, 2), "SAME"), (1,)),
    Case("nchw-explicit-s32-d21",
         Conv((5, 3, 11, 10), (2, 3, 3, 2), (3, 2), _pads((0, 2), (3, 1), channels_last=False),
              "NCHW", (2, 1)), (2, 2, 1)),
    Case("nchw-valid-s34-stride-beyond-filter",
         Conv((4, 2, 12, 9), (2, 2, 2, 3), (3, 4), "VALID", "NCHW"), (1, 3)),
    Case("nhwc-explicit-sym-7=1+4+2",
         Conv((7, 5, 5, 3), (3, 3, 3, 2), (1, 1), _pads((1, 1), (1, 1)), "NHWC"), (1, 4, 2)),
    Case("nhwc-same-s2-d2-auto", Conv((6, 9, 9, 3), (3, 3, 3, 4), (2, 2), "SAME", "NHWC", (2, 2)),
         ()),
    Case("nchw-same-auto", Conv((5, 4, 6, 7), (3, 2, 4, 2), (1, 2), "SAME", "NCHW"), (), (2, 3),
         ()),
]

CONV3D_CASES = [
    Case("ndhwc-same-5=2+3", Conv((5, 4, 5, 4, 2), (2, 3, 3, 2, 3), (1, 1, 1), "SAME", "NDHWC"),
         (2, 3)),
    Case("ndhwc-valid-s221-7=1+4+2",
         Conv((7, 5, 6, 5, 2), (3, 2, 2, 2, 2), (2, 2, 1), "VALID", "NDHWC"), (1, 4, 2), (7,),
         (3, 4)),
    Case("ncdhw-same-s212-ones", Conv((4, 2, 5, 5, 6), (3, 3, 3, 2, 3), (2, 1, 2), "SAME", "NCDHW"),
         (1, 1, 1, 1), (2, 2), (4,)),
    Case("ndhwc-explicit-asym-whole",
         Conv((3, 4, 5, 3, 2), (2, 3, 2, 2, 2), (1, 2, 1), _pads((1, 0), (0, 2), (2, 1)), "NDHWC"),
         (3,)),
    Case("ncdhw-explicit-asym-d221-5=2+3",
         Conv((5, 2, 6, 5, 6), (2, 2, 3, 2, 2), (1, 1, 2),
              _pads((1, 1), (0, 2), (1, 0), channels_last=False), "NCDHW", (2, 2, 1)), (2, 3),
         (5,), (1, 1, 3)),
    Case("ndhwc-same-d213", Conv((2, 6, 6, 6, 1), (2, 2, 2, 1, 2), (1, 1, 1), "SAME", "NDHWC",
                                 (2, 1, 3)), (1, 1)),
    Case("ncdhw-same-1x1x1-s233", Conv((3, 2, 5, 4, 6), (1, 1, 1, 2, 2), (2, 3, 3), "SAME",
                                       "NCDHW"), (2, 1)),
    Case("ndhwc-valid-d2-auto", Conv((4, 6, 5, 5, 2), (2, 2, 2, 2, 2), (1, 1, 1), "VALID", "NDHWC",
                                     (2, 2, 2)), ()),
]

# Grouped convolutions: the groups are the input's channels over the filter's; a depthwise one
# has one input channel per group.
GROUPED_CASES = [
    Case("grouped2-nhwc-same-5=2+3", Conv((5, 7, 7, 4), (3, 3, 2, 6), (1, 1), "SAME", "NHWC"),
         (2, 3)),
    Case("grouped3-nchw-same-s12-d21-6=1+5",
         Conv((6, 6, 9, 8), (3, 2, 2, 9), (1, 2), "SAME", "NCHW", (2, 1)), (1, 5), (6,), (3, 3)),
    Case("depthwise-nhwc-explicit-s2-4=1+3",
         Conv((4, 8, 7, 3), (3, 3, 1, 6), (2, 2), _pads((1, 2), (0, 1)), "NHWC"), (1, 3)),
    Case("depthwise-nchw-valid-whole", Conv((3, 4, 6, 6), (2, 2, 1, 4), (1, 1), "VALID", "NCHW"),
         (3,)),
    Case("grouped2-ndhwc-same-4=2+2",
         Conv((4, 4, 5, 4, 4), (2, 3, 2, 2, 4), (1, 1, 1), "SAME", "NDHWC"), (2, 2)),
    Case("depthwise-ncdhw-explicit-s212-3=1+2",
         Conv((3, 2, 5, 4, 6), (2, 2, 3, 1, 2), (2, 1, 2),
              _pads((1, 0), (0, 1), (1, 1), channels_last=False), "NCDHW"), (1, 2), (3,), (2, 1)),
]
