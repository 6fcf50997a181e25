"""Keras convolution layers as `ConvLayer`s, which ones tf_ucudnn's ops can run, and switching a
layer's convolution to another op.

Conv2D and Conv3D, grouped or not, call their `convolution_op` method; DepthwiseConv2D has none,
so it runs its convolution through a `call` of the same steps as Conv2D's (convolution, bias,
activation). A layer with a bias and a ReLU or no activation can instead run all three as one
fused op, its `call` switched (`switch_fused_call`). A depthwise layer is the convolution grouped
by its input channels, its kernel [kh, kw, C, M] as [kh, kw, 1, C * M] (TensorFlow orders its
outputs channel c * M + m).
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer, UnsupportedConvolution
from tf_ucudnn.graph.conv_layers import DEPTHWISE, grouped_filter_shape
from tf_ucudnn.kernels.ops import depthwise_filter


def _is_depthwise(layer) -> bool:
    import keras

    return type(layer) is keras.layers.DepthwiseConv2D


def check_keras_convolution(layer) -> None:
    """Raises UnsupportedConvolution, naming the layer and why, for a Keras convolution layer
    tf_ucudnn has no op for."""
    import keras

    name = getattr(layer, "path", layer.name)
    if _is_depthwise(layer):
        return
    if not isinstance(layer, (keras.layers.Conv2D, keras.layers.Conv3D)) or \
            type(layer).convolution_op is not keras.layers.Conv2D.convolution_op:
        raise UnsupportedConvolution(
            f"{name}: {type(layer).__name__} is not a Keras Conv2D or Conv3D, nor a "
            "DepthwiseConv2D (tf_ucudnn has 2-D and 3-D convolution ops, grouped or not, without "
            "transposed, separable or custom variants)")


def keras_conv_layer(layer, input_shape, dtype, input_gradient: bool = True) -> ConvLayer:
    """The ConvLayer of a Keras Conv2D/Conv3D/DepthwiseConv2D layer applied to an input of
    `input_shape` (whose gradient training computes, unless `input_gradient` is False)."""
    check_keras_convolution(layer)
    rank = layer.rank
    channels_last = layer.data_format == "channels_last"
    data_format = ("NHWC" if rank == 2 else "NDHWC") if channels_last else \
        ("NCHW" if rank == 2 else "NCDHW")

    def full(values):
        return (1, *values, 1) if channels_last else (1, 1, *values)

    filter_shape = [int(d) for d in layer.kernel.shape]
    if _is_depthwise(layer):
        filter_shape = grouped_filter_shape(filter_shape)
    input_channels = int(input_shape[-1 if channels_last else 1])
    return ConvLayer(
        name=getattr(layer, "path", layer.name),
        op_type=DEPTHWISE if _is_depthwise(layer) else f"Conv{rank}D",
        input_shape=tuple(int(d) for d in input_shape), filter_shape=tuple(filter_shape),
        strides=full(layer.strides), dilations=full(layer.dilation_rate),
        padding=layer.padding.upper(), explicit_paddings=(), data_format=data_format,
        dtype=tf.as_dtype(dtype).name, groups=input_channels // filter_shape[-2],
        input_gradient=input_gradient)


def conv_filter(layer, kernel):
    """The layer's kernel as the filter of tf_ucudnn's convolution ops."""
    return depthwise_filter(kernel) if _is_depthwise(layer) else kernel


def own_convolution(layer):
    """The layer's own convolution, (inputs, kernel) -> outputs."""
    if not _is_depthwise(layer):
        return type(layer).convolution_op.__get__(layer)
    import keras

    def depthwise_convolution(inputs, kernel):
        return keras.ops.depthwise_conv(inputs, kernel, strides=layer.strides,
                                        padding=layer.padding,
                                        dilation_rate=layer.dilation_rate,
                                        data_format=layer.data_format)
    return depthwise_convolution


def switch_convolution(layer, convolution_op) -> None:
    """Runs the layer with `convolution_op` (inputs, kernel) -> outputs as its convolution, or
    with its own convolution and `call` again for None. An instance attribute shadows the
    class's method; deleting it restores the method."""
    name = "call" if _is_depthwise(layer) else "convolution_op"
    if convolution_op is None:
        layer.__dict__.pop("convolution_op", None)
        layer.__dict__.pop("call", None)
    elif _is_depthwise(layer):
        layer.__dict__[name] = _depthwise_call(layer, convolution_op)
    else:
        layer.__dict__[name] = convolution_op


def _depthwise_call(layer, convolution_op):
    """DepthwiseConv2D's `call`, with `convolution_op` as its convolution."""
    import keras

    def call(inputs):
        outputs = convolution_op(inputs, layer.kernel)
        if layer.use_bias:
            channels = int(layer.bias.shape[0])
            shape = (1, 1, 1, channels) if layer.data_format == "channels_last" else \
                (1, channels, 1, 1)
            outputs = keras.ops.add(outputs, keras.ops.reshape(layer.bias, shape))
        return outputs if layer.activation is None else layer.activation(outputs)
    return call


def fusion_refusal(layer) -> Optional[str]:
    """Why a Keras convolution layer cannot run its convolution, bias and activation as one
    fused op (which adds a bias and applies a ReLU or nothing), or None where it can."""
    import keras

    if not layer.use_bias:
        return "no bias (use_bias=False): nothing to fuse with the convolution"
    if layer.activation not in (keras.activations.relu, keras.activations.linear):
        name = getattr(layer.activation, "__name__", type(layer.activation).__name__)
        return f"its activation {name} is neither relu nor linear, the ones the fused op applies"
    return None


def fused_activation(layer) -> str:
    """The fused op's activation for a layer `fusion_refusal` accepts."""
    import keras

    return "relu" if layer.activation is keras.activations.relu else "identity"


def switch_fused_call(layer, fused_op) -> None:
    """Runs the layer's `call` as `fused_op(inputs, kernel, bias)`, its convolution, bias and
    activation in one; `switch_convolution(layer, None)` gives the layer its own back."""
    layer.__dict__["call"] = lambda inputs: fused_op(inputs, layer.kernel, layer.bias)
