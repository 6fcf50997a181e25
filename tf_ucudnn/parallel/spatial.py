"""Spatial parallelism: one sample's volume split into slabs along one spatial dimension, one slab
per device, and the layers of a 3-D (or 2-D) CNN computed slab by slab, as Oyama et al. do with
Distconv.

A convolution needs, for its outputs on one device, input rows that lie on the neighbouring
devices: the halo. Each device takes exactly the rows its outputs' windows cover (zeros where they
fall outside the volume, as SAME padding has it), slices of its neighbours' slabs that TensorFlow's
runtime copies across devices; no communication layer of our own. The rows whose windows lie
inside the device's own slab are convolved apart from the few that need the halo, so that the
interior is computed while the halo is in flight. Everything is made of differentiable TensorFlow
ops, so the backward pass (the halo's gradient sent back to its owner) comes from autodiff, and
the result equals the unpartitioned layer; each device's piece runs through `on_device`, so that
its gradient runs on that device too.

Tensors are channels-last (NHWC / NDHWC); the split dimension is the first spatial one (height,
or depth).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer, same_padding
from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import even_sizes as _even_sizes
from tf_ucudnn.core.plan import plan_or_reason
from tf_ucudnn.kernels import ops

SPLIT_AXIS = 1  # the first spatial dimension, channels-last


class SpatialSplitError(TfUcudnnError, ValueError):
    """A split the layer cannot use; says which device and why."""


def on_device(device: str, fn: Callable, *inputs):
    """`fn(*inputs)` on `device`, its gradient computed there too.

    TF2's GradientTape places each gradient op where `tape.gradient` runs, not beside its forward
    op (TF1's colocate_gradients_with_ops has no TF2 counterpart), which put a spatial split's
    whole backward pass on the first device. The tape also adds up a tensor's gradients from
    several readers there, so a tensor that lives on one device should be read by one such
    piece, which hands out what the others need (as `conv` does with halos). `fn` returns a
    tensor or a tuple of them; gradients reach only `inputs` (tensors or variables), so `fn`
    takes every tensor it differentiates through as an argument, not from a closure. The
    inputs are held until the piece's last op has run (custom_gradient's IdentityN reads them)."""
    inputs = [tf.convert_to_tensor(value) for value in inputs]

    @tf.custom_gradient
    def staged(*staged_inputs):
        with tf.device(device), tf.GradientTape(persistent=True,
                                                watch_accessed_variables=False) as tape:
            tape.watch(staged_inputs)
            outputs = fn(*staged_inputs)

        def gradient(*output_gradients):
            targets = tf.nest.flatten(outputs)
            with tf.device(device):
                # An output nobody read has no gradient: zeros (tape.gradient would take ones).
                output_gradients = [tf.zeros_like(target) if given is None else given
                                    for target, given in zip(targets, output_gradients)]
                return tape.gradient(targets, staged_inputs, output_gradients,
                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return outputs, gradient

    with tf.device(device):  # custom_gradient's IdentityN too, or it would pull the data over
        return staged(*inputs)


@dataclasses.dataclass
class Slabs:
    """A batch of volumes as slabs: `parts[i]` lives on `devices[i]` and holds rows
    [starts[i], starts[i + 1]) of the split dimension."""

    parts: list
    devices: tuple[str, ...]

    @property
    def sizes(self) -> list[int]:
        return [int(part.shape[SPLIT_AXIS]) for part in self.parts]

    @property
    def starts(self) -> list[int]:
        starts = [0]
        for size in self.sizes:
            starts.append(starts[-1] + size)
        return starts

    def map(self, fn, *tensors) -> "Slabs":
        """`fn(part, *tensors)` (an activation, a bias, ...) on each device, its gradient
        there too."""
        tensors = [tf.convert_to_tensor(value) for value in tensors]  # a variable read once
        return Slabs([on_device(device, fn, part, *tensors)
                      for device, part in zip(self.devices, self.parts)], self.devices)


def default_devices(count: int) -> list[str]:
    """`count` GPUs if there are that many, else logical CPUs."""
    for kind in ("GPU", "CPU"):
        devices = [d.name for d in tf.config.list_logical_devices(kind)]
        if len(devices) >= count:
            return devices[:count]
    raise SpatialSplitError(
        f"a spatial split over {count} devices needs {count} GPUs or logical CPUs; TensorFlow "
        f"sees {len(tf.config.list_logical_devices('GPU'))} GPU(s) and "
        f"{len(tf.config.list_logical_devices('CPU'))} CPU(s)")


def even_sizes(total: int, parts: int) -> list[int]:
    if not 1 <= parts <= total:
        raise SpatialSplitError(f"cannot split {total} rows over {parts} devices")
    return _even_sizes(total, parts)


def split(x, devices: Sequence[str], sizes: Optional[Sequence[int]] = None) -> Slabs:
    """`x` cut into slabs along the first spatial dimension, one per device."""
    sizes = list(sizes or even_sizes(int(x.shape[SPLIT_AXIS]), len(devices)))
    if sum(sizes) != x.shape[SPLIT_AXIS] or any(size <= 0 for size in sizes):
        raise SpatialSplitError(f"slab sizes {sizes} do not cover {x.shape[SPLIT_AXIS]} rows")
    parts, start = [], 0
    for device, size in zip(devices, sizes):
        # Cut where x is, so that each device receives only its own rows.
        parts.append(on_device(device, tf.identity, _rows(x, start, start + size)))
        start += size
    return Slabs(parts, tuple(devices))


def from_parts(parts: Sequence, devices: Sequence[str]) -> Slabs:
    """Slabs already cut (a loader's, say), each moved to its device."""
    if len(parts) != len(devices):
        raise SpatialSplitError(f"{len(parts)} slabs for {len(devices)} devices")
    return Slabs([on_device(device, tf.identity, part) for device, part in zip(devices, parts)],
                  tuple(devices))


def gather(slabs: Slabs, device: Optional[str] = None):
    """The whole tensor again, on `device` (default: the first slab's)."""
    return on_device(device or slabs.devices[0], lambda *parts: tf.concat(parts, SPLIT_AXIS),
                     *slabs.parts)


def _rows(x, begin: int, end: int):
    if (begin, end) == (0, x.shape[SPLIT_AXIS]):
        return x  # no Slice op: the liveness analysis would count a copy TensorFlow skips
    begin_index = [0] * len(x.shape)
    size = [-1] * len(x.shape)
    begin_index[SPLIT_AXIS], size[SPLIT_AXIS] = begin, end - begin
    return tf.slice(x, begin_index, size)


def _halo_rows(slabs: Slabs, index: int, begin: int, end: int, layer: str) -> list:
    """The rows [low, high) of the volume that device `index` needs from each other device, as
    (owner, low, high): of the volume's rows [begin, end), those outside its own slab."""
    starts, halos = slabs.starts, []
    for owner in range(len(slabs.parts)):
        low, high = max(begin, starts[owner]), min(end, starts[owner + 1])
        if owner == index or low >= high:
            continue
        if abs(owner - index) > 1:
            raise SpatialSplitError(
                f"{layer}: device {index} ({slabs.devices[index]}) needs rows {low}-{high - 1} "
                f"of device {owner}, beyond its neighbours: the slabs ({slabs.sizes} rows) are "
                "thinner than the layer's halo; use fewer devices or a larger volume")
        halos.append((owner, low, high))
    return halos


def _hand_out_halos(slabs: Slabs, wanted: Sequence[list]) -> tuple[list, list]:
    """Each slab and, cut on its own device so that only those rows cross, the halos the
    others want (`wanted[i]`: device i's `_halo_rows`): (each device's slab, each device's
    halos as (first row, rows) pairs). One piece per slab reads it, so the slab's gradients
    (its own and its halos') are added up on its device."""
    cuts = [[] for _ in slabs.parts]  # per owner: (reader, low, high)
    for reader, rows in enumerate(wanted):
        for owner, low, high in rows:
            cuts[owner].append((reader, low, high))
    owns, halos = [], [[] for _ in slabs.parts]
    for owner, (device, part, start) in enumerate(zip(slabs.devices, slabs.parts,
                                                      slabs.starts)):
        handed = on_device(device, lambda part: (part, *[
            _rows(part, low - start, high - start) for _, low, high in cuts[owner]]), part)
        owns.append(handed[0])
        for (reader, low, _), rows in zip(cuts[owner], handed[1:]):
            halos[reader].append((low, rows))
    return owns, halos


def _window_rows(segments: list, begin: int, end: int, volume_rows: int, template):
    """Rows [begin, end) of the whole volume, zeros outside it, from `segments` ((first row,
    rows) pairs that cover them, on the current device)."""
    pieces = [_zeros_like_rows(template, -begin)] if begin < 0 else []
    for start, rows in sorted(segments, key=lambda segment: segment[0]):
        stop = start + int(rows.shape[SPLIT_AXIS])
        low, high = max(begin, start), min(end, stop)
        if low < high:
            pieces.append(rows if (low, high) == (start, stop)
                          else _rows(rows, low - start, high - start))
    if end > volume_rows:
        pieces.append(_zeros_like_rows(template, end - volume_rows))
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=SPLIT_AXIS)


