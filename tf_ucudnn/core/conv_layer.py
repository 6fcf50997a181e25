"""One convolution layer as plain data, in TensorFlow's own terms: what the profiler measures, the
planners plan for, and the passes rewrite.

A `ConvLayer`'s `cudnn_geometry()` is what cuDNN actually runs: TensorFlow's padding may be
asymmetric (SAME with an odd total, or explicit pairs) while cuDNN pads symmetrically, so
tf_ucudnn's kernels pad the input by the difference first, and the geometry cuDNN sees has that
larger input.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.geometry import ConvGeometry


def same_padding(size: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """(before, after) padding of one dimension under SAME, as TensorFlow computes it."""
    effective = (kernel - 1) * dilation + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + effective - size, 0)
    return total // 2, total - total // 2


@dataclasses.dataclass(frozen=True)
class ConvLayer:
    """One forward convolution of a graph, in TensorFlow's own terms. A grouped convolution's
    filter has the input's channels / `groups` (a depthwise one, as a grouped convolution, has
    `groups` equal to the input's channels and one input channel per group)."""

    name: str
    op_type: str
    input_shape: tuple[int, ...]  # in data_format order, batch first
    filter_shape: tuple[int, ...]  # spatial..., in_channels / groups, out_channels
    strides: tuple[int, ...]  # over all dims, in data_format order, as the op's attribute
    dilations: tuple[int, ...]
    padding: str  # SAME, VALID or EXPLICIT
    explicit_paddings: tuple[int, ...]
    data_format: str
    dtype: str
    groups: int = 1
    # Whether training computes the gradient of the layer's input: not where no variable feeds
    # the input (the model's images, padded or scaled), so its input-gradient kernel never runs.
    input_gradient: bool = True

    def __post_init__(self):
        channels = self.input_shape[-1 if self.channels_last else 1]
        if channels != self.filter_shape[-2] * self.groups:
            raise UnsupportedConvolution(
                f"{self.name}: an input of {channels} channels and a filter for "
                f"{self.filter_shape[-2]} are not {self.groups} group(s)")

    @property
    def num_spatial_dims(self) -> int:
        return len(self.filter_shape) - 2

    @property
    def channels_last(self) -> bool:
        return self.data_format.endswith("C")

    def _spatial(self, values) -> tuple[int, ...]:
        nd = self.num_spatial_dims
        return tuple(values[1:1 + nd] if self.channels_last else values[2:2 + nd])

    @property
    def batch_size(self) -> int:
        return self.input_shape[0]

    @property
    def input_spatial(self) -> tuple[int, ...]:
        return self._spatial(self.input_shape)

    def pads(self) -> list[tuple[int, int]]:
        """(before, after) padding per spatial dim, as TensorFlow computes it."""
        strides, dilations = self._spatial(self.strides), self._spatial(self.dilations)
        if self.padding == "EXPLICIT":
            pairs = list(zip(self.explicit_paddings[::2], self.explicit_paddings[1::2]))
            return self._spatial(pairs)
        return [same_padding(size, k, s, d) if self.padding == "SAME" else (0, 0)
                for size, k, s, d in zip(self.input_spatial, self.filter_shape, strides,
                                         dilations)]

    def output_spatial(self) -> tuple[int, ...]:
        strides, dilations = self._spatial(self.strides), self._spatial(self.dilations)
        return tuple((size + before + after - ((k - 1) * d + 1)) // s + 1
                     for size, k, s, d, (before, after) in zip(
                         self.input_spatial, self.filter_shape, strides, dilations, self.pads()))

    def cudnn_geometry(self) -> ConvGeometry:
        """The convolution cuDNN runs for this layer (see the module's docstring)."""
        pads = self.pads()
        symmetric = tuple(min(before, after) for before, after in pads)
        padded = tuple(size + before + after - 2 * sym
                       for size, (before, after), sym in zip(self.input_spatial, pads, symmetric))
        return ConvGeometry(
            in_channels=self.filter_shape[-2] * self.groups, out_channels=self.filter_shape[-1],
            input_dims=padded, filter_dims=self.filter_shape[:-2], pads=symmetric,
            strides=self._spatial(self.strides), dilations=self._spatial(self.dilations),
            dtype=self.dtype, layout=self.data_format, groups=self.groups)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class UnsupportedConvolution(TfUcudnnError, ValueError):
    """A convolution op this package cannot plan for; the message names it and says why."""


def conv_groups(name: str, input_channels, filter_channels, output_channels) -> Optional[int]:
    """The groups of a convolution, as TensorFlow's Conv2D takes them: the input's channels over
    the filter's, which must divide them, as the groups must divide the output's channels (None
    where a count is unknown). Channels that do not divide are refused, naming the op."""
    if None in (input_channels, filter_channels, output_channels):
        return None
    if filter_channels <= 0 or input_channels % filter_channels:
        raise UnsupportedConvolution(
            f"{name}: the input's {input_channels} channels are not a multiple of the filter's "
            f"{filter_channels} input channels (a grouped convolution's filter has the input's "
            "channels / groups)")
    groups = input_channels // filter_channels
    if output_channels % groups:
        raise UnsupportedConvolution(
            f"{name}: the filter's {output_channels} output channels are not a multiple of its "
            f"{groups} groups ({input_channels} input channels / {filter_channels})")
    return groups
