"""Keras convolution layers as `ConvLayer`s, and which ones tf_ucudnn's ops can run."""

from __future__ import annotations

import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer, UnsupportedConvolution


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

