"""A convolution, its bias and its activation as one op, with the convolution's micro-batch plan:

    fused_conv2d / fused_conv3d   <- tf.nn.conv2d / conv3d, then tf.nn.bias_add, then tf.nn.relu

On the GPU each micro-batch is one cudnnConvolutionBiasActivationForward call, so the bias and
the activation read and write no tensor of their own. The gradient is computed from the op's
output alone (ReLU's derivative is y > 0), so training keeps y and never the pre-activation; the
convolution's gradients run as tf_ucudnn's backprop ops with the plans the op carries for them.
"""

from __future__ import annotations

from typing import Optional, Union

import tensorflow as tf

from tf_ucudnn.core.plan import DIRECT, KernelPlan, LayerPlan
from tf_ucudnn.kernels.gradients import gradient_plan_attrs, gradient_workspace
from tf_ucudnn.kernels.library import op_library
from tf_ucudnn.kernels.ops import (
    Padding,
    as_layer_plan,
    conv_attrs,
    forward_plan_attrs,
    plan_workspaces,
    with_workspaces,
)

OP_TYPES = ("UcudnnFusedConv2D", "UcudnnFusedConv3D")

# The activations the op fuses, by the names the wrapper takes and the op's attribute values.
ACTIVATIONS = {"identity": "Identity", "relu": "Relu"}

# What the backprop ops take from the fused op as it is: the convolution's attributes.
_CONVOLUTION_ATTRS = ("strides", "padding", "explicit_paddings", "data_format", "dilations",
                      "plan_batch_size")


def plan_refusal(plan: LayerPlan) -> Optional[str]:
    """Why the fused op cannot run a layer planned so, if it cannot: cuDNN's fused call reads the
    input as it is, so a forward plan in another form stays with the unfused convolution."""
    if plan.forward.form != DIRECT:
        return (f"its forward plan runs in the {plan.forward.form} form (a stride-1 convolution "
                "on a copy of the input), which the fused op does not")
    return None


def _fused_conv(num_spatial, x, filters, bias, strides, padding, data_format, dilations,
                activation, plan, plan_batch_size, name):
    if not isinstance(activation, str) or activation.lower() not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    plan = as_layer_plan(plan)
    op = op_library().ucudnn_fused_conv2d if num_spatial == 2 else op_library().ucudnn_fused_conv3d
    output = op(x, filters, bias,
                **conv_attrs(num_spatial, strides, padding, data_format, dilations),
                activation=ACTIVATIONS[activation.lower()], **forward_plan_attrs(plan),
                plan_batch_size=-1 if plan_batch_size is None else plan_batch_size, name=name)
    return with_workspaces(output, plan_workspaces(plan))


def fused_conv2d(x, filters, bias, strides, padding: Padding, data_format: str = "NHWC",
                 dilations=None, activation: str = "relu",
                 plan: Union[LayerPlan, KernelPlan, None] = None, name: Optional[str] = None,
                 plan_batch_size: Optional[int] = None):
    """activation(tf.nn.conv2d(x, filters, ...) + bias), bias one value per output channel and
    activation "relu" or "identity", as one op. `strides`, `padding`, `dilations`, `plan` and
    `plan_batch_size` are as for `tf_ucudnn.conv2d`; a LayerPlan also plans the gradient."""
    return _fused_conv(2, x, filters, bias, strides, padding, data_format, dilations, activation,
                       plan, plan_batch_size, name)


def fused_conv3d(x, filters, bias, strides, padding: Padding, data_format: str = "NDHWC",
                 dilations=None, activation: str = "relu",
                 plan: Union[LayerPlan, KernelPlan, None] = None, name: Optional[str] = None,
                 plan_batch_size: Optional[int] = None):
    """fused_conv2d's 3-D form: activation(tf.nn.conv3d(x, filters, ...) + bias)."""
    return _fused_conv(3, x, filters, bias, strides, padding, data_format, dilations, activation,
                       plan, plan_batch_size, name)


def _fused_conv_grad(num_spatial):
    def grad_fn(op, dy):
        x, filters, _ = op.inputs
        if op.get_attr("activation") == b"Relu":
            # y > 0 exactly where the pre-activation is: the derivative needs y alone.
            dy = tf.raw_ops.ReluGrad(gradients=dy, features=op.outputs[0])
        attrs = {name: op.get_attr(name) for name in _CONVOLUTION_ATTRS}
        library = op_library()
        backprop_input, backprop_filter = (
            (library.ucudnn_conv2d_backprop_input, library.ucudnn_conv2d_backprop_filter)
            if num_spatial == 2 else
            (library.ucudnn_conv3d_backprop_input, library.ucudnn_conv3d_backprop_filter))
        channels_last = attrs["data_format"].endswith(b"C")
        return [
            with_workspaces(backprop_input(tf.shape(x), filters, dy, **attrs,
                                           **gradient_plan_attrs(op, "backprop_input_")),
                            gradient_workspace(op, "backprop_input_")),
            with_workspaces(backprop_filter(x, tf.shape(filters), dy, **attrs,
                                            **gradient_plan_attrs(op, "backprop_filter_")),
                            gradient_workspace(op, "backprop_filter_")),
            # BiasAddGrad's NCHW takes the channels from dimension 1 at any rank (NCDHW too).
            tf.raw_ops.BiasAddGrad(out_backprop=dy,
                                   data_format="NHWC" if channels_last else "NCHW"),
        ]
    return grad_fn


for _num_spatial, _op_type in zip((2, 3), OP_TYPES):
    tf.RegisterGradient(_op_type)(_fused_conv_grad(_num_spatial))
