"""The micro-batched convolution ops, with Python wrappers in the manner of `tf.nn`.

Each op mirrors a TensorFlow convolution op and carries a plan (see `tf_ucudnn.core.plan`):

    conv2d / conv3d                        <- tf.nn.conv2d / tf.nn.conv3d
    conv2d_backprop_input / conv3d_...     <- tf.raw_ops.Conv2DBackpropInput / Conv3DBackpropInputV2
    conv2d_backprop_filter / conv3d_...    <- tf.raw_ops.Conv2DBackpropFilter / Conv3DBackpropFilterV2

As TensorFlow's Conv2D, each takes the groups of a grouped convolution from the shapes: a filter
of in_channels / groups input channels. A depthwise convolution (`tf.nn.depthwise_conv2d`, filter
[kh, kw, C, M]) is the grouped one with groups = C and the filter reshaped to [kh, kw, 1, C * M]
(`depthwise_filter`): TensorFlow orders its outputs channel c * M + m, as groups are ordered.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_ucudnn.core.conv_layer import conv_groups
from tf_ucudnn.core.plan import KernelPlan, LayerPlan, workspace_attr
from tf_ucudnn.kernels.library import op_library

OP_TYPES = (
    "UcudnnConv2D", "UcudnnConv2DBackpropInput", "UcudnnConv2DBackpropFilter",
    "UcudnnConv3D", "UcudnnConv3DBackpropInput", "UcudnnConv3DBackpropFilter",
)


Padding = Union[str, Sequence[Sequence[int]]]


def _sequence(value, num_spatial: int, data_format: str, name: str) -> list[int]:
    """Expands an int or a spatial-only list to TensorFlow's full-rank form, as tf.nn does."""
    rank = num_spatial + 2
    if isinstance(value, int):
        value = [value]
    value = [int(v) for v in value]
    if len(value) == rank:
        return value
    if len(value) == 1:
        value = value * num_spatial
    if len(value) != num_spatial:
        raise ValueError(f"{name} should have 1, {num_spatial} or {rank} entries, got {value}")
    return [1, *value, 1] if data_format.endswith("C") else [1, 1, *value]


def _padding_attrs(padding: Padding, num_spatial: int) -> dict:
    if isinstance(padding, str):
        padding = padding.upper()
        if padding not in ("SAME", "VALID"):
            raise ValueError(f"padding must be 'SAME', 'VALID' or explicit pairs, got {padding!r}")
        return {"padding": padding, "explicit_paddings": []}
    pairs = [list(map(int, pair)) for pair in padding]
    if len(pairs) != num_spatial + 2 or any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"explicit padding needs {num_spatial + 2} [before, after] pairs, "
                         f"got {padding}")
    return {"padding": "EXPLICIT", "explicit_paddings": [v for pair in pairs for v in pair]}


def conv_attrs(num_spatial, strides, padding, data_format, dilations) -> dict:
    """The convolution attributes the ops take, from tf.nn-style arguments."""
    default_format = "NHWC" if num_spatial == 2 else "NDHWC"
    data_format = data_format or default_format
    return {
        "strides": _sequence(strides, num_spatial, data_format, "strides"),
        "dilations": _sequence(1 if dilations is None else dilations, num_spatial, data_format,
                               "dilations"),
        "data_format": data_format,
        **_padding_attrs(padding, num_spatial),
    }


def as_layer_plan(plan: Union[LayerPlan, KernelPlan, None]) -> LayerPlan:
    """A plan argument as a LayerPlan (a KernelPlan plans the forward kernel alone)."""
    if plan is None:
        return LayerPlan()
    if isinstance(plan, KernelPlan):
        return LayerPlan(forward=plan)
    if not isinstance(plan, LayerPlan):
        raise TypeError(f"plan must be a LayerPlan, a KernelPlan or None, got {type(plan).__name__}")
    return plan


def forward_plan_attrs(plan: LayerPlan) -> dict:
    """The forward op's plan attributes: its own and those its gradient will use."""
    attrs = plan.forward.attrs()
    for prefix, kernel_plan in (("backprop_input_", plan.backprop_input),
                                ("backprop_filter_", plan.backprop_filter)):
        attrs.update({prefix + key: value for key, value in kernel_plan.attrs().items()})
    return attrs


def _kernel_plan(plan: Optional[KernelPlan]) -> KernelPlan:
    if plan is not None and not isinstance(plan, KernelPlan):
        raise TypeError(f"plan must be a KernelPlan or None, got {type(plan).__name__}")
    return plan or KernelPlan()


def with_workspaces(output: tf.Tensor, workspaces: dict) -> tf.Tensor:
    """`output`, its node (when traced) carrying the known workspaces of `workspaces` (kernel
    prefix as in `tf_ucudnn.core.plan.workspace_attr` -> bytes or None) for the memory planner."""
    if not tf.executing_eagerly():
        for kernel, size in workspaces.items():
            if size is not None:
                output.op._set_attr(workspace_attr(kernel), attr_value_pb2.AttrValue(i=size))
    return output