def _zeros_like_rows(template, rows: int):
    shape = tf.unstack(tf.shape(template))
    shape[SPLIT_AXIS] = rows
    return tf.zeros(tf.stack(shape), template.dtype)


# Values per cuDNN call at most (input or output): cuDNN's tensor descriptors take fewer than
# 2^31, and its 3-D backward-filter algorithms find no workspace for much more than this.
MAX_CALL_ELEMENTS = 1 << 28


def conv(slabs: Slabs, filters, strides=1, padding: str = "SAME", dilations=1,
         out_sizes: Optional[Sequence[int]] = None, name: str = "spatial_conv",
         planner: Optional[Callable] = None,
         max_call_elements: int = MAX_CALL_ELEMENTS) -> Slabs:
    """Conv2D/Conv3D (by the filter's rank) of the volume in slabs; equal to the unpartitioned
    layer. `out_sizes` sets the output rows per device (default: as even as possible).
    `planner` (a ConvLayer -> LayerPlan or reason callable, as `tf_ucudnn.rewrite` takes) plans
    each device's part, micro-batches and all; a reason leaves that part to cuDNN's choice.
    A device's rows are convolved in chunks of at most `max_call_elements` input and output
    values each (ooc_cuDNN's division of the feature map), so that one sample too large for a
    single cuDNN call still runs."""
    filters = tf.convert_to_tensor(filters)  # read once, not once per device
    spatial = len(filters.shape) - 2
    strides = [strides] * spatial if isinstance(strides, int) else list(strides)
    dilations = [dilations] * spatial if isinstance(dilations, int) else list(dilations)
    kernel, stride, dilation = int(filters.shape[0]), strides[0], dilations[0]
    size = slabs.starts[-1]
    padding = padding.upper()
    if padding == "SAME":
        before, after = same_padding(size, kernel, stride, dilation)
    elif padding == "VALID":
        before = after = 0
    else:
        raise ValueError(f"{name}: padding must be SAME or VALID, got {padding!r}")
    out_total = (size + before + after - ((kernel - 1) * dilation + 1)) // stride + 1
    out_sizes = list(out_sizes or even_sizes(out_total, len(slabs.parts)))
    # The other spatial dimensions are whole on every device: pad them as the layer says.
    other_pads = []
    for axis in range(1, spatial):
        full = int(slabs.parts[0].shape[SPLIT_AXIS + axis])
        other_pads.append(same_padding(full, int(filters.shape[axis]), strides[axis],
                                       dilations[axis]) if padding == "SAME" else (0, 0))
    convolve = ops.conv2d if spatial == 2 else ops.conv3d

    def run(rows, filters):
        pads = [[0, 0], [0, 0], *[list(p) for p in other_pads], [0, 0]]
        attrs = dict(strides=[1, *strides, 1], dilations=[1, *dilations, 1])
        plan = None
        if planner is not None:
            plan = plan_or_reason(planner, ConvLayer(
                name=name, op_type=f"Conv{spatial}D", input_shape=tuple(rows.shape),
                filter_shape=tuple(filters.shape), strides=tuple(attrs["strides"]),
                dilations=tuple(attrs["dilations"]), padding="EXPLICIT",
                explicit_paddings=tuple(v for pair in pads for v in pair),
                data_format="NHWC" if spatial == 2 else "NDHWC", dtype=rows.dtype.name,
                groups=int(rows.shape[-1]) // int(filters.shape[-2])))
        # The rows were taken to give exactly the device's outputs.
        return convolve(rows, filters, padding=pads, plan=None if isinstance(plan, str) else plan,
                        **attrs)

    reach = (kernel - 1) * dilation + 1
    # Per row of the split dimension; a batch unknown until run time counts as one sample.
    row_shape = [d or 1 for i, d in enumerate(slabs.parts[0].shape.as_list()) if i != SPLIT_AXIS]
    in_row_values = math.prod(row_shape)
    out_row_values = in_row_values // row_shape[-1] * int(filters.shape[-1])
    chunk = max(1, max_call_elements // max(out_row_values, stride * in_row_values))
    starts, bounds, out_start = slabs.starts, [], 0
    for index, count in enumerate(out_sizes):
        first, last = out_start, out_start + count  # output rows [first, last)
        out_start = last
        # Outputs whose windows stay inside the own slab (or the padding beside it, at the ends
        # of the volume) need no halo.
        own_low = starts[index] if index > 0 else -before
        own_high = starts[index + 1] if index < len(out_sizes) - 1 else starts[-1] + after
        inner_first = max(first, -(-(own_low + before) // stride))
        inner_last = min(last, (own_high - reach + before) // stride + 1)
        if inner_first >= inner_last:
            inner_first = inner_last = first
        bounds.append((first, inner_first, inner_last, last))
    owns, halos = _hand_out_halos(slabs, [
        _halo_rows(slabs, index, first * stride - before, (last - 1) * stride - before + reach,
                   name) for index, (first, _, _, last) in enumerate(bounds)])
    parts = []
    for index, (device, (first, inner_first, inner_last, last)) in enumerate(
            zip(slabs.devices, bounds)):

        # Called at once by on_device: the loop's variables are this device's.
        def device_part(own, filters, *halo_rows):
            segments = [(starts[index], own),
                        *zip([start for start, _ in halos[index]], halo_rows)]
            pieces = []
            for a, b in ((first, inner_first), (inner_first, inner_last), (inner_last, last)):
                for low in range(a, b, chunk):
                    high = min(b, low + chunk)
                    rows = _window_rows(segments, low * stride - before,
                                        (high - 1) * stride - before + reach, size, own)
                    pieces.append(run(rows, filters))
            return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=SPLIT_AXIS)

        with tf.name_scope(f"{name}_{index}"):
            parts.append(on_device(device, device_part, owns[index], filters,
                                   *[rows for _, rows in halos[index]]))
    return Slabs(parts, slabs.devices)


def pool(slabs: Slabs, window: int, kind: str = "MAX", name: str = "spatial_pool",
         max_call_elements: int = MAX_CALL_ELEMENTS) -> Slabs:
    """Non-overlapping pooling (window = stride, VALID) in every spatial dimension; each slab must
    hold whole windows. A slab is pooled in chunks of whole windows of at most
    `max_call_elements` input values (as the convolutions: cuDNN's pooling refuses 2^31)."""
    if any(size % window for size in slabs.sizes):
        raise SpatialSplitError(f"{name}: slabs of {slabs.sizes} rows do not hold whole "
                                f"{window}-row pooling windows; choose slab sizes divisible by "
                                f"{window}")
    spatial = len(slabs.parts[0].shape) - 2
    row_values = math.prod(d or 1 for i, d in enumerate(slabs.parts[0].shape.as_list())
                           if i != SPLIT_AXIS)
    rows_per_call = max(1, max_call_elements // (row_values * window)) * window

    def run(part):
        size = int(part.shape[SPLIT_AXIS])
        pieces = [tf.nn.pool(_rows(part, low, min(size, low + rows_per_call)), [window] * spatial,
                             kind, strides=[window] * spatial, padding="VALID")
                  for low in range(0, size, rows_per_call)]
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=SPLIT_AXIS)

    return slabs.map(run)


def batch_norm(slabs: Slabs, gamma, beta, epsilon: float = 1e-3) -> Slabs:
    """Batch normalization with statistics over the whole volumes (all slabs), as in training."""
    axes = list(range(len(slabs.parts[0].shape) - 1))
    parts, moments, counts = [], [], []
    for device, part in zip(slabs.devices, slabs.parts):
        # One piece reads the slab and hands it on with its moments (see on_device).
        part, sums = on_device(device, lambda part: (part, tf.stack(
            [tf.reduce_sum(part, axes), tf.reduce_sum(tf.square(part), axes)])), part)
        parts.append(part)
        moments.append(sums)
        with tf.device(device):
            counts.append(tf.cast(tf.reduce_prod(tf.shape(part)[:-1]), part.dtype))
    with tf.device(slabs.devices[0]):
        count = tf.add_n(counts)
        mean, mean_square = tf.unstack(tf.add_n(moments) / count)
        variance = mean_square - tf.square(mean)
        scale = gamma * tf.math.rsqrt(variance + epsilon)
        shift = beta - mean * scale
    return Slabs(parts, slabs.devices).map(lambda part, scale, shift: part * scale + shift,
                                           scale, shift)
