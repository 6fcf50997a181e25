"""The convolutions of a TensorFlow graph, as plain data: what the profiler measures and the
optimizer plans for.

A `ConvLayer` is one Conv2D/Conv3D op with its shapes and attributes in TensorFlow's terms. Its
`cudnn_geometry()` is what cuDNN actually runs: TensorFlow's padding may be asymmetric (SAME with
an odd total, or explicit pairs) while cuDNN pads symmetrically, so tf_ucudnn's kernels pad the
input by the difference first, and the geometry cuDNN sees has that larger input.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import tensorflow as tf

from tf_ucudnn.profiling.records import ConvGeometry

# TensorFlow's forward convolution ops this package can replace, by number of spatial dims.
CONV_OP_TYPES = {"Conv2D": 2, "Conv3D": 3}


def same_padding(size: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """(before, after) padding of one dimension under SAME, as TensorFlow computes it."""
    effective = (kernel - 1) * dilation + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + effective - size, 0)
    return total // 2, total - total // 2


@dataclasses.dataclass(frozen=True)
class ConvLayer:
    """One forward convolution of a graph, in TensorFlow's own terms."""

    name: str
    op_type: str
    input_shape: tuple[int, ...]  # in data_format order, batch first
    filter_shape: tuple[int, ...]  # spatial..., in_channels, out_channels
    strides: tuple[int, ...]  # over all dims, in data_format order, as the op's attribute
    dilations: tuple[int, ...]
    padding: str  # SAME, VALID or EXPLICIT
    explicit_paddings: tuple[int, ...]
    data_format: str
    dtype: str

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
            in_channels=self.filter_shape[-2], out_channels=self.filter_shape[-1],
            input_dims=padded, filter_dims=self.filter_shape[:-2], pads=symmetric,
            strides=self._spatial(self.strides), dilations=self._spatial(self.dilations),
            dtype=self.dtype, layout=self.data_format)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class UnsupportedConvolution(ValueError):
    """A convolution op this package cannot plan for; the message names it and says why."""


def conv_layer_of(op: tf.Operation) -> ConvLayer:
    """The ConvLayer of a Conv2D/Conv3D op whose input and filter shapes are fully known."""
    if op.type not in CONV_OP_TYPES:
        raise UnsupportedConvolution(f"{op.name}: {op.type} is not one of {sorted(CONV_OP_TYPES)}")
    input_shape, filter_shape = op.inputs[0].shape, op.inputs[1].shape
    if not input_shape.is_fully_defined() or not filter_shape.is_fully_defined():
        raise UnsupportedConvolution(
            f"{op.name}: input shape {input_shape} or filter shape {filter_shape} is not fully "
            "known; give the batch size and input shape when tracing the model")
    data_format = op.get_attr("data_format").decode()
    channel_dim = -1 if data_format.endswith("C") else 1
    if input_shape[channel_dim] != filter_shape[-2]:
        raise UnsupportedConvolution(
            f"{op.name}: grouped convolution ({input_shape[channel_dim]} input channels, filter "
            f"for {filter_shape[-2]}) is not supported")
    attr = {a.name for a in op.op_def.attr}
    return ConvLayer(
        name=op.name, op_type=op.type,
        input_shape=tuple(input_shape.as_list()), filter_shape=tuple(filter_shape.as_list()),
        strides=tuple(op.get_attr("strides")),
        dilations=tuple(op.get_attr("dilations")),
        padding=op.get_attr("padding").decode(),
        explicit_paddings=tuple(op.get_attr("explicit_paddings")) if "explicit_paddings" in attr
        else (),
        data_format=data_format, dtype=op.get_attr("T").name)


def check_keras_convolution(layer) -> None:
    """Raises UnsupportedConvolution, naming the layer and why, for a Keras convolution layer
    tf_ucudnn has no op for."""
    import keras

    name = getattr(layer, "path", layer.name)
    if not isinstance(layer, (keras.layers.Conv2D, keras.layers.Conv3D)) or \
            type(layer).convolution_op is not keras.layers.Conv2D.convolution_op:
        raise UnsupportedConvolution(
            f"{name}: {type(layer).__name__} is not a Keras Conv2D or Conv3D (tf_ucudnn has "
            "2-D and 3-D convolution ops, without transposed, depthwise or custom variants)")
    if layer.groups != 1:
        raise UnsupportedConvolution(f"{name}: grouped convolution (groups={layer.groups}) is "
                                     "not supported")


def keras_conv_layer(layer, input_shape, dtype) -> ConvLayer:
    """The ConvLayer of a Keras Conv2D/Conv3D layer applied to an input of `input_shape`."""
    check_keras_convolution(layer)
    rank = layer.rank
    channels_last = layer.data_format == "channels_last"
    data_format = ("NHWC" if rank == 2 else "NDHWC") if channels_last else \
        ("NCHW" if rank == 2 else "NCDHW")

    def full(values):
        return (1, *values, 1) if channels_last else (1, 1, *values)

    return ConvLayer(
        name=getattr(layer, "path", layer.name), op_type=f"Conv{rank}D",
        input_shape=tuple(int(d) for d in input_shape),
        filter_shape=tuple(int(d) for d in layer.kernel.shape),
        strides=full(layer.strides), dilations=full(layer.dilation_rate),
        padding=layer.padding.upper(), explicit_paddings=(), data_format=data_format,
        dtype=tf.as_dtype(dtype).name)


def find_conv_layers(graph: tf.Graph) -> tuple[list[ConvLayer], list[tuple[str, str]]]:
    """The convolutions of a graph, and (op name, reason) for each one left out."""
    layers, skipped = [], []
    for op in graph.get_operations():
        if op.type not in CONV_OP_TYPES:
            continue
        try:
            layers.append(conv_layer_of(op))
        except UnsupportedConvolution as error:
            skipped.append((op.name, str(error)))
    return layers, skipped


def trace_model(model: tf.keras.Model, batch_size: int,
                dtype: Optional[tf.DType] = None) -> tf.Graph:
    """The inference graph of a Keras model for one batch size (its forward pass, traced)."""
    inputs = model.inputs if isinstance(model.inputs, (list, tuple)) else [model.inputs]
    specs = [tf.TensorSpec([batch_size, *x.shape[1:]], dtype or x.dtype) for x in inputs]
    function = tf.function(lambda *args: model(list(args) if len(args) > 1 else args[0],
                                               training=False))
    return function.get_concrete_function(*specs).graph


def unique_geometries(layers: Iterable[ConvLayer]) -> dict[ConvGeometry, list[str]]:
    """Distinct cuDNN geometries, each with the layers that share it (profiled once)."""
    result: dict[ConvGeometry, list[str]] = {}
    for layer in layers:
        result.setdefault(layer.cudnn_geometry(), []).append(layer.name)
    return result
