"""The convolution layers the Keras callback plans, and the ops it switches each one to: one that
records the shape of the layer's input, one that runs the layer's plan, and one that runs the plan
fused with the layer's bias and activation. Each op runs the layer's own convolution for an input
of another shape than the plan's (a last, partial batch)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import keras
import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.plan import LayerPlan
from tf_ucudnn.graph.conv_layers import fed_by_variables
from tf_ucudnn.keras.layers import conv_filter, own_convolution
from tf_ucudnn.kernels import fused_conv, ops

CONVOLUTION_TYPES = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
                     keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                     keras.layers.Conv3DTranspose, keras.layers.DepthwiseConv1D,
                     keras.layers.DepthwiseConv2D, keras.layers.SeparableConv1D,
                     keras.layers.SeparableConv2D)


def convolution_layers(model: keras.Model) -> list:
    """Every convolution layer of the model, nested models included, each once."""
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, CONVOLUTION_TYPES)]


@dataclasses.dataclass
class PatchedLayer:
    layer: keras.layers.Layer
    observed_shape: tf.Variable  # the input shape of the layer's last call, written by the step
    first_shape: Optional[tuple] = None  # `observed_shape` after the first step, read back
    traced_shape: Optional[tuple] = None  # the input's static shape where a trace knew it
    # False where the traced step's input to the layer has no variable upstream (its input
    # gradient never runs); True until a trace says so.
    input_gradient: bool = True
    conv_layer: Optional[ConvLayer] = None
    plan: Optional[LayerPlan] = None
    # Under a memory budget: each kernel's Pareto front of plans, and the names of the forward
    # ops traced with the plan (to tell which layer an op at the peak is).
    fronts: dict = dataclasses.field(default_factory=dict)
    forward_ops: set = dataclasses.field(default_factory=set)

    @classmethod
    def of(cls, layer: keras.layers.Layer) -> "PatchedLayer":
        return cls(layer, tf.Variable(tf.zeros([layer.rank + 2], tf.int64), trainable=False,
                                      name="ucudnn_observed_shape"))


def recording_op(patched: PatchedLayer):
    """The layer's own convolution, noting its input's shape (static where traced, and as run)."""
    own_op = own_convolution(patched.layer)

    def convolution_op(inputs, kernel):
        if inputs.shape.is_fully_defined():
            patched.traced_shape = tuple(inputs.shape)
        patched.input_gradient = fed_by_variables(inputs)
        record = patched.observed_shape.assign(tf.shape(inputs, out_type=tf.int64))
        with tf.control_dependencies([record]):
            return own_op(inputs, kernel)
    return convolution_op


def planned_op(patched: PatchedLayer):
    """tf_ucudnn's convolution with the layer's plan."""
    own_op = own_convolution(patched.layer)
    layer, plan = patched.conv_layer, patched.plan
    conv = ops.conv2d if layer.num_spatial_dims == 2 else ops.conv3d

    def convolution_op(inputs, kernel):
        if inputs.shape.is_fully_defined() and tuple(inputs.shape) != layer.input_shape:
            return own_op(inputs, kernel)
        # Traced with the batch unknown, the op itself runs another batch size undivided:
        # XLA would compile both branches of a tf.cond, the plan's at the wrong batch too.
        output = conv(inputs, conv_filter(patched.layer, kernel), strides=list(layer.strides),
                      padding=layer.padding, data_format=layer.data_format,
                      dilations=list(layer.dilations), plan=plan,
                      plan_batch_size=layer.batch_size)
        if not tf.executing_eagerly():
            patched.forward_ops.add(output.op.name)
        return output
    return convolution_op


def fused_op(patched: PatchedLayer, activation: str):
    """The layer's convolution with its plan, its bias and `activation` as one op:
    (inputs, kernel, bias) -> outputs."""
    own_call = type(patched.layer).call.__get__(patched.layer)
    layer, plan = patched.conv_layer, patched.plan
    fused = fused_conv.fused_conv2d if layer.num_spatial_dims == 2 else fused_conv.fused_conv3d

    def convolution_bias_activation(inputs, kernel, bias):
        if inputs.shape.is_fully_defined() and tuple(inputs.shape) != layer.input_shape:
            return own_call(inputs)  # another shape: the layer's own steps
        return fused(inputs, conv_filter(patched.layer, kernel), bias,
                     strides=list(layer.strides), padding=layer.padding,
                     data_format=layer.data_format, dilations=list(layer.dilations),
                     activation=activation, plan=plan, plan_batch_size=layer.batch_size)
    return convolution_bias_activation