def _forward(op_name, num_spatial, input, filters, strides, padding, data_format, dilations, plan,
             plan_batch_size, name):
    plan = as_layer_plan(plan)
    # Where the shapes tell, the plugin's reason, before TensorFlow's shape function gives its own.
    filter_shape = tf.TensorShape(filters.shape)
    conv_groups(op_name if name is None else name,
                tf.TensorShape(input.shape)[-1 if (data_format or "NHWC").endswith("C") else 1],
                filter_shape[-2], filter_shape[-1])
    op = getattr(op_library(), op_name)
    output = op(input, filters,
                **conv_attrs(num_spatial, strides, padding, data_format, dilations),
                **forward_plan_attrs(plan),
                plan_batch_size=-1 if plan_batch_size is None else plan_batch_size, name=name)
    return with_workspaces(output, plan_workspaces(plan))


def plan_workspaces(plan: LayerPlan) -> dict:
    """The workspaces a forward op's node carries for the memory planner, by kernel prefix."""
    return {"": plan.forward.workspace_bytes,
            "backprop_input_": plan.backprop_input.workspace_bytes,
            "backprop_filter_": plan.backprop_filter.workspace_bytes}


def conv2d(input, filters, strides, padding: Padding, data_format: str = "NHWC", dilations=None,
           plan: Union[LayerPlan, KernelPlan, None] = None, name: Optional[str] = None,
           plan_batch_size: Optional[int] = None):
    """tf.nn.conv2d as micro-batches. A LayerPlan also sets the plans its gradient will use.
    A batch the plan does not add up to is an error; with `plan_batch_size` (the batch the plan
    is for), a batch of another size runs undivided instead, its gradient too, the algorithm
    chosen at run time or by XLA."""
    return _forward("ucudnn_conv2d", 2, input, filters, strides, padding, data_format,
                    dilations, plan, plan_batch_size, name)


def conv3d(input, filters, strides, padding: Padding, data_format: str = "NDHWC", dilations=None,
           plan: Union[LayerPlan, KernelPlan, None] = None, name: Optional[str] = None,
           plan_batch_size: Optional[int] = None):
    """tf.nn.conv3d as micro-batches. A LayerPlan also sets the plans its gradient will use.
    A batch the plan does not add up to is an error; with `plan_batch_size` (the batch the plan
    is for), a batch of another size runs undivided instead, its gradient too, the algorithm
    chosen at run time or by XLA."""
    return _forward("ucudnn_conv3d", 3, input, filters, strides, padding, data_format,
                    dilations, plan, plan_batch_size, name)


def depthwise_filter(filters):
    """A `tf.nn.depthwise_conv2d` filter [kh, kw, C, M] as the filter of the same convolution
    grouped C ways, [kh, kw, 1, C * M], for `conv2d` (and back with `tf.reshape`)."""
    kh, kw, channels, multiplier = tf.TensorShape(filters.shape).as_list()
    return tf.reshape(filters, [kh, kw, 1, channels * multiplier])


def _backprop(op_name, num_spatial, first, second, out_backprop, strides, padding, data_format,
              dilations, plan, name):
    plan = _kernel_plan(plan)
    op = getattr(op_library(), op_name)
    output = op(first, second, out_backprop,
                **conv_attrs(num_spatial, strides, padding, data_format, dilations),
                **plan.attrs(), name=name)
    return with_workspaces(output, {"": plan.workspace_bytes})


def conv2d_backprop_input(input_sizes, filters, out_backprop, strides, padding: Padding,
                          data_format: str = "NHWC", dilations=None,
                          plan: Optional[KernelPlan] = None, name: Optional[str] = None):
    return _backprop("ucudnn_conv2d_backprop_input", 2, input_sizes, filters, out_backprop,
                     strides, padding, data_format, dilations, plan, name)


def conv2d_backprop_filter(input, filter_sizes, out_backprop, strides, padding: Padding,
                           data_format: str = "NHWC", dilations=None,
                           plan: Optional[KernelPlan] = None, name: Optional[str] = None):
    return _backprop("ucudnn_conv2d_backprop_filter", 2, input, filter_sizes, out_backprop,
                     strides, padding, data_format, dilations, plan, name)


def conv3d_backprop_input(input_sizes, filters, out_backprop, strides, padding: Padding,
                          data_format: str = "NDHWC", dilations=None,
                          plan: Optional[KernelPlan] = None, name: Optional[str] = None):
    return _backprop("ucudnn_conv3d_backprop_input", 3, input_sizes, filters, out_backprop,
                     strides, padding, data_format, dilations, plan, name)


def conv3d_backprop_filter(input, filter_sizes, out_backprop, strides, padding: Padding,
                           data_format: str = "NDHWC", dilations=None,
                           plan: Optional[KernelPlan] = None, name: Optional[str] = None):
    return _backprop("ucudnn_conv3d_backprop_filter", 3, input, filter_sizes, out_backprop,
                     strides, padding, data_format, dilations, plan, name)


def batch_norm(x, scale, offset, epsilon: float = 1e-3, name: Optional[str] = None):
    """Training batch normalization of a channels-last 4-D or 5-D float32 tensor: (y, the
    batch's mean, 1 / sqrt(its biased variance + epsilon)); differentiable in x, scale and
    offset. On the GPU, cuDNN's on the tensor as it is (FusedBatchNormV3 transposes float32
    NHWC to NCHW and back)."""
    return op_library().ucudnn_batch_norm(x, scale, offset, epsilon=epsilon, name=name)
